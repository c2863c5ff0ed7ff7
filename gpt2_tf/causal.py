"""The causal attention of a sequence without a past: by the kernel where it runs, else in parts of its
queries when it is long.

The original gives every later key the score -1e10, so its softmax weight is exp(-1e10 - max) = 0 exactly
(for finite scores above -1e10; beyond them skipping later keys, in parts or in the kernel, differs from masking
them: gpt2_tf/kernels/attention.cc's header says how).
Where gpt2_tf.kernels.sequence_attention_available says so (float32 on a CPU, outside XLA and exports), the
kernel's op takes the whole attention and its gradient, block by block of queries, no [heads, T, T] tensor
held (BENCHMARKS.md, The causal attention's kernel). Elsewhere, from PARTS_FROM positions on, causal_attn
takes the queries in PARTS parts, each against the keys and values up to its own last position: the same
sums less their zero terms, in another float32 order. At 1024 positions the attention then takes 0.61-0.76x
the whole one's time, forward and backward; below 512 the parts cost more than they save (BENCHMARKS.md,
Causal attention in parts).
"""

from __future__ import annotations

import tensorflow as tf

from . import kernels

PARTS = 8
PARTS_FROM = 512


def causal_attn(q, k, v, b, *, weights, mask):
    """weights(q, k, b) @ v for q, k, v [batch, heads, sequence, f] of one sequence (src = dst, b its causal
    mask) -> [batch, heads, sequence, f]. weights: the original's softmaxed scores (model.attention_weights);
    mask(nd, ns, dtype=): its mask (model.attention_mask)."""
    if kernels.sequence_attention_available(q):
        return kernels.causal_attention(q, k, v)
    sequence = q.shape[2] if q.shape[2] is not None else tf.shape(q)[2]

    def parts():
        size = (sequence + PARTS - 1) // PARTS
        ends = [tf.minimum(sequence, (i + 1) * size) for i in range(PARTS)]
        sizes = tf.stack([ends[0]] + [ends[i] - ends[i - 1] for i in range(1, PARTS)])
        qs, ks, vs = (tf.split(t, sizes, axis=2, num=PARTS) for t in (q, k, v))
        out = []
        for i, end in enumerate(ends):  # keys and values as concats of whole parts: cheap to differentiate
            rows = tf.shape(qs[i])[2]
            part_mask = tf.reshape(mask(rows, end, dtype=q.dtype), [1, 1, rows, end])
            out.append(tf.matmul(weights(qs[i], tf.concat(ks[:i + 1], axis=2), part_mask),
                                 tf.concat(vs[:i + 1], axis=2)))
        return tf.concat(out, axis=2)

    def whole():
        return tf.matmul(weights(q, k, b), v)

    if isinstance(sequence, int):
        return parts() if sequence >= PARTS_FROM else whole()
    return tf.cond(sequence >= PARTS_FROM, parts, whole)
