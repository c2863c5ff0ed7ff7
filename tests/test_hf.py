"""Hugging Face GPT-2 folders, both ways, verified against transformers' own GPT2LMHeadModel and tokenizer."""

import json
import os
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest

import gpt2_tf
from gpt2_tf import hf
from gpt2_tf.encoder import encoder_for

from conftest import FIXTURES, assert_close, require
from support import write_vocabulary

torch = require('torch')
transformers = require('transformers')
safetensors_numpy = require('safetensors.numpy')

HF_CONFIG = dict(vocab_size=300, n_positions=40, n_embd=32, n_head=4, n_layer=2, bos_token_id=299, eos_token_id=299)


def random_hf_model(seed=0, **config):
    """A transformers GPT2LMHeadModel with every parameter random: gains off 1, biases off 0."""
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**HF_CONFIG, **config}))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.2 + (1.0 if name.endswith('ln_1.weight') or
                                                                  name.endswith('ln_2.weight') or
                                                                  name.endswith('ln_f.weight') else 0.0))
    return model.eval()


def torch_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


@pytest.fixture(scope='module')
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp('hf')
    model = random_hf_model()
    model.save_pretrained(folder)  # safetensors
    return folder, model


def test_an_hf_folder_loads_with_the_logits_and_greedy_ids_of_transformers(hf_folder):
    folder, reference = hf_folder
    assert (folder / 'model.safetensors').exists()
    model = gpt2_tf.load_model(folder)
    tokens = np.random.default_rng(0).integers(0, 300, (3, 40), dtype=np.int32)
    assert_close(model(tokens)['logits'], torch_logits(reference, tokens), 'logits vs transformers')
    prompt = tokens[:, :6]
    with torch.no_grad():
        theirs = reference.generate(torch.tensor(prompt, dtype=torch.long), max_new_tokens=20, do_sample=False,
                                    pad_token_id=0).numpy()
    np.testing.assert_array_equal(gpt2_tf.sample_sequence(model, 20, context=prompt, top_k=1), theirs)


def test_a_pytorch_bin_loads_the_same(tmp_path, hf_folder):
    folder, reference = hf_folder
    shutil.copy(folder / 'config.json', tmp_path)
    torch.save(reference.state_dict(), tmp_path / 'pytorch_model.bin')  # transformers now writes safetensors only
    model = gpt2_tf.load_model(tmp_path)
    tokens = np.arange(40, dtype=np.int32)[None] % 300
    assert_close(model(tokens)['logits'], torch_logits(reference, tokens), 'logits from .bin')


def test_an_original_checkpoint_written_as_hf_loads_in_transformers(tmp_path):
    model = gpt2_tf.load_model(FIXTURES / 'tf1-tiny-hot')
    gpt2_tf.save_hf(model, tmp_path / 'hf', vocabulary=write_vocabulary(tmp_path / 'vocabulary', 300))
    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / 'hf').eval()
    tokens = np.load(FIXTURES / 'tf1-tiny-hot' / 'reference.npz')['tokens']
    assert_close(torch_logits(theirs, tokens), model(tokens)['logits'], 'transformers on our HF folder')


def test_original_to_hf_to_original_is_byte_identical(tmp_path, tiny_with_vocabulary):
    source = tiny_with_vocabulary
    for argv in (['convert', str(source), str(tmp_path / 'hf'), '--to', 'hf'],
                 ['convert', str(tmp_path / 'hf'), str(tmp_path / 'back'), '--to', 'original']):
        done = subprocess.run([sys.executable, '-m', 'gpt2_tf.cli', *argv], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr
    first, back = gpt2_tf.load_model(source), gpt2_tf.load_model(tmp_path / 'back')
    for name, variable in first.variables_by_name().items():
        assert variable.numpy().tobytes() == back.variables_by_name()[name].numpy().tobytes(), name
    assert (tmp_path / 'back' / 'encoder.json').read_bytes() == (tmp_path / 'hf' / 'vocab.json').read_bytes() \
        == (source / 'encoder.json').read_bytes()  # the model's own vocabulary, carried both ways


def test_save_hf_carries_the_models_own_vocabulary_and_transformers_runs_on_its_ids(tmp_path, tiny_with_vocabulary):
    model = gpt2_tf.load_model(tiny_with_vocabulary)
    gpt2_tf.save_hf(model, tmp_path / 'hf')  # no vocabulary given: the one of the folder it was loaded from
    assert (tmp_path / 'hf' / 'vocab.json').read_bytes() == (tiny_with_vocabulary / 'encoder.json').read_bytes()
    assert (tmp_path / 'hf' / 'merges.txt').read_bytes() == (tiny_with_vocabulary / 'vocab.bpe').read_bytes()
    ids = transformers.AutoTokenizer.from_pretrained(tmp_path / 'hf')('Hello world, this is a test')['input_ids']
    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / 'hf').eval()
    assert_close(torch_logits(theirs, [ids]), model(np.array([ids], np.int32))['logits'], 'own vocabulary')


def test_a_vocabulary_of_more_tokens_than_the_model_is_refused_by_save_hf_and_convert(tmp_path, capsys):
    from gpt2_tf.cli import main

    tiny = gpt2_tf.load_model(FIXTURES / 'tf1-tiny')  # 512 tokens, no vocabulary of its own: the bundled 50257
    with pytest.raises(gpt2_tf.GPT2Error, match=r"encoder.json holds 50257 tokens, more than the model's 512: put "
                                                r'the pair made for the model .* in its folder'):
        gpt2_tf.save_hf(tiny, tmp_path / 'hf')
    assert not (tmp_path / 'hf').exists()
    assert main(['convert', str(FIXTURES / 'tf1-tiny'), str(tmp_path / 'out'), '--to', 'hf']) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "holds 50257 tokens, more than the model's 512" in err, err
    assert not (tmp_path / 'out').exists()


def test_hf_tokenizer_files_written_here_give_our_ids(tmp_path):
    gpt2_tf.save_hf(gpt2_tf.load_model('test'), tmp_path)  # GPT-2's vocabulary: the cases' ids reach 50256
    theirs = transformers.GPT2TokenizerFast.from_pretrained(tmp_path)
    ours = encoder_for(tmp_path)
    cases = [json.loads(line) for line in (FIXTURES / 'bpe-cases.jsonl').read_text(encoding='utf-8').split('\n') if line]
    for case in cases:
        assert theirs(case['text'], split_special_tokens=True)['input_ids'] == ours.encode(case['text']) == case['ids']


# --- the variants real folders have, and what is refused ---------------------------------------------

def write_tensors(folder, tensors, config=None):
    folder.mkdir(exist_ok=True)
    (folder / 'config.json').write_text(json.dumps({**HF_CONFIG, **(config or {})}))
    safetensors_numpy.save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
                                str(folder / 'model.safetensors'))


@pytest.fixture
def state(hf_folder):
    _, reference = hf_folder
    return {k: v.numpy().copy() for k, v in reference.state_dict().items()}


def test_names_with_or_without_the_transformer_prefix_and_mask_buffers(tmp_path, state, hf_folder):
    bare = {k[len('transformer.'):]: v for k, v in state.items() if k != 'lm_head.weight'}
    bare['h.0.attn.bias'] = np.tril(np.ones((40, 40), np.float32))[None, None]  # an old causal-mask buffer
    bare['h.0.attn.masked_bias'] = np.array(-1e4, np.float32)
    write_tensors(tmp_path / 'bare', bare)
    tokens = np.arange(12, dtype=np.int32)[None]
    assert_close(gpt2_tf.load_model(tmp_path / 'bare')(tokens)['logits'], torch_logits(hf_folder[1], tokens), 'bare')


def test_a_tied_head_stored_only_as_lm_head_loads(tmp_path, hf_folder):
    from safetensors.torch import save_model

    folder, reference = hf_folder
    (tmp_path / 'head').mkdir()
    shutil.copy(folder / 'config.json', tmp_path / 'head')
    save_model(reference, str(tmp_path / 'head' / 'model.safetensors'))  # keeps lm_head.weight, drops wte
    assert 'transformer.wte.weight' not in hf.read_tensors(tmp_path / 'head')
    tokens = np.arange(12, dtype=np.int32)[None]
    assert_close(gpt2_tf.load_model(tmp_path / 'head')(tokens)['logits'], torch_logits(reference, tokens), 'head')
    (tmp_path / 'head' / 'config.json').write_text(json.dumps({**HF_CONFIG, 'tie_word_embeddings': False}))
    with pytest.raises(hf.HFFormatError, match='tie_word_embeddings is false, but the weights have no wte.weight: '
                                               'the folder is incomplete'):  # untied: the head is not wte
        gpt2_tf.load_model(tmp_path / 'head')


def write_shards(folder, state: dict, first: list, second: list) -> None:
    """An HF folder of two safetensors shards holding the tensors named in first and in second, and its index."""
    folder.mkdir()
    halves = {'model-00001-of-00002.safetensors': first, 'model-00002-of-00002.safetensors': second}
    for shard, keys in halves.items():
        safetensors_numpy.save_file({k: np.ascontiguousarray(state[k]) for k in keys}, str(folder / shard))
    (folder / 'model.safetensors.index.json').write_text(json.dumps(
        {'weight_map': {k: shard for shard, keys in halves.items() for k in keys}}))
    (folder / 'config.json').write_text(json.dumps(HF_CONFIG))


def test_sharded_safetensors_load(tmp_path, state, hf_folder):
    folder, names = tmp_path / 'sharded', sorted(state)
    write_shards(folder, state, names[:10], names[10:])
    tokens = np.arange(12, dtype=np.int32)[None]
    assert_close(gpt2_tf.load_model(folder)(tokens)['logits'], torch_logits(hf_folder[1], tokens), 'sharded')


@pytest.mark.parametrize('add, message', [
    ({'wte.weight': 'transformer.wte.weight'}, 'transformer.wte.weight and wte.weight name the same tensor'),
    ({'transformer.h.01.ln_1.weight': 'transformer.h.1.ln_1.weight'},
     'transformer.h.01.ln_1.weight and transformer.h.1.ln_1.weight name the same tensor'),
    ({'transformer.lm_head.weight': 'lm_head.weight'}, 'lm_head.weight and transformer.lm_head.weight name the '
                                                       'same tensor'),
    ({'transformer.h.\u00b2.ln_1.weight': 'transformer.h.1.ln_1.weight'},
     "1 tensor\\(s\\) GPT-2 does not have: transformer.h.\u00b2.ln_1.weight"),  # '²' is no layer index
])
def test_two_names_for_one_tensor_are_refused_naming_both(tmp_path, state, add, message):
    tensors = {**state, 'lm_head.weight': state['transformer.wte.weight']}
    tensors.update({name: tensors[copy_of] for name, copy_of in add.items()})
    write_tensors(tmp_path / 'twice', tensors)
    with pytest.raises(hf.HFFormatError, match=message):
        gpt2_tf.load_model(tmp_path / 'twice')


def test_a_tensor_in_two_shards_is_refused_naming_both(tmp_path, state):
    folder, names = tmp_path / 'sharded', sorted(state)
    write_shards(folder, state, names[:10], names[9:])  # names[9] in both
    with pytest.raises(hf.HFFormatError, match=f'model-00002-of-00002.safetensors: {names[9]} is also in '
                                               f'.*model-00001-of-00002.safetensors'):
        gpt2_tf.load_model(folder)


@pytest.mark.parametrize('kind', ['safetensors', 'bin'])
@pytest.mark.parametrize('dtype, message', [('float16', r'float16 tensors were upcast to float32$'),
                                            ('bfloat16', r'bfloat16 tensors were upcast to float32$'),
                                            ('float64', r'float64 tensors were rounded to float32 \(a downcast\)$')])
def test_other_float_tensors_are_converted_with_a_true_note_from_either_file(tmp_path, state, kind, dtype, message):
    import ml_dtypes

    numpy_dtype = ml_dtypes.bfloat16 if dtype == 'bfloat16' else np.dtype(dtype)
    if kind == 'safetensors':
        write_tensors(tmp_path / 'other', {k: v.astype(numpy_dtype) for k, v in state.items()})
    else:
        (tmp_path / 'other').mkdir()
        (tmp_path / 'other' / 'config.json').write_text(json.dumps(HF_CONFIG))
        torch.save({k: torch.from_numpy(v).to(getattr(torch, dtype)) for k, v in state.items()},
                   tmp_path / 'other' / 'pytorch_model.bin')
    with pytest.warns(UserWarning, match=message):
        model = gpt2_tf.load_model(tmp_path / 'other')
    np.testing.assert_array_equal(model.variables_by_name()['model/wte'].numpy(),
                                  state['transformer.wte.weight'].astype(numpy_dtype).astype(np.float32))


def test_safetensors_wins_over_a_bin_in_the_same_folder(tmp_path, state):
    write_tensors(tmp_path / 'both', state)
    torch.save({k: torch.zeros_like(torch.from_numpy(v)) for k, v in state.items()}, tmp_path / 'both' / 'pytorch_model.bin')
    wte = gpt2_tf.load_model(tmp_path / 'both').variables_by_name()['model/wte'].numpy()
    np.testing.assert_array_equal(wte, state['transformer.wte.weight'])


@pytest.mark.parametrize('change, message', [
    (dict(drop='transformer.h.1.mlp.c_fc.bias'), r'model/h1/mlp/c_fc/b: missing from the checkpoint'),
    (dict(add='transformer.h.0.attn.c_attn.lora'), "tensor\\(s\\) GPT-2 does not have: transformer.h.0.attn.c_attn.lora"),
    (dict(untie=True), 'lm_head.weight differs from wte'),
    (dict(config={'activation_function': 'relu'}), "activation_function='relu': GPT-2 uses the tanh GELU"),
    (dict(config={'scale_attn_weights': False}), 'scale_attn_weights=False'),
    (dict(config={'scale_attn_by_inverse_layer_idx': True}), 'scale_attn_by_inverse_layer_idx=True'),
    (dict(config={'reorder_and_upcast_attn': True}), 'reorder_and_upcast_attn=True'),
    (dict(config={'add_cross_attention': True}), 'add_cross_attention=True'),
    (dict(config={'n_inner': 100}), 'n_inner=100: the MLP is 4 \\* n_embd = 128 wide'),
    (dict(config={'layer_norm_epsilon': 1e-6}), 'layer_norm_epsilon=1e-06'),
    (dict(config={'n_ctx': 64}), 'n_ctx=64: it differs from n_positions=40'),
    (dict(config={'n_embd': 48}), r'model/wte: expected shape \[300, 48\], found \[300, 32\]'),
    (dict(config={'n_embd': None, 'n_inner': 256}), r"config.json: missing \['n_embd'\]"),
    (dict(config={'n_embd': {}, 'n_inner': 256}), r'config.json: n_embd must be an integer, got \{\}$'),
    (dict(config={'vocab_size': True}), r'config.json: vocab_size must be an integer, got True$'),  # the file's name
    (dict(config={'n_positions': -3}), r'config.json: n_positions must be positive, got -3$'),
    (dict(config={'tie_word_embeddings': False}, headless=True), 'tie_word_embeddings is false, but the weights have '
     'no lm_head.weight: the folder is incomplete'),
])
def test_what_the_original_graph_cannot_express_is_refused_by_name(tmp_path, state, change, message):
    tensors = dict(state)
    if 'drop' in change:
        del tensors[change['drop']]
    if 'add' in change:
        tensors[change['add']] = np.zeros(3, np.float32)
    tensors['lm_head.weight'] = tensors['transformer.wte.weight'] + (1 if change.get('untie') else 0)
    if change.get('headless'):
        del tensors['lm_head.weight']
    write_tensors(tmp_path / 'bad', tensors, change.get('config'))
    with pytest.raises(ValueError, match=message):
        gpt2_tf.load_model(tmp_path / 'bad')


def test_added_tokens_and_a_lone_tokenizer_json(tmp_path, state):
    big = dict(state)
    big['transformer.wte.weight'] = np.concatenate([state['transformer.wte.weight'], np.ones((3, 32), np.float32)])
    big.pop('lm_head.weight', None)
    write_tensors(tmp_path / 'added', big, {'vocab_size': 303})
    (tmp_path / 'added' / 'added_tokens.json').write_text('{"<pad>": 300}')
    assert gpt2_tf.load_model(tmp_path / 'added').hparams.n_vocab == 303  # the model loads either way
    with pytest.raises(ValueError, match='added tokens, which this tokenizer does not read'):
        encoder_for(tmp_path / 'added')
    write_tensors(tmp_path / 'fast', state)
    (tmp_path / 'fast' / 'tokenizer.json').write_text(json.dumps({'added_tokens': [{'content': '<|endoftext|>'}]}))
    with pytest.raises(ValueError, match='has only a tokenizer.json'):
        encoder_for(tmp_path / 'fast')


def test_a_bin_without_torch_says_what_to_install(tmp_path, state, monkeypatch):
    (tmp_path / 'config.json').write_text(json.dumps(HF_CONFIG))
    torch.save({k: torch.from_numpy(v) for k, v in state.items()}, tmp_path / 'pytorch_model.bin')
    monkeypatch.setitem(sys.modules, 'torch', None)
    with pytest.raises(ValueError, match='needs torch'):
        gpt2_tf.load_model(tmp_path)


@pytest.mark.parametrize('saved, found', [
    (lambda tensors: {'state_dict': tensors}, 'found a dict holding more than tensors'),
    (lambda tensors: list(tensors.values()), 'found list'),
])
def test_a_bin_that_is_not_a_state_dict_is_refused_in_one_line(tmp_path, state, saved, found):
    (tmp_path / 'config.json').write_text(json.dumps(HF_CONFIG))
    torch.save(saved({k: torch.from_numpy(v) for k, v in state.items()}), tmp_path / 'pytorch_model.bin')
    with pytest.raises(hf.HFFormatError, match=f'pytorch_model.bin: expected a state dict of tensor names to tensors, '
                                               f'{found}'):
        gpt2_tf.load_model(tmp_path)


def test_a_bin_of_a_whole_pickled_model_is_refused_with_the_next_step(tmp_path):
    (tmp_path / 'config.json').write_text(json.dumps(HF_CONFIG))
    torch.save(torch.nn.Linear(2, 3), tmp_path / 'pytorch_model.bin')  # the module, not its state_dict()
    with pytest.raises(hf.HFFormatError, match=r"^\S*pytorch_model.bin: holds a pickled torch.nn.modules.linear."
                                               r"Linear, not only tensors, and is not read, since unpickling it would "
                                               r"run its code; save the model's state_dict\(\) itself"):
        gpt2_tf.load_model(tmp_path)
    (tmp_path / 'pytorch_model.bin').write_bytes(np.random.default_rng(0).bytes(5000))  # no pickle: damaged
    with pytest.raises(hf.HFFormatError, match=r'pytorch_model.bin: cannot be read \(.*\); is the file complete'):
        gpt2_tf.load_model(tmp_path)


@pytest.mark.parametrize('name', ['tokenizer_config.json', 'pytorch_model.bin', 'adapter_config.json'])
def test_save_hf_refuses_a_folder_holding_another_saves_files(tmp_path, tiny_with_vocabulary, name):
    folder = tmp_path / 'hf'
    gpt2_tf.save_hf(gpt2_tf.load_model(tiny_with_vocabulary), folder)  # the same size: only the stale file stops it
    (folder / name).write_text('{}')
    before = {n: (folder / n).read_bytes() for n in os.listdir(folder)}
    with pytest.raises(hf.HFFormatError, match=f'holds {name} of another save, which transformers would read'):
        gpt2_tf.save_hf(gpt2_tf.load_model(tiny_with_vocabulary), folder)
    assert {n: (folder / n).read_bytes() for n in os.listdir(folder)} == before


@pytest.mark.parametrize('files, message', [
    ({'pytorch_model-00001-of-00002.bin': '', 'pytorch_model.bin.index.json': '{"weight_map": {}}'},
     'sharded pytorch_model.bin files are not read here'),
    ({'model.safetensors.index.json': '{"weight_map": {"wte.weight": "../model.safetensors"}}'},
     "shard '../model.safetensors' is not a file name in the folder"),
])
def test_weights_it_does_not_read_are_named(tmp_path, files, message):
    (tmp_path / 'config.json').write_text(json.dumps(HF_CONFIG))
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(hf.HFFormatError, match=message):
        gpt2_tf.load_model(tmp_path)


def test_convert_refuses_to_overwrite(tmp_path):
    (tmp_path / 'out').mkdir()
    (tmp_path / 'out' / 'x').write_text('mine')
    done = subprocess.run([sys.executable, '-m', 'gpt2_tf.cli', 'convert', str(FIXTURES / 'tf1-tiny'),
                           str(tmp_path / 'out'), '--to', 'hf'], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and 'exists and is not empty' in done.stderr
    assert os.listdir(tmp_path / 'out') == ['x']


@pytest.mark.parametrize('extra, message', [({'added_tokens.json': '{"<pad>": 300}'}, 'has added tokens'),
                                             ({'tokenizer.json': '{"added_tokens": []}'}, 'has only a tokenizer.json')])
def test_convert_refuses_a_vocabulary_it_would_not_carry(hf_folder, tmp_path, capsys, extra, message):
    from gpt2_tf.assets import bundled_vocabulary
    from gpt2_tf.cli import main

    source = tmp_path / 'source'
    shutil.copytree(hf_folder[0], source)
    for name in hf.TOKENIZER_FILES:  # save_pretrained of a model writes none; the vocabulary is what is added
        (source / name).unlink(missing_ok=True)
    for name, text in extra.items():
        (source / name).write_text(text)
    if 'added_tokens.json' in extra:  # with the pair, the added tokens are what convert would drop
        for name, path in zip(hf.TOKENIZER_FILES, bundled_vocabulary()):
            shutil.copy(path, source / name)
    assert main(['convert', str(source), str(tmp_path / 'out'), '--to', 'original']) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / 'out').exists()


def test_no_warning_for_float32_folders(hf_folder):
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        gpt2_tf.load_model(hf_folder[0])


# --- what save_hf writes, and read errors --------------------------------------------------------------

def test_tokenizer_json_alone_gives_autotokenizer_our_ids(tmp_path):
    gpt2_tf.save_hf(gpt2_tf.load_model('test'), tmp_path)
    for name in hf.TOKENIZER_FILES:  # only tokenizer.json left: the fast tokenizer must come from it
        (tmp_path / name).unlink()
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert theirs.is_fast
    lines = (FIXTURES / 'bpe-cases.jsonl').read_text(encoding='utf-8').split('\n')
    cases = [json.loads(line) for line in lines if line]
    ours = gpt2_tf.get_encoder()
    for case in cases:
        assert theirs(case['text'], split_special_tokens=True)['input_ids'] == ours.encode(case['text']) == case['ids']
    assert theirs.convert_tokens_to_ids('<|endoftext|>') == 50256


def test_every_file_gets_the_same_mode(tmp_path, tiny_with_vocabulary):
    gpt2_tf.save_hf(gpt2_tf.load_model(tiny_with_vocabulary), tmp_path / 'hf')
    umask = os.umask(0)
    os.umask(umask)
    modes = {name: os.stat(tmp_path / 'hf' / name).st_mode & 0o777 for name in os.listdir(tmp_path / 'hf')}
    assert set(modes) == {'config.json', 'model.safetensors', 'vocab.json', 'merges.txt', 'tokenizer.json'}
    assert set(modes.values()) == {0o666 & ~umask}, modes


def test_special_token_ids_only_when_the_vocabulary_has_them(tmp_path, tiny_with_vocabulary):
    gpt2_tf.save_hf(gpt2_tf.load_model(tiny_with_vocabulary), tmp_path / 'small')  # 512 tokens
    config = json.loads((tmp_path / 'small' / 'config.json').read_text())
    assert config['bos_token_id'] is None and config['eos_token_id'] is None  # GPT2Config's default would be 50256
    loaded = transformers.AutoConfig.from_pretrained(tmp_path / 'small')
    assert loaded.bos_token_id is None and loaded.eos_token_id is None
    with pytest.raises(hf.HFFormatError, match=r'small holds a model of another size \(HParams\(n_vocab=512.*save to '
                                               r'another folder$'):
        gpt2_tf.save_hf(gpt2_tf.load_model(FIXTURES / 'tf1-tiny-hot'), tmp_path / 'small',
                        vocabulary=write_vocabulary(tmp_path / 'vocabulary', 300))
    assert json.loads((tmp_path / 'small' / 'config.json').read_text()) == config  # untouched
    gpt2_tf.save_hf(gpt2_tf.load_model(tiny_with_vocabulary), tmp_path / 'small')  # the same size: saved again
    gpt2_tf.save_hf(gpt2_tf.load_model('test'), tmp_path / 'gpt2')  # 50257 tokens
    config = json.loads((tmp_path / 'gpt2' / 'config.json').read_text())
    assert config['bos_token_id'] == config['eos_token_id'] == 50256


@pytest.mark.parametrize('damage', ['truncate', 'garbage header'])
def test_an_unreadable_weights_file_is_named(hf_folder, tmp_path, damage):
    folder = tmp_path / 'broken'
    shutil.copytree(hf_folder[0], folder)
    weights = folder / 'model.safetensors'
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2] if damage == 'truncate' else b'\xff' * 64)
    with pytest.raises(hf.HFFormatError, match=f'{weights}: cannot be read'):
        gpt2_tf.load_model(folder)
    done = subprocess.run([sys.executable, '-m', 'gpt2_tf.cli', 'generate', '!', '--length', '2', '--model_dir',
                           str(folder)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1].startswith(f'gpt2-tf: error: {weights}: cannot be read'), done.stderr


# --- saving over a folder, and what it refuses -----------------------------------------------------------

def test_save_hf_refuses_a_folder_holding_an_original_checkpoint(tmp_path):
    folder = tmp_path / 'tiny'
    shutil.copytree(FIXTURES / 'tf1-tiny', folder)
    before = {name: (folder / name).read_bytes() for name in os.listdir(folder)}
    with pytest.raises(hf.HFFormatError, match=r'tiny holds a model in the original layout \(hparams.json\).*'
                                               r'save the HF folder to another folder'):
        gpt2_tf.save_hf(gpt2_tf.load_model('test'), folder)
    assert {name: (folder / name).read_bytes() for name in os.listdir(folder)} == before


def test_save_checkpoint_refuses_an_hf_folder(hf_folder, tmp_path):
    folder = tmp_path / 'hf'
    shutil.copytree(hf_folder[0], folder)
    before = {name: (folder / name).read_bytes() for name in os.listdir(folder)}
    with pytest.raises(gpt2_tf.CheckpointError, match=r'hf holds a Hugging Face model \(config.json and its '
                                                      r'weights\), which would stay beside the checkpoint'):
        gpt2_tf.save_checkpoint(gpt2_tf.load_model(FIXTURES / 'tf1-tiny'), folder)
    assert {name: (folder / name).read_bytes() for name in os.listdir(folder)} == before
    assert gpt2_tf.load_model(folder).hparams.n_vocab == HF_CONFIG['vocab_size']  # still the HF model


@pytest.mark.parametrize('weights', ['pytorch_model.bin.index.json', 'tf_model.h5', 'flax_model.msgpack'])
def test_save_checkpoint_refuses_an_hf_folder_of_weights_gpt2_tf_does_not_read(tmp_path, weights):
    folder = tmp_path / 'hf'  # a sharded .bin, or TFGPT2LMHeadModel's or Flax's save_pretrained
    folder.mkdir()
    (folder / 'config.json').write_text(json.dumps(HF_CONFIG))
    (folder / weights).write_bytes(b'weights')
    with pytest.raises(gpt2_tf.CheckpointError, match='holds a Hugging Face model'):
        gpt2_tf.save_checkpoint(gpt2_tf.load_model(FIXTURES / 'tf1-tiny'), folder)
    assert sorted(os.listdir(folder)) == sorted(['config.json', weights])


def test_a_failed_save_leaves_the_folder_as_it_was(tmp_path, monkeypatch, capsys, tiny_vocabulary):
    import safetensors

    folder = tmp_path / 'hf'
    gpt2_tf.save_hf(gpt2_tf.load_model(FIXTURES / 'tf1-tiny'), folder, vocabulary=tiny_vocabulary)
    before = {name: (folder / name).read_bytes() for name in os.listdir(folder)}

    def full_disk(tensors, filename, metadata=None):
        with open(filename, 'wb') as f:
            f.write(b'\0' * 100)  # a part written, then the disk is full
        raise safetensors.SafetensorError('Error while serializing: IoError(No space left on device)')

    monkeypatch.setattr(safetensors_numpy, 'save_file', full_disk)
    with pytest.raises(hf.HFFormatError, match=r'model.safetensors cannot be written \(Error while serializing: '
                                               r'IoError\(No space left on device\)\); nothing in .*hf was changed'):
        gpt2_tf.save_hf(gpt2_tf.load_model(FIXTURES / 'tf1-tiny'), folder,  # the same size again: allowed, and it fails
                        vocabulary=tiny_vocabulary)
    assert {name: (folder / name).read_bytes() for name in os.listdir(folder)} == before
    # The command line says it in one line.
    from gpt2_tf.cli import main

    assert main(['convert', 'test', str(tmp_path / 'new'), '--to', 'hf']) == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith('free some space or save elsewhere')
    assert not (tmp_path / 'new').exists() and sorted(os.listdir(tmp_path)) == ['hf']  # nor a staging folder


def test_ctrl_c_as_a_save_moves_its_files_in_waits_for_all_of_them(tmp_path, monkeypatch, tiny_vocabulary):
    import signal

    model, folder, replace = gpt2_tf.load_model(FIXTURES / 'tf1-tiny'), tmp_path / 'hf', os.replace

    def interrupted(source, target):
        replace(source, target)
        if target.endswith(hf.SAFETENSORS):  # the first moved in: config.json, the last, still to come
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(hf.os, 'replace', interrupted)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal's process
    try:
        with pytest.raises(KeyboardInterrupt):
            gpt2_tf.save_hf(model, folder, vocabulary=tiny_vocabulary)
    finally:
        signal.signal(signal.SIGINT, previous)
    monkeypatch.setattr(hf.os, 'replace', replace)
    assert sorted(os.listdir(folder)) == sorted(hf.WRITTEN)  # whole: a retry takes it as its own
    gpt2_tf.save_hf(model, folder, vocabulary=tiny_vocabulary)
    np.testing.assert_array_equal(gpt2_tf.load_model(folder)(np.array([[1, 2, 3]]))['logits'],
                                  model(np.array([[1, 2, 3]]))['logits'])


def test_saving_to_a_file_is_refused_in_one_line(tmp_path, tiny_with_vocabulary):
    model = gpt2_tf.load_model(tiny_with_vocabulary)
    (tmp_path / 'file').write_text('mine')
    for save in (gpt2_tf.save_hf, gpt2_tf.save_checkpoint):
        with pytest.raises(ValueError, match=r'file is a file, not a folder: save into a folder$'):
            save(model, tmp_path / 'file')
    assert (tmp_path / 'file').read_text() == 'mine'


@pytest.mark.parametrize('index, message', [
    ({'weight_map': []}, 'no "weight_map" object of tensor names to shard files'),
    ({'metadata': {}}, 'no "weight_map" object'),
    ({'weight_map': {'transformer.wte.weight': 3}}, 'no "weight_map" object'),
    ({'weight_map': {}}, r'shard\(s\) missing: the index lists none'),
])
def test_a_broken_shard_index_is_named(tmp_path, index, message):
    (tmp_path / 'config.json').write_text(json.dumps(HF_CONFIG))
    (tmp_path / 'model.safetensors.index.json').write_text(json.dumps(index))
    with pytest.raises(hf.HFFormatError, match='model.safetensors.index.json: ' + message):
        gpt2_tf.load_model(tmp_path)


def test_n_ctx_without_n_positions_names_the_missing_field(tmp_path, state):
    config = {k: v for k, v in HF_CONFIG.items() if k != 'n_positions'}
    write_tensors(tmp_path / 'old', state)
    (tmp_path / 'old' / 'config.json').write_text(json.dumps({**config, 'n_ctx': 40}))
    with pytest.raises(hf.HFFormatError, match=r"config.json: missing \['n_positions'\]"):
        gpt2_tf.load_model(tmp_path / 'old')


def test_strict_false_loads_an_hf_folder_with_tensors_gpt2_does_not_have_but_not_another_size(tmp_path, state,
                                                                                              hf_folder):
    extra = {**state, 'transformer.h.0.attn.c_attn.lora_A': np.zeros((4, 32), np.float32),
             'transformer.h.2.ln_1.weight': np.ones(32, np.float32)}  # a block past n_layer
    write_tensors(tmp_path / 'extra', extra)
    with pytest.raises(hf.HFFormatError, match=r'1 tensor\(s\) GPT-2 does not have: transformer.h.0.attn.c_attn.lora_A; '
                                               r'load with strict=False \(--no_strict on the command line\)'):
        gpt2_tf.load_model(tmp_path / 'extra')
    del extra['transformer.h.0.attn.c_attn.lora_A']
    write_tensors(tmp_path / 'extra', extra)
    with pytest.raises(gpt2_tf.CheckpointError, match=r'n_layer=3\). Likely cause: config.json describes another '
                                                      r'model size .*\n.*does not have: model/h2/ln_1/g$'):
        gpt2_tf.load_model(tmp_path / 'extra')
    extra['transformer.h.0.attn.c_attn.lora_A'] = np.zeros((4, 32), np.float32)
    write_tensors(tmp_path / 'extra', extra)
    with pytest.raises(gpt2_tf.CheckpointError, match=r'n_layer=3\). Likely cause: config.json describes another '
                                                      r'model size'):  # strict=False passes over extras, not a size
        gpt2_tf.load_model(tmp_path / 'extra', strict=False)
    del extra['transformer.h.2.ln_1.weight']
    write_tensors(tmp_path / 'extra', extra)
    tokens = np.arange(12, dtype=np.int32)[None]
    assert_close(gpt2_tf.load_model(tmp_path / 'extra', strict=False)(tokens)['logits'],
                 torch_logits(hf_folder[1], tokens), 'strict=False')


def test_inspect_lists_the_tensors_gpt2_does_not_have(tmp_path, state):
    from gpt2_tf.diagnostics import parameter_table

    write_tensors(tmp_path / 'extra', {**state, 'score.weight': np.zeros((2, 32), np.float32)})
    table = parameter_table(tmp_path / 'extra')
    assert table['mismatches'] == ['1 checkpoint variable(s) outside the model: score.weight (training state, or a '
                                   'head GPT-2 does not have? the commands that load it pass over it with '
                                   '--no_strict)']
    assert table['total_checkpoint'] == table['total_expected'] + 64


def test_inspect_names_config_json_for_an_hf_folders_problems(tmp_path, state, capsys):
    from gpt2_tf.cli import main

    write_tensors(tmp_path / 'extra', {**state, 'score.weight': np.zeros((2, 32), np.float32)})
    assert main(['inspect', str(tmp_path / 'extra')]) == 2
    assert capsys.readouterr().err.strip().endswith('1 problem(s) against config.json, the first: 1 checkpoint '
                                                    'variable(s) outside the model: score.weight (training state, '
                                                    'or a head GPT-2 does not have? the commands that load it '
                                                    'pass over it with --no_strict)')


def test_bfloat16_weights_are_read_before_tensorflow_is_imported(tmp_path, state):
    import ml_dtypes

    write_tensors(tmp_path / 'bf16', {k: v.astype(ml_dtypes.bfloat16) for k, v in state.items()})
    code = ('import sys; from gpt2_tf import hf; '
            't = hf.read_tensors(sys.argv[1]); print(t["transformer.wte.weight"].dtype, "tensorflow" in sys.modules)')
    done = subprocess.run([sys.executable, '-c', code, str(tmp_path / 'bf16')], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ['bfloat16', 'False'], done.stderr[-500:]


def test_save_hf_refuses_a_folder_of_someone_elses_weights_and_tokenizer_without_config_json(tmp_path):
    folder = tmp_path / 'theirs'
    folder.mkdir()
    safetensors_numpy.save_file({'unet.conv.weight': np.ones((4, 4), np.float32)}, str(folder / 'model.safetensors'))
    (folder / 'tokenizer.json').write_text('{"mine": true}')
    (folder / 'notes.txt').write_text('mine')
    before = {name: (folder / name).read_bytes() for name in os.listdir(folder)}
    with pytest.raises(hf.HFFormatError, match=r'theirs holds model.safetensors, tokenizer.json but no config.json: '
                                               r"another model's files, which this save would overwrite"):
        gpt2_tf.save_hf(gpt2_tf.load_model('test'), folder)
    assert {name: (folder / name).read_bytes() for name in os.listdir(folder)} == before
    (folder / 'model.safetensors').unlink()
    (folder / 'tokenizer.json').unlink()
    gpt2_tf.save_hf(gpt2_tf.load_model('test'), folder)  # other files of other names stay, as they did
    assert (folder / 'notes.txt').read_text() == 'mine' and (folder / 'config.json').exists()


def test_save_hf_into_a_folder_of_another_kind_of_model_is_refused(tmp_path, tiny_with_vocabulary):
    (tmp_path / 'llama').mkdir()
    (tmp_path / 'llama' / 'config.json').write_text(json.dumps({'model_type': 'llama', 'hidden_size': 64}))
    with pytest.raises(hf.HFFormatError, match=r'llama holds another model \(.*\); save to another folder$'):
        gpt2_tf.save_hf(gpt2_tf.load_model(tiny_with_vocabulary), tmp_path / 'llama')
    assert os.listdir(tmp_path / 'llama') == ['config.json']
