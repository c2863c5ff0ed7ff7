"""Hugging Face GPT-2 folders: the same tensors under other names.

HF's Conv1D keeps the original [nx, nf] layout (the original adds a leading 1),
c_attn packs q, k, v the same way, and the LM head is tied to wte, so reading
is renaming and reshaping, and writing is the reverse. A config that the
original graph cannot express is refused, naming the field, rather than
computed differently.

Reading needs the `safetensors` package (for model.safetensors, without
PyTorch) or `torch` (for pytorch_model.bin, loaded with weights_only=True);
writing needs `safetensors` and `tokenizers` (for tokenizer.json). Reading a
config imports no TensorFlow: the command line checks a folder before loading it.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import warnings
from typing import Optional

import numpy as np

from . import interrupts
from .encoder import END_OF_TEXT_ID, TOKENIZER_JSON, carried_vocabulary  # the fast tokenizer's one file
from .hparams import HF_CONFIG, HF_WEIGHTS, HParams
from .tensorfiles import read_torch, unreadable
from .validate import GPT2Error, first_line, save_folder

CONFIG = HF_CONFIG
SAFETENSORS, SAFETENSORS_INDEX, TORCH_BIN = HF_WEIGHTS
TOKENIZER_FILES = {'vocab.json': 'encoder.json', 'merges.txt': 'vocab.bpe'}  # HF's names for the same files
WRITTEN = (SAFETENSORS, *TOKENIZER_FILES, TOKENIZER_JSON, CONFIG)  # what save_hf writes, in the order it moves them in
GPT2_VOCAB = 50257


def hf_name(name: str) -> str:
    """A table name's HF name (under h.<i>. for a block): 'h{i}/attn/c_proj/b' -> 'attn.c_proj.bias'."""
    from .checkpoint import BLOCK, in_block

    *scope, variable = name[len(BLOCK):].split('/') if in_block(name) else name.split('/')
    if not scope:  # wte, wpe
        return f'{variable}.weight'
    return '.'.join(scope) + ('.bias' if variable == 'b' else '.weight')


@functools.lru_cache(maxsize=None)
def names() -> tuple:
    """(BLOCK_NAMES, TOP_NAMES), derived from checkpoint.VARIABLES.

    BLOCK_NAMES: HF name under h.<i>. -> (original name under model/h<i>/, whether it is a conv1d
    weight: [nx, nf] in HF, [1, nx, nf] in the original); TOP_NAMES: HF name -> original name.
    checkpoint.py imports TensorFlow, so it is imported here, on first use: reading a config needs none.
    """
    from .checkpoint import BLOCK, VARIABLES, in_block

    block = {hf_name(n): (n[len(BLOCK):], len(u) == 3) for n, u, _ in VARIABLES if in_block(n)}
    top = {hf_name(n): 'model/' + n for n, _, _ in VARIABLES if not in_block(n)}
    return block, top


# Files of an HF folder that save_hf does not write, and that would describe the saved model wrongly: another
# tokenizer's settings and added tokens, other weights, and a LoRA adapter (transformers applies it again on top of
# the merged weights save_hf writes).
OTHER_SAVES = ('tokenizer_config.json', 'special_tokens_map.json', 'added_tokens.json', SAFETENSORS_INDEX, TORCH_BIN,
               TORCH_BIN + '.index.json', 'adapter_config.json')
IGNORED = ('attn.bias', 'attn.masked_bias')  # the causal-mask buffers older versions saved


HF_NAMES = {'n_vocab': 'vocab_size', 'n_ctx': 'n_positions', 'n_embd': 'n_embd', 'n_head': 'n_head',
            'n_layer': 'n_layer'}  # HParams' field: config.json's key


class HFFormatError(GPT2Error):
    """An HF folder that cannot be read into the original graph as it is."""


def read_config(path) -> HParams:
    """HParams from an HF config.json, refusing what the original graph cannot compute."""
    source = os.path.join(path, CONFIG)
    config = _read_json(source)
    if not isinstance(config, dict):
        raise HFFormatError(f'{source}: expected a JSON object, got {type(config).__name__}')

    def refuse(field, why):
        raise HFFormatError(f'{source}: {field}={config.get(field)!r}: {why}; the original graph cannot compute it')

    if config.get('model_type', 'gpt2') != 'gpt2':
        refuse('model_type', 'not a GPT-2 model')
    missing = [k for k in HF_NAMES.values() if config.get(k) is None]
    if missing:
        raise HFFormatError(f'{source}: missing {missing}')
    try:  # the sizes' types and values first: n_inner is checked against n_embd
        hparams = HParams.from_dict({ours: config[theirs] for ours, theirs in HF_NAMES.items()}, source=source)
    except GPT2Error as e:  # named as the file names them
        raise HFFormatError(re.sub(r'\b(n_vocab|n_ctx)\b', lambda m: HF_NAMES[m.group(1)], str(e))) from None
    if config.get('activation_function', 'gelu_new') not in ('gelu_new', 'gelu_pytorch_tanh'):
        refuse('activation_function', 'GPT-2 uses the tanh GELU (gelu_new or gelu_pytorch_tanh)')
    if config.get('scale_attn_weights', True) is not True:
        refuse('scale_attn_weights', 'GPT-2 scales attention scores by 1/sqrt(head size)')
    for field in ('scale_attn_by_inverse_layer_idx', 'reorder_and_upcast_attn', 'add_cross_attention'):
        if config.get(field):
            refuse(field, 'not part of GPT-2')
    if config.get('n_inner') is not None and config['n_inner'] != 4 * hparams.n_embd:
        refuse('n_inner', f'the MLP is 4 * n_embd = {4 * hparams.n_embd} wide in GPT-2')
    if config.get('layer_norm_epsilon', 1e-5) != 1e-5:
        refuse('layer_norm_epsilon', 'GPT-2 normalizes with epsilon 1e-5')
    if 'n_ctx' in config and 'n_positions' in config and config['n_ctx'] != config['n_positions']:
        refuse('n_ctx', f'it differs from n_positions={config.get("n_positions")}')
    return hparams


def _read_json(path: str):
    try:
        with open(path, encoding='utf-8') as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFFormatError(f'{path}: not valid JSON ({e})') from None
    except OSError as e:
        raise HFFormatError(f'{path}: cannot be read ({e.strerror})') from None


def _read_safetensors(files: list) -> dict:
    try:
        import ml_dtypes  # noqa: F401  (numpy's bfloat16, which TensorFlow's import also brings: files read before it)
        from safetensors import safe_open
    except ImportError:
        raise HFFormatError('reading model.safetensors needs the safetensors package: '
                            "pip install -e '.[hf]' (or pip install safetensors)") from None
    tensors, where = {}, {}  # where: the file each name was read from
    for file in files:
        try:
            with safe_open(file, framework='np') as f:
                read = {name: f.get_tensor(name) for name in f.keys()}
        except Exception as e:  # safetensors' own error type, OSError, or a broken header's ValueError
            raise unreadable(file, e, HFFormatError) from None
        twice = sorted(set(read) & set(tensors))
        if twice:
            raise HFFormatError(f'{file}: {twice[0]} is also in {where[twice[0]]}, and which one the model holds is '
                                f'unclear; copy or download the model again')
        tensors.update(read)
        where.update(dict.fromkeys(read, file))
    return tensors


def read_tensors(path) -> dict:
    """{HF name: array} from model.safetensors, a sharded safetensors index, or pytorch_model.bin (in that order)."""
    single = os.path.join(path, SAFETENSORS)
    index = os.path.join(path, SAFETENSORS_INDEX)
    if os.path.isfile(single):
        return _read_safetensors([single])
    if os.path.isfile(index):
        weight_map = _read_json(index)
        weight_map = weight_map.get('weight_map') if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(s, str) for s in weight_map.values()):
            raise HFFormatError(f'{index}: no "weight_map" object of tensor names to shard files; '
                                f'is the file complete? Copy or download it again')
        shards = sorted(set(weight_map.values()))
        outside = [s for s in shards if os.path.basename(s) != s or s in ('.', '..')]
        if outside:
            raise HFFormatError(f'{index}: shard {outside[0]!r} is not a file name in the folder; '
                                f'is the index from this folder? Copy or download it again')
        missing = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
        if not shards or missing:
            raise HFFormatError(f'{index}: shard(s) missing: {missing or "the index lists none"}')
        return _read_safetensors([os.path.join(path, s) for s in shards])
    if os.path.isfile(os.path.join(path, TORCH_BIN)):
        return read_torch(os.path.join(path, TORCH_BIN), HFFormatError)
    if os.path.isfile(os.path.join(path, TORCH_BIN + '.index.json')):
        raise HFFormatError(f'{path}: sharded {TORCH_BIN} files are not read here; save the model again as '
                            f'safetensors (in transformers: model.save_pretrained(folder))')
    raise HFFormatError(f'{path}: no {SAFETENSORS}, {SAFETENSORS_INDEX} or {TORCH_BIN} beside {CONFIG}')


def to_original(tensors: dict, hparams: HParams, *, source: str, strict: bool = True,
                dropped: Optional[list] = None) -> dict:
    """{HF name: array} -> {checkpoint name: float32 array}, every name and shape checked; strict=False drops
    tensors GPT-2 does not have instead of refusing them (their names appended to dropped, when given)."""
    out, extra, converted = {}, [] if dropped is None else dropped, set()
    block_names, top_names = names()
    origin = {}  # checkpoint name -> the HF name it was read from: two names for one tensor are refused
    for name, value in tensors.items():
        key = name[len('transformer.'):] if name.startswith('transformer.') else name
        parts = key.split('.', 2)
        # ASCII digits only: str.isdigit also takes '²', which int() refuses
        block = len(parts) == 3 and parts[0] == 'h' and parts[1].isascii() and parts[1].isdigit()
        if key == 'lm_head.weight' or (block and parts[2] in IGNORED):
            continue
        if key in top_names:
            target, conv = top_names[key], False
        elif block and parts[2] in block_names:
            target, conv = block_names[parts[2]]
            target = f'model/h{int(parts[1])}/{target}'
        else:
            extra.append(name)
            continue
        if target in origin:  # wte.weight beside transformer.wte.weight, h.01.* beside h.1.*
            raise _named_twice(source, origin[target], name)
        origin[target] = name
        value = _float32(name, value, source, converted)
        out[target] = value[None] if conv else value
    if extra and strict:
        raise HFFormatError(f'{source}: {len(extra)} tensor(s) GPT-2 does not have: {", ".join(extra[:5])}; '
                            f'load with strict=False (--no_strict on the command line) to ignore them')
    heads = [n for n in ('lm_head.weight', 'transformer.lm_head.weight') if n in tensors]
    if len(heads) > 1:
        raise _named_twice(source, *heads)
    head_name = heads[0] if heads else None
    if head_name is not None:
        head = _float32(head_name, tensors[head_name], source, converted)
        if 'model/wte' not in out:  # a tied pair stored once, under the head's name (safetensors.torch.save_model)
            out['model/wte'] = head
        elif not np.array_equal(head, out['model/wte']):
            raise HFFormatError(f'{source}: lm_head.weight differs from wte: an untied head, which GPT-2 does not '
                                f'have')
    if converted:
        warnings.warn(f'{source}: {_conversion_note(converted)}', stacklevel=3)
    return out


def _named_twice(source: str, *both: str) -> HFFormatError:
    first, second = sorted(both)  # in one order, whichever the file lists first
    return HFFormatError(f'{source}: {first} and {second} name the same tensor, and which one the model holds is '
                         f'unclear; save the model again with one of them')


def _float32(name: str, value, source: str, converted: set) -> np.ndarray:
    """A floating tensor as float32, its other dtype added to converted; any other tensor refused."""
    value = np.asarray(value)
    if not np.issubdtype(value.dtype, np.floating) and value.dtype.name != 'bfloat16':
        raise HFFormatError(f'{source}: {name} is {value.dtype}, expected floating point')
    if value.dtype != np.float32:
        converted.add(value.dtype.name)
        value = value.astype(np.float32)
    return value


def _conversion_note(dtypes) -> str:
    """What reading tensors of these dtypes as float32 did: narrower ones are upcast (exactly), wider ones
    rounded (float64: a downcast)."""
    upcast = sorted(d for d in dtypes if np.dtype(d).itemsize < 4)
    rounded = sorted(d for d in dtypes if np.dtype(d).itemsize > 4)
    said = ([f'{", ".join(upcast)} tensors were upcast to float32'] if upcast else []) + \
        ([f'{", ".join(rounded)} tensors were rounded to float32 (a downcast)'] if rounded else [])
    return '; '.join(said)


def check_head(tensors: dict, path) -> None:
    """A config.json that unties the head (tie_word_embeddings false) needs both its lm_head.weight and wte:
    without either the folder is incomplete (transformers starts the missing one at random; GPT-2's head is
    wte itself, and to_original reads a tied pair stored under the head's name alone as wte)."""
    config = _read_json(os.path.join(path, CONFIG))
    if not (isinstance(config, dict) and config.get('tie_word_embeddings', True) is False):
        return
    for name in ('lm_head.weight', 'wte.weight'):
        if name not in tensors and 'transformer.' + name not in tensors:
            raise HFFormatError(f'{os.path.join(path, CONFIG)}: tie_word_embeddings is false, but the weights have '
                                f'no {name}: the folder is incomplete; copy or download it again')


def config_for(hparams: HParams) -> dict:
    """The HF config.json of a GPT-2 of these hparams; bos/eos_token_id null unless the vocabulary has
    <|endoftext|>'s id (GPT2Config's default is 50256, about which transformers warns past the vocabulary)."""
    end = END_OF_TEXT_ID if hparams.n_vocab > END_OF_TEXT_ID else None
    special = {'bos_token_id': end, 'eos_token_id': end}
    return {'architectures': ['GPT2LMHeadModel'], 'model_type': 'gpt2',
            **{theirs: getattr(hparams, ours) for ours, theirs in HF_NAMES.items()}, 'n_ctx': hparams.n_ctx,
            'n_inner': None,
            'activation_function': 'gelu_new', 'layer_norm_epsilon': 1e-05, 'scale_attn_weights': True,
            'resid_pdrop': 0.1, 'embd_pdrop': 0.1, 'attn_pdrop': 0.1, 'initializer_range': 0.02,
            'tie_word_embeddings': True, **special}


def to_hf(tensors: dict) -> dict:
    """{checkpoint name: array} -> {HF name: float32 array} under `transformer.`, as save_pretrained writes them."""
    block_names, top_names = names()
    top = {v: k for k, v in top_names.items()}
    out = {}
    for name, value in tensors.items():
        value = np.asarray(value, np.float32)
        if name in top:
            out['transformer.' + top[name]] = value
            continue
        layer, rest = name[len('model/h'):].split('/', 1)
        hf_name, conv = next((k, c) for k, (target, c) in block_names.items() if target == rest)
        out[f'transformer.h.{int(layer)}.{hf_name}'] = value[0] if conv else value
    return out


def tokenizer_json(encoder_path: str, bpe_path: str, destination: str) -> None:
    """Writes the fast tokenizer's tokenizer.json for GPT-2 vocabulary files, with the tokenizers library.

    It is what transformers' GPT2TokenizerFast builds from vocab.json and merges.txt: byte-level BPE
    under GPT-2's pattern, no prefix space, and <|endoftext|> as a special token when the vocabulary has it.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    from .encoder import END_OF_TEXT, _read_files

    vocabulary, merges = _read_files(encoder_path, bpe_path)
    tokenizer = Tokenizer(models.BPE(vocab=vocabulary, merges=merges, continuing_subword_prefix='',
                                     end_of_word_suffix='', fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    if END_OF_TEXT in vocabulary:
        tokenizer.add_special_tokens([END_OF_TEXT])
    tokenizer.save(destination)


def save_hf(model, path, *, vocabulary=None) -> str:
    """Writes an HF GPT-2 folder: config.json, model.safetensors, vocab.json, merges.txt and tokenizer.json;
    returns the folder. Every file gets the mode a new file gets (0644 under the usual umask). Attached LoRA
    adapters are written merged (checkpoint.stored_weights); an int8 model is refused.

    vocabulary: (encoder.json path, vocab.bpe path) to copy under HF's names (default: the model's own,
    encoder.carried_vocabulary: its folder's pair, else GPT-2's bundled one); one of more tokens than the
    model's is refused, as transformers would fail on its ids.
    """
    try:
        import tokenizers  # noqa: F401
        import safetensors.numpy  # noqa: F401
    except ImportError:
        raise HFFormatError("writing an HF folder needs the safetensors and tokenizers packages: "
                            "pip install -e '.[hf]'") from None
    from .checkpoint import staged, stored_weights

    if model.dtype == 'int8':
        raise HFFormatError('an int8 model cannot be saved as an HF folder: it holds float weights, and int8 ones '
                            'are a lossy copy of them; save the float32 model (load it with dtype="float32")')
    files = carried_vocabulary(model.folder.path if model.folder else None, model.hparams.n_vocab, vocabulary)
    path = _check_destination(save_folder(path), model.hparams)
    tensors = to_hf({name: v.numpy() for name, v in stored_weights(model).items()})  # adapters merged
    with staged(path) as staging:  # every file is written beside the folder's own first, then moved in, config last
        _write_hf_files(staging, model.hparams, tensors, files, destination=path)
        with interrupts.deferred():  # all moved in, or (Ctrl-C before) none: a retry finds its own save whole
            for name in WRITTEN:
                os.replace(os.path.join(staging, name), os.path.join(path, name))
    return path


def _check_destination(path: str, hparams: HParams) -> str:
    """The folder save_hf writes into, unless it holds another model: an original checkpoint, an HF model of
    another size or kind, another save's files transformers would read beside ours (OTHER_SAVES), or without a
    config.json, files of the names save_hf writes (someone's weights or tokenizer, overwritten otherwise)."""
    if os.path.isfile(os.path.join(path, 'hparams.json')):
        raise HFFormatError(f'{path} holds a model in the original layout (hparams.json), which would stay the one '
                            f'that loads from there; save the HF folder to another folder')
    if os.path.isfile(os.path.join(path, CONFIG)):
        try:
            existing = read_config(path)
        except HFFormatError as e:
            raise HFFormatError(f'{path} holds another model ({first_line(e)}); save to another folder') from None
        if existing != hparams:
            raise HFFormatError(f'{path} holds a model of another size ({existing}); save to another folder')
    else:
        theirs = [name for name in WRITTEN if os.path.lexists(os.path.join(path, name))]
        if theirs:
            raise HFFormatError(f'{path} holds {", ".join(theirs)} but no {CONFIG}: another model\'s files, which '
                                f'this save would overwrite; save to another folder, or remove them first')
    stale = [name for name in OTHER_SAVES if os.path.exists(os.path.join(path, name))]
    if stale:
        raise HFFormatError(f'{path} holds {", ".join(stale)} of another save, which transformers would read with '
                            f'this model; save to another folder, or remove them first')
    return path


def _write_hf_files(folder: str, hparams: HParams, tensors: dict, vocabulary, *, destination: str) -> None:
    from safetensors.numpy import save_file

    config = os.path.join(folder, CONFIG)
    with open(config, 'w', encoding='utf-8') as f:
        json.dump(config_for(hparams), f, indent=2)
        f.write('\n')
    weights = os.path.join(folder, SAFETENSORS)
    try:
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, weights, metadata={'format': 'pt'})
    except Exception as e:  # safetensors' own error type (a full disk, say), or OSError
        raise HFFormatError(f'{os.path.join(destination, SAFETENSORS)} cannot be written ({first_line(e)}); nothing in '
                            f'{destination} was changed: free some space or save elsewhere') from None
    shutil.copymode(config, weights)  # safetensors writes through a private (0600) file
    for hf_name, source in zip(TOKENIZER_FILES, vocabulary):
        shutil.copyfile(source, os.path.join(folder, hf_name))
    tokenizer_json(*vocabulary, os.path.join(folder, TOKENIZER_JSON))
