"""Compiled functions shared by every model of one shape, with the weights passed in as arguments.

A tf.function that reads a model's variables captures them: each model then
compiles its own copy (XLA takes seconds for 124M), and the function keeps the
model alive. Here the weights go in as arguments instead. While the function
traces, the model code runs on a copy of the model's module tree whose leaves
are those argument tensors (`bound`); the model itself is never touched, so an
eager call on it from another thread sees its own variables. Afterwards the
function holds no reference to any model.

Each function traces once per (model shape, static arguments, shapes after the
leading batch dimension): a new batch size reuses the trace (XLA still compiles
per shape), so a library session traces each function once per option set.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Callable, Optional

import tensorflow as tf

from . import kernels, precision
from .validate import GPT2Error

_functions = {}
_variables = weakref.WeakKeyDictionary()  # model -> its variables; tf.Module takes 2.5 ms to list 148


def forget(model) -> None:
    """Drops the model's cached variable list: after its module tree changes (an adapter attached), the next
    call lists its variables again."""
    _variables.pop(model, None)


def weights(model) -> tuple:
    """The model's variables as tensors, in tf.Module order (the same for every model of a shape)."""
    if model not in _variables:
        _variables[model] = model.variables
    return tuple(v.value() for v in _variables[model])


def bound(model, tensors):
    """A copy of the model's module tree whose variables are `tensors` (in tf.Module order); the model
    and its modules stay as they are. Lists of modules are copied as lists; other values are shared."""
    variables = _variables[model] if model in _variables else model.variables
    assert len(variables) == len(tensors), 'weights of another model shape'
    leaves = {id(v): t for v, t in zip(variables, tensors)}
    copies = {}

    def copy(value):
        if isinstance(value, tf.Variable):
            return leaves[id(value)]
        if isinstance(value, tf.Module):
            if id(value) not in copies:
                copies[id(value)] = twin = object.__new__(type(value))
                twin.__dict__.update({name: copy(v) for name, v in vars(value).items()})
            return copies[id(value)]
        if isinstance(value, (list, tuple)) and any(isinstance(v, (tf.Module, tf.Variable)) for v in value):
            return [copy(v) for v in value]
        return value

    return copy(model)


def placement(model):
    """The model's device context (runtime.Model.on_device), or none for a bare graph."""
    on_device = getattr(model, 'on_device', None)
    return on_device() if on_device else contextlib.nullcontext()


def open_batch(value):
    """A tensor's spec with its leading (batch) dimension left open; other values as they are."""
    if isinstance(value, tf.Tensor) and value.shape.rank:
        return tf.TensorSpec([None] + value.shape.as_list()[1:], value.dtype)
    return value


def signature(structure) -> tuple:
    """What tracing depends on, past the weights (fixed per model shape): each tensor's shape after its
    batch dimension and its dtype, and every other value itself (its repr when it cannot be hashed)."""
    out = []
    for leaf in tf.nest.flatten(structure):
        if isinstance(leaf, tf.Tensor):
            out.append((tuple(leaf.shape[1:]) if leaf.shape.rank else None, leaf.dtype))
        else:
            try:
                out.append((hash(leaf), leaf))
            except TypeError:
                out.append(repr(leaf))
    return tuple(out)


class Shared:
    """fn(model, *tensors, **static) compiled once per (model shape, static arguments), for any model.

    mode: 'xla' (XLA-compiled), 'function' (a plain tf.function) or 'eager'
    (fn runs on the model's own variables). Static arguments are Python values;
    each new one traces anew. Every tensor argument's leading dimension is its
    batch: a new batch size does not retrace.
    """

    def __init__(self, fn: Callable, mode: str):
        self.fn = fn
        self.mode = mode
        self._model = threading.local()
        self._signatures = set()
        if mode != 'eager':
            # The code uses tf.while_loop and tf.cond itself: AutoGraph's conversion would only cost seconds.
            self._compiled = tf.function(self._traced, jit_compile=(mode == 'xla'), autograph=False)

    def _traced(self, tensors, *args, **static):
        return self.fn(bound(self._model.value, tensors), *args, **static)

    def _trace(self, tensors, args, static):
        """Traces once for these shapes with the batch open; later calls of any batch dispatch to it."""
        key = signature((args, sorted(static.items())))
        if key not in self._signatures:
            args, static = tf.nest.map_structure(open_batch, (list(args), static))
            self._compiled.get_concrete_function(tensors, *args, **static)
            self._signatures.add(key)

    def __call__(self, model, *args, **static):
        with placement(model):
            if self.mode == 'eager':
                return self.fn(model, *args, **static)
            self._model.value = model
            try:
                tensors = weights(model)
                self._trace(tensors, args, static)
                return self._compiled(tensors, *args, **static)
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
    """XLA for float32 weights, and for int8 ones where the int8 kernel compiles under XLA (its custom
    call; 0.44x float32's time at batch 1 in bench_int8) and XLA's persistent cache is off (see
    precision.custom_calls_unsafe; the command line turns the cache on). For bfloat16 and float16, a plain
    tf.function: XLA on CPU upcasts them into float32 copies (twice the memory, no speed gained)."""
    if model.dtype == 'int8':
        return 'xla' if kernels.xla_available() and not precision.custom_calls_unsafe(model.dtype) else 'function'
    return 'xla' if model.dtype == 'float32' else 'function'


def shared(fn: Callable, model, mode: Optional[str] = None) -> Shared:
    """The one Shared for (fn, the model's shape and dtype, mode): every such model uses it."""
    mode = mode or default_mode(model)
    if mode not in MODES:
        raise GPT2Error(f'mode must be one of {MODES}, got {mode!r}')
    if mode == 'xla':
        precision.refuse_unsafe_xla(model.dtype, "mode='xla'")
    key = (fn, model.hparams, model.dtype, mode)
    if key not in _functions:
        _functions[key] = Shared(fn, mode)
    return _functions[key]
