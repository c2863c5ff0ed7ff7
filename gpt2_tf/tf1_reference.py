"""The original GPT-2 graph restated in TF1 graph mode, as the yardstick for the port.

This module builds the graph the way openai/gpt-2 src/model.py and src/sample.py
do: variable_scope and get_variable, placeholders, a Session, and a while_loop
that concatenates `past` every step. It shares no code with gpt2_tf.model but
the shape helper, on purpose, so that the two can be compared. The tests hold it to the outputs of
the original code (tests/fixtures/*/reference.npz); the benchmarks, the compare
tool and the tests then measure the port against it.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from .hparams import HParams
from .model import shape_list  # the one helper shared with the port: static where known, else dynamic

v1 = tf.compat.v1


def _layer_norm(x, scope, epsilon=1e-5):
    with v1.variable_scope(scope):
        width = x.shape[-1]
        g = v1.get_variable('g', [width], initializer=v1.constant_initializer(1))
        b = v1.get_variable('b', [width], initializer=v1.constant_initializer(0))
        mean = tf.reduce_mean(x, axis=-1, keepdims=True)
        centered = x - mean
        variance = tf.reduce_mean(tf.square(centered), axis=-1, keepdims=True)
        return centered * tf.math.rsqrt(variance + epsilon) * g + b


def _dense(x, scope, nf):
    with v1.variable_scope(scope):
        *lead, nx = shape_list(x)
        w = v1.get_variable('w', [1, nx, nf], initializer=v1.random_normal_initializer(stddev=0.02))
        b = v1.get_variable('b', [nf], initializer=v1.constant_initializer(0))
        y = tf.matmul(tf.reshape(x, [-1, nx]), tf.reshape(w, [-1, nf])) + b
        return tf.reshape(y, lead + [nf])


def _heads(x, n_head):  # [batch, seq, feat] -> [batch, head, seq, feat / head]
    *lead, feat = shape_list(x)
    return tf.transpose(tf.reshape(x, lead + [n_head, feat // n_head]), [0, 2, 1, 3])


def _unheads(x):  # [batch, head, seq, f] -> [batch, seq, head * f]
    x = tf.transpose(x, [0, 2, 1, 3])
    *lead, a, b = shape_list(x)
    return tf.reshape(x, lead + [a * b])


def _attention(x, scope, *, past, hparams, record):
    width = x.shape[-1]
    with v1.variable_scope(scope):
        qkv = _dense(x, 'c_attn', width * 3)
        q, k, v = [_heads(t, hparams.n_head) for t in tf.split(qkv, 3, axis=2)]
        present = tf.stack([k, v], axis=1)
        if past is not None:
            past_k, past_v = tf.unstack(past, axis=1)
            k = tf.concat([past_k, k], axis=-2)
            v = tf.concat([past_v, v], axis=-2)
        scores = tf.matmul(q, k, transpose_b=True) * tf.math.rsqrt(tf.cast(v.shape[-1], tf.float32))
        _, _, nd, ns = shape_list(scores)
        visible = tf.cast(tf.range(nd)[:, None] >= tf.range(ns) - ns + nd, scores.dtype)
        visible = tf.reshape(visible, [1, 1, nd, ns])
        scores = scores * visible - 1e10 * (1 - visible)
        scores = scores - tf.reduce_max(scores, axis=-1, keepdims=True)
        weights = tf.exp(scores) / tf.reduce_sum(tf.exp(scores), axis=-1, keepdims=True)
        record['attn_weights'] = weights
        out = _dense(_unheads(tf.matmul(weights, v)), 'c_proj', width)
        return out, present


def _feed_forward(x, scope):
    width = x.shape[-1]
    with v1.variable_scope(scope):
        h = _dense(x, 'c_fc', width * 4)
        h = 0.5 * h * (1 + tf.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * tf.pow(h, 3))))
        return _dense(h, 'c_proj', width)


def _block(x, scope, *, past, hparams, record):
    with v1.variable_scope(scope):
        record['x'] = x
        record['z1'] = _layer_norm(x, 'ln_1')
        record['attn'], present = _attention(record['z1'], 'attn', past=past, hparams=hparams, record=record)
        record['x_attn'] = x + record['attn']
        record['z2'] = _layer_norm(record['x_attn'], 'ln_2')
        record['mlp'] = _feed_forward(record['z2'], 'mlp')
        record['out'] = record['x_attn'] + record['mlp']
        return record['out'], present


def gpt2_graph(hparams: HParams, X, past=None, *, scope='model', reuse=False, states=None):
    """The original model(hparams, X, past): returns {'logits', 'present'}; fills states per block.

    The variables are reference variables, as TF 1.x made them (TF2 would make
    resource variables, whose reads copy wte once it has been gathered from).
    """
    with v1.variable_scope(scope, reuse=reuse, use_resource=False):
        batch, sequence = shape_list(X)
        wpe = v1.get_variable('wpe', [hparams.n_ctx, hparams.n_embd],
                              initializer=v1.random_normal_initializer(stddev=0.01))
        wte = v1.get_variable('wte', [hparams.n_vocab, hparams.n_embd],
                              initializer=v1.random_normal_initializer(stddev=0.02))
        start = 0 if past is None else tf.shape(past)[-2]
        positions = tf.tile((start + tf.range(sequence))[None], [batch, 1])
        h = tf.gather(wte, X) + tf.gather(wpe, positions)
        layer_pasts = tf.unstack(past, axis=1) if past is not None else [None] * hparams.n_layer
        presents = []
        for layer, layer_past in enumerate(layer_pasts):
            record = {}
            if states is not None:
                states.append(record)
            h, present = _block(h, 'h%d' % layer, past=layer_past, hparams=hparams, record=record)
            presents.append(present)
        h = _layer_norm(h, 'ln_f')
        logits = tf.matmul(tf.reshape(h, [batch * sequence, hparams.n_embd]), wte, transpose_b=True)
        return {'logits': tf.reshape(logits, [batch, sequence, hparams.n_vocab]),
                'present': tf.stack(presents, axis=1)}


def top_k_filter(logits, k):
    """The original top_k_logits: logits [batch, vocab]; ties with the k-th value survive; k = 0 keeps all."""
    if k == 0:
        return logits

    def cut():
        values, _ = tf.nn.top_k(logits, k=k)
        return tf.where(logits < values[:, -1, None], tf.ones_like(logits) * -1e10, logits)
    return tf.cond(tf.equal(k, 0), lambda: logits, cut)


def top_p_filter(logits, p):
    """The original top_p_logits, with min_values given the trailing axis it lacked for batch > 1."""
    batch = tf.shape(logits)[0]
    ordered = tf.sort(logits, direction='DESCENDING', axis=-1)
    mass = tf.cumsum(tf.nn.softmax(ordered, axis=-1), axis=-1)
    keep = tf.maximum(tf.reduce_sum(tf.cast(mass <= p, tf.int32), axis=-1) - 1, 0)
    floor = tf.gather_nd(ordered, tf.stack([tf.range(batch), keep], axis=-1))
    return tf.where(logits < floor[:, None], tf.ones_like(logits) * -1e10, logits)


def sample_graph(hparams: HParams, *, length, context, batch_size, temperature=1, top_k=0, top_p=1):
    """The original sample_sequence: context [batch, T] -> tokens [batch, T + length].

    top_p=None skips the nucleus filter, as the port does at top_p = 1 (the
    original always applies it; at 1 it only trims a float32-rounded tail).
    """
    def step(tokens, past=None):
        out = gpt2_graph(hparams, tokens, past=past, reuse=v1.AUTO_REUSE)
        out['present'].set_shape([batch_size, hparams.n_layer, 2, hparams.n_head, None, hparams.head_size])
        return out

    def body(past, prev, output, first=False):
        out = step(prev if first else prev[:, None], past=past)
        logits = out['logits'][:, -1, :] / tf.cast(temperature, tf.float32)
        logits = top_k_filter(logits, top_k)
        if top_p is not None:
            logits = top_p_filter(logits, top_p)
        picked = v1.multinomial(logits, num_samples=1, output_dtype=tf.int32)
        past = out['present'] if first else tf.concat([past, out['present']], axis=-2)
        return [past, tf.squeeze(picked, axis=[1]), tf.concat([output, picked], axis=1)]

    past, prev, output = body(None, context, context, first=True)
    _, _, tokens = tf.while_loop(
        cond=lambda *_: True, body=body, maximum_iterations=length - 1,
        loop_vars=[past, prev, output],
        shape_invariants=[
            tf.TensorShape([batch_size, hparams.n_layer, 2, hparams.n_head, None, hparams.head_size]),
            tf.TensorShape([batch_size]),
            tf.TensorShape([batch_size, None]),
        ],
        back_prop=False)
    return tokens


class Reference:
    """The TF1 graph in a Session of its own, restored from a checkpoint prefix."""

    def __init__(self, hparams: HParams, checkpoint: str):
        self.hparams = hparams
        self.graph = tf.Graph()
        with self.graph.as_default():
            self.tokens = v1.placeholder(tf.int32, [None, None], name='tokens')
            self.past = v1.placeholder(tf.float32, [None, hparams.n_layer, 2, hparams.n_head, None,
                                                    hparams.head_size], name='past')
            self.states = []
            self.outputs = gpt2_graph(hparams, self.tokens, states=self.states)
            self.outputs_past = gpt2_graph(hparams, self.tokens, past=self.past, reuse=True)
            # What users wrote on top of the original to score text: a log-softmax, gathered at the next tokens.
            logits = self.outputs['logits'][:, :-1]
            self.next_log_probs = tf.gather(tf.nn.log_softmax(logits), self.tokens[:, 1:], batch_dims=2)
            self._samplers = {}
            self.session = v1.Session(graph=self.graph)
            v1.train.Saver(var_list=v1.global_variables()).restore(self.session, checkpoint)

    def __call__(self, tokens, past=None) -> dict:
        if past is None:
            return self.session.run(self.outputs, {self.tokens: tokens})
        return self.session.run(self.outputs_past, {self.tokens: tokens, self.past: past})

    def log_probs(self, tokens):
        """tokens [batch, T] -> log p(tokens[:, i + 1] | tokens[:, :i + 1]) [batch, T - 1]."""
        return self.session.run(self.next_log_probs, {self.tokens: tokens})

    def trace(self, tokens) -> list:
        """Per block, the named states of gpt2_tf.model.STATE_NAMES plus 'attn_weights', as numpy."""
        return self.session.run(self.states, {self.tokens: tokens})

    def sampler(self, *, length: int, batch_size: int, temperature=1.0, top_k=0, top_p=1.0, seed=None):
        """A callable context [batch_size, T] -> tokens [batch_size, T + length], built once per setting."""
        key = (length, batch_size, temperature, top_k, top_p, seed)
        if key not in self._samplers:
            with self.graph.as_default():
                v1.set_random_seed(seed)  # None for an unseeded one: an earlier sampler's seed must not carry over
                context = v1.placeholder(tf.int32, [batch_size, None])
                tokens = sample_graph(self.hparams, length=length, context=context, batch_size=batch_size,
                                      temperature=temperature, top_k=top_k, top_p=top_p)
            self._samplers[key] = lambda c: self.session.run(tokens, {context: c})
        return self._samplers[key]

    def close(self):
        self.session.close()


class ReferenceTrainer:
    """The original fine-tuning step in a TF1 graph: the model graph, its training loss, a TF1 optimizer.

    The loss is the mean softmax cross-entropy of logits[:, :-1] against
    tokens[:, 1:], and the optimizer tf.compat.v1.train.AdamOptimizer (or plain
    gradient descent), as nshepperd's train.py and gpt-2-simple set them up.
    """

    def __init__(self, hparams: HParams, checkpoint: str, *, learning_rate: float = 1e-4, optimizer: str = 'adam',
                 only_train_transformer_layers: bool = False):
        self.graph = tf.Graph()
        with self.graph.as_default():
            self.tokens = v1.placeholder(tf.int32, [None, None], name='tokens')
            out = gpt2_graph(hparams, self.tokens)
            self.logits = out['logits']
            self.loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=self.tokens[:, 1:], logits=self.logits[:, :-1]))
            model_vars = [v for v in v1.trainable_variables() if 'model' in v.name]
            train_vars = [v for v in model_vars if '/h' in v.name] if only_train_transformer_layers else model_vars
            if optimizer == 'adam':
                opt = v1.train.AdamOptimizer(learning_rate=learning_rate)
            else:
                opt = v1.train.GradientDescentOptimizer(learning_rate=learning_rate)
            self.train_op = opt.minimize(self.loss, var_list=train_vars)
            self.session = v1.Session(graph=self.graph)
            self.session.run(v1.global_variables_initializer())
            v1.train.Saver(var_list=model_vars).restore(self.session, checkpoint)

    def step(self, tokens) -> float:
        """One update; returns the batch's loss before it."""
        loss, _ = self.session.run([self.loss, self.train_op], {self.tokens: tokens})
        return float(loss)

    def __call__(self, tokens):
        return self.session.run(self.logits, {self.tokens: tokens})

    def close(self):
        self.session.close()
