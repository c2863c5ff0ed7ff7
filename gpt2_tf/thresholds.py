"""The kept set of the original filters as a threshold on the logits, found without a sort.

top_p(top_k(logits / temperature)) keeps every token at or above some logit,
so each row's kept set is one number: a floor on `order_keys(logits)`. top_k's
floor is the k-th largest logit (tf.math.top_k, or a bisection when k is known
only at run time); top_p's is found by bisection over the logit values, exact,
with the original's rule that the token crossing p is dropped: among
tf.math.top_k's candidates (taken for a top_k) where they hold the nucleus, else
over the full row.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

TOP_P_MARGIN = 8e-6  # a token whose cumulative probability is this close below top_p is dropped
BIG = 2**40  # beyond every order key (they fit in 32 bits)


def order_keys(x):
    """float32 [...] -> int64 [...] with the same order: the kept sets are thresholds on these."""
    x = tf.where(tf.equal(x, 0), tf.zeros_like(x), x)  # -0.0 ties with 0.0
    bits = tf.bitcast(x, tf.int32)
    return tf.cast(tf.where(bits < 0, tf.bitwise.bitwise_xor(bits, 0x7fffffff), bits), tf.int64)


def bisect(low, high, fits):
    """Per row, the smallest integer t in [low, high] with fits(t), for fits false then true as t grows."""
    def halve(low, high):
        mid = (low + high) // 2
        ok = fits(mid)
        return [tf.where(ok, low, mid + 1), tf.where(ok, mid, high)]

    low, _ = tf.while_loop(lambda low, high: tf.reduce_any(low < high), halve, [low, high], maximum_iterations=34)
    return low


def kth_largest(keys, k):
    """keys int64 [batch, vocab], k int32 [batch] >= 1 -> the k-th largest key per row, ties counted:
    what tf.math.top_k gives, for a k known only at run time (an exported signature's)."""
    k = tf.cast(k, tf.float32)
    fewer = lambda t: tf.reduce_sum(tf.cast(keys >= t[:, None], tf.float32), axis=-1) < k  # noqa: E731
    first_below = bisect(tf.reduce_min(keys, axis=-1), tf.reduce_max(keys, axis=-1) + 1, fewer)
    return tf.reduce_max(tf.where(keys < first_below[:, None], keys, -BIG), axis=-1)


def nucleus_floor(keys, probs, target):
    """The original top-p cut as a threshold: keys, probs [batch, vocab], target [batch] -> floor key [batch].

    Sorted by logit, the original keeps a token when the cumulative probability up
    to and including it is <= p. That is a threshold t: the smallest logit whose
    mass at or above it is <= target, found by bisection over the keys; then the
    next lower logit too when its first token still fits (ties share a logit).
    """
    def mass(t):  # [batch] -> [batch]: probability of the tokens with key >= t
        return tf.reduce_sum(tf.where(keys >= t[:, None], probs, 0.0), axis=-1)

    low = tf.reduce_min(tf.where(probs > 0, keys, BIG), axis=-1)
    t = bisect(low, tf.reduce_max(keys, axis=-1) + 1, lambda t: mass(t) <= target)
    t1 = tf.reduce_min(tf.where(keys >= t[:, None], keys, BIG), axis=-1)  # BIG: the top alone is over
    t2 = tf.reduce_max(tf.where((keys < t1[:, None]) & (probs > 0), keys, -BIG), axis=-1)
    p2 = tf.reduce_max(tf.where(tf.equal(keys, t2[:, None]), probs, 0.0), axis=-1)
    floor = tf.where((t2 > -BIG) & (mass(t1) + p2 <= target), t2, t1)
    return tf.minimum(floor, tf.reduce_max(keys, axis=-1))


def top_k_floor(logits, keys, top_k, *, kmax, values=None):
    """The top-k floor key per row [batch], -BIG where a row keeps everything (top_k 0 or >= vocab).

    kmax (static) >= every top_k in use, 0 if none, None when the top_k are known
    only at run time (then a bisection finds the k-th logit that tf.math.top_k does).
    values: tf.math.top_k(logits, min(kmax, vocab))'s, given with a kmax past 0.
    """
    vocab = logits.shape[-1]
    none = tf.fill(tf.shape(logits)[:1], tf.constant(-BIG, tf.int64))
    truncating = (top_k > 0) & (top_k < vocab)
    if kmax is None:
        return tf.cond(tf.reduce_any(truncating),
                       lambda: tf.where(truncating, kth_largest(keys, tf.maximum(top_k, 1)), none), lambda: none)
    if not kmax:
        return none
    kth = tf.gather(values, tf.maximum(tf.minimum(top_k, values.shape[-1]) - 1, 0), batch_dims=1)
    return tf.where(truncating, order_keys(kth), none)


def floors(logits, temperature, top_k, top_p, *, kmax, top=None):
    """The kept set of top_p(top_k(logits / temperature)) as a threshold: keep order_keys(logits) >= floor.

    logits [batch, vocab]; temperature, top_p float32 [batch] (temperature > 0);
    top_k int32 [batch], 0 for none; kmax as top_k_floor takes it; top, with a
    kmax past 0, tf.math.top_k(logits, min(kmax, vocab)) (values, ids), the candidates.
    Returns floor int64 [batch], and z = (logits - max) / temperature [batch, vocab].
    """
    keys = order_keys(logits)
    none = tf.fill(tf.shape(logits)[:1], tf.constant(-BIG, tf.int64))
    floor_k = top_k_floor(logits, keys, top_k, kmax=kmax, values=None if top is None else top[0])
    z = (logits - tf.reduce_max(logits, axis=-1, keepdims=True)) / temperature[:, None]

    def nucleus():
        valid = keys >= floor_k[:, None]
        zv = tf.where(valid, z, -np.inf)
        total = tf.reduce_logsumexp(zv, axis=-1, keepdims=True)
        target = top_p - TOP_P_MARGIN
        full = lambda: nucleus_floor(keys, tf.exp(zv - total), target)  # noqa: E731  0 outside the top-k set
        floor = full() if top is None else _among(top, zv, total, top_p, target, full)
        return tf.where(top_p < 1, floor, none)

    floor_p = tf.cond(tf.reduce_any(top_p < 1), nucleus, lambda: none)
    return tf.maximum(floor_k, floor_p), z


def _among(top, zv, total, top_p, target, full):
    """nucleus_floor among the candidates, where every cut row's are enough, else full(): the full row's floor
    (its sums rounded in another order).

    Every token above the last candidate's logit is a candidate, so where the candidates above it hold more than
    top_p, the tokens nucleus_floor looks at (those at or above the floor, and the next logit down) are all
    candidates, with the same probabilities (each exp(zv - total), total over the full row).
    """
    values, ids = top
    keys = order_keys(values)
    probs = tf.exp(tf.gather(zv, ids, batch_dims=1) - total)
    last = tf.reduce_min(keys, axis=-1, keepdims=True)  # not a slice (see sample.choose)
    above = tf.reduce_sum(tf.where(keys > last, probs, 0.0), axis=-1)
    held = tf.reduce_all((above > top_p) | (top_p >= 1))
    return tf.cond(held, lambda: nucleus_floor(keys, probs, target), full)
