"""Penalties on the logits, with OpenAI's and Hugging Face's meanings: logit_bias, presence, frequency, repetition.

Order, per row: repetition, then frequency and presence, then logit_bias; then sampling's temperature and filters.

- repetition_penalty p (HF's and CTRL's rule; 1 is none): for each token in the
  row's prompt or among its tokens generated so far, a positive logit is divided
  by p and a negative one multiplied by p.
- frequency_penalty f and presence_penalty r (OpenAI's formula, over the tokens
  generated so far in the row, the prompt not counted):
  logit[t] -= count[t] * f + (count[t] > 0) * r.
- logit_bias: a bias per token id, added to the logits; -100 bans a token and
  100 forces it in practice (the Gumbel noise is bounded, gpt2_tf.noise).

The state the loop carries per row is (counts, seen): how often each token was
generated, and which tokens the prompt holds. Every function here works row by
row, so a batch's tensors are its rows' stacked.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import numpy as np
import tensorflow as tf

from . import validate


class Penalties(NamedTuple):
    """Each row's penalties, one entry per row (numpy from penalties_for, tensors in the loop)."""
    bias: Any  # float32 [batch, vocab]: the logit_bias, 0 where none
    presence: Any  # float32 [batch]; 0 for none
    frequency: Any  # float32 [batch]; 0 for none
    repetition: Any  # float32 [batch]; 1 for none


def neutral(rows: int, vocab: int) -> Penalties:
    """Penalties that change nothing, for rows without any (a penalised batch's other rows)."""
    return Penalties(np.zeros([rows, vocab], np.float32), np.zeros([rows], np.float32),
                     np.zeros([rows], np.float32), np.ones([rows], np.float32))


def penalties_for(rows: int, vocab: int, logit_bias=None, presence_penalty=0, frequency_penalty=0,
                  repetition_penalty=1) -> Optional[Penalties]:
    """The checked penalties of `rows` rows as numpy arrays; None when none is set.

    logit_bias: one dict {token id: bias} for every row, or a list of one dict (or
    None) per row; the others are numbers, or one per row.
    """
    biases = validate.check_logit_bias(logit_bias, rows, vocab)
    presence, frequency, repetition = validate.check_penalties(presence_penalty, frequency_penalty,
                                                               repetition_penalty, rows)
    if not any(biases) and not presence.any() and not frequency.any() and (repetition == 1).all():
        return None
    bias = np.zeros([rows, vocab], np.float32)
    for i, row in enumerate(biases):
        bias[i, list(row)] = list(row.values())
    return Penalties(bias, presence, frequency, repetition)


def start_state(prompts: list, vocab: int) -> tuple:
    """prompts (token ids, one list per row) -> (counts float32 [batch, vocab], zeros: nothing generated yet;
    seen bool [batch, vocab], True at each prompt token)."""
    seen = np.zeros([len(prompts), vocab], bool)
    for i, row in enumerate(prompts):
        seen[i, list(row)] = True
    return np.zeros([len(prompts), vocab], np.float32), seen


def penalize(logits, counts, seen, p: Penalties):
    """logits [batch, vocab] -> the penalised logits [batch, vocab]; counts and seen as start_state's, p tensors."""
    dtype = logits.dtype
    repetition = tf.cast(p.repetition, dtype)[:, None]
    repeated = seen | (counts > 0)  # the prompt's tokens and the generated ones
    logits = tf.where(repeated, tf.where(logits > 0, logits / repetition, logits * repetition), logits)
    counts = tf.cast(counts, dtype)
    logits -= counts * tf.cast(p.frequency, dtype)[:, None] \
        + tf.cast(counts > 0, dtype) * tf.cast(p.presence, dtype)[:, None]
    return logits + tf.cast(p.bias, dtype)


def record(counts, tokens):
    """counts float32 [batch, vocab], tokens int32 [batch] -> counts with each row's token counted once more."""
    return counts + tf.one_hot(tokens, counts.shape[-1], dtype=counts.dtype)
