"""The original filters, after openai/gpt-2 src/sample.py: top_k_logits and top_p_logits.

They keep the original's semantics and its -1e10 for a removed logit; the
sampling loop draws from the same kept set through thresholds (gpt2_tf.thresholds)
and never calls these. One departure: the original's top-p threshold lacked a
trailing axis and failed for batch > 1; here it has one.
"""

from __future__ import annotations

import tensorflow as tf


def top_k_logits(logits, k: int):  # [batch, vocab] -> [batch, vocab]
    """Keeps the k largest logits of each row, and any tied with the k-th; k = 0 keeps all.

    The rest become -1e10, as in the original.
    """
    logits = tf.convert_to_tensor(logits)
    if k == 0:
        return logits
    values, _ = tf.math.top_k(logits, k=min(k, logits.shape[-1]))
    return tf.where(logits < values[:, -1:], tf.cast(-1e10, logits.dtype), logits)


def top_p_logits(logits, p: float):  # [batch, vocab] -> [batch, vocab]
    """Nucleus filtering: keeps the tokens whose inclusive cumulative probability is <= p.

    As in the original, the token that crosses p is dropped, and at least one
    token (with its ties) always stays.
    """
    logits = tf.convert_to_tensor(logits)
    ordered = tf.sort(logits, direction='DESCENDING', axis=-1)
    cumulative = tf.cumsum(tf.nn.softmax(ordered, axis=-1), axis=-1)
    last = tf.maximum(tf.reduce_sum(tf.cast(cumulative <= p, tf.int32), axis=-1) - 1, 0)  # [batch]
    floor = tf.gather(ordered, last, axis=-1, batch_dims=1)  # [batch]
    # floor[:, None]: the original compared with floor [batch] itself, which broadcasts along the vocabulary.
    return tf.where(logits < floor[:, None], tf.cast(-1e10, logits.dtype), logits)
