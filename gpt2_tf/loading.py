"""Loading a model from any folder this project reads: the original layout or a Hugging Face folder.

The one place that decides what a model folder is; the command line, the
server, Beam and the library all load through load_model.
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import tensorflow as tf

from . import hf
from .checkpoint import find_checkpoint, restore, variable_shapes, verify
from .hparams import HParams
from .model import Model


def load_model(model_dir: str | os.PathLike, *, device: Optional[str] = None, strict: bool = True,
               jit_compile: bool = False, strategy=None, dtype: str = 'float32') -> Model:
    """A Model from a folder laid out as OpenAI published it (hparams.json and a checkpoint), or from a
    Hugging Face GPT-2 folder (config.json with model.safetensors or pytorch_model.bin; see gpt2_tf.hf).
    A folder with both an hparams.json and a config.json loads as the original layout.

    device pins the variables and the computation ('/GPU:0', '/CPU:0'); by default
    TensorFlow places them, on a GPU when it sees one. strict=False ignores
    checkpoint variables the model does not use (optimizer slots). jit_compile=True
    XLA-compiles model calls (see Model). strategy, a tf.distribute strategy, creates
    the variables under its scope (mirrored on its devices), for data-parallel
    training with gpt2_tf.train.Trainer. dtype holds the weights in 'float32'
    (the default, exact), 'bfloat16' or 'float16' (see gpt2_tf.precision); the
    checkpoint's float32 values are rounded to it once, at load.
    """
    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f'no model folder at {model_dir}')
    with strategy.scope() if strategy else contextlib.nullcontext():
        if hf.is_hf_folder(model_dir):
            model = _load_hf(model_dir, device=device, jit_compile=jit_compile, dtype=dtype)
        else:
            hparams = HParams.from_json(os.path.join(model_dir, 'hparams.json'))
            prefix = find_checkpoint(model_dir)
            model = Model(hparams, device=device, jit_compile=jit_compile, dtype=dtype)
            restore(model, prefix, strict=strict, all_or_nothing=False)
    model.strategy = strategy
    return model


def _load_hf(model_dir: str, **options) -> Model:
    """A Model from a Hugging Face GPT-2 folder (config.json and model.safetensors or pytorch_model.bin)."""
    hparams = hf.read_config(model_dir)
    tensors = hf.to_original(hf.read_tensors(model_dir), hparams, source=model_dir)
    verify(variable_shapes(hparams), {name: value.shape for name, value in tensors.items()}, hparams=hparams,
           source=model_dir, settings='config.json')
    model = Model(hparams, **options)
    for name, variable in model.variables_by_name().items():
        variable.assign(tf.cast(tensors[name], variable.dtype))
    return model
