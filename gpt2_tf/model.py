"""The GPT-2 graph as tf.Modules, function for function after openai/gpt-2 src/model.py. Variables are created
under the original scopes, so a variable's name is its checkpoint name (model/h0/attn/c_attn/w); the numerics
are the original's (tanh GELU, LayerNorm epsilon 1e-5, the -1e10 mask). The weights' dtype is an argument
(gpt2_tf.precision); the block is written once, with where its keys and values come from (Past, or decoding's
cache, each with its way to attend over them) and what it records as arguments. Compiled calls and devices are
gpt2_tf.runtime's."""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import tensorflow as tf

from .causal import causal_attn
from .hparams import HParams
from .precision import f32, gather, logits_product, matrix, product, weight


def shape_list(x):
    """Static dimensions where known, dynamic ones elsewhere."""
    static, dynamic = x.shape.as_list(), tf.shape(x)
    return [dynamic[i] if s is None else s for i, s in enumerate(static)]


def softmax(x, axis=-1):
    # The original's formula, exp(x - max) / sum, as TF's one fused kernel: within a few ulps of the
    # five separate ops (identical under XLA), and half the attention's time in training.
    return tf.nn.softmax(x, axis=axis)


def gelu(x):
    # The tanh approximation GPT-2 was trained with, not the exact erf GELU. Its ops under the name TensorFlow's
    # own tanh GELU has: oneDNN's rewriter then fuses them into the product before (BiasAdd, 2-D, one reader).
    with tf.name_scope('Gelu'):
        return 0.5 * x * (1 + tf.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * tf.pow(x, 3))))


class Norm(tf.Module):
    """Normalize to mean 0 and std 1 over the last axis, then a diagonal affine map."""

    def __init__(self, n_state: int, scope: str, *, dtype: str, axis: int = -1, epsilon: float = 1e-5):
        super().__init__(name=scope)
        self.axis = axis
        self.epsilon = epsilon  # 1e-5, not a library default
        with self.name_scope:
            self.g = weight([n_state], 'g', dtype, ones=True)
            self.b = weight([n_state], 'b', dtype)

    def __call__(self, x):  # [..., n_state] -> [..., n_state]
        u = tf.reduce_mean(x, axis=self.axis, keepdims=True)
        n = x - u
        s = tf.reduce_mean(tf.square(n), axis=self.axis, keepdims=True)
        x = n * tf.math.rsqrt(s + self.epsilon)
        return x * f32(self.g) + f32(self.b)


def split_states(x, n):
    """[..., m] -> [..., n, m // n]"""
    *start, m = shape_list(x)
    return tf.reshape(x, start + [n, m // n])


def merge_states(x):
    """[..., a, b] -> [..., a * b]"""
    *start, a, b = shape_list(x)
    return tf.reshape(x, start + [a * b])


class Conv1D(tf.Module):
    """A dense layer whose weight keeps the checkpoint's [1, nx, nf] shape."""

    def __init__(self, nx: int, scope: str, nf: int, *, dtype: str):
        super().__init__(name=scope)
        with self.name_scope:
            self.w, self.w_scale = matrix([1, nx, nf], 'w', dtype, channels=nf)  # int8: a scale per column
            self.b = weight([nf], 'b', dtype)

    def product(self, x):  # [rows, nx] @ [nx, nf] -> [rows, nf], in the weights' dtype
        return product(x, tf.reshape(self.w, [-1, self.w.shape[-1]]), self.w_scale)

    adapter = None  # a LoRA adapter (gpt2_tf.lora): [rows, nx] -> [rows, nf], added after the bias

    def __call__(self, x, activation=None):  # [..., nx] -> activation([..., nf]), taken on the rows
        *start, nx = shape_list(x)
        x2d = tf.reshape(x, [-1, nx])
        c = tf.nn.bias_add(self.product(x2d), f32(self.b))
        if self.adapter is not None:
            c = c + self.adapter(x2d)
        return tf.reshape(activation(c) if activation else c, start + [self.w.shape[-1]])


def attention_mask(nd, ns, *, dtype):
    """[nd, ns]: 1 where destination i sees source j, j <= i + ns - nd (the past plus itself)."""
    i, j = tf.range(nd)[:, None], tf.range(ns)
    return tf.cast(i >= j - ns + nd, dtype)


def mask_attn_weights(w, b):
    """w [batch, heads, dst, src]; b 1 where dst sees src. The original's -1e10, not -inf: no row goes NaN."""
    return w * b - tf.cast(1e10, w.dtype) * (1 - b)


def attention_weights(q, k, b):
    """q [batch, heads, dst, f], k [batch, heads, src, f], mask b -> softmaxed w [batch, heads, dst, src]"""
    w = tf.matmul(q, k, transpose_b=True)
    w = w * tf.math.rsqrt(tf.cast(k.shape[-1], w.dtype))
    return softmax(mask_attn_weights(w, b))


class Past(NamedTuple):
    """The original's key/value source: the past's keys and values, then this call's, under the causal mask."""
    past: Optional[tf.Tensor] = None  # [batch, 2, heads, past_sequence, f], or no past

    def __call__(self, k, v):  # k, v [batch, heads, dst, f] -> k, v [.., src, f], mask [1, 1, dst, src], present
        present = tf.stack([k, v], axis=1)  # [batch, 2, heads, dst, f]
        if self.past is not None:
            pk, pv = tf.unstack(self.past, axis=1)
            k = tf.concat([pk, k], axis=-2)  # [batch, heads, src, f]
            v = tf.concat([pv, v], axis=-2)
        nd, ns = shape_list(present)[3], shape_list(k)[2]
        return k, v, tf.reshape(attention_mask(nd, ns, dtype=k.dtype), [1, 1, nd, ns]), present

    def attend(self, q, k, v):  # q, k, v [batch, heads, dst, f] -> a [batch, heads, dst, f], present
        k, v, b, present = self(k, v)
        if self.past is None:  # a whole sequence: in parts when long
            return causal_attn(q, k, v, b, weights=attention_weights, mask=attention_mask), present
        return tf.matmul(attention_weights(q, k, b), v), present


class Attn(tf.Module):
    def __init__(self, nx: int, scope: str, n_state: int, *, hparams: HParams, dtype: str):
        super().__init__(name=scope)
        assert n_state % hparams.n_head == 0
        self.n_head = hparams.n_head
        with self.name_scope:
            self.c_attn = Conv1D(nx, 'c_attn', n_state * 3, dtype=dtype)
            self.c_proj = Conv1D(n_state, 'c_proj', n_state, dtype=dtype)

    def split_heads(self, x):  # [batch, sequence, features] -> [batch, heads, sequence, features / heads]
        return tf.transpose(split_states(x, self.n_head), [0, 2, 1, 3])

    def merge_heads(self, x):  # [batch, heads, sequence, f] -> [batch, sequence, heads * f]
        return merge_states(tf.transpose(x, [0, 2, 1, 3]))

    def __call__(self, x, *, kv, record=None):  # x [batch, dst, nx] -> a [batch, dst, n_state], present
        q, k, v = map(self.split_heads, tf.split(self.c_attn(x), 3, axis=2))
        a, present = kv.attend(q, k, v)  # the key/value source's way (Past.attend, decoding's Cache.attend)
        if record is not None:  # the weights as the original computes them, beside the way taken above
            keys, _, b, _ = kv(k, v)
            record(attn_weights=attention_weights(q, keys, b))
        return self.c_proj(self.merge_heads(a)), present


class MLP(tf.Module):
    def __init__(self, nx: int, scope: str, n_state: int, *, dtype: str):
        super().__init__(name=scope)
        with self.name_scope:
            self.c_fc = Conv1D(nx, 'c_fc', n_state, dtype=dtype)
            self.c_proj = Conv1D(n_state, 'c_proj', nx, dtype=dtype)

    def __call__(self, x):  # [batch, sequence, nx] -> [batch, sequence, nx]
        return self.c_proj(self.c_fc(x, activation=gelu))


class Block(tf.Module):
    def __init__(self, nx: int, scope: str, *, hparams: HParams, dtype: str):
        super().__init__(name=scope)
        with self.name_scope:
            self.ln_1 = Norm(nx, 'ln_1', dtype=dtype)
            self.attn = Attn(nx, 'attn', nx, hparams=hparams, dtype=dtype)
            self.ln_2 = Norm(nx, 'ln_2', dtype=dtype)
            self.mlp = MLP(nx, 'mlp', nx * 4, dtype=dtype)

    def __call__(self, x, *, kv=None, record=None):  # [batch, sequence, nx] -> [batch, sequence, nx], present
        x, present = self.attend(x, kv=kv or Past(), record=record)
        return self.feed(x, record=record), present

    def attend(self, x, *, kv, record=None):  # the first residual half: x + attn(ln_1(x)), present
        z1 = self.ln_1(x)
        a, present = self.attn(z1, kv=kv, record=record)
        if record is not None: record(x=x, z1=z1, attn=a, x_attn=x + a)  # noqa: E701
        return x + a, present

    def feed(self, x, *, record=None):  # the second: x + mlp(ln_2(x))
        z2 = self.ln_2(x)
        m = self.mlp(z2)
        if record is not None: record(z2=z2, mlp=m, out=x + m)  # noqa: E701
        return x + m

    def halves(self) -> tuple:  # the two halves in turn, each x -> x (training's recompute wraps each)
        return (lambda x: self.attend(x, kv=Past())[0]), self.feed


def past_shape(*, hparams: HParams, batch_size=None, sequence=None):
    return [batch_size, hparams.n_layer, 2, hparams.n_head, sequence, hparams.head_size]


def positions_for(tokens, past_length):  # [batch, sequence] -> [batch, sequence]
    batch_size, nsteps = tf.shape(tokens)[0], tf.shape(tokens)[1]
    return tf.tile((past_length + tf.range(nsteps))[None], [batch_size, 1])


class Graph(tf.Module):
    """GPT-2's graph: forward(tokens [batch, sequence], past=None) -> {'logits': [batch, sequence, n_vocab],
    'present': [batch, n_layer, 2, n_head, sequence, head_size]}; with past, positions start at its length."""

    def __init__(self, hparams: HParams, scope: str = 'model', *, dtype: str = 'float32'):
        super().__init__(name=scope)
        self._name_scope = tf.name_scope(scope + '/')  # names from this scope alone, not the caller's
        self.hparams, self.dtype = hparams, dtype
        with self.name_scope:
            self.wpe = weight([hparams.n_ctx, hparams.n_embd], 'wpe', dtype)
            self.wte, self.wte_scale = matrix([hparams.n_vocab, hparams.n_embd], 'wte', dtype,
                                              channels=hparams.n_vocab)  # int8: a scale per row
            self.h = [Block(hparams.n_embd, 'h%d' % i, hparams=hparams, dtype=dtype) for i in range(hparams.n_layer)]
            self.ln_f = Norm(hparams.n_embd, 'ln_f', dtype=dtype)

    def embed(self, X, positions):  # [batch, sequence] x2 -> [batch, sequence, n_embd]
        # Dense reads: tf.gather on the variable puts it in copy-on-read mode (each later read copies it all).
        wte, wpe = tf.convert_to_tensor(self.wte), tf.convert_to_tensor(self.wpe)
        return gather(wte, self.wte_scale, X) + f32(tf.gather(wpe, positions))

    def blocks(self, h, kvs=None, *, wrap=None, record=None):
        """h [batch, sequence, n_embd] through every block -> h, [present per block]. kvs: a key/value source per
        block (default Past(); called as kv(k, v) and kv.attend(q, k, v)); wrap(block): each block as h -> h
        (training's recompute, from outside); record(layer, **states) sees the named states."""
        presents = []
        for layer, (block, kv) in enumerate(zip(self.h, kvs or [None] * len(self.h))):
            note = record and (lambda **states: record(layer, **states))  # called within this step
            h, present = (wrap(block)(h), None) if wrap else block(h, kv=kv, record=note)
            presents.append(present)
        return h, presents

    def logits(self, h):  # [batch, sequence, n_embd] -> [batch, sequence, n_vocab]: ln_f, then the tied wte
        batch, sequence, n_embd = shape_list(h)
        logits = logits_product(tf.reshape(self.ln_f(h), [batch * sequence, n_embd]), self.wte, self.wte_scale)
        return tf.reshape(logits, [batch, sequence, self.hparams.n_vocab])

    def forward(self, X, past=None):
        """The original model(): X [batch, sequence], past [batch, n_layer, 2, n_head, past_sequence, head_size]."""
        past_length = 0 if past is None else tf.shape(past)[-2]
        h = self.embed(X, positions_for(X, past_length))
        pasts = tf.unstack(past, axis=1) if past is not None else [None] * self.hparams.n_layer
        h, presents = self.blocks(h, [Past(p) for p in pasts])
        return {'logits': self.logits(h), 'present': tf.stack(presents, axis=1)}

    def variables_by_name(self) -> dict:  # {checkpoint name: variable}, e.g. 'model/h0/attn/c_attn/w'
        return {v.name.split(':')[0]: v for v in self.variables}
