"""Sampling, after openai/gpt-2 src/sample.py: one step's choice, and a compiled decode loop.

What is drawn is the original's: softmax(top_p(top_k(logits / temperature)))
with the original filters' semantics (gpt2_tf.filters, whose top_k_logits and
top_p_logits this module re-exports), over the logits after any penalties
(gpt2_tf.penalties: repetition, frequency and presence, logit_bias; none set,
the loop is today's exactly). How it is drawn differs:

- Each step's choice is one pure function, `choose`. The filters' kept set is
  a threshold on the logits (gpt2_tf.thresholds), and the draw is Gumbel-max
  over the kept set only, so a removed token has probability exactly 0 at any
  temperature. The noise (gpt2_tf.noise) hashes each row's own key, the step
  and the token id, so a row draws the same tokens whatever else is in the
  batch, and in every mode.
- The loop runs as compiled chunks of `chunk` tokens. It calls the model
  through a Decoder, an argument: by default gpt2_tf.decoding's step over a
  preallocated KV cache; a fake one tests the loop without a model. The
  compiled code is shared by every model of a shape (gpt2_tf.compiled), and
  callers get tokens chunk by chunk.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, NamedTuple, Optional

import numpy as np
import tensorflow as tf

from . import compiled, penalties, validate
from .compiled import bucket
from .decoding import decode, empty_cache
from .filters import top_k_logits, top_p_logits  # noqa: F401  the original's filters, under their own names
from .noise import gumbel, row_keys
from .thresholds import floors, order_keys
from .validate import GPT2Error

MODES = compiled.MODES
DEFAULT_CHUNK = 32  # tokens per compiled call; see BENCHMARKS.md for the overhead against one call
_TOP_K_SIZES = (64, 256, 1024, 4096, 16384)  # tf.math.top_k compiles per k; these are the sizes it sees


# --- one step's choice -----------------------------------------------------------------------

def first_argmax(x):
    """[batch, vocab] -> int32 [batch]: the lowest index of each row's maximum, as tf.argmax.

    Written as a max and a min: XLA on CPU runs tf.argmax (a reduction over value
    and index pairs) and whatever is fused into it element by element, 4x slower.
    """
    top = tf.reduce_max(x, axis=-1, keepdims=True)
    ids = tf.range(x.shape[-1], dtype=tf.int32)
    return tf.reduce_min(tf.where(x >= top, ids, x.shape[-1]), axis=-1)


def _first_best(noisy, tokens):
    """The first_argmax of noisy [batch, n], as a token id: tokens is the vocabulary size (n) or ids [batch, n]."""
    if isinstance(tokens, int):
        return first_argmax(noisy)
    top = tf.reduce_max(noisy, axis=-1, keepdims=True)
    return tf.reduce_min(tf.where(noisy >= top, tokens, tf.int32.max), axis=-1)  # exact ties: the lowest id


def choose(logits, temperature, top_k, top_p, keys, step, *, kmax: int, greedy: bool = False,
           among_top: bool = False):
    """One step's tokens: logits [batch, vocab] -> int32 [batch].

    Per row: temperature, top_p float32 [batch], top_k int32 [batch], keys int64
    [batch, 2]; step int64 []. A row with temperature 0 or top_k 1 takes the
    argmax (the lowest id among exact ties); greedy=True (static) says every row does.
    kmax (static) is how many of tf.math.top_k's candidates the filters look at,
    past every drawing row's top_k (thresholds.floors; 0: none; None: top_k known
    only at run time). among_top=True (static) says every other
    row has 0 < top_k < kmax: the draw then runs over the candidates only, each
    with the noise it has in the full row, so it picks the same token for a
    fraction of the cost (over the full row where exact ties at a row's k-th
    logit reach the last candidate).
    """
    best = first_argmax(logits)
    if greedy:
        return best
    is_greedy = tf.equal(temperature, 0) | tf.equal(top_k, 1)
    vocab = logits.shape[-1]
    top = tf.math.top_k(logits, k=min(kmax, vocab)) if kmax else None  # [batch, kmax] each: the candidates
    floor, z = floors(logits, tf.where(is_greedy, 1.0, temperature), top_k, tf.where(is_greedy, 1.0, top_p),
                      kmax=kmax, top=top)

    def draw(values, tokens, z):  # the noisiest kept token
        noisy = tf.where(order_keys(values) >= floor[:, None], z + gumbel(keys, step, tokens), -np.inf)
        return _first_best(noisy, tokens)

    full = lambda: draw(logits, vocab, z)  # noqa: E731
    if not among_top or kmax >= vocab:
        return tf.where(is_greedy, best, full())
    values, ids = top
    # Exact ties at a row's k-th logit, all of which top_k keeps, can reach the last candidate and run past it:
    # then every row draws over its full row (the same token wherever nothing was cut). The last candidate by
    # reduce_min, not a slice: XLA sorts the whole row where top_k's values are sliced other than to their first k.
    past = tf.reduce_any(~is_greedy & (order_keys(tf.reduce_min(values, axis=-1)) >= floor))
    chosen = tf.cond(past, full, lambda: draw(values, ids, tf.gather(z, ids, batch_dims=1)))
    return tf.where(is_greedy, best, chosen)


# --- the compiled loop -----------------------------------------------------------------------

class Decoder(NamedTuple):
    """How the loop calls the model, after keras-hub's samplers' `next(prompt, cache, index)`.

    step(model, X [batch, n], *, pads, caches, index) -> (the last token's logits
    [batch, n_vocab], caches), X at cache slots index .. index + n - 1;
    cache(model, batch, size) -> the empty caches to start from.
    """
    step: Callable = decode
    cache: Callable = empty_cache


DECODER = Decoder()  # the model's own cached decode


class Options(NamedTuple):
    """Each row's sampling options as tensors, what `choose` reads per row."""
    temperature: Any  # float32 [batch]; 0 is greedy
    top_k: Any  # int32 [batch]; 0 for none, 1 is greedy
    top_p: Any  # float32 [batch]; 1 for none
    keys: Any  # int64 [batch, 2]: each row's noise key (noise.row_keys)
    penalties: Any = None  # penalties.Penalties as tensors, when the plan is penalized


class Plan(NamedTuple):
    """What shapes the compiled loop; Python values (each new one traces anew), chunk a tensor in a signature."""
    chunk: Any  # tokens chosen per call
    greedy: bool = False  # every row takes the argmax
    kmax: Optional[int] = 0  # tf.math.top_k's candidates, past every drawing row's top_k; 0: none truncates;
    # None: the top_k are known only at run time
    among_top: bool = False  # every drawing row keeps at most kmax tokens (see choose)
    logprobs: Optional[int] = None  # N: also the chosen tokens' log-probs and the N likeliest tokens'
    penalized: bool = False  # the rows' logits go through penalties.penalize (options.penalties, the state)


def begin(model, context, *, pads, size, decoder: Decoder = DECODER):
    """context [batch, P] left-padded by pads [batch] -> the last token's logits [batch, vocab], caches of `size`
    slots, the prompt in the first P."""
    return decoder.step(model, context, pads=pads, caches=decoder.cache(model, tf.shape(context)[0], size), index=0)


def _outputs(plan: Plan, batch) -> dict:
    """Zeroed outputs, step-major: tokens [chunk, batch]; with logprobs=N, the log-probs too."""
    out = {'tokens': tf.zeros([plan.chunk, batch], tf.int32)}
    if plan.logprobs is not None:
        top = [plan.chunk, batch, plan.logprobs]
        out.update(log_probs=tf.zeros([plan.chunk, batch]), top_ids=tf.zeros(top, tf.int32), top_log_probs=tf.zeros(top))
    return out


def _pick(logits, step, out: dict, at, *, options: Options, plan: Plan, state=(), write=None):
    """Chooses step's tokens from logits [batch, vocab] and records them at out[name][at] -> tokens, out, state.

    write: a bool tensor; where False, out and state keep their values. state: (counts, seen) when
    plan.penalized (see penalties.start_state), else ().
    """
    drawn = penalties.penalize(logits, *state, options.penalties) if plan.penalized else logits
    token = choose(drawn, options.temperature, options.top_k, options.top_p, options.keys, tf.cast(step, tf.int64),
                   kmax=plan.kmax, greedy=plan.greedy, among_top=plan.among_top)
    # A row holding a NaN or +inf logit gets an id past the vocabulary, which the caller refuses (check_drawn):
    # the filters' arithmetic on it is NaN, and XLA's max on a CPU skips NaN, so it would draw something.
    broken = tf.reduce_any(tf.logical_not(logits < np.inf), axis=-1)
    found = {'tokens': tf.where(broken, logits.shape[-1], token)}
    token = tf.minimum(token, logits.shape[-1] - 1)  # ... and the loop goes on with a real id meanwhile
    if plan.logprobs is not None:
        lp = tf.nn.log_softmax(logits)  # float32, stable: logits minus their logsumexp
        found['log_probs'] = tf.gather(lp, token, batch_dims=1)
        found['top_log_probs'], found['top_ids'] = tf.math.top_k(lp, k=plan.logprobs)
    out = dict(out)
    for name, value in found.items():
        if write is not None:
            value = tf.where(write, value, tf.gather(out[name], at))
        out[name] = tf.tensor_scatter_nd_update(out[name], [[at]], value[None])
    if plan.penalized:
        counts = penalties.record(state[0], token)
        state = (counts if write is None else tf.where(write, counts, state[0]), state[1])
    return token, out, state


def advance(model, logits, caches, *, pads, prompt, done, length, options: Options, plan: Plan,
            decoder: Decoder = DECODER, state=()):
    """Chooses tokens done .. done + chunk - 1 (fewer at the end) -> outputs, logits, caches (and state).

    logits [batch, vocab] are the model's after the last token fed; prompt is the
    padded prompt's length (it fills the first cache slots, and token i goes in
    slot prompt + i); length the tokens wanted in all. Each chosen token is fed
    back except the sequence's last, as in the original. outputs: 'tokens'
    [batch, chunk]; with plan.logprobs = N also 'log_probs' [batch, chunk] and
    'top_ids', 'top_log_probs' [batch, chunk, N], from the model's raw
    distribution at each step (before any penalty, temperature or filter).
    With plan.penalized, state is (counts, seen) as penalties.start_state makes
    it, and comes back after the chunk's tokens, to pass to the next chunk.
    """
    pick = dict(options=options, plan=plan)
    fed = tf.minimum(plan.chunk, length - 1 - done)  # steps in this chunk whose token is fed back

    def body(j, logits, caches, out, state):
        token, out, state = _pick(logits, done + j, out, j, state=state, **pick)
        logits, caches = decoder.step(model, token[:, None], pads=pads, caches=caches, index=prompt + done + j)
        return j + 1, logits, caches, out, state

    start = [tf.constant(0), logits, caches, _outputs(plan, tf.shape(logits)[0]), tuple(state)]
    _, logits, caches, out, state = tf.while_loop(lambda j, *_: j < fed, body, start)
    # The sequence's last token, when it falls in this chunk: chosen, never fed.
    _, out, state = _pick(logits, done + fed, out, tf.minimum(fed, plan.chunk - 1), state=state,
                          write=fed < plan.chunk, **pick)
    by_row = {name: tf.transpose(value, [1, 0] + list(range(2, value.shape.rank))) for name, value in out.items()}
    return (by_row, logits, caches) + ((state,) if plan.penalized else ())


# --- requests --------------------------------------------------------------------------------

def top_k_size(top_k: np.ndarray, vocab: int) -> int:
    """The static k for tf.math.top_k past every row's top_k (0: no row truncates): its last candidate is kept
    only where logits tie at a row's k-th (choose then draws over the full row)."""
    largest = int(max((k for k in top_k if 0 < k < vocab), default=0))
    if not largest:
        return 0
    return next((size for size in _TOP_K_SIZES if size > largest), vocab)


def _drawing(temperature: np.ndarray, top_k: np.ndarray) -> np.ndarray:
    """Per row: whether it draws at random (a row with temperature 0 or top_k 1 takes the argmax)."""
    return (temperature > 0) & (top_k != 1)


def truncating(temperature: np.ndarray, top_k: np.ndarray, vocab: int) -> bool:
    """Whether every row that draws at random keeps at most its top_k tokens (choose's among_top)."""
    return bool(np.all(~_drawing(temperature, top_k) | ((top_k > 0) & (top_k < vocab))))


def plan_for(temperature: np.ndarray, top_k: np.ndarray, vocab: int, *, chunk: int, logprobs=None,
             penalized: bool = False) -> Plan:
    """The static plan for rows with these options (the candidates past the drawing rows' top_k only: a greedy
    row's is not looked at)."""
    greedy = bool(np.all((temperature == 0) | (top_k == 1)))
    kmax = 0 if greedy else top_k_size(top_k[_drawing(temperature, top_k)], vocab)
    return Plan(chunk=chunk, greedy=greedy, kmax=kmax, among_top=truncating(temperature, top_k, vocab),
                logprobs=logprobs, penalized=penalized)


def _prompts(context, start_token, batch_size) -> list:
    """The prompts as a list of lists of ints, one per row."""
    if (context is None) == (start_token is None):
        raise GPT2Error('give exactly one of context and start_token')
    if batch_size is not None and (not validate.is_int(batch_size) or batch_size < 1):
        raise GPT2Error(f'batch_size must be a positive integer, got {validate.shown(batch_size)}')
    if start_token is not None:
        if not validate.is_int(start_token):
            raise GPT2Error(f'start_token must be an integer token id, got {validate.shown(start_token)}')
        return [[int(start_token)]] * (batch_size or 1)
    if isinstance(context, str):
        validate.token_array(context, name='context')  # refuses text, saying to encode it first
    if isinstance(context, (tf.Tensor, np.ndarray, np.generic)):
        context = np.asarray(context).tolist()
    if not isinstance(context, (list, tuple)):
        raise GPT2Error(f'context must be a list of token ids, or one list per row, got {validate.shown(context)}')
    is_row = [isinstance(row, (list, tuple, np.ndarray)) for row in context]
    if any(is_row) and not all(is_row):
        raise GPT2Error('context mixes token ids and lists of them: give one list of ids, or one list per row')
    if not any(is_row):
        rows = [list(context)] * (batch_size or 1)  # one prompt, repeated
    else:
        rows = [list(row) for row in context]
        if batch_size is not None and batch_size != len(rows):
            raise GPT2Error(f'batch_size {batch_size} differs from the {len(rows)} prompts in context')
    for row in rows:
        for t in row:
            if not validate.is_int(t):
                raise GPT2Error(f'token ids must be integers, got {validate.shown(t)}')
    return [[int(t) for t in row] for row in rows]


def _check_loop_options(mode, chunk, logprobs, n_vocab: int) -> None:
    if mode not in MODES:
        raise GPT2Error(f'mode must be one of {MODES}, got {validate.shown(mode)}')
    if chunk is not None and (not validate.is_int(chunk) or chunk < 1):
        raise GPT2Error(f'chunk must be a positive integer, got {validate.shown(chunk)}')
    most = min(20, n_vocab)
    if logprobs is not None and (not validate.is_int(logprobs) or not 0 <= logprobs <= most):
        raise GPT2Error(f'logprobs must be an integer in [0, {most}], got {validate.shown(logprobs)}'
                        + (f' (the vocabulary has {n_vocab} tokens)' if most < 20 else ''))


class Request:
    """A checked sampling request: padded prompts, per-row options and keys, and the plan, ready for the loop."""

    def __init__(self, model, length, context, start_token, batch_size, temperature, top_k, top_p,
                 seed, mode: Optional[str], chunk: Optional[int], logprobs: Optional[int] = None, **penalty):
        hp = model.hparams
        self.rows = _prompts(context, start_token, batch_size)
        validate.check_length(length, hp.n_ctx)
        for i, row in enumerate(self.rows):
            if not row:
                raise GPT2Error(f'prompt {i} is empty; give at least one token, or start_token')
            validate.check_token_ids(row, hp.n_vocab, name=f'prompt {i}: token')
            validate.check_window(len(row), length, hp.n_ctx, what=f'prompt {i}')
        self.temperature, self.top_k, self.top_p = validate.check_sampling(temperature, top_k, top_p, len(self.rows))
        self.keys = row_keys(seed, len(self.rows))
        self.penalties = penalties.penalties_for(len(self.rows), hp.n_vocab, **penalty)  # None: none set
        self.length, self.mode = length, mode or compiled.default_mode(model)
        _check_loop_options(self.mode, chunk, logprobs, hp.n_vocab)
        self.plan = plan_for(self.temperature, self.top_k, hp.n_vocab,
                             chunk=min(chunk or DEFAULT_CHUNK, bucket(length)), logprobs=logprobs,
                             penalized=self.penalties is not None)
        prompt = bucket(max(len(row) for row in self.rows))
        self.pads = np.array([prompt - len(row) for row in self.rows], np.int32)
        self.context = np.zeros([len(self.rows), prompt], np.int32)
        for i, row in enumerate(self.rows):
            self.context[i, self.pads[i]:] = row
        # Cache slots: the padded prompt, then the fed tokens, rounded up so that nearby lengths share code.
        self.size = prompt + bucket(length)

    def options(self) -> Options:
        tensors = [tf.constant(x) for x in (self.temperature, self.top_k, self.top_p, self.keys)]
        if self.penalties is None:
            return Options(*tensors)
        return Options(*tensors, penalties=penalties.Penalties(*(tf.constant(x) for x in self.penalties)))

    def state(self) -> dict:
        """advance's state argument: {} unpenalized, else {'state': (counts, seen)} before the first token."""
        if self.penalties is None:
            return {}
        return {'state': tuple(tf.constant(x) for x in penalties.start_state(self.rows, self.penalties.bias.shape[1]))}


def run(model, request: Request, *, decoder: Decoder = DECODER) -> Iterator:
    """The loop over a checked request: yields tokens int32 [batch, n] (dicts with logprobs), chunk by chunk."""
    first, then = (compiled.shared(fn, model, request.mode) for fn in (begin, advance))
    pads, options, chunk = tf.constant(request.pads), request.options(), request.plan.chunk
    logits, caches = first(model, tf.constant(request.context), pads=pads, size=request.size, decoder=decoder)
    loop = dict(pads=pads, prompt=tf.constant(request.context.shape[1], tf.int32), options=options,
                length=tf.constant(request.length, tf.int32), plan=request.plan, decoder=decoder)
    state = request.state()
    done = 0
    while done < request.length:
        out, logits, caches, *carried = then(model, logits, caches, done=tf.constant(done, tf.int32), **loop, **state)
        state = {'state': carried[0]} if carried else {}
        n = min(chunk, request.length - done)
        tokens = out['tokens'].numpy()[:, :n]
        validate.check_drawn(tokens, model.hparams.n_vocab)
        if request.plan.logprobs is None:
            yield tokens
        else:
            yield {name: value.numpy()[:, :n] for name, value in out.items()}
        done += n


def sample_chunks(model, length: int, context=None, start_token: Optional[int] = None,
                  batch_size: Optional[int] = None, temperature=1, top_k=0, top_p=1, seed=None, *,
                  mode: Optional[str] = None, chunk: Optional[int] = None, logprobs: Optional[int] = None,
                  decoder: Decoder = DECODER, logit_bias=None, presence_penalty=0, frequency_penalty=0,
                  repetition_penalty=1) -> Iterator:
    """sample_sequence as a generator: yields the new tokens, int32 [batch, n], chunk by chunk.

    Each chunk is one compiled call of `chunk` tokens (DEFAULT_CHUNK by default;
    the last may be shorter). Stop iterating to stop generating. With
    logprobs=N, yields dicts instead: 'tokens', 'log_probs' [batch, n] (the chosen
    tokens' log-probs under the model's raw distribution) and 'top_ids',
    'top_log_probs' [batch, n, N] (the N likeliest tokens at each step), before
    any penalty. The penalties are sample_sequence's. Every argument is checked
    before anything runs.
    """
    request = Request(model, length, context, start_token, batch_size, temperature, top_k, top_p, seed, mode,
                      chunk, logprobs, logit_bias=logit_bias, presence_penalty=presence_penalty,
                      frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty)
    return run(model, request, decoder=decoder)


def sample_sequence(model, length: int, context=None, start_token: Optional[int] = None,
                    batch_size: Optional[int] = None, temperature=1, top_k=0, top_p=1, seed=None, *,
                    mode: Optional[str] = None, chunk: Optional[int] = None, decoder: Decoder = DECODER,
                    logit_bias=None, presence_penalty=0, frequency_penalty=0, repetition_penalty=1):
    """Generates `length` tokens after each prompt, as the original sample_sequence does.

    Give exactly one of context (token ids: one prompt, a [batch, T] array, or a
    list of prompts of different lengths) and start_token (with batch_size).
    Returns int32 [batch, T + length], prompts included; for prompts of different
    lengths, a list of one such row each.

    temperature (in [0, 2]; 0 is greedy), top_k (0: none; 1 is greedy) and top_p
    (1: none) are numbers, or one per row. seed: an int, a pair of ints, or one
    pair per row [batch, 2]; a pair p gives row i the key fold_in(p, i), and a row
    draws the same tokens as its key given alone as a one-row seed. None draws a
    random seed. mode: 'xla' (the default for float32 weights, and for int8 ones
    where the int8 kernel compiles under XLA), 'function' (the default for
    bfloat16 and float16, see compiled.default_mode) or 'eager'; all three
    draw the same tokens. chunk: tokens per compiled call (see sample_chunks).
    decoder: how the loop calls the model (see Decoder); the model's own by default.

    Penalties (gpt2_tf.penalties; applied in this order, before temperature and
    the filters): repetition_penalty (in [0.01, 100], 1 none: HF's rule over the prompt and
    the generated tokens), frequency_penalty and presence_penalty (in [-2, 2], 0
    none: OpenAI's formula over the generated tokens), logit_bias (a dict
    {token id: bias in [-100, 100]}, -100 bans and 100 forces). Each is a number
    or one per row (logit_bias: one dict, or a list of one dict or None per row).
    """
    request = Request(model, length, context, start_token, batch_size, temperature, top_k, top_p, seed, mode,
                      chunk, logit_bias=logit_bias, presence_penalty=presence_penalty,
                      frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty)
    new = np.concatenate(list(run(model, request, decoder=decoder)), axis=1)
    out = [np.concatenate([np.asarray(row, np.int32), new[i]]) for i, row in enumerate(request.rows)]
    if len({len(row) for row in request.rows}) == 1:
        return np.stack(out)
    return out
