"""The model as the library calls it: GPT-2's graph (gpt2_tf.model), with its variables placed on a
device, its inputs checked, and its calls compiled.

    model = Model(hparams, device='/GPU:0', jit_compile=False, dtype='float32')
    model(tokens)                 # int [batch, sequence] -> {'logits', 'present'}
    model(tokens, past=present)   # positions start at the past's length

Calls run as tf.functions with an input signature, so new shapes do not
retrace; jit_compile=True XLA-compiles them, anew for each input shape.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import numpy as np
import tensorflow as tf

from . import kernels, quiet, validate
from . import model as graph
from .hparams import HParams
from .precision import check_dtype, f32, refuse_unsafe_xla


def placed(device: Optional[str]):
    """A context that pins variables and computation to device; by default TensorFlow places them."""
    return tf.device(device) if device else contextlib.nullcontext()


class Model(graph.Graph):
    """GPT-2: model(tokens [batch, sequence], past=None) -> {'logits': [batch, sequence, n_vocab],
    'present': [batch, n_layer, 2, n_head, sequence, head_size]}, the graph's forward compiled.
    device pins the variables and the calls; dtype: the weights' (gpt2_tf.precision).
    """

    strategy = None  # a tf.distribute strategy, when load_model created the variables under one
    folder = None  # the ModelFolder load_model read (its vocabulary is the one text goes through)

    def __init__(self, hparams: HParams, scope: str = 'model', *, device: Optional[str] = None,
                 jit_compile: bool = False, dtype: str = 'float32'):
        if jit_compile:
            refuse_unsafe_xla(check_dtype(dtype), 'jit_compile=True')
        quiet.check_device(device)  # a device TensorFlow would silently replace with another is refused
        with placed(device):
            super().__init__(hparams, scope, dtype=check_dtype(dtype))
        self.device = device
        tokens = tf.TensorSpec([None, None], tf.int32)
        past = tf.TensorSpec(graph.past_shape(hparams=hparams), tf.float32)
        options = dict(jit_compile=jit_compile, autograph=False)  # explicit control flow: AutoGraph only costs time
        self._forward = tf.function(lambda X: self.forward(X), input_signature=[tokens], **options)
        self._forward_past = tf.function(self.forward, input_signature=[tokens, past], **options)

    def on_device(self):
        return placed(self.device)

    def __call__(self, tokens, past=None):
        if tf.executing_eagerly():
            tokens = self.check_inputs(tokens, past)
        if past is not None:
            past = f32(past)
        tokens = tf.cast(tokens, tf.int32)
        with self.on_device():
            if kernels.under_xla():  # called inside an XLA-compiled function: traced there, with XLA's own ops,
                return self.forward(tokens, past)  # not through a trace made outside it (it may hold the kernels')
            if past is None:
                return self._forward(tokens)
            return self._forward_past(tokens, past)

    def check_inputs(self, tokens, past=None) -> np.ndarray:
        """tokens as a checked integer array (see validate.check_model_inputs)."""
        hp = self.hparams
        shape = graph.past_shape(hparams=hp)
        return validate.check_model_inputs(tokens, past, shape, n_vocab=hp.n_vocab, n_ctx=hp.n_ctx)

    @property
    def tracing_count(self) -> int:
        return sum(f.experimental_get_tracing_count() for f in (self._forward, self._forward_past))
