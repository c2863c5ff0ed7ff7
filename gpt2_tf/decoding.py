"""Cached decoding: the model's blocks over a key/value cache preallocated for the whole sequence.

The original concatenates `past` at every step, so each step's shapes grow and
a compiled loop cannot keep them. Here each layer's keys and values go into a
cache [batch, 2, heads, S, f] of fixed size S, written at the step's slots, and
a mask says which slots each query sees: the earlier tokens of its own row
(never the left padding of a shorter prompt) and itself, through the original's
-1e10 mask. The projections, norms and MLP are the model's own modules.
"""

from __future__ import annotations

import tensorflow as tf

from .model import Model, multihead_attn, shape_list
from .precision import f32


def empty_cache(model: Model, batch, size: int) -> list:
    """One zeroed cache [batch, 2, n_head, size, head_size] per layer, in the dtype of the model's weights."""
    hp = model.hparams
    return [tf.zeros([batch, 2, hp.n_head, size, hp.head_size], model.wte.dtype) for _ in range(hp.n_layer)]


def write_cache(cache, kv, index):
    """Writes kv [batch, 2, heads, n, f] into cache [batch, 2, heads, S, f] at slots index .. index + n - 1."""
    batch, _, heads, n, _ = shape_list(kv)
    slots = tf.meshgrid(tf.range(batch), tf.range(2), tf.range(heads), index + tf.range(n), indexing='ij')
    return tf.tensor_scatter_nd_update(cache, tf.stack(slots, axis=-1), kv)  # indices [batch, 2, heads, n, 4]


def cache_mask(pads, queries, size: int):
    """pads [batch] left-padding slots, queries [n] slots -> mask [batch, 1, n, size]: 1 where a query sees a slot."""
    slots = tf.range(size)
    seen = (slots[None, None, :] >= pads[:, None, None]) & (slots[None, None, :] <= queries[None, :, None])
    return tf.cast(seen, tf.float32)[:, None]


def positions(pads, queries):
    """pads [batch], queries [n] slots -> [batch, n] positions; each row counts from 0 after its padding."""
    return tf.maximum(queries[None, :] - pads[:, None], 0)


def cached_block(block, x, cache, index, mask):
    """The original block over a cache: x [batch, n, nx] at slots index.. -> x [batch, n, nx], cache."""
    q, k, v = block.attn.qkv(block.ln_1(x))
    cache = write_cache(cache, tf.cast(tf.stack([k, v], axis=1), cache.dtype), index)
    k, v = tf.unstack(f32(cache), axis=1)  # [batch, heads, S, f] each; attention itself stays float32
    x = x + block.attn.project(multihead_attn(q, k, v, mask))
    x = x + block.mlp(block.ln_2(x))
    return x, cache


def decode(model: Model, X, *, pads, caches, index):
    """X [batch, n] at slots index .. index + n - 1 -> the last token's logits [batch, n_vocab], updated caches."""
    size = shape_list(caches[0])[3]  # static in the compiled loop, dynamic in an exported signature
    queries = index + tf.range(tf.shape(X)[1])
    mask = cache_mask(pads, queries, size)
    h = model.embed(X, positions(pads, queries))
    updated = []
    for block, cache in zip(model.h, caches):
        h, cache = cached_block(block, h, cache, index, mask)
        updated.append(cache)
    h = model.ln_f(h[:, -1:])  # only the last token's logits are needed
    return model.logits(h)[:, 0], updated
