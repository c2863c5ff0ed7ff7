"""Every number of the explorer page for one prompt, as plain numpy arrays (a notebook can plot the same views).

The states are what the model's own blocks record as they run (diagnostics.trace); the MLP's inner
values come from calling the block's own c_fc and the model's gelu on the recorded second norm's output.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from ..diagnostics import trace
from ..model import Graph, gelu
from ..precision import gather
from ..scoring import score
from ..validate import GPT2Error

# The residual stream's five norms per token and block, in forward order.
RESIDUAL = ['x_n', 'attention delta', "x'_n", 'MLP delta', 'x_{n+1}']
# An activation counts as near zero when |GELU(u)| is below this.
NEAR_ZERO = 0.01
# Bins of the histogram of the GELU's input, per block.
BINS = 24
# The logit lens takes this many of its (block, position) rows through ln_f and wte at a time: all at once held
# n_layer·T·n_vocab logits and as many probabilities (1.6 GB at 341 tokens on 124M), and a block at a time read
# all of wte n_layer times over for a short prompt.
LENS_ROWS = 256


def explore(model: Graph, tokens) -> dict:
    """Every number of the explorer page for one prompt, tokens int [T] (1 <= T <= n_ctx), as numpy:

    residual_norms [n_layer, T, 5]   L2 norms of x_n, the attention delta, x'_n, the MLP delta, x_{n+1}
    attention      [n_layer, n_head, T, T]   the softmaxed attention weights
    norm_stats     [n_layer, 2, T, 4]  LayerNorm 1 then 2: each token's feature mean and variance before, then after
    gelu_range     [n_layer, 2]      the smallest and largest input to the GELU (c_fc's output)
    gelu_histogram [n_layer, BINS]   counts of the GELU's inputs in BINS equal bins over that range
    near_zero      [n_layer]         the share of the GELU's outputs with |GELU(u)| < NEAR_ZERO
    embedding_norms [T, 3]           |wte[token]|, |wpe[position]|, |x_0| per token
    lens_ids, lens_probs [n_layer, T, 5]     the logit lens: the top 5 next tokens that x_{n+1} gives
                                             through ln_f and the tied wte
    next_ids, next_probs [10]        the model's top 10 next tokens after the prompt
    prompt_log_probs [T - 1]         log p of each prompt token after the ones before it (scoring)
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise GPT2Error(f'explore takes one prompt\'s token ids, int [T]; got {tokens.dtype} of shape '
                        f'{tokens.shape} (encode text first; for a batch, one prompt at a time)')
    if tokens.size == 0:
        raise GPT2Error('the prompt is empty: give at least one token')
    states = trace(model, tokens[None], attention_weights=True)
    broken = [n for n, block in enumerate(states) if not np.isfinite(block['out']).all()]
    if broken:
        raise GPT2Error(f'the activations are not finite from block h{broken[0]} on {NOT_FINITE}')
    names = ['x', 'attn', 'x_attn', 'mlp', 'out']
    norms = np.stack([np.stack([np.linalg.norm(block[n][0], axis=-1) for n in names], axis=-1) for block in states])
    outs = np.stack([block['out'][0] for block in states]).reshape(-1, model.hparams.n_embd)  # [n_layer * T, n_embd]
    lens_probs, lens_ids = [], []
    for start in range(0, len(outs), LENS_ROWS):
        rows = tf.constant(outs[None, start:start + LENS_ROWS])
        probs = tf.nn.softmax(model.logits(rows), axis=-1)[0]  # [rows, n_vocab]: ln_f, then the tied wte
        top = tf.math.top_k(probs, k=min(5, model.hparams.n_vocab))
        lens_probs.append(top.values.numpy())
        lens_ids.append(top.indices.numpy())
    next_probs, next_ids = tf.math.top_k(probs[-1], k=min(10, model.hparams.n_vocab))  # the last block's last token
    lens_ids, lens_probs = (np.concatenate(parts).reshape(len(states), tokens.size, -1)  # [n_layer, T, 5]
                            for parts in (lens_ids, lens_probs))
    log_probs = score(model, tokens[None])[0] if tokens.size >= 2 else np.zeros([0], np.float32)
    return finite({'tokens': tokens, 'residual_norms': norms.astype(np.float32),
                   'attention': np.stack([block['attn_weights'][0] for block in states]),
                   'norm_stats': np.stack([[norm_stats(b['x'][0], b['z1'][0]), norm_stats(b['x_attn'][0], b['z2'][0])]
                                           for b in states]),
                   **mlp_inside(model, states), 'embedding_norms': embedding_norms(model, tokens, states[0]['x'][0]),
                   'lens_ids': lens_ids, 'lens_probs': lens_probs,
                   'next_ids': next_ids.numpy(), 'next_probs': next_probs.numpy(), 'prompt_log_probs': log_probs})


NOT_FINITE = ('(an overflow in a reduced precision, or a damaged checkpoint): explore it with --dtype float32 '
              '(dtype="float32"), or check the checkpoint with gpt2-tf inspect')
PER_BLOCK = ('residual_norms', 'attention', 'norm_stats', 'gelu_range', 'near_zero', 'lens_probs')


def finite(measured: dict) -> dict:
    """measured, each of its numbers finite; else a GPT2Error naming the first measure that is not (finite
    activations can still overflow the norms and variances taken of them, and a damaged ln_f or wte the
    logits), and its first block where it has one per block."""
    for name, value in measured.items():
        bad = ~np.isfinite(value) if np.asarray(value).dtype.kind == 'f' else None
        if bad is not None and bad.any():
            first = int(np.argmax(bad.reshape(len(bad), -1).any(axis=1)))  # per block: the first block's
            where = f' from block h{first} on' if name in PER_BLOCK else ''
            raise GPT2Error(f'{name} is not finite{where} {NOT_FINITE}')
    return measured


def norm_stats(before: np.ndarray, after: np.ndarray) -> np.ndarray:
    """[T, n_embd] x2 -> [T, 4]: each token's feature mean and variance before the norm, then after it."""
    return np.stack([before.mean(-1), before.var(-1), after.mean(-1), after.var(-1)], axis=-1).astype(np.float32)


def mlp_inside(model: Graph, states: list) -> dict:
    """The GELU's input (the block's own c_fc on its recorded second norm's output) per block: range, histogram, near zero."""
    ranges, histograms, near = [], [], []
    for block, state in zip(model.h, states):
        u = block.mlp.c_fc(tf.constant(state['z2']))  # [1, T, 4 n_embd]
        a = gelu(u).numpy()
        u = u.numpy()
        ranges.append([u.min(), u.max()])
        histograms.append(np.histogram(u, bins=BINS, range=(u.min(), u.max()))[0])
        near.append(np.mean(np.abs(a) < NEAR_ZERO))
    return {'gelu_range': np.array(ranges, np.float32), 'gelu_histogram': np.array(histograms, np.int64),
            'near_zero': np.array(near, np.float32)}


def embedding_norms(model: Graph, tokens: np.ndarray, x0: np.ndarray) -> np.ndarray:
    """[T, 3]: |wte[token]|, |wpe[position]| and |x_0| = |wte[token] + wpe[position]| per token."""
    wte = gather(model.wte, model.wte_scale, tokens).numpy()  # int8 rows times their scales
    wpe = tf.convert_to_tensor(model.wpe)[:len(tokens)].numpy().astype(np.float32)
    return np.stack([np.linalg.norm(wte, axis=-1), np.linalg.norm(wpe, axis=-1), np.linalg.norm(x0, axis=-1)], -1)
