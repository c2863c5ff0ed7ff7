"""Text in, text out, in one call."""

import os

import pytest

import gpt2_tf
from gpt2_tf.assets import bundled_checkpoint
from gpt2_tf.encoder import encoder_for
from gpt2_tf.validate import GPT2Error

from test_encoder import bundled_tables, read_tables


@pytest.fixture(scope='module')
def model():
    return gpt2_tf.load_model(bundled_checkpoint())


def test_generate_is_encode_sample_decode(model):
    texts = gpt2_tf.generate(model, 'The meaning of life is', 10, nsamples=2, batch_size=2, seed=4, mode='function')
    prompt = gpt2_tf.encode('The meaning of life is')
    tokens = gpt2_tf.sample_sequence(model, 10, context=prompt, batch_size=2, seed=(4, 0), mode='function')
    assert texts == [gpt2_tf.decode(row[len(prompt):]) for row in tokens]


def test_greedy_text_is_deterministic(model):
    first = gpt2_tf.generate(model, 'Hello', 12, temperature=0, mode='function')
    assert first == gpt2_tf.generate(model, 'Hello', 12, temperature=0, mode='eager')


def test_unconditional_starts_after_end_of_text(model):
    texts = gpt2_tf.generate(model, None, 5, nsamples=3, seed=1, mode='function')
    assert len(texts) == 3 and len(set(texts)) == 3
    after_end = [gpt2_tf.decode(gpt2_tf.sample_sequence(model, 5, start_token=50256, seed=(1, b),
                                                         mode='function')[0, 1:]) for b in range(3)]
    assert list(texts) == after_end  # batch b draws with the pair (seed, b), after token 50256


def test_empty_prompt_is_an_error(model):
    with pytest.raises(ValueError, match='the prompt is empty'):
        gpt2_tf.generate(model, '', 5)


def test_bundled_checkpoint_uses_the_bundled_vocabulary():
    assert encoder_for(bundled_checkpoint()).n_vocab == 50257


@pytest.mark.parametrize('options, message', [
    (dict(batch_size=0), 'batch_size must be a positive integer'),
    (dict(nsamples=3, batch_size=2), r'nsamples \(3\) must be a positive multiple of batch_size \(2\)'),
    (dict(nsamples=0), 'nsamples .* must be a positive multiple'),
    (dict(nsamples=None), 'generate returns a list, so nsamples=None .* would never return'),
    (dict(seed=(1, 2)), r'seed must be an integer here \(batch b draws with the pair \(seed, b\)\), got \(1, 2\)'),
    (dict(seed=2 ** 64), 'seed 18446744073709551616 is out of range'),
])
def test_bad_counts_are_refused_with_the_projects_error(model, options, message):
    with pytest.raises(GPT2Error, match=message):
        gpt2_tf.generate(model, 'Hello', 5, **options)


def test_iter_samples_checks_every_argument_before_it_returns(model):
    from gpt2_tf.text import iter_samples

    with pytest.raises(GPT2Error, match=r'temperature must be in \[0, 2\]'):
        iter_samples(model, 'Hello', 5, temperature=5)  # not at the first next()
    texts = iter_samples(model, 'Hello', 5, nsamples=None, batch_size=2, seed=7, mode='function')
    drawn = [next(texts) for _ in range(6)]  # three batches, with no end
    assert drawn == gpt2_tf.generate(model, 'Hello', 5, nsamples=6, batch_size=2, seed=7, mode='function')


def test_text_goes_through_the_vocabulary_of_the_folder_the_model_came_from(tmp_path):
    import json
    import shutil

    from conftest import FIXTURES
    from gpt2_tf.encoder import bytes_to_unicode

    folder = tmp_path / 'bytes'  # a 512-token model whose own vocabulary is the 256 bytes, no merges
    shutil.copytree(FIXTURES / 'tf1-tiny', folder)
    (folder / 'encoder.json').write_text(json.dumps({c: i for i, c in enumerate(bytes_to_unicode().values())}))
    (folder / 'vocab.bpe').write_text('#version: 0.2\n')
    model = gpt2_tf.load_model(folder)
    texts = gpt2_tf.generate(model, 'Hi', 3, temperature=0, mode='function')  # GPT-2's 'Hi' is id 17250: refused
    own = encoder_for(folder)
    tokens = gpt2_tf.sample_sequence(model, 3, context=own.encode('Hi'), temperature=0, mode='function')
    assert texts == [own.decode(tokens[0, 2:])]


def test_a_folder_with_only_transformers_5s_tokenizer_json_reads_writes_and_converts(tmp_path, monkeypatch, model,
                                                                                       capsys):
    import shutil
    import warnings

    from conftest import require
    from gpt2_tf.assets import bundled_vocabulary
    from gpt2_tf.cli import main
    from gpt2_tf.encoder import CACHE_ENV

    transformers = require('transformers')
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / 'cache'))
    folder, pair = gpt2_tf.save_hf(model, tmp_path / 'hf'), tmp_path / 'pair'
    pair.mkdir()
    for name, path in zip(('vocab.json', 'merges.txt'), bundled_vocabulary()):
        os.remove(os.path.join(folder, name))
        shutil.copy(path, pair / name)
    os.remove(os.path.join(folder, 'tokenizer.json'))
    transformers.GPT2TokenizerFast.from_pretrained(pair).save_pretrained(folder)  # tokenizer.json, its config
    assert not {'vocab.json', 'merges.txt'} & set(os.listdir(folder))  # as transformers 5 saves it
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # no "using the bundled GPT-2 vocabulary": the folder's own is read
        loaded = gpt2_tf.load_model(folder)
        assert gpt2_tf.generate(loaded, 'Hello', 6, temperature=0, mode='function') == \
            gpt2_tf.generate(model, 'Hello', 6, temperature=0, mode='function')
    again = gpt2_tf.save_hf(loaded, tmp_path / 'again')
    assert read_tables(os.path.join(again, 'vocab.json'), os.path.join(again, 'merges.txt')) == bundled_tables()
    assert main(['convert', folder, str(tmp_path / 'original'), '--to', 'original']) == 0, capsys.readouterr().err
    original = tmp_path / 'original'
    assert read_tables(original / 'encoder.json', original / 'vocab.bpe') == bundled_tables()


def test_a_vocabulary_missing_a_byte_is_refused_in_one_line(tmp_path, capsys):
    import json
    import shutil

    from gpt2_tf.cli import main

    folder = tmp_path / 'no-z'
    shutil.copytree(bundled_checkpoint(), folder)
    encoder, merges = bundled_tables()
    encoder['zzzzzzzzzzzzzzzz'] = encoder.pop('z')  # the same ids; no token stands for the byte 'z' alone
    (folder / 'encoder.json').write_text(json.dumps(encoder), encoding='utf-8')
    (folder / 'vocab.bpe').write_text('\n'.join(['#version: 0.2', *map(' '.join, merges), '']), encoding='utf-8')
    assert main(['generate', 'zebra', '--model_dir', str(folder), '--length', '2']) == 2
    assert capsys.readouterr().err.strip() == (
        f"gpt2-tf: error: {folder / 'encoder.json'}: no token for byte 0x7a ('z'); a byte-level BPE vocabulary has "
        f"all 256 byte symbols: give the vocabulary's complete file")


def test_unconditional_samples_need_end_of_text_in_the_vocabulary():
    from gpt2_tf.encoder import Encoder, bytes_to_unicode

    bytes_only = Encoder({c: i for i, c in enumerate(bytes_to_unicode().values())}, [])
    model = gpt2_tf.load_model('test')
    with pytest.raises(GPT2Error, match=r'^unconditional samples start from <\|endoftext\|>, which this vocabulary '
                                        r'does not have: give a prompt$'):
        gpt2_tf.generate(model, None, 2, encoder=bytes_only)
