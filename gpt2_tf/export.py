"""A SavedModel for TensorFlow Serving (or any SavedModel consumer), with three signatures:

    serving_default(tokens int32 [batch, T])        -> {'logits': float32 [batch, T, n_vocab]}
    generate(tokens int32 [batch, T], length int32 [], temperature float32 [], top_k int32 [],
             top_p float32 [], seed int64 [2])      -> {'tokens': int32 [batch, T + length]}
    score(tokens int32 [batch, T])                  -> {'log_probs': float32 [batch, T - 1]}

generate is the library's decode loop: for the same seed it gives the same
tokens as sample_sequence (the prompt is left-padded to the same bucket, and a
run-time top_k finds the same k-th logit). Rows share one prompt length here.
Without xla the export holds no XLA-compiled function (TF Serving needs extra
flags for XLA on CPU, and some GPU images fail with it); with xla=True every
signature is jit-compiled, per input shape, on first use.
"""

from __future__ import annotations

import os

import tensorflow as tf

from . import sample
from .decoding import decode, empty_cache
from .model import Model
from .scoring import hidden, log_probs
from .validate import MAX_TEMPERATURE


def _bucket(n):
    """sample.bucket in graph ops: 8, 16, 32, 64, then multiples of 64."""
    small = tf.maximum(8, tf.cast(2 ** tf.math.ceil(tf.math.log(tf.cast(n, tf.float32)) / tf.math.log(2.0)), tf.int32))
    return tf.where(n <= 64, small, (n + 63) // 64 * 64)


class Servable(tf.Module):
    """The model and its three signatures, as tf.functions with input signatures."""

    def __init__(self, model: Model, *, xla: bool = False):
        super().__init__(name='gpt2_tf')
        self.model = model
        tokens = tf.TensorSpec([None, None], tf.int32, name='tokens')
        scalar = lambda dtype, name: tf.TensorSpec([], dtype, name=name)  # noqa: E731
        self.serving_default = tf.function(self._logits, input_signature=[tokens], jit_compile=xla, autograph=False)
        self.score = tf.function(self._score, input_signature=[tokens], jit_compile=xla, autograph=False)
        self.generate = tf.function(self._generate, jit_compile=xla, autograph=False, input_signature=[
            tokens, scalar(tf.int32, 'length'), scalar(tf.float32, 'temperature'), scalar(tf.int32, 'top_k'),
            scalar(tf.float32, 'top_p'), tf.TensorSpec([2], tf.int64, name='seed')])

    def _logits(self, tokens):
        return {'logits': self.model.forward(tokens)['logits']}

    def _score(self, tokens):
        logits = self.model.logits(hidden(self.model, tokens)[:, :-1])
        return {'log_probs': log_probs(logits, tokens[:, 1:])[0]}

    def _generate(self, tokens, length, temperature, top_k, top_p, seed):
        hp = self.model.hparams
        batch, prompt = tf.shape(tokens)[0], tf.shape(tokens)[1]
        checks = [
            tf.debugging.assert_positive(length, message='length must be >= 1'),
            tf.debugging.assert_less_equal(prompt + length - 1, hp.n_ctx,
                                           message=f'prompt + length - 1 must be <= n_ctx = {hp.n_ctx}'),
            tf.debugging.assert_greater_equal(temperature, 0.0, message='temperature must be in [0, 2]'),
            tf.debugging.assert_less_equal(temperature, MAX_TEMPERATURE, message='temperature must be in [0, 2]'),
            tf.debugging.assert_non_negative(top_k, message='top_k must be >= 0'),
            tf.debugging.assert_greater_equal(top_p, 0.0, message='top_p must be in [0, 1]'),
            tf.debugging.assert_less_equal(top_p, 1.0, message='top_p must be in [0, 1]'),
        ]
        with tf.control_dependencies(checks):
            padded = _bucket(prompt)
        pads = tf.fill([batch], padded - prompt)  # left padding, as sample_sequence pads
        context = tf.pad(tokens, [[0, 0], [padded - prompt, 0]])
        logits, caches = decode(self.model, context, pads=pads,
                                caches=empty_cache(self.model, batch, padded + _bucket(length)), index=0)
        keys = tf.map_fn(lambda i: tf.random.experimental.stateless_fold_in(seed, i, alg='philox'),
                         tf.range(tf.cast(batch, tf.int64)), fn_output_signature=tf.TensorSpec([2], tf.int64))
        options = [tf.fill([batch], temperature), tf.fill([batch], top_k), tf.fill([batch], top_p), keys]
        out, _, _ = sample._advance(self.model, logits, caches, pads, padded, 0, length, *options,
                                    chunk=length, greedy=False, kmax=None)
        return {'tokens': tf.concat([tokens, out['tokens']], axis=1)}


def export_saved_model(model: Model, out_dir, *, xla: bool = False) -> str:
    """Writes model as a SavedModel at out_dir with the three signatures above; returns out_dir."""
    out_dir = os.fspath(out_dir)
    servable = Servable(model, xla=xla)
    tf.saved_model.save(servable, out_dir, signatures={
        'serving_default': servable.serving_default, 'generate': servable.generate, 'score': servable.score})
    return out_dir
