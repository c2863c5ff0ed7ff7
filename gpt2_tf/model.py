"""The GPT-2 graph as tf.Modules, function for function after openai/gpt-2 src/model.py.

Each module creates its variables under the original variable scope, so a
variable's name is its name in the published checkpoints (model/h0/attn/c_attn/w).
The numerics are the original's: the tanh GELU, LayerNorm epsilon 1e-5 and the
-1e10 attention mask.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import numpy as np
import tensorflow as tf

from .hparams import HParams


def shape_list(x):
    """Static dimensions where known, dynamic ones elsewhere."""
    static = x.shape.as_list()
    dynamic = tf.shape(x)
    return [dynamic[i] if s is None else s for i, s in enumerate(static)]


def softmax(x, axis=-1):
    x = x - tf.reduce_max(x, axis=axis, keepdims=True)
    ex = tf.exp(x)
    return ex / tf.reduce_sum(ex, axis=axis, keepdims=True)


def gelu(x):
    # The tanh approximation GPT-2 was trained with, not the exact erf GELU.
    return 0.5 * x * (1 + tf.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * tf.pow(x, 3))))


class Norm(tf.Module):
    """Normalize to mean 0 and std 1 over the last axis, then a diagonal affine map."""

    def __init__(self, n_state: int, scope: str, *, axis: int = -1, epsilon: float = 1e-5):
        super().__init__(name=scope)
        self.axis = axis
        self.epsilon = epsilon  # 1e-5, not a library default
        with self.name_scope:
            self.g = tf.Variable(tf.ones([n_state]), name='g')
            self.b = tf.Variable(tf.zeros([n_state]), name='b')

    def __call__(self, x):  # [..., n_state] -> [..., n_state]
        u = tf.reduce_mean(x, axis=self.axis, keepdims=True)
        n = x - u
        s = tf.reduce_mean(tf.square(n), axis=self.axis, keepdims=True)
        x = n * tf.math.rsqrt(s + self.epsilon)
        return x * self.g + self.b


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

    def __init__(self, nx: int, nf: int, scope: str):
        super().__init__(name=scope)
        with self.name_scope:
            self.w = tf.Variable(tf.zeros([1, nx, nf]), name='w')
            self.b = tf.Variable(tf.zeros([nf]), name='b')

    def __call__(self, x):  # [..., nx] -> [..., nf]
        *start, nx = shape_list(x)
        nf = self.w.shape[-1]
        c = tf.matmul(tf.reshape(x, [-1, nx]), tf.reshape(self.w, [-1, nf])) + self.b
        return tf.reshape(c, start + [nf])


def attention_mask(nd, ns, *, dtype):
    """1s in the lower triangle, counting from the lower right corner: [nd, ns].

    Destination i sees source j when j <= i + ns - nd, i.e. the past plus itself.
    """
    i = tf.range(nd)[:, None]
    j = tf.range(ns)
    m = i >= j - ns + nd
    return tf.cast(m, dtype)


def mask_attn_weights(w, b):
    """w [batch, heads, dst, src]; b is 1 where dst may see src, broadcastable to w."""
    # The original's -1e10, not -inf: a fully masked row stays finite.
    return w * b - tf.cast(1e10, w.dtype) * (1 - b)


def multihead_attn(q, k, v, b):
    """q [batch, heads, dst, f]; k, v [batch, heads, src, f] -> a [batch, heads, dst, f], w [batch, heads, dst, src]"""
    w = tf.matmul(q, k, transpose_b=True)
    w = w * tf.math.rsqrt(tf.cast(v.shape[-1], w.dtype))
    w = mask_attn_weights(w, b)
    w = softmax(w)
    a = tf.matmul(w, v)
    return a, w


def write_cache(cache, kv, index):
    """Writes kv [batch, 2, heads, n, f] into cache [batch, 2, heads, S, f] at sequence slots index .. index+n-1."""
    batch, _, heads, n, _ = shape_list(kv)
    slots = tf.meshgrid(tf.range(batch), tf.range(2), tf.range(heads), index + tf.range(n), indexing='ij')
    return tf.tensor_scatter_nd_update(cache, tf.stack(slots, axis=-1), kv)  # indices [batch, 2, heads, n, 4]


class Attn(tf.Module):
    def __init__(self, nx: int, n_state: int, scope: str, *, hparams: HParams):
        super().__init__(name=scope)
        assert n_state % hparams.n_head == 0
        self.n_head = hparams.n_head
        with self.name_scope:
            self.c_attn = Conv1D(nx, n_state * 3, 'c_attn')
            self.c_proj = Conv1D(n_state, n_state, 'c_proj')

    def split_heads(self, x):  # [batch, sequence, features] -> [batch, heads, sequence, features / heads]
        return tf.transpose(split_states(x, self.n_head), [0, 2, 1, 3])

    def merge_heads(self, x):  # [batch, heads, sequence, f] -> [batch, sequence, heads * f]
        return merge_states(tf.transpose(x, [0, 2, 1, 3]))

    def __call__(self, x, *, past=None, cache_index=None, mask=None, states=None):
        """x [batch, dst, nx] -> a [batch, dst, n_state], present.

        As in the original, past [batch, 2, heads, src, f] holds the keys and values of
        earlier tokens, and present [batch, 2, heads, dst, f] those of x.
        With cache_index, past is instead a preallocated cache [batch, 2, heads, S, f]:
        x's keys and values are written at slots cache_index.., present is the updated
        cache, and mask [batch, 1, dst, S] says which slots each token may see.
        """
        c = self.c_attn(x)
        q, k, v = map(self.split_heads, tf.split(c, 3, axis=2))
        present = tf.stack([k, v], axis=1)  # [batch, 2, heads, dst, f]
        if cache_index is not None:
            present = write_cache(past, present, cache_index)
            k, v = tf.unstack(present, axis=1)
        elif past is not None:
            pk, pv = tf.unstack(past, axis=1)
            k = tf.concat([pk, k], axis=-2)  # [batch, heads, src + dst, f]
            v = tf.concat([pv, v], axis=-2)
        if mask is None:
            nd, ns = shape_list(q)[2], shape_list(k)[2]
            mask = tf.reshape(attention_mask(nd, ns, dtype=q.dtype), [1, 1, nd, ns])
        a, w = multihead_attn(q, k, v, mask)
        if states is not None:
            states['attn_weights'] = w
        a = self.merge_heads(a)
        a = self.c_proj(a)
        return a, present


class MLP(tf.Module):
    def __init__(self, nx: int, n_state: int, scope: str):
        super().__init__(name=scope)
        with self.name_scope:
            self.c_fc = Conv1D(nx, n_state, 'c_fc')
            self.c_proj = Conv1D(n_state, nx, 'c_proj')

    def __call__(self, x):  # [batch, sequence, nx] -> [batch, sequence, nx]
        h = gelu(self.c_fc(x))
        return self.c_proj(h)


class Block(tf.Module):
    def __init__(self, scope: str, *, hparams: HParams):
        super().__init__(name=scope)
        nx = hparams.n_embd
        with self.name_scope:
            self.ln_1 = Norm(nx, 'ln_1')
            self.attn = Attn(nx, nx, 'attn', hparams=hparams)
            self.ln_2 = Norm(nx, 'ln_2')
            self.mlp = MLP(nx, nx * 4, 'mlp')

    def __call__(self, x, *, past=None, states=None, **cache):
        """x [batch, sequence, n_embd] -> x [batch, sequence, n_embd], present.

        states, when given a dict, receives the block's named states (see STATE_NAMES).
        """
        z1 = self.ln_1(x)
        a, present = self.attn(z1, past=past, states=states, **cache)
        x_attn = x + a
        z2 = self.ln_2(x_attn)
        m = self.mlp(z2)
        out = x_attn + m
        if states is not None:
            states.update(x=x, z1=z1, attn=a, x_attn=x_attn, z2=z2, mlp=m, out=out)
        return out, present


# The states Block records, in order:
STATE_NAMES = {
    'x': 'x_n, the block input (the embeddings for h0)',
    'z1': 'ln_1(x_n)',
    'attn': "the attention delta, attn(z1)",
    'x_attn': "x'_n = x_n + attention delta",
    'z2': "ln_2(x'_n)",
    'mlp': 'the mlp delta, mlp(z2)',
    'out': "x_{n+1} = x'_n + mlp delta, the block output",
}


def components(hp: HParams) -> list:
    """The model's parts: (component, scope under model/ with {i} for the block, {variable: shape}, instances)."""
    e = hp.n_embd
    per_block = [
        ('ln_1', 'h{i}/ln_1', {'g': [e], 'b': [e]}),
        ('attn.c_attn', 'h{i}/attn/c_attn', {'w': [1, e, 3 * e], 'b': [3 * e]}),
        ('attn.c_proj', 'h{i}/attn/c_proj', {'w': [1, e, e], 'b': [e]}),
        ('ln_2', 'h{i}/ln_2', {'g': [e], 'b': [e]}),
        ('mlp.c_fc', 'h{i}/mlp/c_fc', {'w': [1, e, 4 * e], 'b': [4 * e]}),
        ('mlp.c_proj', 'h{i}/mlp/c_proj', {'w': [1, 4 * e, e], 'b': [e]}),
    ]
    return ([('wte', '', {'wte': [hp.n_vocab, e]}, 1), ('wpe', '', {'wpe': [hp.n_ctx, e]}, 1)]
            + [(name, scope, shapes, hp.n_layer) for name, scope, shapes in per_block]
            + [('ln_f', 'ln_f', {'g': [e], 'b': [e]}, 1)])


def variable_name(scope: str, variable: str, layer: int = 0) -> str:
    return '/'.join(part for part in ('model', scope.format(i=layer), variable) if part)


def variable_shapes(hp: HParams) -> dict:
    """{checkpoint name: shape} of every variable, without building the model."""
    return {variable_name(scope, variable, i): tuple(shape)
            for _, scope, shapes, instances in components(hp)
            for i in range(instances) for variable, shape in shapes.items()}


def past_shape(*, hparams: HParams, batch_size=None, sequence=None):
    return [batch_size, hparams.n_layer, 2, hparams.n_head, sequence, hparams.head_size]


def positions_for(tokens, past_length):  # [batch, sequence] -> [batch, sequence]
    batch_size = tf.shape(tokens)[0]
    nsteps = tf.shape(tokens)[1]
    return tf.tile((past_length + tf.range(nsteps))[None], [batch_size, 1])


class Model(tf.Module):
    """GPT-2. Call it with int32 tokens [batch, sequence] and, optionally, past.

    model(tokens)               -> {'logits': [batch, sequence, n_vocab],
                                    'present': [batch, n_layer, 2, n_head, sequence, head_size]}
    model(tokens, past=present) continues after past: positions start at its length.

    Calls run as tf.functions with an input_signature, so a new batch size,
    sequence or past length does not retrace. With jit_compile=True they are
    XLA-compiled: faster, but compiled anew for each new input shape.
    model.forward is the same computation, run eagerly when called eagerly.
    """

    def __init__(self, hparams: HParams, scope: str = 'model', *, device: Optional[str] = None,
                 jit_compile: bool = False):
        super().__init__(name=scope)
        self.hparams = hparams
        self.device = device
        with self._on_device(), self.name_scope:
            self.wpe = tf.Variable(tf.zeros([hparams.n_ctx, hparams.n_embd]), name='wpe')
            self.wte = tf.Variable(tf.zeros([hparams.n_vocab, hparams.n_embd]), name='wte')
            self.h = [Block('h%d' % layer, hparams=hparams) for layer in range(hparams.n_layer)]
            self.ln_f = Norm(hparams.n_embd, 'ln_f')
        tokens = tf.TensorSpec([None, None], tf.int32, name='tokens')
        past = tf.TensorSpec(past_shape(hparams=hparams), tf.float32, name='past')
        self._forward = tf.function(
            lambda X: self.forward(X), input_signature=[tokens], jit_compile=jit_compile)
        self._forward_past = tf.function(
            lambda X, past: self.forward(X, past), input_signature=[tokens, past], jit_compile=jit_compile)

    def _on_device(self):
        return tf.device(self.device) if self.device else contextlib.nullcontext()

    def embed(self, X, positions):  # [batch, sequence] x2 -> [batch, sequence, n_embd]
        # Gather from dense reads: tf.gather on the variable itself puts it in copy-on-read
        # mode, and every later read of wte (the logits) would then copy all 154 MB of it.
        return tf.gather(self.wte.value(), X) + tf.gather(self.wpe.value(), positions)

    def logits(self, h):  # [batch, sequence, n_embd] -> [batch, sequence, n_vocab]
        batch, sequence, n_embd = shape_list(h)
        logits = tf.matmul(tf.reshape(h, [batch * sequence, n_embd]), self.wte, transpose_b=True)
        return tf.reshape(logits, [batch, sequence, self.hparams.n_vocab])

    def forward(self, X, past=None, *, states=None):
        """The original model(): X [batch, sequence], past [batch, n_layer, 2, n_head, past_sequence, head_size].

        states, when given a list, receives one dict of named states per block.
        """
        past_length = 0 if past is None else tf.shape(past)[-2]
        h = self.embed(X, positions_for(X, past_length))
        pasts = tf.unstack(past, axis=1) if past is not None else [None] * self.hparams.n_layer
        presents = []
        for block, layer_past in zip(self.h, pasts):
            block_states = None
            if states is not None:
                block_states = {}
                states.append(block_states)
            h, present = block(h, past=layer_past, states=block_states)
            presents.append(present)
        h = self.ln_f(h)
        return {'logits': self.logits(h), 'present': tf.stack(presents, axis=1)}

    def decode(self, X, *, positions, caches, cache_index, mask):
        """One step of cached decoding: X [batch, n] at slots cache_index .. cache_index+n-1.

        caches: one [batch, 2, n_head, S, head_size] per layer; positions [batch, n];
        mask [batch, 1, n, S]. Returns the last token's logits [batch, n_vocab] and the
        updated caches.
        """
        h = self.embed(X, positions)
        updated = []
        for block, cache in zip(self.h, caches):
            h, cache = block(h, past=cache, cache_index=cache_index, mask=mask)
            updated.append(cache)
        h = self.ln_f(h[:, -1:])  # only the last token's logits are needed
        return self.logits(h)[:, 0], updated

    def __call__(self, tokens, past=None):
        tokens = tf.convert_to_tensor(tokens)
        if not tokens.dtype.is_integer:
            raise ValueError(f'tokens must be integers, got {tokens.dtype.name}')
        tokens = tf.cast(tokens, tf.int32)
        if tokens.shape.rank != 2:
            raise ValueError(f'tokens must be [batch, sequence], got shape {tokens.shape}')
        if past is not None:
            past = tf.convert_to_tensor(past, tf.float32)
        if tf.executing_eagerly():
            self.check_inputs(tokens, past)
        with self._on_device():
            if past is None:
                return self._forward(tokens)
            return self._forward_past(tokens, past)

    def check_inputs(self, tokens, past=None):
        """Raises ValueError for ids outside the vocabulary, a bad past, or a sequence past n_ctx.

        On a GPU, tf.gather returns zeros for an out-of-range id instead of failing.
        """
        hp = self.hparams
        if tf.size(tokens) > 0:
            low, high = int(tf.reduce_min(tokens)), int(tf.reduce_max(tokens))
            if low < 0 or high >= hp.n_vocab:
                bad = low if low < 0 else high
                raise ValueError(f'token id {bad} is outside the vocabulary [0, {hp.n_vocab})')
        past_length = 0
        if past is not None:
            want = past_shape(hparams=hp, batch_size=tokens.shape[0])
            got = past.shape.as_list()
            if len(got) != 6 or any(w is not None and w != g for w, g in zip(want, got)):
                want_text = str(want).replace('None', 'past_length')
                raise ValueError(f'past must have shape {want_text}, got {got}')
            past_length = got[4]
        if past_length + tokens.shape[1] > hp.n_ctx:
            raise ValueError(
                f'sequence too long: {past_length} past + {tokens.shape[1]} new tokens > n_ctx = {hp.n_ctx}')

    @property
    def tracing_count(self) -> int:
        return self._forward.experimental_get_tracing_count() + \
            self._forward_past.experimental_get_tracing_count()

    def variables_by_name(self) -> dict:
        """{checkpoint name: variable}, e.g. 'model/h0/ln_1/g'."""
        return {v.name.split(':')[0]: v for v in self.variables}
