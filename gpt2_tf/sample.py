"""Sampling, after openai/gpt-2 src/sample.py: the original filters, and a compiled decode loop.

What is drawn is the original's: softmax(top_p(top_k(logits / temperature)))
with the original filters' semantics. How it is drawn differs:

- Each step's choice is one pure function, `choose`. The filters' kept set is
  a threshold on the logits (`floors`): top_k through tf.math.top_k, top_p by
  bisection over the logit values (exact, no sort). The draw is Gumbel-max over
  the kept set only, so a removed token has probability exactly 0 at any
  temperature.
- Noise comes from integer hashing (SplitMix64) of each row's own key, the
  step and the token id, so a row draws the same tokens whatever else is in
  the batch, and in every mode.
- The loop runs as compiled chunks of `chunk` tokens over a preallocated KV
  cache (gpt2_tf.decoding); the compiled code is shared by every model of a
  shape (gpt2_tf.compiled), and callers get tokens chunk by chunk.
"""

from __future__ import annotations

import secrets
from typing import Iterator, Optional

import numpy as np
import tensorflow as tf

from . import compiled, validate
from .decoding import decode, empty_cache
from .model import Model

MODES = compiled.MODES
DEFAULT_CHUNK = 32  # tokens per compiled call; see BENCHMARKS.md for the overhead against one call
UNIFORM_BITS = 23  # u = (b + 0.5) / 2**23 is exact in float32 and lies in [2**-24, 1 - 2**-24]
TOP_P_MARGIN = 8e-6  # a token whose cumulative probability is this close below top_p is dropped
_TOP_K_SIZES = (64, 256, 1024, 4096, 16384)  # tf.math.top_k compiles per k; these are the sizes it sees


# --- the original filters --------------------------------------------------------------------

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
    token (with its ties) always stays. The original's threshold lacked a
    trailing axis and failed for batch > 1; here it has one.
    """
    logits = tf.convert_to_tensor(logits)
    ordered = tf.sort(logits, direction='DESCENDING', axis=-1)
    cumulative = tf.cumsum(tf.nn.softmax(ordered, axis=-1), axis=-1)
    last = tf.maximum(tf.reduce_sum(tf.cast(cumulative <= p, tf.int32), axis=-1) - 1, 0)  # [batch]
    floor = tf.gather(ordered, last, axis=-1, batch_dims=1)  # [batch]
    return tf.where(logits < floor[:, None], tf.cast(-1e10, logits.dtype), logits)


# --- one step's choice -----------------------------------------------------------------------

def order_keys(x):
    """float32 [...] -> int64 [...] with the same order: the kept sets are thresholds on these."""
    x = tf.where(tf.equal(x, 0), tf.zeros_like(x), x)  # -0.0 ties with 0.0
    bits = tf.bitcast(x, tf.int32)
    return tf.cast(tf.where(bits < 0, tf.bitwise.bitwise_xor(bits, 0x7fffffff), bits), tf.int64)


_BIG = 2**40  # beyond every order key (they fit in 32 bits)


def _bisect(low, high, fits):
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
    first_below = _bisect(tf.reduce_min(keys, axis=-1), tf.reduce_max(keys, axis=-1) + 1, fewer)
    return tf.reduce_max(tf.where(keys < first_below[:, None], keys, -_BIG), axis=-1)


def nucleus_floor(keys, probs, target):
    """The original top-p cut as a threshold: keys, probs [batch, vocab], target [batch] -> floor key [batch].

    Sorted by logit, the original keeps a token when the cumulative probability up
    to and including it is <= p. That is a threshold t: the smallest logit whose
    mass at or above it is <= target, found by bisection over the keys; then the
    next lower logit too when its first token still fits (ties share a logit).
    """
    def mass(t):  # [batch] -> [batch]: probability of the tokens with key >= t
        return tf.reduce_sum(tf.where(keys >= t[:, None], probs, 0.0), axis=-1)

    low = tf.reduce_min(tf.where(probs > 0, keys, _BIG), axis=-1)
    t = _bisect(low, tf.reduce_max(keys, axis=-1) + 1, lambda t: mass(t) <= target)
    t1 = tf.reduce_min(tf.where(keys >= t[:, None], keys, _BIG), axis=-1)  # _BIG: the top alone is over
    t2 = tf.reduce_max(tf.where((keys < t1[:, None]) & (probs > 0), keys, -_BIG), axis=-1)
    p2 = tf.reduce_max(tf.where(tf.equal(keys, t2[:, None]), probs, 0.0), axis=-1)
    floor = tf.where((t2 > -_BIG) & (mass(t1) + p2 <= target), t2, t1)
    return tf.minimum(floor, tf.reduce_max(keys, axis=-1))


def floors(logits, temperature, top_k, top_p, *, kmax):
    """The kept set of top_p(top_k(logits / temperature)) as a threshold: keep order_keys(logits) >= floor.

    logits [batch, vocab]; temperature, top_p float32 [batch] (temperature > 0);
    top_k int32 [batch], 0 for none; kmax (static) >= every top_k in use, 0 if
    none, None when the top_k are known only at run time (then a bisection finds
    the same k-th logit that tf.math.top_k does).
    Returns floor int64 [batch], and z = (logits - max) / temperature [batch, vocab].
    """
    vocab = logits.shape[-1]
    keys = order_keys(logits)
    none = tf.fill(tf.shape(logits)[:1], tf.constant(-_BIG, tf.int64))
    truncating = (top_k > 0) & (top_k < vocab)
    floor_k = none
    if kmax is None:
        floor_k = tf.cond(tf.reduce_any(truncating),
                          lambda: tf.where(truncating, kth_largest(keys, tf.maximum(top_k, 1)), none), lambda: none)
    elif kmax:
        values, _ = tf.math.top_k(logits, k=min(kmax, vocab))
        kth = tf.gather(values, tf.maximum(tf.minimum(top_k, values.shape[-1]) - 1, 0), batch_dims=1)
        floor_k = tf.where(truncating, order_keys(kth), none)
    z = (logits - tf.reduce_max(logits, axis=-1, keepdims=True)) / temperature[:, None]

    def nucleus():
        valid = keys >= floor_k[:, None]
        zv = tf.where(valid, z, -np.inf)
        probs = tf.exp(zv - tf.reduce_logsumexp(zv, axis=-1, keepdims=True))  # 0 outside the top-k set
        return tf.where(top_p < 1, nucleus_floor(keys, probs, top_p - TOP_P_MARGIN), none)

    floor_p = tf.cond(tf.reduce_any(top_p < 1), nucleus, lambda: none)
    return tf.maximum(floor_k, floor_p), z


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # SplitMix64's increment
_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def _mix64(z):
    """SplitMix64's output function: a bijection on uint64 that scrambles every bit."""
    for shift, factor in zip((30, 27), _MIX):
        z = tf.bitwise.bitwise_xor(z, tf.bitwise.right_shift(z, tf.constant(shift, tf.uint64))) * factor
    return tf.bitwise.bitwise_xor(z, tf.bitwise.right_shift(z, tf.constant(31, tf.uint64)))


def uniform_bits(keys, step, tokens):
    """Integers in [0, 2**UNIFORM_BITS), one per (row, token): row i's from its own key and the step alone.

    tokens: the vocabulary size V (every token: [batch, V]) or token ids int32
    [batch, n] (those tokens' integers, the same as in the full row).
    Each (row key, step) seeds a SplitMix64 stream (the generator behind Java's
    SplittableRandom), and token j takes the stream's j-th output. It is integer
    arithmetic only, so XLA, tf.function and eager give the same bits, and one
    op covers the whole batch (a per-row stateless Philox call costs 6x more at batch 8).
    """
    if isinstance(tokens, int):
        tokens = tf.range(tokens)[None]
    keys = tf.bitcast(tf.cast(keys, tf.int64), tf.uint64)  # [batch, 2]
    state = _mix64(_mix64(_mix64(keys[:, 0] + _GOLDEN) + keys[:, 1]) + tf.bitcast(tf.cast(step, tf.int64), tf.uint64))
    counter = tf.cast(tokens, tf.uint64) + 1
    out = _mix64(state[:, None] + counter * _GOLDEN)
    return tf.cast(tf.bitwise.right_shift(out, tf.constant(64 - UNIFORM_BITS, tf.uint64)), tf.int32)


def uniform(bits):
    """Integers in [0, 2**23) -> (b + 0.5) / 2**23: exact in float32, in [2**-24, 1 - 2**-24], never 0 or 1."""
    return (tf.cast(bits, tf.float32) + 0.5) / (1 << UNIFORM_BITS)


def gumbel(keys, step, tokens):
    """Gumbel noise from uniform_bits (same `tokens`): in [-2.81, 16.64], never infinite."""
    return -tf.math.log(-tf.math.log(uniform(uniform_bits(keys, step, tokens))))


def first_argmax(x):
    """[batch, vocab] -> int32 [batch]: the lowest index of each row's maximum, as tf.argmax.

    Written as a max and a min: XLA on CPU runs tf.argmax (a reduction over value
    and index pairs) and whatever is fused into it element by element, 4x slower.
    """
    top = tf.reduce_max(x, axis=-1, keepdims=True)
    ids = tf.range(x.shape[-1], dtype=tf.int32)
    return tf.reduce_min(tf.where(x >= top, ids, x.shape[-1]), axis=-1)


def choose(logits, temperature, top_k, top_p, keys, step, *, kmax: int, greedy: bool = False,
           among_top: bool = False):
    """One step's tokens: logits [batch, vocab] -> int32 [batch].

    Per row: temperature, top_p float32 [batch], top_k int32 [batch], keys int64
    [batch, 2]; step int64 []. A row with temperature 0 or top_k 1 takes the
    argmax (the lowest id among exact ties); greedy=True (static) says every row does.
    among_top=True (static) says every other row has 0 < top_k <= kmax: the draw
    then runs over tf.math.top_k's candidates only, each with the noise it has in
    the full row, so it picks the same token for a fraction of the cost.
    """
    best = first_argmax(logits)
    if greedy:
        return best
    is_greedy = tf.equal(temperature, 0) | tf.equal(top_k, 1)
    floor, z = floors(logits, tf.where(is_greedy, 1.0, temperature), top_k, top_p, kmax=kmax)
    if among_top:
        values, tokens = tf.math.top_k(logits, k=min(kmax, logits.shape[-1]))  # [batch, k]
        z = tf.gather(z, tokens, batch_dims=1)
    else:
        values, tokens = logits, logits.shape[-1]
    noisy = tf.where(order_keys(values) >= floor[:, None], z + gumbel(keys, step, tokens), -np.inf)
    return tf.where(is_greedy, best, _first_best(noisy, tokens))


def _first_best(noisy, tokens):
    """The first_argmax of noisy [batch, n], as a token id: tokens is the vocabulary size (n) or ids [batch, n]."""
    if isinstance(tokens, int):
        return first_argmax(noisy)
    top = tf.reduce_max(noisy, axis=-1, keepdims=True)
    return tf.reduce_min(tf.where(noisy >= top, tokens, tf.int32.max), axis=-1)  # exact ties: the lowest id


# --- the compiled loop -----------------------------------------------------------------------

def _start(model: Model, context, pads, *, size: int):
    """context [batch, P] left-padded by pads [batch] -> the last token's logits [batch, vocab], caches of size slots."""
    return decode(model, context, pads=pads, caches=empty_cache(model, tf.shape(context)[0], size), index=0)


def _advance(model: Model, logits, caches, pads, prompt, step0, length, temperature, top_k, top_p, keys, *,
             chunk, greedy: bool, kmax, among_top: bool = False, logprobs=None):
    """Chooses tokens step0 .. step0 + chunk - 1 (fewer at the end) -> tokens [batch, chunk], logits, caches.

    Token i goes in cache slot prompt + i (the padded prompt fills the first
    slots). Each chosen token is fed back except the sequence's last, as in the
    original. With logprobs=N (static), also the chosen tokens' log-probs
    [batch, chunk] and the N likeliest tokens' ids and log-probs [batch, chunk, N],
    from the model's raw distribution at each step.
    """
    options = dict(kmax=kmax, greedy=greedy, among_top=among_top)
    batch = tf.shape(logits)[0]
    top = logprobs or 0
    out = {'tokens': tf.zeros([chunk, batch], tf.int32), 'log_probs': tf.zeros([chunk, batch]),
           'top_ids': tf.zeros([chunk, batch, top], tf.int32), 'top_log_probs': tf.zeros([chunk, batch, top])}

    def pick(logits, i, out, at, write=None):  # write: a bool tensor; where False the slot keeps its value
        token = choose(logits, temperature, top_k, top_p, keys, tf.cast(i, tf.int64), **options)
        found = {'tokens': token}
        if logprobs is not None:
            lp = tf.nn.log_softmax(logits)  # float32, stable: logits minus their logsumexp
            found['log_probs'] = tf.gather(lp, token, batch_dims=1)
            found['top_log_probs'], found['top_ids'] = tf.math.top_k(lp, k=top)
        for name, value in found.items():
            if write is not None:
                value = tf.where(write, value, out[name][at])
            out[name] = tf.tensor_scatter_nd_update(out[name], [[at]], value[None])
        return token, out

    fed = tf.minimum(chunk, length - 1 - step0)  # steps in this chunk whose token is fed back

    def body(j, logits, caches, out):
        token, out = pick(logits, step0 + j, out, j)
        logits, caches = decode(model, token[:, None], pads=pads, caches=caches, index=prompt + step0 + j)
        return j + 1, logits, caches, out

    _, logits, caches, out = tf.while_loop(lambda j, *_: j < fed, body, [tf.constant(0), logits, caches, out])
    # The sequence's last token, when it falls in this chunk: chosen, never fed.
    _, out = pick(logits, step0 + fed, out, tf.minimum(fed, chunk - 1), write=fed < chunk)
    result = {'tokens': tf.transpose(out['tokens'])}
    if logprobs is not None:
        result.update(log_probs=tf.transpose(out['log_probs']), top_ids=tf.transpose(out['top_ids'], [1, 0, 2]),
                      top_log_probs=tf.transpose(out['top_log_probs'], [1, 0, 2]))
    return result, logits, caches


def bucket(n: int) -> int:
    """The padded size for n: 8, 16, 32, 64, then multiples of 64."""
    if n <= 64:
        return max(8, 1 << (n - 1).bit_length())
    return -(-n // 64) * 64


def top_k_size(top_k: np.ndarray, vocab: int) -> int:
    """The static k for tf.math.top_k that covers every row's top_k (0: no row truncates)."""
    largest = int(max((k for k in top_k if 0 < k < vocab), default=0))
    if not largest:
        return 0
    return next((size for size in _TOP_K_SIZES if size >= largest), vocab)


def truncating(temperature: np.ndarray, top_k: np.ndarray, vocab: int) -> bool:
    """Whether every row that draws at random keeps at most its top_k tokens (choose's among_top)."""
    drawing = (temperature > 0) & (top_k != 1)
    return bool(np.all(~drawing | ((top_k > 0) & (top_k < vocab))))


def row_keys(seed, batch: int) -> np.ndarray:
    """int64 [batch, 2]: one Philox key per row.

    seed: an int s (the pair (s, 0)), a pair p (row i gets fold_in(p, i)), one pair
    per row (used as given), or None (a random pair).
    """
    if seed is None:
        seed = (secrets.randbits(63), secrets.randbits(63))
    validate.check_seed(seed, batch)
    if validate.is_int(seed):
        seed = (seed, 0)
    seed = np.asarray(seed, np.int64)
    if seed.ndim == 2:  # one pair per row
        return seed
    return np.stack([tf.random.experimental.stateless_fold_in(seed, np.int64(i), alg='philox').numpy()
                     for i in range(batch)])


def _prompts(context, start_token, batch_size) -> list:
    """The prompts as a list of lists of ints, one per row."""
    if (context is None) == (start_token is None):
        raise ValueError('give exactly one of context and start_token')
    if batch_size is not None and (not validate.is_int(batch_size) or batch_size < 1):
        raise ValueError(f'batch_size must be a positive integer, got {batch_size!r}')
    if start_token is not None:
        return [[start_token]] * (batch_size or 1)
    if isinstance(context, (tf.Tensor, np.ndarray)):
        context = np.asarray(context).tolist()
    context = list(context)
    if not context or not isinstance(context[0], (list, tuple, np.ndarray)):
        rows = [context] * (batch_size or 1)  # one prompt, repeated
    else:
        rows = [list(row) for row in context]
        if batch_size is not None and batch_size != len(rows):
            raise ValueError(f'batch_size {batch_size} differs from the {len(rows)} prompts in context')
    for row in rows:
        for t in row:
            if not validate.is_int(t):
                raise ValueError(f'token ids must be integers, got {t!r}')
    return [[int(t) for t in row] for row in rows]


class Request:
    """A checked sampling request: padded prompts, per-row options and keys, ready for the loop."""

    def __init__(self, model: Model, length, context, start_token, batch_size, temperature, top_k, top_p,
                 seed, mode: str, chunk: Optional[int], logprobs: Optional[int] = None):
        hp = model.hparams
        self.rows = _prompts(context, start_token, batch_size)
        batch = len(self.rows)
        validate.check_length(length, hp.n_ctx)
        for i, row in enumerate(self.rows):
            if not row:
                raise ValueError(f'prompt {i} is empty; give at least one token, or start_token')
            validate.check_token_ids(row, hp.n_vocab, name=f'prompt {i}: token')
            validate.check_window(len(row), length, hp.n_ctx, what=f'prompt {i}')
        self.temperature, self.top_k, self.top_p = validate.check_sampling(temperature, top_k, top_p, batch)
        self.keys = row_keys(seed, batch)
        mode = mode or compiled.default_mode(model)
        if mode not in MODES:
            raise ValueError(f'mode must be one of {MODES}, got {mode!r}')
        if chunk is not None and (not validate.is_int(chunk) or chunk < 1):
            raise ValueError(f'chunk must be a positive integer, got {chunk!r}')
        if logprobs is not None and (not validate.is_int(logprobs) or not 0 <= logprobs <= 20):
            raise ValueError(f'logprobs must be an integer in [0, 20], got {logprobs!r}')
        self.length, self.mode, self.logprobs = length, mode, logprobs
        self.chunk = min(chunk or DEFAULT_CHUNK, bucket(length))
        self.greedy = bool(np.all((self.temperature == 0) | (self.top_k == 1)))
        self.kmax = 0 if self.greedy else top_k_size(self.top_k, hp.n_vocab)
        self.among_top = truncating(self.temperature, self.top_k, hp.n_vocab)
        prompt = bucket(max(len(row) for row in self.rows))
        self.context = np.zeros([batch, prompt], np.int32)
        self.pads = np.array([prompt - len(row) for row in self.rows], np.int32)
        for i, row in enumerate(self.rows):
            self.context[i, self.pads[i]:] = row
        # Cache slots: the padded prompt, then the fed tokens, rounded up so that nearby lengths share code.
        self.size = prompt + bucket(length)


def _run(model: Model, request: Request) -> Iterator[np.ndarray]:
    start = compiled.shared(_start, model, request.mode)
    advance = compiled.shared(_advance, model, request.mode)
    pads = tf.constant(request.pads)
    logits, caches = start(model, tf.constant(request.context), pads, size=request.size)
    options = [tf.constant(request.temperature), tf.constant(request.top_k), tf.constant(request.top_p),
               tf.constant(request.keys)]
    prompt = tf.constant(request.context.shape[1], tf.int32)
    length = tf.constant(request.length, tf.int32)
    step = 0
    while step < request.length:
        out, logits, caches = advance(model, logits, caches, pads, prompt, tf.constant(step, tf.int32), length,
                                      *options, chunk=request.chunk, greedy=request.greedy, kmax=request.kmax,
                                      among_top=request.among_top,
                                      logprobs=request.logprobs)
        n = min(request.chunk, request.length - step)
        if request.logprobs is None:
            yield out['tokens'].numpy()[:, :n]
        else:
            yield {name: value.numpy()[:, :n] for name, value in out.items()}
        step += n


def sample_chunks(model: Model, length: int, context=None, start_token: Optional[int] = None,
                  batch_size: Optional[int] = None, temperature=1, top_k=0, top_p=1, seed=None, *,
                  mode: Optional[str] = None, chunk: Optional[int] = None, logprobs: Optional[int] = None) -> Iterator:
    """sample_sequence as a generator: yields the new tokens, int32 [batch, n], chunk by chunk.

    Each chunk is one compiled call of `chunk` tokens (DEFAULT_CHUNK by default;
    the last may be shorter). Stop iterating to stop generating. With
    logprobs=N, yields dicts instead: 'tokens', 'log_probs' [batch, n] (the chosen
    tokens' log-probs under the model's raw distribution) and 'top_ids',
    'top_log_probs' [batch, n, N] (the N likeliest tokens at each step).
    Every argument is checked before anything runs.
    """
    request = Request(model, length, context, start_token, batch_size, temperature, top_k, top_p, seed, mode,
                      chunk, logprobs)
    return _run(model, request)


def sample_sequence(model: Model, length: int, context=None, start_token: Optional[int] = None,
                    batch_size: Optional[int] = None, temperature=1, top_k=0, top_p=1, seed=None, *,
                    mode: Optional[str] = None, chunk: Optional[int] = None):
    """Generates `length` tokens after each prompt, as the original sample_sequence does.

    Give exactly one of context (token ids: one prompt, a [batch, T] array, or a
    list of prompts of different lengths) and start_token (with batch_size).
    Returns int32 [batch, T + length], prompts included; for prompts of different
    lengths, a list of one such row each.

    temperature (in [0, 2]; 0 is greedy), top_k (0: none; 1 is greedy) and top_p
    (1: none) are numbers, or one per row. seed: an int, a pair of ints, or one
    pair per row [batch, 2]; a pair p gives row i the key fold_in(p, i), and a row
    draws the same tokens as its key given alone as a one-row seed. None draws a
    random seed. mode: 'xla' (the default for float32 weights), 'function' (the
    default for reduced ones, see compiled.default_mode) or 'eager'; all three
    draw the same tokens. chunk: tokens per compiled call (see sample_chunks).
    """
    request = Request(model, length, context, start_token, batch_size, temperature, top_k, top_p, seed, mode,
                      chunk)
    new = np.concatenate(list(_run(model, request)), axis=1)
    out = [np.concatenate([np.asarray(row, np.int32), new[i]]) for i, row in enumerate(request.rows)]
    if len({len(row) for row in request.rows}) == 1:
        return np.stack(out)
    return out
