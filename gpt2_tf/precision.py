"""The one place that decides the dtype of the weights, and so of the matrix products.

The model holds its weights in float32 (the default, and exact), bfloat16,
float16 or int8. In bfloat16 and float16, matrix products take reduced inputs and the
kernels accumulate in float32, their results rounded to the reduced dtype; the tied
logits' product takes wte as float32 (GPT-2's logits sit near -100, where bfloat16's
spacing is 0.5); the residual stream, LayerNorm statistics, attention scores with
their mask and softmax, and the logits stay float32, because reduced precision there
costs accuracy for no speed (they are small, or sums whose rounding compounds). For float32 weights every cast here is a
no-op, so the float32 graph is the original's. The dtype is an argument of
every module that creates weights (weight(shape, name, dtype)), never a global.

int8 holds only the matrices (conv1d's w and wte) in int8, with one float32
scale per output channel (a conv1d's column, a wte row: symmetric, round to
nearest, scale = max|w| / 127, computed at load from the float32 files); norms,
biases, wpe, the activations and the KV cache stay float32. A product reads the
int8 bytes themselves (gpt2_tf.kernels) and sums in float32. A conv1d's int8 w keeps
its [1, nx, nf] shape, but where nf is a multiple of PANEL its values are laid out
in panels, [nf / PANEL, nx, PANEL] (pack): the kernel then streams each block of
output channels contiguously. unpacked() reads any int8 matrix back in its plain layout.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Optional

import numpy as np
import tensorflow as tf

from . import kernels, quiet
from .validate import DTYPES, GPT2Error
SCALE = '_scale'  # an int8 matrix `name` has its scales in the variable `name + SCALE`
PANEL = 128  # output channels per panel of a packed int8 conv1d w: two cache lines of int8 per row
_building = threading.local()  # .unfilled, .decoding: inside unfilled(), decoding() on this thread


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise GPT2Error(f'dtype must be one of {DTYPES}, got {dtype!r}')
    return dtype


def activations(dtype: str) -> str:
    """The dtype products take their inputs in and the KV cache is kept in: float32 beside int8 weights."""
    return 'float32' if check_dtype(dtype) == 'int8' else dtype


@contextlib.contextmanager
def unfilled():
    """Within it, on this thread, new model variables start as memory no page of which is written yet, so
    their values are undefined: for a loader that assigns every variable before any use (load_model; a
    checkpoint missing any variable is refused first). Zeros would be written, then stay resident after
    the checkpoint's values replace them (a 124M load peaked at 1.47 GiB with them, 1.21 GiB without)."""
    before, _building.unfilled = getattr(_building, 'unfilled', False), True
    try:
        yield
    finally:
        _building.unfilled = before


def _initial(shape: list, dtype, fill: int):
    if getattr(_building, 'unfilled', False):
        return tf.raw_ops.Empty(shape=shape, dtype=dtype, init=False)
    return tf.fill(shape, tf.constant(fill, dtype))


def weight(shape: list, name: str, dtype: str, *, ones: bool = False) -> tf.Variable:
    """A model variable of zeros (or ones; undefined values within unfilled()), made directly in dtype, the
    dtype of the model being built (float32 for an int8 model: only matrices are int8)."""
    return tf.Variable(_initial(shape, tf.as_dtype(activations(dtype)), 1 if ones else 0), name=name)


def matrix(shape: list, name: str, dtype: str, *, channels: int) -> tuple:
    """A product's weight in dtype and, for int8, its per-channel scales (channels of them), else None."""
    if check_dtype(dtype) != 'int8':
        return weight(shape, name, dtype), None
    return (tf.Variable(_initial(shape, tf.int8, 0), name=name),
            tf.Variable(_initial([channels], tf.float32, 1), name=name + SCALE))


def quantize(value: np.ndarray, *, rows: bool, name: str = 'the weight') -> tuple:
    """float32 [..., n] (rows=False: one scale per last-axis column) or [n, k] (rows=True: one per row)
    -> (int8 of the same shape, float32 scales [n]): symmetric, round to nearest, scale = max|w| / 127 (at
    least float32's smallest normal number: a channel of subnormal values then rounds to 0, within half a step)."""
    value = np.array(value, np.float32)  # a copy, rounded in place: no float32 temporaries beside it
    axes = tuple(range(1, value.ndim)) if rows else tuple(range(value.ndim - 1))
    peak = np.maximum(value.max(axis=axes, keepdims=True), -value.min(axis=axes, keepdims=True))
    if not np.isfinite(peak).all():
        raise GPT2Error(f'{name} holds NaN or infinite values, which int8 cannot hold: the checkpoint is damaged '
                        f'(load it with dtype float32 to look at it)')
    tiny = np.finfo(np.float32).tiny
    scale = np.where(peak > 0, np.maximum(peak / np.float32(127), tiny), np.float32(1)).astype(np.float32)
    np.rint(np.divide(value, scale, out=value), out=value)  # within [-127, 127]: |w| <= max|w|
    return value.astype(np.int8), scale.reshape(-1)


def panel(nf: int) -> int:
    """The panel width of an int8 conv1d w with nf output channels; 0: the plain layout."""
    return PANEL if nf % PANEL == 0 and nf > PANEL else 0


def pack(q: np.ndarray) -> np.ndarray:
    """int8 [..., nx, nf] -> the same shape holding the values as panels [nf / PANEL, nx, PANEL], when packed."""
    *start, nx, nf = q.shape
    width = panel(nf)
    if not width:
        return q
    panels = q.reshape(nx, nf // width, width).transpose(1, 0, 2)  # [nf / PANEL, nx, PANEL]
    return np.ascontiguousarray(panels).reshape(q.shape)


def unpacked(variable) -> np.ndarray:
    """An int8 matrix's values in its plain layout ([1, nx, nf] or wte's [n_vocab, n_embd]), as numpy."""
    q = np.asarray(variable)
    if q.ndim == 2 or not panel(q.shape[-1]):
        return q
    nx, nf = q.shape[-2:]
    width = panel(nf)
    return q.reshape(nf // width, nx, width).transpose(1, 0, 2).reshape(q.shape)


def assign(variables: dict, name: str, value) -> None:
    """Assigns a float32 checkpoint value to variables[name], in its dtype: the one place int8 is quantized."""
    variable = variables[name]
    if variable.dtype == tf.float16:
        check_float16(value, name)
    if variable.dtype != tf.int8:
        variable.assign(tf.cast(value, variable.dtype))
        return
    rows = variable.shape.rank == 2  # wte [n_vocab, n_embd]: a scale per row, its rows serve the lookup too
    q, scale = quantize(value, rows=rows, name=name)
    variable.assign(q if rows else pack(q))
    variables[name + SCALE].assign(scale)


def check_float16(value, name: str) -> None:
    """A weight float16 can hold: one past its range (65504) would become inf, and every logit NaN later."""
    peak = float(np.max(np.abs(value))) if np.size(value) else 0.0
    if peak > float(np.finfo(np.float16).max):
        raise GPT2Error(f'{name} holds {peak:.4g}, past float16\'s range (65504): load it in bfloat16 or float32')


def stored(variables: dict) -> dict:
    """{checkpoint name: variable}: the variables a checkpoint holds, without int8's scales."""
    return {name: v for name, v in variables.items()
            if not (name.endswith(SCALE) and name[:-len(SCALE)] in variables)}


def f32(v):
    """A weight or activation read as float32, where it meets the float32 computation."""
    return tf.cast(v, tf.float32)


def product(x, w, scale: Optional[tf.Tensor] = None, *, transpose_b: bool = False):
    """float32 x [M, K] times w [K, N] (or [N, K] with transpose_b), in w's dtype -> float32 [M, N]: reduced
    inputs, float32 accumulation, the result rounded to w's dtype; int8 w is multiplied as it is, with its scales
    [N]."""
    if w.dtype == tf.int8:
        return kernels.int8_matmul(x, w, scale, transpose_w=transpose_b, panel=0 if transpose_b else panel(w.shape[-1]))
    few = kernels.few_rows(transpose_b) if w.dtype == tf.float32 and kernel_while_decoding() and \
        kernels.on_cpu(x) else None
    if few:
        return _few_rows_product(x, w, transpose_b, few)
    return f32(tf.matmul(tf.cast(x, w.dtype), w, transpose_b=transpose_b))


def logits_product(x, wte, scale: Optional[tf.Tensor] = None):
    """float32 x [M, n_embd] times the tied wte [n_vocab, n_embd] transposed -> float32 logits [M, n_vocab]: as
    product() multiplies int8 and float32 wte, and a bfloat16 or float16 one as float32: GPT-2's logits sit near
    -100, where bfloat16's spacing is 0.5, and a log-prob would move by as much as the rounding."""
    if wte.dtype in (tf.bfloat16, tf.float16):
        return tf.matmul(x, f32(wte), transpose_b=True)
    return product(x, wte, scale, transpose_b=True)


@contextlib.contextmanager
def decoding():
    """Within it, on this thread, float32 products over a few rows (a decode step at batch 1-16) take the kernel
    where it beats XLA's and TensorFlow's own (kernels.few_rows: by CPU and layout), and so does a step's
    attention over its cache, except where XLA's persistent cache is on (XLA code that calls the kernel crashes
    when read back from it; see compiled): kernel_while_decoding. Decoding's graphs trace inside it; forward
    passes, scoring and training keep TensorFlow's products."""
    before, _building.decoding = getattr(_building, 'decoding', False), True
    try:
        yield
    finally:
        _building.decoding = before


def kernel_while_decoding() -> bool:
    """Whether a float32 product (over kernels.few_rows) or the attention over decoding's float32 cache
    (kernels.cached_attention) traced now may take the kernel: inside decoding(), where the kernel may run
    (kernels.decoding_available), with XLA's persistent cache off."""
    return getattr(_building, 'decoding', False) and kernels.decoding_available() and not quiet.xla_cache_on()


def _few_rows_product(x, w, transpose_b: bool, few: range):
    """float32 x [M, K] times w: the kernel for the few rows, else TensorFlow's product; where M is unknown
    when traced (an open batch), a tf.cond that XLA, knowing M when it compiles, reduces to one branch."""
    kernel = lambda: kernels.float_matmul(x, w, transpose_w=transpose_b)  # noqa: E731
    plain = lambda: tf.matmul(x, w, transpose_b=transpose_b)  # noqa: E731
    if x.shape[0] is not None:
        return kernel() if x.shape[0] in few else plain()
    rows = tf.shape(x)[0]
    return tf.cond((rows >= few.start) & (rows < few.stop), kernel, plain)


def gather(w, scale: Optional[tf.Tensor], ids):
    """Rows ids of w (wte) as float32: int8 rows times their scales."""
    rows = f32(tf.gather(w, ids))
    return rows if scale is None else rows * tf.gather(scale, ids)[..., None]


def custom_calls_unsafe(dtype: str) -> bool:
    """Whether XLA code for a model of dtype would call the int8 kernel and may be read back from XLA's
    persistent cache: code read back from it into another process crashes at the kernel's call (inside XLA's
    untyped custom-call path), so such a model decodes in a plain tf.function there."""
    return dtype == 'int8' and kernels.available() and quiet.xla_cache_on()


def refuse_unsafe_xla(dtype: str, what: str) -> None:
    """One line, where XLA code would call the int8 kernel from XLA's persistent cache (custom_calls_unsafe)."""
    if custom_calls_unsafe(dtype):
        raise GPT2Error(f"{what} for an int8 model with XLA's persistent cache on (TF_XLA_FLAGS): cached code that "
                        f"calls the int8 kernel crashes when read back; compile without XLA, or start without the "
                        f"cache (GPT2_TF_XLA_CACHE=off for gpt2-tf)")
