"""Cached decoding: the model's blocks over a key/value cache preallocated for the whole sequence.

The original concatenates `past` at every step, so each step's shapes grow and
a compiled loop cannot keep them. Here each layer's keys and values go into a
cache [batch, 2, heads, S, f] of fixed size S, written at the step's slots, and
a mask says which slots each query sees: the earlier tokens of its own row
(never the left padding of a shorter prompt) and itself, through the original's
-1e10 mask. The cache is the blocks' key/value source (Cache); the blocks
themselves are the model's own.
"""

from __future__ import annotations

import tensorflow as tf

from . import kernels
from .model import attention_weights, shape_list
from .runtime import Model
from .precision import activations, decoding, f32, kernel_while_decoding


def empty_cache(model: Model, batch, size: int) -> list:
    """One zeroed cache [batch, 2, n_head, size, head_size] per layer, in the dtype of the model's weights
    (float32 beside int8 weights)."""
    hp = model.hparams
    dtype = activations(model.dtype)
    return [tf.zeros([batch, 2, hp.n_head, size, hp.head_size], dtype) for _ in range(hp.n_layer)]


def row_slots(index, batch, n):
    """index: [] (every row) or [batch] (each row's own) first slot -> int32 [batch, n]: each row's n slots."""
    return tf.broadcast_to(index, [batch])[:, None] + tf.range(n)[None, :]


def write_cache(cache, kv, slots):
    """Writes kv [batch, 2, heads, n, f] into cache [batch, 2, heads, S, f], row b's at slots[b] ([batch, n])."""
    batch, _, heads, n, _ = shape_list(kv)
    grid = [tf.range(batch)[:, None, None, None], tf.range(2)[None, :, None, None],
            tf.range(heads)[None, None, :, None], slots[:, None, None, :]]
    indices = tf.stack([tf.broadcast_to(axis, [batch, 2, heads, n]) for axis in grid], axis=-1)
    return tf.tensor_scatter_nd_update(cache, indices, kv)  # indices [batch, 2, heads, n, 4]


def cache_mask(pads, queries, size: int):
    """pads [batch] left-padding slots, queries [batch, n] slots -> mask [batch, 1, n, size]: 1 where a query
    sees a slot."""
    slots = tf.range(size)
    seen = (slots[None, None, :] >= pads[:, None, None]) & (slots[None, None, :] <= queries[:, :, None])
    return tf.cast(seen, tf.float32)[:, None]


def positions(pads, queries, n_ctx: int):
    """pads [batch], queries [batch, n] slots -> [batch, n] positions; each row counts from 0 after its padding.

    Past the window they stay at its last position: only tokens fed past a row's end get there (an
    in-flight row's last chunk, an idle slot), and no output of theirs is used.
    """
    return tf.clip_by_value(queries - pads[:, None], 0, n_ctx - 1)


class Cache:
    """A block's key/value source over its cache: this call's keys and values written at slots index..,
    then every slot under the mask. The block's present is the updated cache."""

    def __init__(self, cache, slots, mask):  # cache [batch, 2, heads, S, f], slots [batch, n], mask [batch, 1, n, S]
        self.cache, self.slots, self.mask = cache, slots, mask

    def __call__(self, k, v):  # k, v [batch, heads, n, f] -> k, v [batch, heads, S, f], mask, cache
        cache = self.write(k, v)
        k, v = tf.unstack(f32(cache), axis=1)  # attention itself stays float32
        return k, v, self.mask, cache

    def write(self, k, v):  # -> the cache with k, v [batch, heads, n, f] at the slots
        return write_cache(self.cache, tf.cast(tf.stack([k, v], axis=1), self.cache.dtype), self.slots)

    def attend(self, q, k, v):  # q, k, v [batch, heads, n, f] -> a [batch, heads, n, f], cache
        """One query a row (a step, or a one-token prompt) over a float32 cache takes the kernel where decoding
        allows it (precision.kernel_while_decoding): it reads the cache in place; XLA's attention copies each layer's
        keys and values out of it first. Otherwise, and for a prompt's several queries, the original's."""
        if q.shape[2] == 1 and self.cache.dtype == tf.float32 and kernel_while_decoding() and kernels.on_cpu(q):
            cache = self.write(k, v)
            return kernels.cached_attention(q[:, :, 0], cache, self.mask[:, 0, 0])[:, :, None], cache
        k, v, mask, cache = self(k, v)
        return tf.matmul(attention_weights(q, k, mask), v), cache


def decode(model: Model, X, *, pads, caches, index):
    """X [batch, n] at slots index .. index + n - 1 -> the last token's logits [batch, n_vocab], updated caches.

    index: int32 [] for every row, or [batch], each row at its own slots (rows of an in-flight batch).
    """
    size = shape_list(caches[0])[3]  # static in the compiled loop, dynamic in an exported signature
    batch, n = shape_list(X)
    queries = row_slots(index, batch, n)
    mask = cache_mask(pads, queries, size)
    h = model.embed(X, positions(pads, queries, model.hparams.n_ctx))
    with decoding():  # a step's few rows and its attention may take the kernel (gpt2_tf.precision.decoding)
        h, caches = model.blocks(h, [Cache(cache, queries, mask) for cache in caches])
        return model.logits(h[:, -1:])[:, 0], caches  # only the last token's logits are needed
