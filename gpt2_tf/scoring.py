"""Scoring text: per-token log-probabilities, top-N alternatives, and perplexity over texts of any length.

    lp = score(model, tokens)             # [batch, T] -> [batch, T - 1]: lp[b, i] = log p(tokens[b, i + 1] | tokens[b, :i + 1])
    lp, ids, top_lp = score(model, tokens, top=5)   # plus the 5 likeliest next tokens per position
    perplexity(model, ids)                # {'perplexity', 'nll', 'tokens'} over windows of n_ctx tokens
    lp = window_log_probs(model, ids); summary(lp)   # the same in two steps, every token's log p kept

Log-probs come from the model's raw distribution (no temperature, no filters),
as a float32 log-softmax computed stably (the logit minus the logsumexp, never
log(softmax)). Calls are compiled once per model shape and padded length
(right padding: causal attention keeps it invisible to the real positions),
and logits are computed only at the positions that are scored.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import tensorflow as tf

from . import compiled, validate
from .encoder import END_OF_TEXT_ID
from .model import positions_for, shape_list
from .runtime import Model

LOSS_ROWS = 256  # frozen_head_loss's most rows of logits at a time: [256, 50257] float32 is 51 MB


def hidden(model: Model, X, *, wrap: Optional[Callable] = None):
    """The residual stream after the last block: X [batch, T] -> h [batch, T, n_embd]; model.logits(h) ends
    the original model() (ln_f, then the tied wte).

    wrap, when given, turns each block into the function h -> h that runs it
    (training passes its recompute this way, from outside the model: train.recomputed).
    """
    return model.blocks(model.embed(X, positions_for(X, 0)), wrap=wrap)[0]


def mean_loss(model: Model, tokens, *, wrap: Optional[Callable] = None, wte_trained: bool = True):
    """The original training loss: mean over batch and positions of the cross-entropy of
    logits[:, :-1] against tokens[:, 1:]. tokens [batch, T] -> float32 [].

    Through the original's own fused op, whose backward pass (softmax minus the
    one-hot) needs no second [batch, T, vocab] tensor; it equals the mean of
    -log_probs to float32 rounding (the validation loss uses log_probs).
    wte_trained=False (LoRA, only_train_transformer_layers): the same loss
    through frozen_head_loss, which never holds the [batch, T, vocab] logits.
    """
    h = hidden(model, tokens, wrap=wrap)[:, :-1]
    if not wte_trained:
        return frozen_head_loss(model, h, tokens[:, 1:])
    logits = model.logits(h)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tokens[:, 1:], logits=logits))


def frozen_head_loss(model: Model, h, labels):
    """mean_loss's cross-entropy for h [batch, T, n_embd] (the last block's output) and labels [batch, T], for
    a step in which wte takes no gradient. model.logits (ln_f, then wte) and the original's fused op run on
    at most LOSS_ROWS rows at a time, and each part's gradients (its softmax minus one-hot, times 1/N as the
    mean's backward scales it, back to h's rows and ln_f's g and b) are formed in the forward pass: the
    backward then holds h's gradient [N, n_embd], never the logits or their gradient (2 x 206 MB a row of
    1024 positions). Another order of float32 sums only (tests: against the one-op loss, and LoRA and
    blocks-only steps against TF1's). The products must be differentiable: Trainer.step runs them as
    TensorFlow's ops (kernels.tensorflow_ops)."""
    n_embd, norm = h.shape[-1], [model.ln_f.g, model.ln_f.b]
    labels = tf.reshape(labels, [-1])

    @tf.custom_gradient
    def loss(x):  # x [N, n_embd] -> the mean loss, and its gradient function
        n = shape_list(x)[0]  # an int when N is known when traced
        parts = (n + LOSS_ROWS - 1) // LOSS_ROWS
        size = (n + parts - 1) // parts if isinstance(n, int) else LOSS_ROWS  # known N: parts of equal size
        xs = tf.reshape(tf.pad(x, [[0, parts * size - n], [0, 0]]), [parts, size, n_embd])
        ys = tf.reshape(tf.pad(labels, [[0, parts * size - n]]), [parts, size])
        real = tf.reshape(tf.cast(tf.range(parts * size) < n, tf.float32), [parts, size])  # 0: a padding row
        mean_grad = real / tf.cast(n, tf.float32)  # the mean's gradient, per row

        def part(i, total, grads, norm_grads):
            rows = xs[i]  # [size, n_embd]
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch([rows] + norm)
                logits = model.logits(rows[None])[0]  # [size, n_vocab]
            losses, back = tf.raw_ops.SparseSoftmaxCrossEntropyWithLogits(features=logits, labels=ys[i])
            d = tape.gradient(logits, [rows] + norm, output_gradients=back * mean_grad[i][:, None])
            return (i + 1, total + tf.reduce_sum(losses * real[i]), grads.write(i, d[0]),
                    [a + b for a, b in zip(norm_grads, d[1:])])

        start = [tf.constant(0), tf.constant(0.0), tf.TensorArray(tf.float32, size=parts, element_shape=[size, n_embd]),
                 [tf.zeros_like(v) for v in norm]]
        _, total, grads, norm_grads = tf.while_loop(lambda i, *_: i < parts, part, start,
                                                    parallel_iterations=1)  # one part's logits at a time
        dx = tf.reshape(grads.stack(), [parts * size, n_embd])[:n]
        by_name = {v.name: g for v, g in zip(norm, norm_grads)}

        def gradient(upstream, variables=None):  # of the variables read inside, ln_f's have one; wte takes none
            scaled = {name: g * tf.cast(upstream, g.dtype) for name, g in by_name.items()}
            return dx * upstream, [scaled.get(v.name) for v in variables or []]

        return total / tf.cast(n, tf.float32), gradient

    return loss(tf.reshape(h, [-1, n_embd]))


def log_probs(logits, targets, *, top: int = 0):
    """logits [..., vocab], targets [...] -> log p(target) [...] (and, with top, the top ids and log-probs [..., top])."""
    lse = tf.reduce_logsumexp(logits, axis=-1)
    picked = tf.gather(logits, targets, batch_dims=len(targets.shape)) - lse
    if not top:
        return picked, None, None
    top_logits, top_ids = tf.math.top_k(logits, k=top)
    return picked, top_ids, top_logits - lse[..., None]


def _scored(model: Model, tokens, first, *, count: int, top: int):
    """tokens [batch, Tb] right-padded; per row, positions first .. first + count - 1 predict the token after them.

    -> log-probs [batch, count] (and top ids, log-probs [batch, count, top]); positions past Tb - 2 repeat the last.
    """
    h = hidden(model, tokens)
    positions = tf.minimum(first[:, None] + tf.range(count)[None, :], tokens.shape[1] - 2)  # [batch, count]
    logits = model.logits(tf.gather(h, positions, batch_dims=1))  # [batch, count, vocab]: only where scored
    return log_probs(logits, tf.gather(tokens, positions + 1, batch_dims=1), top=top)


def _rows(tokens, n_vocab: int, n_ctx: int) -> list:
    """tokens ([batch, T], or a list of rows of any lengths) as checked lists of ints."""
    if isinstance(tokens, (list, tuple)) and tokens and isinstance(tokens[0], (list, tuple, np.ndarray)):
        rows = [validate.token_array(row, name=f'row {i}') for i, row in enumerate(tokens)]
    else:
        array = validate.token_array(tokens)
        if array.ndim != 2:
            raise validate.GPT2Error(f'tokens must be [batch, T] or a list of rows, got shape {list(array.shape)}')
        rows = list(array)
    if not rows:
        raise validate.GPT2Error('tokens is empty: give at least one row')
    for i, row in enumerate(rows):
        if row.ndim != 1:
            raise validate.GPT2Error(f'row {i} must be one sequence of token ids, got shape {list(row.shape)}')
        if len(row) < 2:
            raise validate.GPT2Error(f'row {i} has {row.size} token(s): scoring needs at least 2 (a context and a '
                                     f'next token)')
        validate.check_token_ids(row, n_vocab, name=f'row {i}: token')
        if len(row) > n_ctx:
            raise validate.GPT2Error(f'row {i} has {len(row)} tokens, past n_ctx = {n_ctx}: score a longer text in '
                                     f'windows with perplexity() or window_log_probs()')
    return [row.tolist() for row in rows]


def score(model: Model, tokens, *, top: int = 0, mode: Optional[str] = None):
    """Per-token log-probabilities: int [batch, T] (T <= n_ctx) -> float32 [batch, T - 1].

    lp[b, i] = log p(tokens[b, i + 1] | tokens[b, :i + 1]). With top=N (1..50),
    also the N likeliest next tokens at each position and their log-probs:
    (lp, int32 ids [batch, T - 1, N], float32 [batch, T - 1, N]). A list of rows
    of different lengths is padded internally and gives one array per row.
    """
    hp = model.hparams
    rows = _rows(tokens, hp.n_vocab, hp.n_ctx)
    most = min(50, hp.n_vocab)
    if not validate.is_int(top) or not 0 <= top <= most:
        raise validate.GPT2Error(f'top must be an integer in [0, {most}], got {validate.shown(top)}'
                                 + (f' (the vocabulary has {hp.n_vocab} tokens)' if most < 50 else ''))
    top = int(top)  # a Python int: it picks the compiled variant (a NumPy integer would reach the graph)
    length = compiled.bucket(max(len(row) for row in rows), hp.n_ctx)
    padded = np.zeros([len(rows), length], np.int32)
    for i, row in enumerate(rows):
        padded[i, :len(row)] = row
    run = compiled.shared(_scored, model, mode)
    lp, ids, top_lp = run(model, tf.constant(padded), tf.zeros([len(rows)], tf.int32), count=length - 1, top=top)
    lp = lp.numpy()
    cut = [len(row) - 1 for row in rows]
    same = len(set(cut)) == 1
    parts = [lp] if not top else [lp, ids.numpy(), top_lp.numpy()]
    if same:
        parts = [part[:, :cut[0]] for part in parts]
    else:
        parts = [[part[i, :n] for i, n in enumerate(cut)] for part in parts]
    return parts[0] if not top else tuple(parts)


def windows(n: int, n_ctx: int, stride: int) -> list:
    """The windows that score positions 1 .. n - 1 of an n-token sequence, each exactly once.

    Window k scores positions [1 + k * stride, 1 + (k + 1) * stride) and sees the up
    to n_ctx tokens ending at its last scored position, so each scored token has at
    least n_ctx - stride tokens of context (or all before it). Returns
    (start, end, first scored position) per window: tokens[start:end] is its input.
    """
    out = []
    for first in range(1, n, stride):
        end = min(first + stride, n)
        out.append((max(0, end - n_ctx), end, first))
    return out


def default_stride(hparams) -> int:
    """Half a window (512 for GPT-2's 1024): each window after the first scores its last n_ctx // 2 tokens."""
    return hparams.n_ctx // 2


def window_log_probs(model: Model, ids, *, stride: Optional[int] = None, bos: bool = False, batch_size: int = 4,
                     mode: Optional[str] = None, progress: Optional[Callable[[int], None]] = None,
                     end_of_text: int = END_OF_TEXT_ID) -> np.ndarray:
    """log p of every token of ids from position 1 on (from 0 with bos), over the windows of `windows`, `stride`
    tokens scored a window (default_stride by default).

    bos prepends end_of_text (<|endoftext|>, 50256) as context, as GPT-2
    evaluations do. progress, when given, is called with the number of windows
    done after each batch of them.
    """
    hp = model.hparams
    ids = validate.token_array(ids, name='ids')
    if ids.ndim != 1:
        raise validate.GPT2Error(f'ids must be one sequence of token ids, got shape {list(ids.shape)}')
    validate.check_token_ids(ids, hp.n_vocab)
    if len(ids) < 2 - bool(bos):
        raise validate.GPT2Error(f'the text has {len(ids)} token(s): scoring needs at least '
                                 + ('1 with bos=True' if bos else '2 (or 1 with bos=True)'))
    if bos:
        if not validate.is_int(end_of_text):
            raise validate.GPT2Error(f'end_of_text must be a token id, an integer, got {validate.shown(end_of_text)}')
        validate.check_token_ids([end_of_text], hp.n_vocab, name='end_of_text')
        ids = np.concatenate([[end_of_text], ids]).astype(np.int64)
    validate.check_stride(stride, hp.n_ctx)
    stride = default_stride(hp) if stride is None else stride
    if not validate.is_int(batch_size) or batch_size < 1:
        raise validate.GPT2Error(f'batch_size must be a positive integer (windows a call), got {validate.shown(batch_size)}')
    stride = int(stride)  # a numpy integer would make the compiled call's count int64
    spans = windows(len(ids), hp.n_ctx, stride)
    run = compiled.shared(_scored, model, mode)
    out = np.zeros(len(ids) - 1, np.float32)
    for at in range(0, len(spans), batch_size):
        group = spans[at:at + batch_size]
        length = compiled.bucket(max(end - start for start, end, _ in group), hp.n_ctx)
        padded = np.zeros([len(group), length], np.int32)
        first = np.zeros([len(group)], np.int32)
        for i, (start, end, scored) in enumerate(group):
            padded[i, :end - start] = ids[start:end]
            first[i] = scored - 1 - start  # the position that predicts the first scored token
        lp, _, _ = run(model, tf.constant(padded), tf.constant(first), count=min(stride, length - 1), top=0)
        lp = lp.numpy()
        for i, (start, end, scored) in enumerate(group):
            out[scored - 1:end - 1] = lp[i, :end - scored]
        if progress is not None:
            progress(len(group))
    return out


def perplexity(model: Model, ids, *, stride: Optional[int] = None, bos: bool = False, **options) -> dict:
    """Perplexity of one token sequence of any length: {'perplexity', 'nll', 'tokens'}.

    nll is the mean negative log-likelihood in nats per scored token, over every
    token from position 1 on (0 with bos=True); see window_log_probs for the
    windows, and its options (batch_size, mode, progress, end_of_text).
    """
    return summary(window_log_probs(model, ids, stride=stride, bos=bos, **options))


def summary(lp: np.ndarray) -> dict:
    """{'perplexity', 'nll', 'tokens'} of the log-probs lp (nats) that window_log_probs gives."""
    nll = float(-lp.astype(np.float64).mean())
    return {'perplexity': float(np.exp(nll)), 'nll': nll, 'tokens': int(lp.size)}


def _sequence(ids, name: str) -> list:
    array = validate.token_array(ids, name=name)
    if array.ndim != 1:
        raise validate.GPT2Error(f'{name} must be one sequence of token ids, got shape {list(array.shape)}')
    return array.tolist()


def score_completion(model: Model, prompt_ids, completion_ids, *, mode: Optional[str] = None) -> float:
    """log p(completion | prompt), summed over the completion's tokens: the basis of ranking candidates."""
    prompt_ids, completion_ids = (_sequence(ids, name) for ids, name in ((prompt_ids, 'prompt_ids'),
                                                                       (completion_ids, 'completion_ids')))
    if not prompt_ids or not completion_ids:
        raise validate.GPT2Error('score_completion needs a non-empty prompt and completion')
    n_ctx, total = model.hparams.n_ctx, len(prompt_ids) + len(completion_ids)
    if total > n_ctx:
        keep = (f"keep the prompt's last {n_ctx - len(completion_ids)} tokens" if len(completion_ids) < n_ctx
                else 'shorten the completion')
        raise validate.GPT2Error(f'the prompt and completion are {total} tokens, past n_ctx = {n_ctx}: {keep}')
    lp = score(model, [prompt_ids + completion_ids], mode=mode)[0]
    return float(lp[len(prompt_ids) - 1:].astype(np.float64).sum())
