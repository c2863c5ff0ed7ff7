"""Reading and writing the name-based TF1 checkpoints that OpenAI published.

A model folder holds `checkpoint`, `hparams.json`, `model.ckpt.index`,
`model.ckpt.data-00000-of-00001` (and `model.ckpt.meta`, `encoder.json`,
`vocab.bpe`, which loading does not need).
"""

from __future__ import annotations

import codecs
import contextlib
import ctypes
import errno
import glob
import ntpath
import os
import re
import shutil
import sys
import tempfile
from typing import Optional

import numpy as np
import tensorflow as tf

from .hparams import HParams, holds_hf_model
from .precision import assign, stored
from . import validate
from .validate import GPT2Error, first_line, save_folder
from .runtime import Model

CHECKPOINT_PREFIX = 'model.ckpt'
RUN_SAVE = re.compile(r'model-(\d+)')  # a run folder's save of a step (runfolder.save, gpt-2-simple's)
NOT_RUN_SAVE = re.compile(rf'(?!{RUN_SAVE.pattern}$).+')  # what save_checkpoint's keep counts: a run's saves stay


# The one table of the original graph's variables: checkpoint name (under model/, with {i} for a block),
# shape in units of (n_embd 'e', n_vocab 'v', n_ctx 'c'), and the component it belongs to. The HF names,
# the diagnostics' components and the explorer's accounting derive from it.
VARIABLES = (
    ('wte', ('v', 'e'), 'wte'),
    ('wpe', ('c', 'e'), 'wpe'),
    ('h{i}/ln_1/g', ('e',), 'ln_1'),
    ('h{i}/ln_1/b', ('e',), 'ln_1'),
    ('h{i}/attn/c_attn/w', (1, 'e', '3e'), 'attn.c_attn'),
    ('h{i}/attn/c_attn/b', ('3e',), 'attn.c_attn'),
    ('h{i}/attn/c_proj/w', (1, 'e', 'e'), 'attn.c_proj'),
    ('h{i}/attn/c_proj/b', ('e',), 'attn.c_proj'),
    ('h{i}/ln_2/g', ('e',), 'ln_2'),
    ('h{i}/ln_2/b', ('e',), 'ln_2'),
    ('h{i}/mlp/c_fc/w', (1, 'e', '4e'), 'mlp.c_fc'),
    ('h{i}/mlp/c_fc/b', ('4e',), 'mlp.c_fc'),
    ('h{i}/mlp/c_proj/w', (1, '4e', 'e'), 'mlp.c_proj'),
    ('h{i}/mlp/c_proj/b', ('e',), 'mlp.c_proj'),
    ('ln_f/g', ('e',), 'ln_f'),
    ('ln_f/b', ('e',), 'ln_f'),
)
BLOCK = 'h{i}/'

# Per component, the original function that creates it, the line of src/model.py at revision 9b63575 where
# that starts, and what it does (the explorer's architecture table).
ORIGINAL_CODE = {
    'wte': ('model', 154, 'token embedding: row i of wte is token i; the same matrix gives the logits (tied)'),
    'wpe': ('model', 152, 'position embedding: row p is added to the token at position p'),
    'ln_1': ('norm', 28, 'LayerNorm before attention: mean 0, variance 1 over the features (epsilon 1e-5), '
                         'then a gain g and a bias b'),
    'attn.c_attn': ('conv1d', 50, 'one dense layer giving queries, keys and values for every head at once'),
    'attn.c_proj': ('attn', 69, 'mixes the heads\' outputs back into the residual stream'),
    'ln_2': ('norm', 28, 'LayerNorm before the MLP'),
    'mlp.c_fc': ('mlp', 115, 'widens to 4 x n_embd, then the tanh GELU'),
    'mlp.c_proj': ('mlp', 115, 'narrows back to n_embd'),
    'ln_f': ('model', 147, 'the final LayerNorm, before the logits'),
}


def _dimension(unit, hp: HParams) -> int:
    if isinstance(unit, int):
        return unit
    sizes = {'e': hp.n_embd, 'v': hp.n_vocab, 'c': hp.n_ctx}
    return int(unit[:-1] or 1) * sizes[unit[-1]] if len(unit) > 1 else sizes[unit]


def table_shape(units: tuple, hp: HParams) -> tuple:
    """A table entry's shape for these hparams: (1, 'e', '3e') -> (1, n_embd, 3 * n_embd)."""
    return tuple(_dimension(unit, hp) for unit in units)


def in_block(name: str) -> bool:
    return name.startswith(BLOCK)


def block_shapes(n_embd: int) -> dict:
    """{name under model/h<i>/: shape} for one block's variables, conv1d weights in their [1, nx, nf] shape."""
    hp = HParams(n_vocab=1, n_ctx=1, n_embd=n_embd, n_head=1, n_layer=1)
    return {name[len(BLOCK):]: table_shape(units, hp) for name, units, _ in VARIABLES if in_block(name)}


def variable_shapes(hp: HParams) -> dict:
    """{checkpoint name: shape} of every variable of the original graph, in the model's order, without building it."""
    shapes = {}
    for name, units, _ in VARIABLES:
        if name == 'ln_f/g':  # the blocks sit between the embeddings and ln_f
            for layer in range(hp.n_layer):
                shapes.update({f'model/h{layer}/{n}': s for n, s in block_shapes(hp.n_embd).items()})
        if not in_block(name):
            shapes['model/' + name] = table_shape(units, hp)
    return shapes


class CheckpointError(GPT2Error):
    """A checkpoint that cannot be loaded into the model as it is."""


def find_checkpoint(path: str | os.PathLike) -> str:
    """The checkpoint prefix for a model folder (through its `checkpoint` file) or a prefix itself."""
    path = os.fspath(path)
    if os.path.isfile(path + '.index'):
        return path
    if not os.path.isdir(path):
        raise FileNotFoundError(f'no model folder or checkpoint at {path}')
    state_file = os.path.join(path, 'checkpoint')
    if os.path.isfile(state_file):
        named, _ = read_state(path)
        if named is None:
            saves = saves_in(path)
            raise CheckpointError(f'{state_file}: no model_checkpoint_path line; write the line naming the '
                                  f'checkpoint to load' + (f', or {_load_one(path, saves)}' if saves else ''))
        # Fine-tuned checkpoints often name a path on another machine, or this one's path of the folder they
        # were copied from: the files are the ones beside the `checkpoint` file, never another folder's. A
        # relative name inside the folder is relative to that file (as TF reads it), else beside it too.
        inside = not (os.path.isabs(named) or ntpath.isabs(named)) and '..' not in re.split(r'[/\\]', named)
        for candidate in ([os.path.join(path, named)] if inside else []) + [os.path.join(path, file_name(named))]:
            if os.path.isfile(candidate + '.index'):
                return candidate
        saves = saves_in(path)
        raise FileNotFoundError(
            f'{state_file} names checkpoint {named!r}, but {file_name(named)}.index is not in {path}'
            + (f': copy its files in, or name one that is there ({", ".join(saves)}) in the `checkpoint` file'
               if saves else ': copy its files in'))
    prefix = os.path.join(path, CHECKPOINT_PREFIX)
    if os.path.isfile(prefix + '.index'):
        return prefix
    if os.path.isfile(os.path.join(path, 'adapter_config.json')):
        raise FileNotFoundError(f'{path} is a LoRA adapter folder, which holds the adapter alone: give its base '
                                f'model, with --adapter {path} (load_model(base, adapter=...))')
    saves = saves_in(path)
    if saves:
        raise FileNotFoundError(f'no `checkpoint` file in {path} to say which save is current: '
                                f'{_load_one(path, saves)}')
    raise FileNotFoundError(
        f'no checkpoint in {path}: expected a `checkpoint` file or {CHECKPOINT_PREFIX}.index '
        f'(download one with: python -m gpt2_tf.download 124M)')


def saves_in(path: str) -> list:
    """The prefixes of the models saved in a folder (an .index file; a run folder's optimizer-<step> states
    are none), oldest step first: model-9 before model-10."""
    names = [os.path.basename(f)[:-len('.index')] for f in glob.glob(os.path.join(glob.escape(path), '*.index'))]
    return sorted((n for n in names if not n.startswith('optimizer-')),
                  key=lambda n: [int(p) if p.isdigit() else p for p in re.split(r'(\d+)', n)])


def _load_one(path: str, saves: list) -> str:
    return f'load one of its saves ({", ".join(saves)}) by its prefix, as {os.path.join(path, saves[-1])}'


def _open_reader(prefix: str):
    try:
        return tf.train.load_checkpoint(prefix)
    except Exception as e:  # TF raises OpError, ValueError, and others for damaged files
        raise CheckpointError(f'cannot read checkpoint {prefix}: {first_line(e)}; its .index file is damaged or '
                              f'not a checkpoint: copy or download the checkpoint again') from None


def checkpoint_shapes(path: str | os.PathLike) -> dict:
    """{variable name: shape} as stored in a checkpoint (a folder or a prefix)."""
    reader = _open_reader(find_checkpoint(path))
    return {name: tuple(shape) for name, shape in reader.get_variable_to_shape_map().items()}


def _size(shapes: dict) -> dict:
    """What a checkpoint's own shapes say about its size: {'n_vocab': .., 'n_embd': .., 'n_ctx': .., 'n_layer': ..}
    as far as they tell."""
    size = {}
    if len(shapes.get('model/wte', ())) == 2:
        size.update(n_vocab=int(shapes['model/wte'][0]), n_embd=int(shapes['model/wte'][1]))
    if len(shapes.get('model/wpe', ())) == 2:
        size['n_ctx'] = int(shapes['model/wpe'][0])
    layers = {int(m.group(1)) for name in shapes if (m := re.match(r'model/h(\d+)/', name))}
    if layers:
        size['n_layer'] = max(layers) + 1
    return size


def _listed(names: list) -> str:
    return ', '.join(names[:3]) + (f' and {len(names) - 3} more' if len(names) > 3 else '')


def verify(expected: dict, shapes: dict, *, hparams: HParams, source: str, strict: bool = True,
           settings: str = 'hparams.json') -> None:
    """Raises CheckpointError unless the checkpoint's names and shapes are exactly the expected ones.

    Its first line names the likely cause and the next step (the command line shows only that line): another
    model size than settings says, variables missing from a checkpoint of the right size, or variables the
    model does not have (optimizer slots: strict=False); the lines after it list each name. strict=False
    passes over extra variables, never over a size: blocks past n_layer are another model's, not extras."""
    missing = [name for name in expected if name not in shapes]
    reshaped = [name for name in expected if name in shapes and tuple(shapes[name]) != tuple(expected[name])]
    hp, size = hparams, _size(shapes)
    ours = {'n_vocab': hp.n_vocab, 'n_embd': hp.n_embd, 'n_ctx': hp.n_ctx, 'n_layer': hp.n_layer}
    resized = any(size[k] != ours[k] for k in size)
    extra = sorted(set(shapes) - set(expected)) if strict or resized else []
    if not (missing or reshaped or extra):
        return
    where = f'checkpoint {source} does not match the model'
    if reshaped or resized:
        looks = ', '.join(f'{k}={v}' for k, v in size.items()) or 'no GPT-2 variables'
        first = (f'{where} (hparams: n_vocab={hp.n_vocab}, n_ctx={hp.n_ctx}, n_embd={hp.n_embd}, '
                 f'n_layer={hp.n_layer}; checkpoint looks like {looks}). Likely cause: {settings} describes another '
                 f'model size than the checkpoint; use the {settings} that came with it')
    elif missing:
        first = (f'{where}: {len(missing)} of its variable(s) are missing from the checkpoint ({_listed(missing)}); '
                 f'it is incomplete or not a GPT-2 checkpoint: copy or download it again')
    else:
        first = (f'{where}: the checkpoint holds {len(extra)} variable(s) the model does not have '
                 f'({_listed(extra)}); if they are optimizer slots or other training state, load with strict=False '
                 f'(--no_strict on the command line) to ignore them')
    problems = ([f'{name}: missing from the checkpoint (expected shape {list(expected[name])})' for name in missing]
                + [f'{name}: expected shape {list(expected[name])}, found {list(shapes[name])}' for name in reshaped]
                + ([f'{len(extra)} variable(s) the model does not have: {_listed(extra)}'] if extra else []))
    raise CheckpointError(first + '.\n  ' + '\n  '.join(problems[:10])
                          + (f'\n  ... and {len(problems) - 10} more' if len(problems) > 10 else ''))


def _checked_reader(prefix: str, expected: dict, hparams: HParams, *, strict: bool):
    """A reader for a checkpoint whose names, shapes, dtypes and data size are all as expected."""
    reader = _open_reader(prefix)
    shapes = reader.get_variable_to_shape_map()
    verify(expected, shapes, hparams=hparams, source=prefix, strict=strict)
    dtypes = reader.get_variable_to_dtype_map()
    for name in expected:
        if dtypes[name] != tf.float32:
            raise CheckpointError(f'{prefix}: {name} is {dtypes[name].name}, expected float32')
    # A truncated .data file is found here, before anything is read or assigned.
    needed = sum(4 * int(np.prod(shapes[name])) for name in expected)
    data_files = glob.glob(glob.escape(prefix) + '.data-*')
    if not data_files:
        raise FileNotFoundError(f'checkpoint {prefix}: no {os.path.basename(prefix)}.data-* file: copy it in '
                                f'beside {os.path.basename(prefix)}.index (or download the checkpoint again)')
    for shards in {int(m.group(1)) for m in map(re.compile(r'\.data-\d{5}-of-(\d{5})$').search, data_files) if m}:
        for shard in (f'{prefix}.data-{i:05d}-of-{shards:05d}' for i in range(shards)):
            if not os.path.exists(shard):
                raise FileNotFoundError(f'checkpoint {prefix}: {os.path.basename(shard)} is missing: copy it in '
                                        f'beside the other shards (or download the checkpoint again)')
    have = sum(os.path.getsize(f) for f in data_files)
    if have < needed:
        raise CheckpointError(
            f'checkpoint {prefix}: the .data file holds {have:,} bytes but the variables need '
            f'{needed:,}; it is truncated (an interrupted download?)')
    return reader


def check_folder(model_dir: str | os.PathLike, *, strict: bool = True) -> HParams:
    """Checks a model folder without loading it: hparams.json, and the checkpoint's names, shapes and size."""
    model_dir = os.fspath(model_dir)
    hparams = HParams.from_json(os.path.join(model_dir, 'hparams.json'))
    _checked_reader(find_checkpoint(model_dir), variable_shapes(hparams), hparams, strict=strict)
    return hparams


@contextlib.contextmanager
def freed_to_the_system(on: bool):
    """While on, glibc's malloc serves blocks of 1 MiB and more by mmap, so each tensor read and freed goes
    back to the system: its default raises that threshold as large blocks are freed, and the freed float32
    tensors then stay in the heap beside the int8 ones (a 1558M int8 load peaked at 3.9 GB, 2.8 with this).
    Afterwards the threshold is 32 MiB, where glibc's own rule ends up."""
    libc = _libc() if on else None
    if libc is not None:
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    try:
        yield
    finally:
        if libc is not None:
            libc.mallopt(-3, 32 << 20)


def _libc():
    try:
        return ctypes.CDLL('libc.so.6') if sys.platform.startswith('linux') else None
    except OSError:  # not glibc
        return None


def restore(model: Model, path: str | os.PathLike, *, strict: bool = True, all_or_nothing: bool = True,
            add: Optional[dict] = None) -> None:
    """Assigns a checkpoint (folder or prefix) to the model, after checking every name and shape.

    add, {checkpoint name: float32 array of the variable's shape}, is added to those values as they are
    read, before the model's dtype rounds them (a LoRA adapter's A·B·scale, lora.merged_deltas).

    all_or_nothing reads every value before it assigns any, so a damaged file
    leaves the model as it was; load_model, whose fresh model is dropped on
    failure, turns it off and assigns value by value: the peak is then the model
    plus one tensor, not twice the model.
    """
    prefix = find_checkpoint(path)
    variables = model.variables_by_name()
    expected = {name: tuple(v.shape.as_list()) for name, v in stored(variables).items()}
    reader = _checked_reader(prefix, expected, model.hparams, strict=strict)

    def read(name):
        try:
            return reader.get_tensor(name)
        except Exception as e:  # OpError for a bad checksum; IndexError and others for other damage
            raise CheckpointError(
                f'checkpoint {prefix}: cannot read {name} ({first_line(e)}); '
                f'the .data file is corrupt or truncated') from None

    values = {name: read(name) for name in expected} if all_or_nothing else None
    with freed_to_the_system(model.dtype == 'int8'):
        for name in expected:  # float32 on disk, the model's dtype in memory (int8 quantized here, one by one)
            value = values.pop(name) if values is not None else read(name)
            assign(variables, name, value + add[name] if add and name in add else value)
            del value  # let go before the next is read: the peak is the model plus one tensor


def read_state(model_dir: str) -> tuple:
    """(the current path, every listed path) as a folder's `checkpoint` file names them, or (None, []).

    The one reader of that file; the paths are as written (often absolute, from another machine, Windows
    ones included), their text-format escapes undone: a doubled backslash is one, octal escapes are UTF-8 bytes."""
    try:
        with open(os.path.join(model_dir, 'checkpoint'), 'rb') as f:
            text = f.read()
    except FileNotFoundError:
        return None, []

    def paths(field: bytes) -> list:  # a quoted string may hold escaped quotes and backslashes
        return [_unescaped(m) for m in re.findall(field + rb'"((?:[^"\\\n]|\\.)*)"', text, re.MULTILINE)]

    current = paths(rb'^model_checkpoint_path:\s*')
    return (current[0] if current else None), paths(rb'^all_model_checkpoint_paths:\s*')


def _unescaped(quoted: bytes) -> str:
    try:
        quoted = codecs.escape_decode(quoted)[0]
    except ValueError:  # a malformed escape (a backslash and x without hex digits): the text as written
        pass
    return quoted.decode('utf-8', errors='replace')


def file_name(path: str) -> str:
    r"""The last part of a path written on any system: 'C:\run1\model-5' and '/content/run1/model-5' -> 'model-5'."""
    return ntpath.basename(path)  # splits at '/' and at '\\'


def checkpoint_state(model_dir: str) -> tuple:
    """(the current prefix name, every listed prefix name) from a folder's `checkpoint` file, or (None, [])."""
    current, listed = read_state(model_dir)
    current = file_name(current) if current else None
    names = [file_name(name) for name in listed]
    return current, names if current in names else names + [current] if current else names


def write_state(model_dir: str, names: list) -> None:
    """The `checkpoint` file naming names, the last one current (replaced atomically); no names: no file."""
    path = os.path.join(model_dir, 'checkpoint')
    if not names:
        if os.path.exists(path):
            os.remove(path)
        return
    replace_atomically(path, f'model_checkpoint_path: "{names[-1]}"\n'
                       + ''.join(f'all_model_checkpoint_paths: "{n}"\n' for n in names))


def forget(model_dir: str, name: str) -> None:
    """Drops prefix `name` from the folder's `checkpoint` file (the newest other one becomes current),
    then removes its files: before a save that reuses the name, so that no crash leaves it half-replaced."""
    _, listed = checkpoint_state(model_dir)
    if name in listed:
        write_state(model_dir, [n for n in listed if n != name])
    remove_bundle(os.path.join(model_dir, name))


def replace_atomically(path: str, text: str) -> None:
    """path holds text, whole and on the disk, or what it held before (validate.replacing)."""
    with validate.replacing(path) as temporary, open(temporary, 'w', encoding='utf-8') as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def staged(folder: str, prefix: str = '.saving-'):
    """A fresh staging folder inside folder, removed afterwards with whatever is left in it. Files are written
    there, then moved into place by os.replace (the same file system): each appears whole or not at all.
    It is named prefix + the writer's pid, so the stagings of writers killed outright (the OOM killer) are known
    as such: those of the same prefix go first (validate.left_behind), a live writer's stay."""
    _remove_left_behind(folder, prefix)
    staging = tempfile.mkdtemp(prefix=f'{prefix}{os.getpid()}-', dir=folder)
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def whole_folder(path):
    """A staging folder whose files become the folder `path` (missing or empty, validate.check_new_folder)
    when the block ends without an error: an export is there whole or not at all. A missing folder is staged
    beside it and moved into place; an empty one (a mount point, the working folder) stays the same folder,
    staged inside and its entries moved into it."""
    path = validate.check_new_folder(os.path.abspath(path))
    if os.path.isdir(path):
        with staged(path, prefix=validate.PARTIAL) as staging:
            yield staging
            _move_entries(staging, path)
        return
    parent, name = os.path.split(path)
    made = missing_folders(parent)
    os.makedirs(parent, exist_ok=True)
    try:
        with staged(parent, prefix=f'.{name}.partial-') as staging:
            yield staging
            os.chmod(staging, 0o777 & ~current_umask())  # mkdtemp's folder is private (0700); a save's is not
            os.replace(staging, path)
    except BaseException:  # the folders made for it go too, innermost first (each only while still empty)
        for folder in reversed(made):
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        raise


def missing_folders(path: str) -> list:
    """The folders os.makedirs(path) would create, outermost first."""
    missing = []
    while path and not os.path.exists(path):
        missing.insert(0, path)
        path = os.path.dirname(path)
    return missing


def _remove_left_behind(folder: str, prefix: str) -> None:
    """The stagings in folder named prefix + pid whose writer has gone (validate.left_behind)."""
    for left in filter(lambda entry: validate.left_behind(entry, prefix), os.listdir(folder)):
        left = os.path.join(folder, left)
        if os.path.isdir(left) and not os.path.islink(left):
            shutil.rmtree(left, ignore_errors=True)
        else:
            os.remove(left)


def _move_entries(staging: str, path: str) -> None:
    """Every entry of staging moved into path (the same file system); on a failure or Ctrl-C, those moved go
    back."""
    moved = []
    try:
        for entry in sorted(os.listdir(staging)):
            moved.append(entry)  # before the move: a Ctrl-C between the two still finds it
            os.replace(os.path.join(staging, entry), os.path.join(path, entry))
    except BaseException:
        for entry in moved:
            if os.path.lexists(os.path.join(path, entry)):
                os.replace(os.path.join(path, entry), os.path.join(staging, entry))
        raise


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


WRITE_ERRORS = {tf.errors.ResourceExhaustedError: errno.ENOSPC, tf.errors.PermissionDeniedError: errno.EACCES}


def write_tensors(prefix: str, tensors: dict) -> None:
    """Writes {name: tensor} as a TF name-based checkpoint at prefix (.index and .data-00000-of-00001).

    The files are written in a staging folder beside them and moved into place data
    first, so a reader never finds an index whose data is missing.
    """
    with staged(os.path.dirname(prefix) or '.') as staging:
        names = sorted(tensors)
        try:
            tf.raw_ops.SaveV2(prefix=os.path.join(staging, 'bundle'), tensor_names=names,
                              shape_and_slices=[''] * len(names), tensors=[tensors[n] for n in names])
        except tf.errors.OpError as e:  # a full disk is TensorFlow's ResourceExhaustedError: an OSError here
            code = WRITE_ERRORS.get(type(e))  # its message names a staging file, gone by now
            raise OSError(code or errno.EIO, os.strerror(code) if code else first_line(e), prefix) from None
        for suffix in ('.data-00000-of-00001', '.index'):  # on the disk before a `checkpoint` file names them
            with open(os.path.join(staging, 'bundle' + suffix), 'rb') as f:
                os.fsync(f.fileno())
        move_bundle(os.path.join(staging, 'bundle'), prefix)


def move_bundle(source: str, prefix: str) -> None:
    """A bundle written by write_tensors renamed to prefix (the same file system), data first, so a reader
    never finds an index whose data is missing."""
    for suffix in ('.data-00000-of-00001', '.index'):
        os.replace(source + suffix, prefix + suffix)


def remove_bundle(prefix: str) -> None:
    for path in glob.glob(glob.escape(prefix) + '.data-*') + [prefix + '.index', prefix + '.meta']:
        if os.path.exists(path):
            os.remove(path)


def stored_weights(model: Model) -> dict:
    """{checkpoint name: float32 tensor}: what a file of the model holds. A product with a LoRA adapter attached
    (gpt2_tf.lora: conv.adapter, whose delta() is A·B·scale [nx, nf]) holds w + delta, summed in float32, and
    the adapter's own variables are left out: the file is the adapted model, in the original graph's names."""
    adapted = {m.w.name.split(':')[0]: m.adapter for m in model.submodules if getattr(m, 'adapter', None) is not None}
    own = {v.name.split(':')[0] for a in adapted.values() for v in a.variables}
    weights = {}
    for name, variable in stored(model.variables_by_name()).items():
        if name not in own:
            weights[name] = tf.cast(variable.read_value(), tf.float32)  # a float32 read aliases the variable
            if name in adapted:
                weights[name] = weights[name] + adapted[name].delta()[None]  # [1, nx, nf]
    return weights


def save_checkpoint(model: Model, model_dir: str | os.PathLike, *, name: Optional[str] = None,
                    keep: int = 1) -> str:
    """Writes the model in the original layout; returns the checkpoint prefix.

    Into a folder without a checkpoint it writes the published layout (model.ckpt.*,
    `checkpoint`, hparams.json). Over an existing checkpoint it writes the tensors
    under a new prefix (model.ckpt-1, -2, ...; or `name`, which must be new), switches
    the `checkpoint` file to it with an atomic rename, and only then removes the listed
    prefixes beyond the `keep` newest, but for a run folder's model-<step> saves, which
    stay listed (fine-tuning's, not this function's): an interrupted save leaves the
    earlier checkpoint loadable, and a failed one leaves the folder as it was. The
    folder's other files stay. A folder whose
    hparams.json describes another model size, and one holding a Hugging Face model
    (config.json and its weights), are refused. Attached LoRA adapters are written
    merged (stored_weights).
    """
    model_dir = check_save(model, model_dir)
    current, listed = checkpoint_state(model_dir)
    if name is None:
        name = CHECKPOINT_PREFIX
        number = 0
        while name == current or os.path.exists(os.path.join(model_dir, name + '.index')):
            number += 1
            name = f'{CHECKPOINT_PREFIX}-{number}'
    elif name in listed or os.path.exists(os.path.join(model_dir, name + '.index')):
        raise CheckpointError(f'{model_dir} holds a checkpoint named {name} already, and a save never replaces '
                              f'one in place (an interrupted one would leave neither): give a new name, or '
                              f'leave name out')
    write_tensors(os.path.join(model_dir, name), stored_weights(model))
    return publish(model, model_dir, name, keep=keep, own=NOT_RUN_SAVE)


def check_save(model: Model, model_dir: str | os.PathLike) -> str:
    """The folder a save of the model may write into (created), before anything is written: an int8 model,
    a folder holding a model of another size, and one holding a Hugging Face model (refuse_hf_model) are
    refused."""
    if model.dtype == 'int8':
        raise CheckpointError('an int8 model cannot be saved: the original format holds float32 weights, '
                              'and int8 ones are a lossy copy of them; save the float32 model (dtype="float32")')
    model_dir = save_folder(model_dir)
    refuse_hf_model(model_dir)
    hparams_path = os.path.join(model_dir, 'hparams.json')
    if os.path.exists(hparams_path):
        existing = HParams.from_json(hparams_path)
        if existing != model.hparams:
            raise CheckpointError(f'{model_dir} holds a model of another size ({existing}); '
                                  f'save to another folder')
    return model_dir


def refuse_hf_model(model_dir: str) -> None:
    """A folder holding a Hugging Face model (config.json and its weights) takes no checkpoint: both would stay
    beside it, describing another model (save_hf refuses the mirror case). A config.json alone is no model."""
    if holds_hf_model(model_dir):
        raise CheckpointError(f'{model_dir} holds a Hugging Face model (config.json and its weights), which would '
                              f'stay beside the checkpoint and describe another model; save to another folder')


def publish(model: Model, model_dir: str, name: str, *, keep: int, own: re.Pattern) -> str:
    """After prefix `name`'s files are in place: hparams.json when missing, the `checkpoint` file switched to
    name, then the listed prefixes of the saver's own kind (those `own` matches) beyond the `keep` newest
    removed; other listed prefixes stay. A failure before the switch removes name's files too, so a failed
    save leaves the folder as it was. Returns the prefix."""
    hparams_path = os.path.join(model_dir, 'hparams.json')
    written = not os.path.exists(hparams_path)
    try:
        if written:
            model.hparams.to_json(hparams_path)  # whole or absent, as the `checkpoint` file
        _, listed = checkpoint_state(model_dir)
        mine = [n for n in listed if n != name and own.fullmatch(n)]
        gone = set(mine[:max(len(mine) - (keep - 1), 0)])
        write_state(model_dir, [n for n in listed if n != name and n not in gone] + [name])
    except BaseException:
        if _remove_unlisted(model_dir, name) and written:  # the folder as it was: without the hparams.json too
            with contextlib.suppress(OSError):
                os.remove(hparams_path)
        raise
    for old in gone:  # only once the `checkpoint` file names the new one
        remove_bundle(os.path.join(model_dir, old))
    return os.path.join(model_dir, name)


def _remove_unlisted(model_dir: str, name: str) -> bool:
    """Prefix name's files, unless the `checkpoint` file lists it (or cannot be read: then they stay); whether
    they went."""
    try:
        listed = checkpoint_state(model_dir)[1]
    except Exception:
        return False
    if name not in listed:
        remove_bundle(os.path.join(model_dir, name))
    return name not in listed
