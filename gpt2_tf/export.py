"""A SavedModel for TensorFlow Serving (or any SavedModel consumer), with three signatures:

    serving_default(tokens int32 [batch, T])        -> {'logits': float32 [batch, T, n_vocab]}
    generate(tokens int32 [batch, T], length int32 [], temperature float32 [], top_k int32 [],
             top_p float32 [], seed int64 [2])      -> {'tokens': int32 [batch, T + length]}
    score(tokens int32 [batch, T])                  -> {'log_probs': float32 [batch, T - 1]}

generate is the library's decode loop (sample.begin and sample.advance): for
the same seed it gives the same tokens as sample_sequence (the prompt is
left-padded to the same bucket, row keys fold in as noise.row_keys folds them,
and a run-time top_k finds the same k-th logit). Rows share one prompt length
here. Its inputs are checked in the graph by the library's rules (validate.py).
Without xla the export holds no XLA-compiled function (TF Serving needs extra
flags for XLA on CPU, and some GPU images fail with it); with xla=True every
signature is jit-compiled, per input shape, on first use.
"""

from __future__ import annotations

import os

import tensorflow as tf

from . import compiled, kernels, noise, sample, validate
from .checkpoint import whole_folder
from .runtime import Model
from .scoring import hidden, log_probs


def _in_range(x, low, high, message: str) -> list:
    return [tf.debugging.assert_greater_equal(x, low, message=message),
            tf.debugging.assert_less_equal(x, high, message=message)]


def _some_rows(tokens) -> list:
    return [tf.debugging.assert_positive(tf.shape(tokens)[0], message='tokens must hold at least one row')]


def token_checks(hp, tokens) -> list:
    """validate.py's rules for tokens [batch, T] to run the model on, as graph assertions: batch >= 1,
    1 <= T <= n_ctx, every id in the vocabulary."""
    length = tf.shape(tokens)[1]
    return [*_some_rows(tokens),
            tf.debugging.assert_positive(length, message='tokens must hold at least one token per row'),
            tf.debugging.assert_less_equal(length, hp.n_ctx, message=f'tokens must hold at most n_ctx = {hp.n_ctx} '
                                                                     f'per row'),
            *_in_range(tokens, 0, hp.n_vocab - 1, f'token ids must be in the vocabulary [0, {hp.n_vocab})')]


def score_checks(hp, tokens) -> list:
    """token_checks, and T >= 2: the first token has no log-prob, so one token scores nothing."""
    return [*token_checks(hp, tokens),
            tf.debugging.assert_greater_equal(tf.shape(tokens)[1], 2,
                                              message='scoring needs at least 2 tokens per row')]


def generate_checks(hp, tokens, length, temperature, top_k, top_p, seed) -> list:
    """validate.py's rules for a generate request, as graph assertions: a signature's inputs are run-time values."""
    prompt = tf.shape(tokens)[1]
    return [
        *_some_rows(tokens),
        tf.debugging.assert_positive(prompt, message='tokens must hold at least one token per row'),
        *_in_range(tokens, 0, hp.n_vocab - 1, f'token ids must be in the vocabulary [0, {hp.n_vocab})'),
        tf.debugging.assert_positive(length, message='length must be >= 1'),
        tf.debugging.assert_less_equal(prompt, validate.room_for_prompt(length, hp.n_ctx),
                                       message=f'prompt + length - 1 must be <= n_ctx = {hp.n_ctx}'),
        *_in_range(temperature, 0.0, validate.MAX_TEMPERATURE,
                   f'temperature must be in [0, {validate.MAX_TEMPERATURE:g}] (0 is greedy)'),
        tf.debugging.assert_non_negative(top_k, message='top_k must be >= 0 (0: no truncation)'),
        *_in_range(top_p, 0.0, 1.0, 'top_p must be in [0, 1] (1: no truncation)'),
    ]


def signature(run, checks, hp, specs: list, *, xla: bool, drawn: bool = False):
    """A signature: the checks as graph assertions, then run (jit-compiled with xla) on the inputs they passed.
    The assertions stay outside the compiled function: XLA drops them. drawn: its 'tokens' are drawn, and an
    id past the vocabulary (what NaN logits draw) is an error, as validate.check_drawn makes it."""
    compiled_run = tf.function(run, jit_compile=xla, autograph=False)

    def checked(*inputs):
        with tf.control_dependencies(checks(hp, *inputs)):
            inputs = [tf.identity(x) for x in inputs]
        out = compiled_run(*inputs)
        if not drawn:
            return out
        with tf.control_dependencies(_in_range(out['tokens'], 0, hp.n_vocab - 1, validate.NOT_DRAWN)):
            return {name: tf.identity(value) for name, value in out.items()}

    return tf.function(checked, input_signature=specs, autograph=False)


class Servable(tf.Module):
    """The model and its three signatures, as tf.functions with input signatures."""

    def __init__(self, model: Model, *, xla: bool = False):
        super().__init__(name='gpt2_tf')
        self.model = model
        hp = model.hparams
        tokens = tf.TensorSpec([None, None], tf.int32, name='tokens')
        scalar = lambda dtype, name: tf.TensorSpec([], dtype, name=name)  # noqa: E731
        self.serving_default = signature(self._logits, token_checks, hp, [tokens], xla=xla)
        self.score = signature(self._score, score_checks, hp, [tokens], xla=xla)
        self.generate = signature(self._generate, generate_checks, hp, [
            tokens, scalar(tf.int32, 'length'), scalar(tf.float32, 'temperature'), scalar(tf.int32, 'top_k'),
            scalar(tf.float32, 'top_p'), tf.TensorSpec([2], tf.int64, name='seed')], xla=xla, drawn=True)

    def _logits(self, tokens):
        return {'logits': self.model.forward(tokens)['logits']}

    def _score(self, tokens):
        logits = self.model.logits(hidden(self.model, tokens)[:, :-1])
        return {'log_probs': log_probs(logits, tokens[:, 1:])[0]}

    def _generate(self, tokens, length, temperature, top_k, top_p, seed):
        batch, prompt = tf.shape(tokens)[0], tf.shape(tokens)[1]
        padded = compiled.bucket(prompt)
        pads = tf.fill([batch], padded - prompt)  # left padding, as sample_sequence pads
        context = tf.pad(tokens, [[0, 0], [padded - prompt, 0]])
        logits, caches = sample.begin(self.model, context, pads=pads, size=padded + compiled.bucket(length))
        options = sample.Options(temperature=tf.fill([batch], temperature), top_k=tf.fill([batch], top_k),
                                 top_p=tf.fill([batch], top_p), keys=noise.fold_keys(seed, batch))
        # One call for the whole length; kmax=None: the top_k is a run-time value.
        out, _, _ = sample.advance(self.model, logits, caches, pads=pads, prompt=padded, done=0, length=length,
                                   options=options, plan=sample.Plan(chunk=length, kmax=None))
        return {'tokens': tf.concat([tokens, out['tokens']], axis=1)}


def export_saved_model(model: Model, out_dir, *, xla: bool = False) -> str:
    """Writes model as a SavedModel at out_dir (a new or empty folder, which appears only when complete) with
    the three signatures above; returns out_dir."""
    out_dir = os.fspath(out_dir)
    servable = Servable(model, xla=xla)
    # an int8 model's products as TensorFlow ops: the SavedModel needs no op library
    with kernels.tensorflow_ops(), whole_folder(out_dir) as staging:
        tf.saved_model.save(servable, staging, signatures={
            'serving_default': servable.serving_default, 'generate': servable.generate, 'score': servable.score})
    return out_dir
