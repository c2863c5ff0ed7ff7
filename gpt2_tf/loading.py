"""Finding and loading a model: the one place that decides what a model folder or name is.

    resolve('checkpoints/124M')        an original folder (hparams.json and a checkpoint), also a
                                       fine-tuning run folder such as checkpoint/run1
    resolve('gpt2-hf')                 a Hugging Face folder (config.json and model.safetensors)
    resolve(model_name='124M')         a published name, under models_dir (default checkpoints/)
    resolve(model_name='test')         the bundled test checkpoint (gpt2_tf/assets/test-checkpoint)

resolve() reads no weights and imports no TensorFlow, so the command line can
check every argument first; load_model() loads what it finds. The command
line, the server, Beam and the library all go through these two.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from typing import Optional

import numpy as np

from . import hf
from .assets import bundled_checkpoint
from .download import partial_folder
from .encoder import Encoder, carried_vocabulary, encoder_for, is_save, vocabulary_files
from .hparams import BUNDLED, OLD_NAMES, PUBLISHED, HParams, folder_names, is_hf_folder
from .validate import GPT2Error

DEFAULT_MODEL = '124M'
DEFAULT_MODELS_DIR = 'checkpoints'


class ModelNotFound(GPT2Error, FileNotFoundError):
    """No model where one was named: a one-line message with the command that gets one."""


@dataclasses.dataclass(frozen=True)
class ModelFolder:
    """A model folder found by resolve(): where it is, its layout, and the names it answers to."""
    path: str
    layout: str  # 'original' (OpenAI's layout, and fine-tuning run folders) or 'hf'
    names: tuple  # the ids a server answers to: the folder's name first, then its published name or 'test'
    notice: Optional[str] = None  # a line to show before loading it (why the bundled checkpoint is used)
    checkpoint: Optional[str] = None  # one save of the folder, when named (checkpoint/run1/model-2)

    def prefix(self) -> str:
        """The checkpoint to read: the save named, else the one the folder's `checkpoint` file names."""
        from .checkpoint import find_checkpoint

        return self.checkpoint or find_checkpoint(self.path)

    @property
    def name(self) -> str:
        return self.names[0]

    def hparams(self) -> HParams:
        if self.layout == 'hf':
            return hf.read_config(self.path)
        try:
            return HParams.from_json(os.path.join(self.path, 'hparams.json'))
        except ValueError as e:  # not JSON, a missing or unknown key, a value HParams refuses
            raise GPT2Error(str(e)) from None

    def original(self) -> 'ModelFolder':
        """The folder, where the TF1 graph can read it (the original layout); an HF folder is refused in one line."""
        if self.layout == 'hf':
            raise GPT2Error(f'{self.path} is a Hugging Face folder; the TF1 graph reads the original layout: '
                            f'convert it first (gpt2-tf convert {self.path} DST --to original)')
        return self

    def encoder(self) -> Encoder:
        """The folder's own vocabulary; a folder without one gets GPT-2's bundled one, with a warning
        when its layout normally carries one (HF folders)."""
        encoder = encoder_for(self.path)  # first: a vocabulary it refuses is not said to be replaced
        if self.layout == 'hf' and vocabulary_files(self.path) is None:
            n_vocab = self.hparams().n_vocab
            warnings.warn(f'{self.path} has no vocab.json/merges.txt; using the bundled GPT-2 vocabulary'
                          + ('' if n_vocab == hf.GPT2_VOCAB else f' (50257 tokens; the model has {n_vocab})'),
                          stacklevel=2)
        return encoder

    def carried_vocabulary(self) -> tuple:
        """The vocabulary files a folder written from this one carries (encoder.carried_vocabulary), refused
        before the model loads; with encoder()'s warning where GPT-2's bundled pair stands in."""
        files = carried_vocabulary(self.path, self.hparams().n_vocab)
        self.encoder()
        return files


def _folder(path: str, *, names: Optional[tuple] = None, notice: Optional[str] = None) -> ModelFolder:
    """A ModelFolder for a folder that exists, after the checks that need no weights."""
    if not os.path.isdir(path):
        what = 'a file' if os.path.exists(path) else 'not there'
        raise ModelNotFound(f'{path} is {what}: give a model folder (hparams.json and a checkpoint, or an HF '
                            f'config.json), or a model name such as {DEFAULT_MODEL} or {BUNDLED}')
    if is_hf_folder(path):
        layout = 'hf'
    elif os.path.isfile(os.path.join(path, 'hparams.json')):
        layout = 'original'
    else:
        raise ModelNotFound(f'{path}: no hparams.json (the original layout) or config.json (a Hugging Face '
                            f'folder): not a model folder (a run folder takes its base model\'s hparams.json)')
    return ModelFolder(path, layout, names or folder_names(path), notice)


def _one_save(prefix: str) -> ModelFolder:
    """One save of a folder in the original layout, named by its prefix (gpt-2-simple's checkpoint='model-2')."""
    folder = _folder(os.path.dirname(prefix) or '.')
    if folder.layout != 'original':
        raise ModelNotFound(f'{prefix}: a checkpoint prefix names one save of a folder in the original layout '
                            f'(hparams.json beside it); give the folder itself')
    return dataclasses.replace(folder, checkpoint=prefix)


def _bundled(notice: Optional[str] = None) -> ModelFolder:
    return _folder(bundled_checkpoint(), notice=notice)


def _incomplete(folder: str) -> bool:
    """A model folder that an interrupted download left behind (.part files, or no index)."""
    names = os.listdir(folder)
    return any(n.endswith('.part') for n in names) or not any(n.endswith('.index') for n in names)


def resolve(model_dir=None, *, model_name: Optional[str] = None, models_dir=None) -> ModelFolder:
    """The model that model_dir names (a folder, else a model name), or models_dir/model_name.

    With none of the three, models_dir/124M when it is downloaded, else the
    bundled test checkpoint, with a notice saying so. Raises ModelNotFound
    with the command that gets the model.
    """
    if isinstance(model_dir, ModelFolder):
        return model_dir
    if model_dir is not None:
        model_dir = os.fspath(model_dir)
        if is_save(model_dir):
            return _one_save(model_dir)
        if os.path.exists(model_dir) or os.sep in model_dir or not model_dir:
            if not os.path.exists(model_dir):
                raise ModelNotFound(f'no model folder at {model_dir}: check the path, or give a model name '
                                    f'({", ".join(PUBLISHED)}, or {BUNDLED} for the bundled test checkpoint)')
            return _folder(model_dir)
        if model_dir != BUNDLED and OLD_NAMES.get(model_dir, model_dir) not in PUBLISHED:
            raise ModelNotFound(f'no model folder at {model_dir}, and {model_dir!r} is not a model name '
                                f'({", ".join(PUBLISHED)}, or {BUNDLED} for the bundled test checkpoint)')
        model_name = model_dir  # a bare name: a published model or the bundled one
    chosen = os.path.expanduser(os.fspath(models_dir or DEFAULT_MODELS_DIR))
    if models_dir is not None and not os.path.isdir(chosen):
        raise ModelNotFound(f'--models_dir {models_dir} is not a folder; give the folder that holds the model '
                            f'folders (default: {DEFAULT_MODELS_DIR})')
    name = model_name or DEFAULT_MODEL
    if name in OLD_NAMES and not os.path.isdir(os.path.join(chosen, name)):
        name = OLD_NAMES[name]  # download_model.py 117M saves 124M (a folder of the old name is taken as it is)
    path = os.path.join(chosen, name)
    published = name in PUBLISHED
    resume = f'python -m gpt2_tf.download {name}' + (f' --models_dir {models_dir}' if models_dir else '')
    if os.path.isdir(path):
        if published and not is_hf_folder(path) and _incomplete(path):  # an HF folder is no download of ours
            raise ModelNotFound(f'the download in {path} is incomplete: run `{resume}` again to resume it')
        return _folder(path)
    if name == BUNDLED:
        return _bundled()
    partial = os.path.isdir(partial_folder(path))
    if model_name is None and models_dir is None:
        return _bundled(_fallback_notice(name, path, partial, resume))
    if partial:
        raise ModelNotFound(f'the download of {name} is incomplete: run `{resume}` again to resume it')
    if not published:
        raise ModelNotFound(f'no model folder {path}, and {name!r} is not a published model '
                            f'({", ".join(PUBLISHED)}) or {BUNDLED!r} (the bundled test checkpoint); give '
                            f'--model_dir for a folder of your own')
    raise ModelNotFound(f'no model at {path}; download it with: {resume}')


def _fallback_notice(name: str, path: str, partial: bool, resume: str) -> str:
    if partial:
        why = (f'the download of {name} is incomplete ({partial_folder(path)}); resume it with `{resume}`. '
               f'Meanwhile using')
    else:
        why = f'no model at {path}, so using'
    return (f'gpt2-tf: {why} the bundled test checkpoint (--model_name {BUNDLED}: random weights, 2 tiny layers, '
            f'the text is gibberish).' + ('' if partial else f' Get a real model with: {resume}'))


def load_model(model_dir, *, device: Optional[str] = None, strict: bool = True, jit_compile: bool = False,
               strategy=None, dtype: str = 'float32', adapter=None):
    """A Model from a folder laid out as OpenAI published it (hparams.json and a checkpoint, also a
    fine-tuning run folder), from a Hugging Face GPT-2 folder (config.json with model.safetensors or
    pytorch_model.bin; see gpt2_tf.hf), or from a name: 'test' (the bundled test checkpoint) or a
    published one ('124M') under checkpoints/. A folder with both an hparams.json and a config.json
    loads as the original layout. model_dir may also be a ModelFolder from resolve().

    device pins the variables and the computation ('/GPU:0', '/CPU:0'); by default
    TensorFlow places them, on a GPU when it sees one. strict=False ignores
    checkpoint variables the model does not use (optimizer slots). jit_compile=True
    XLA-compiles model calls (see Model). strategy, a tf.distribute strategy, creates
    the variables under its scope (mirrored on its devices), for data-parallel
    training with gpt2_tf.train.Trainer. dtype holds the weights in 'float32'
    (the default, exact), 'bfloat16', 'float16' or 'int8' (see gpt2_tf.precision);
    the checkpoint's float32 values are rounded to it once, at load. adapter, a
    LoRA run folder or any PEFT LoRA folder made for this base, is folded into
    the weights (w + A·B·alpha/r, see gpt2_tf.lora) in float32, before that
    rounding: the model is the adapted one, and save_checkpoint or save_hf
    write it merged.
    """
    from . import lora, precision
    from .checkpoint import restore
    from .runtime import Model

    folder = model_dir if isinstance(model_dir, ModelFolder) else resolve(model_dir)
    prefix = folder.prefix() if folder.layout == 'original' else None
    hparams = folder.hparams()
    with strategy.scope() if strategy else contextlib.nullcontext():
        with precision.unfilled():  # every variable is assigned below, or the model is dropped
            model = Model(hparams, device=device, jit_compile=jit_compile, dtype=dtype)
        # The adapter is added to the float32 values as they are read, before they are rounded or quantized
        # to dtype: bfloat16 and int8 round the merged weight once.
        deltas = lora.merged_deltas(model, adapter) if adapter is not None else None
        if prefix is None:
            _load_hf(model, folder.path, strict=strict, add=deltas)
        else:
            restore(model, prefix, strict=strict, all_or_nothing=False, add=deltas)
    model.strategy, model.folder = strategy, folder
    return model


def _load_hf(model, model_dir: str, *, strict: bool = True, add: Optional[dict] = None) -> None:
    """Assigns a Hugging Face GPT-2 folder (config.json and model.safetensors or pytorch_model.bin) to the
    model, every name and shape checked first, in the model's dtype (int8 quantized); strict and add as
    restore's."""
    from .checkpoint import variable_shapes, verify
    from .precision import assign, stored

    hparams = model.hparams
    read = hf.read_tensors(model_dir)
    hf.check_head(read, model_dir)
    tensors = hf.to_original(read, hparams, source=model_dir, strict=strict)
    verify(variable_shapes(hparams), {name: value.shape for name, value in tensors.items()}, hparams=hparams,
           source=model_dir, strict=strict, settings='config.json')
    variables = model.variables_by_name()
    for name in stored(variables):
        value = tensors.pop(name)
        assign(variables, name, value + add[name] if add and name in add else value)


def stored_shapes(model_dir) -> dict:
    """{checkpoint name: shape} of the tensors a model folder holds, in either layout (HF names mapped to
    the original's), read without loading a model: what parameter accounting counts."""
    folder = model_dir if isinstance(model_dir, ModelFolder) else resolve(model_dir)
    if folder.layout == 'hf':  # tensors GPT-2 does not have kept under their own names, for accounting to list
        read, extra = hf.read_tensors(folder.path), []
        tensors = hf.to_original(read, folder.hparams(), source=folder.path, strict=False, dropped=extra)
        return {name: tuple(np.shape(value)) for name, value in {**tensors, **{n: read[n] for n in extra}}.items()}
    from .checkpoint import checkpoint_shapes

    return checkpoint_shapes(folder.prefix())
