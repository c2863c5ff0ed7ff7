"""The one place that decides the dtype of the weights, and so of the matrix products.

The model holds its weights in float32 (the default, and exact), bfloat16 or
float16. In the reduced dtypes, matrix products take reduced inputs and the
kernels accumulate in float32; the residual stream, LayerNorm statistics,
attention scores with their mask and softmax, and the logits stay float32,
because reduced precision there costs accuracy for no speed (they are small,
or sums whose rounding compounds). For float32 weights every cast here is a
no-op, so the float32 graph is the original's. The dtype is an argument of
every module that creates weights (weight(shape, name, dtype)), never a global.
"""

from __future__ import annotations

import tensorflow as tf

DTYPES = ('float32', 'bfloat16', 'float16')


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise ValueError(f'dtype must be one of {DTYPES}, got {dtype!r}')
    return dtype


def weight(shape: list, name: str, dtype: str, *, ones: bool = False) -> tf.Variable:
    """A model variable of zeros (or ones), made directly in dtype, the dtype of the model being built."""
    return tf.Variable((tf.ones if ones else tf.zeros)(shape, check_dtype(dtype)), name=name)


def f32(v):
    """A weight or activation read as float32, where it meets the float32 computation."""
    return tf.cast(v, tf.float32)


def product(x, w, **options):
    """float32 x times w, in w's dtype -> float32: reduced inputs, float32 accumulation and result."""
    return f32(tf.matmul(tf.cast(x, w.dtype), w, **options))
