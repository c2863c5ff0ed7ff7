"""A fine-tuning run's folder, in gpt-2-simple's layout, on top of checkpoint.py.

    checkpoint_dir/run_name/
        checkpoint             the current model-<step> (written last: an interrupted save keeps the previous)
        model-<step>.*         the model alone, loadable by load_model and by the original code
        optimizer-<step>.*     the optimizer's slots, named after the variables they shadow (not in gpt-2-simple)
        counter                the step
        hparams.json, encoder.json, vocab.bpe

Every read is checked before anything is assigned: the model through
checkpoint.restore, the optimizer's slots here (names, shapes, dtypes, the
data's size and checksums), each failure a one-line CheckpointError.
"""

from __future__ import annotations

import contextlib
import filecmp
import glob
import os
import re
import shutil
import warnings
from typing import Optional

import numpy as np
import tensorflow as tf

from . import checkpoint
from .assets import bundled_vocabulary
from .checkpoint import CheckpointError
from .encoder import is_save
from .hparams import PUBLISHED, HParams, folder_names
from .precision import stored
from .validate import GPT2Error, first_line, replacing

COUNTER = 'counter'
TRAINING_STATE = re.compile(r'(^|/)(beta[12]_power|global_step)$|/Adam(_1)?$')  # TF1 Adam's and the Saver's


def optimizer_prefix(model_prefix: str):
    """model-<step> -> optimizer-<step>, beside it; None for a prefix of another name (model.ckpt)."""
    folder, name = os.path.split(model_prefix)
    return os.path.join(folder, 'optimizer-' + name[len('model-'):]) if name.startswith('model-') else None


def save(run_dir: str, model, slots: dict, step: int, *, max_checkpoints: int = 1, vocabulary=None) -> str:
    """Writes model-<step>, optimizer-<step> (when there are slots), `counter`, hparams.json and the
    vocabulary ({file name in the run folder: source path}; None: the bundled GPT-2 one); keeps the newest
    max_checkpoints. Returns the model's prefix.

    Both bundles are written whole in a staging folder first; only then is an earlier save of the same
    step (a fresh start over the folder, or the same step saved again) dropped from the `checkpoint` file
    and replaced, with a discarded run's optimizer-<step>, and the `checkpoint` file switched to the new
    step: no crash leaves one run's model beside another's optimizer state, and a failed write leaves the
    folder as it was.
    """
    run_dir = checkpoint.check_save(model, run_dir)
    name = f'model-{step}'
    state = optimizer_prefix(os.path.join(run_dir, name))
    with checkpoint.staged(run_dir) as staging:
        checkpoint.write_tensors(os.path.join(staging, 'model'), checkpoint.stored_weights(model))
        if slots:
            checkpoint.write_tensors(os.path.join(staging, 'optimizer'), {n: v.read_value() for n, v in slots.items()})
        checkpoint.forget(run_dir, name)
        checkpoint.remove_bundle(state)
        if slots:
            checkpoint.move_bundle(os.path.join(staging, 'optimizer'), state)
        checkpoint.move_bundle(os.path.join(staging, 'model'), os.path.join(run_dir, name))
    try:
        prefix = checkpoint.publish(model, run_dir, name, keep=max_checkpoints, own=checkpoint.RUN_SAVE)
    except BaseException:  # publish removed model-<step>: its optimizer state goes too
        with contextlib.suppress(Exception):
            remove_orphan_states(run_dir)
        raise
    remove_orphan_states(run_dir)
    try:
        checkpoint.replace_atomically(os.path.join(run_dir, COUNTER), f'{step}\n')
        copy_vocabulary(run_dir, vocabulary)
    except OSError as e:
        raise Unfinished(e.errno, e.strerror) from None
    return prefix


def remove_orphan_states(run_dir: str) -> None:
    """Optimizer states are of no use without their model: those of models the `checkpoint` file no longer
    lists go (also ones an interrupted save left behind). Unlisted models stay: a copy kept by hand is the user's."""
    _, listed = checkpoint.checkpoint_state(run_dir)
    for index in glob.glob(os.path.join(glob.escape(run_dir), 'optimizer-*.index')):
        if 'model-' + os.path.basename(index)[len('optimizer-'):-len('.index')] not in listed:
            checkpoint.remove_bundle(index[:-len('.index')])


class Unfinished(OSError):
    """The step is saved (the `checkpoint` file, or the adapter's metadata, names it), but writing `what` failed:
    the counter or the vocabulary, or a LoRA step's optimizer state or adapter_config.json."""

    def __init__(self, errno_: int, strerror: str, what: str = 'its counter or vocabulary'):
        super().__init__(errno_, strerror)
        self.what = what


def copy_vocabulary(run_dir: str, vocabulary=None) -> None:
    """{name: source} into the run folder, each whole or not at all: a file there that differs (another base's,
    or one cut short) is replaced. None: the bundled GPT-2 files, where the run folder has none."""
    replace = vocabulary is not None
    vocabulary = vocabulary or dict(zip(('encoder.json', 'vocab.bpe'), bundled_vocabulary()))
    for name, source in vocabulary.items():
        target = os.path.join(run_dir, name)
        if os.path.exists(target) and (not replace or filecmp.cmp(target, source, shallow=False)):
            continue
        with replacing(target) as temporary:
            shutil.copyfile(source, temporary)


def run_hparams(run_dir: str) -> HParams:
    return HParams.from_json(os.path.join(run_dir, 'hparams.json'))


def has_checkpoint(run_dir: str) -> bool:
    return os.path.exists(os.path.join(run_dir, 'checkpoint'))


def read_step(run_dir: str, prefix: str) -> int:
    """The run's step: the number in model-<step>, which names what the files hold (gpt-2-simple also writes
    it to `counter`, after the save: a save cut short leaves the counter behind); for a prefix of another
    name, `counter`, else 0."""
    saved = checkpoint.RUN_SAVE.fullmatch(os.path.basename(prefix))
    if saved:
        return int(saved.group(1))
    counter = os.path.join(run_dir, COUNTER)
    if os.path.exists(counter):
        with open(counter, encoding='utf-8') as f:
            text = f.read().strip() or '0'
        if not text.isdigit():
            raise CheckpointError(f'{counter}: expected the step number, found {text[:40]!r}; write the step '
                                  f'the run reached there, or remove the file to start counting from 0')
        return int(text)
    return 0


def restore(run_dir: str, model, slots: dict) -> tuple:
    """Loads the run's latest model-<step> and, when saved, its optimizer slots: -> (step, slots restored).

    The slots are read and checked first, so a damaged or mismatched optimizer
    state leaves the model and the slots as they were. They come from
    optimizer-<step>, else from model-<step> itself when it holds them (a TF1
    Saver over every variable writes TF1 Adam's slots under the names used
    here; training state there is otherwise passed over). A gpt-2-simple run
    folder has no optimizer state: (step, False), and the caller starts its
    slots afresh.
    """
    prefix = checkpoint.find_checkpoint(run_dir)
    step = read_step(run_dir, prefix)
    state = optimizer_prefix(prefix)
    expected = {n: tuple(v.shape.as_list()) for n, v in slots.items()}
    held = checkpoint.checkpoint_shapes(prefix)
    values = None
    if slots and state and os.path.exists(state + '.index'):
        values = read_slots(state, expected)
    elif slots and all(held.get(n) == shape for n, shape in expected.items()):
        values = read_slots(prefix, expected)
    extra = set(held) - set(stored(model.variables_by_name()))
    checkpoint.restore(model, prefix, strict=not extra or not all(map(TRAINING_STATE.search, extra)))
    for name, value in (values or {}).items():
        slots[name].assign(value)
    return step, values is not None


def _reader(prefix: str, expected: dict):
    """A reader of the optimizer state whose every expected slot has its name, shape and dtype, and
    whose data file is as large as they need."""
    try:
        reader = tf.train.load_checkpoint(prefix)
    except Exception as e:  # TF raises OpError, ValueError, and others for damaged files
        raise CheckpointError(f'cannot read the optimizer state {prefix}: {first_line(e)}') from None
    shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
    fresh = f'resume with restore_from fresh, or remove {os.path.basename(prefix)}.* to start the optimizer afresh'
    for name, shape in expected.items():
        if name not in shapes:
            raise CheckpointError(f'optimizer state {prefix} has no {name} (a run that trained other variables?); '
                                  f'{fresh}')
        if tuple(shapes[name]) != tuple(shape):
            raise CheckpointError(f'optimizer state {prefix}: {name} has shape {list(shapes[name])}, the model '
                                  f'needs {list(shape)}; {fresh}')
        if dtypes[name] != tf.float32:
            raise CheckpointError(f'optimizer state {prefix}: {name} is {dtypes[name].name}, expected float32')
    needed = sum(4 * int(np.prod(shapes[name])) for name in expected)
    have = sum(os.path.getsize(f) for f in glob.glob(glob.escape(prefix) + '.data-*'))
    if have < needed:
        raise CheckpointError(f'optimizer state {prefix}: the .data file holds {have:,} bytes but the slots need '
                              f'{needed:,}; it is truncated: {fresh}')
    return reader


def read_slots(prefix: str, expected: dict) -> dict:
    """{name: float32 array} for each name in expected {name: shape}, every one checked before it is returned."""
    reader = _reader(prefix, expected)
    values = {}
    for name in expected:
        try:
            values[name] = reader.get_tensor(name)
        except Exception as e:  # OpError for a bad checksum; others for other damage
            raise CheckpointError(f'optimizer state {prefix}: cannot read {name} ({first_line(e)}); '
                                  f'the .data file is corrupt') from None
    return values


# --- a LoRA run: the adapter in PEFT's format, never the base model's files ------------------------

def is_adapter_run(run_dir: str) -> bool:
    return os.path.isfile(os.path.join(run_dir, 'adapter_config.json'))


def check_mode(run_dir: str, *, lora: bool) -> None:
    """Refuses to start afresh over a run folder of the other kind (LoRA adapters or full fine-tuning): a new
    run would overwrite its counter and drop its optimizer state."""
    if lora and has_checkpoint(run_dir):
        raise GPT2Error(f'{run_dir} holds a full fine-tuning run; resume it without --lora_rank, or train the '
                        f'adapters under another --run_name')
    if not lora and is_adapter_run(run_dir):
        raise GPT2Error(f'{run_dir} holds a LoRA run; resume it with its --lora_rank (and lora options), or '
                        f'fine-tune under another --run_name')


def save_adapter(run_dir: str, model, adapters: dict, config: dict, slots: dict, step: int, *,
                 vocabulary=None) -> str:
    """A LoRA run's step: adapter_model.safetensors and adapter_config.json (PEFT's folder; the step in the
    file's metadata is what a resumed run reads) and optimizer-<step> (the adapters' slots), then `counter`,
    hparams.json and the vocabulary. Earlier optimizer states go. Returns the adapter's path.

    As in save(), the files are written whole in a staging folder first, and an earlier run's optimizer-<step>
    goes before the adapter is replaced: no crash leaves one run's adapter beside another's optimizer state,
    and a failed write leaves the folder as it was."""
    from . import lora

    os.makedirs(run_dir, exist_ok=True)
    state = os.path.join(run_dir, f'optimizer-{step}')
    with checkpoint.staged(run_dir) as staging:
        if slots:
            checkpoint.write_tensors(os.path.join(staging, 'optimizer'), {n: v.read_value() for n, v in slots.items()})
        try:
            lora.save(staging, adapters, config, step=step, dtype=model.dtype)
        except OSError as e:  # named where it was to go
            raise OSError(e.errno, (e.strerror or str(e)).replace(staging, run_dir)) from None
        checkpoint.remove_bundle(state)
        os.replace(os.path.join(staging, lora.WEIGHTS), os.path.join(run_dir, lora.WEIGHTS))
        try:  # the step's adapter is in place from here: a failure says what it lacks
            os.replace(os.path.join(staging, lora.CONFIG), os.path.join(run_dir, lora.CONFIG))
        except OSError as e:
            raise Unfinished(e.errno, e.strerror, f'its {lora.CONFIG} and optimizer state (the new adapter is beside '
                                                  f'the previous step\'s config)') from None
        try:
            if slots:
                checkpoint.move_bundle(os.path.join(staging, 'optimizer'), state)
        except OSError as e:
            raise Unfinished(e.errno, e.strerror, 'its optimizer state (a resume starts the optimizer afresh)') \
                from None
    for index in glob.glob(os.path.join(glob.escape(run_dir), 'optimizer-*.index')):
        if index[:-len('.index')] != state:
            checkpoint.remove_bundle(index[:-len('.index')])
    try:
        checkpoint.replace_atomically(os.path.join(run_dir, COUNTER), f'{step}\n')
        if not os.path.exists(os.path.join(run_dir, 'hparams.json')):
            model.hparams.to_json(os.path.join(run_dir, 'hparams.json'))
        copy_vocabulary(run_dir, vocabulary)
    except OSError as e:
        raise Unfinished(e.errno, e.strerror) from None
    return os.path.join(run_dir, lora.WEIGHTS)


def saved_step(run_dir: str) -> Optional[str]:
    """What the run folder holds now, as a save's failure names it: model-<step>, a LoRA run's adapter of its
    step, or None."""
    from . import lora

    if is_adapter_run(run_dir):
        try:
            return f'the adapter of step {lora.saved_step(run_dir)}'
        except (OSError, GPT2Error):
            return None
    try:
        return checkpoint.checkpoint_state(run_dir)[0]
    except OSError:
        return None


def restore_adapter(run_dir: str, model, adapters: dict, slots: dict) -> tuple:
    """The run's adapter into the attached adapters and, when saved, its slots: -> (step, slots restored).
    Both are read and checked, the base they adapt included, before either is assigned."""
    from . import lora

    config, pairs, metadata = lora.read(run_dir, model)
    lora.check_fits(adapters, config, pairs, run_dir)
    check_same_base(run_dir, config.get('base_model_name_or_path'), getattr(model, 'folder', None))
    step = lora.step_of(metadata)
    step = read_step(run_dir, '') if step is None else step
    if metadata.get('dtype', model.dtype) != model.dtype:  # a choice of memory, not of the run: said, not refused
        warnings.warn(f'{run_dir} trained over {metadata["dtype"]} base weights up to step {step}, and goes on over '
                      f'{model.dtype} ones (--dtype {metadata["dtype"]} resumes it as it ran)', stacklevel=2)
    state = os.path.join(run_dir, f'optimizer-{step}')
    values = None
    if slots and os.path.exists(state + '.index'):
        values = read_slots(state, {n: tuple(v.shape.as_list()) for n, v in slots.items()})
    lora.assign(adapters, pairs)
    for name, value in (values or {}).items():
        slots[name].assign(value)
    return step, values is not None


def check_same_base(run_dir: str, saved, folder) -> None:
    """A LoRA run resumes on the base it trained on, which its adapter_config.json names (base_model_name_or_path,
    the base as the run was given it): its adapters correct that base's weights, and another base of the same
    sizes would train on without a word. The same base reached otherwise is no mismatch: the same folder by
    another path (relative, absolute, through a symlink) or the same published model (124M, 117M). A base that
    is no longer where the run recorded it (a moved or copied run folder) cannot be compared: a note."""
    from . import lora

    if folder is None or not isinstance(saved, str) or not saved:
        return  # a model built by hand, or an adapter that names no base (PEFT writes null then)
    current = folder.checkpoint or folder.path
    if os.path.realpath(saved) == os.path.realpath(current) or _published(saved) & _published(current):
        return
    if not (os.path.exists(saved) or is_save(saved)):
        warnings.warn(f'{run_dir} was trained on {saved}, which is not there now; it resumes on {current}',
                      stacklevel=3)
        return
    raise lora.AdapterError(f'{run_dir} holds adapters for {saved}, not for {current}: resume it with --model_dir '
                            f'{saved}, or give --restore_from fresh (or another --run_name) to train new ones')


def _published(path: str) -> set:
    """The published model (or 'test', the bundled checkpoint) a base is, among the names folder_names gives its
    folder, by its path or the one a symlink leads to: two downloads of 124M are one base. Not a folder's own
    name (any folder may be called 'model'), and nothing for one save of a run folder (model-2), which is no
    published model."""
    found = set()
    for spelling in (path, os.path.realpath(path)):
        own, *others = folder_names(spelling)
        found |= set(others) | ({own} & set(PUBLISHED))
    return found
