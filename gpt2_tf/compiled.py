"""Compiled functions shared by every model of one shape, with the weights passed in as arguments.

A tf.function that reads a model's variables captures them: each model then
compiles its own copy (XLA takes seconds for 124M), and the function keeps the
model alive. Here the weights go in as arguments instead. While the function
traces, the module tree of the model being called has its variables swapped
for those argument tensors, so the model code runs unchanged; afterwards the
function holds no reference to any model.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Callable, Optional

import tensorflow as tf

_functions = {}
_tracing = threading.RLock()  # one trace at a time: tracing swaps a model's attributes
_variables = weakref.WeakKeyDictionary()  # model -> its variables; tf.Module takes 2.5 ms to list 148


def weights(model) -> tuple:
    """The model's variables as tensors, in tf.Module order (the same for every model of a shape)."""
    if model not in _variables:
        _variables[model] = model.variables
    return tuple(v.value() for v in _variables[model])


@contextlib.contextmanager
def bound(model, tensors):
    """Within the block, the model's modules hold `tensors` where they held their variables."""
    paths = [path for path, _ in model._flatten(predicate=lambda v: isinstance(v, tf.Variable), with_path=True)]
    assert len(paths) == len(tensors), 'weights of another model shape'
    saved = []
    for path, tensor in zip(paths, tensors):
        owner = model
        for step in path[:-1]:
            owner = owner[step] if isinstance(step, int) else getattr(owner, step)
        saved.append((owner, path[-1], getattr(owner, path[-1])))
        setattr(owner, path[-1], tensor)
    try:
        yield model
    finally:
        for owner, name, variable in saved:
            setattr(owner, name, variable)


class Shared:
    """fn(model, *tensors, **static) compiled once per (model shape, static arguments), for any model.

    mode: 'xla' (XLA-compiled), 'function' (a plain tf.function) or 'eager'
    (fn runs on the model's own variables). Static arguments are Python values;
    each new one traces anew.
    """

    def __init__(self, fn: Callable, mode: str):
        self.fn = fn
        self.mode = mode
        self._model = threading.local()
        if mode != 'eager':
            # The code uses tf.while_loop and tf.cond itself: AutoGraph's conversion would only cost seconds.
            self._compiled = tf.function(self._traced, jit_compile=(mode == 'xla'), autograph=False)

    def _traced(self, tensors, *args, **static):
        with _tracing, bound(self._model.value, tensors) as model:
            return self.fn(model, *args, **static)

    def __call__(self, model, *args, **static):
        with model.on_device():
            if self.mode == 'eager':
                return self.fn(model, *args, **static)
            self._model.value = model
            try:
                return self._compiled(weights(model), *args, **static)
            finally:
                self._model.value = None

    @property
    def tracing_count(self) -> int:
        return 0 if self.mode == 'eager' else self._compiled.experimental_get_tracing_count()


MODES = ('xla', 'function', 'eager')
SMALL_BUCKETS = (8, 16, 32, 64)  # padded sizes up to 64; beyond, multiples of BUCKET_STEP
BUCKET_STEP = 64


def bucket(n, limit=None):
    """The padded size for n, so that nearby sizes share compiled code: 8, 16, 32, 64, then multiples of 64,
    at most limit when given. n is a Python int, or an int32 scalar tensor inside a graph (the export)."""
    if isinstance(n, tf.Tensor):
        small = tf.reduce_min(tf.where(tf.constant(SMALL_BUCKETS) >= n, SMALL_BUCKETS, SMALL_BUCKETS[-1]))
        size = tf.where(n <= SMALL_BUCKETS[-1], small, (n + BUCKET_STEP - 1) // BUCKET_STEP * BUCKET_STEP)
        return size if limit is None else tf.minimum(size, limit)
    size = next((s for s in SMALL_BUCKETS if s >= n), None) or -(-n // BUCKET_STEP) * BUCKET_STEP
    return size if limit is None else min(size, limit)


def default_mode(model) -> str:
    """XLA for float32 weights. For reduced ones, a plain tf.function: XLA on CPU upcasts bfloat16 and
    float16 weights into float32 copies (twice the memory, no speed gained), TensorFlow's kernels do not."""
    return 'xla' if model.dtype == 'float32' else 'function'


def shared(fn: Callable, model, mode: Optional[str] = None) -> Shared:
    """The one Shared for (fn, the model's shape and dtype, mode): every such model uses it."""
    mode = mode or default_mode(model)
    if mode not in MODES:
        raise ValueError(f'mode must be one of {MODES}, got {mode!r}')
    key = (fn, model.hparams, model.dtype, mode)
    if key not in _functions:
        _functions[key] = Shared(fn, mode)
    return _functions[key]
