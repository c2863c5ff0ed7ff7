"""In-flight batching: a fixed number of decoding slots over one key/value cache, joined and left between chunks.

Each slot holds one row: its rows of the cache, its position, its own options
and key. A joining row's prompt is prefilled alone (sample.begin at batch 1,
padded as it would be alone) and written into its slot; every chunk then
decodes all slots at once, each at its own cache slots (decoding.decode with
one index per row), and a finished row's slot takes the next waiting row at the
next chunk. A row draws the tokens it would draw alone with the same key: the
noise reads its own step count, and its attention sees only its own slots.

    slots = Slots(model, 8, chunk=8)
    slots.join(0, prompt, length=64, key=(1, 2), temperature=0.8)
    out = slots.step()            # {'tokens': int32 [8, chunk]}: each slot's next tokens
    slots.leave(0)
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import tensorflow as tf

from . import compiled, penalties, validate
from .compiled import BUCKET_STEP, bucket
from .sample import DECODER, Decoder, Options, Plan, _outputs, _pick, begin, plan_for

MIN_CACHE = 64  # cache slots at least; sizes are powers of two, so the compiled step sees a handful


def cache_size(need: int, n_ctx: int) -> int:
    """The cache slots for rows that need `need`: a power of two, at least MIN_CACHE, and at most n_ctx +
    BUCKET_STEP. A row needs its window (at most n_ctx) and its prompt's padding (under BUCKET_STEP), so a
    row that fills the window takes a few slots past n_ctx, not twice the cache."""
    return max(MIN_CACHE, min(1 << (need - 1).bit_length(), n_ctx + BUCKET_STEP))


def decode_slots(model, logits, caches, *, pads, pos, made, options: Options, plan: Plan,
                 decoder: Decoder = DECODER, state=()):
    """plan.chunk tokens for every slot -> outputs [slots, chunk], logits, caches, state.

    logits [slots, vocab] are each slot's next-token logits; slot b chooses its
    tokens made[b] .. made[b] + chunk - 1 and feeds token j at cache slot
    pos[b] + j (at most the last slot: an idle or finished row writes only into
    its own rows of the cache, which no other row sees). state: the penalties'
    (counts, seen) when plan.penalized, else ().
    """
    size = caches[0].shape[3]

    def body(j, logits, caches, out, state):
        token, out, state = _pick(logits, made + j, out, j, options=options, plan=plan, state=state)
        index = tf.minimum(pos + j, size - 1)
        logits, caches = decoder.step(model, token[:, None], pads=pads, caches=caches, index=index)
        return j + 1, logits, caches, out, state

    start = [tf.constant(0), logits, caches, _outputs(plan, tf.shape(logits)[0]), tuple(state)]
    _, logits, caches, out, state = tf.while_loop(lambda j, *_: j < plan.chunk, body, start)
    by_row = {name: tf.transpose(value, [1, 0] + list(range(2, value.shape.rank))) for name, value in out.items()}
    return by_row, logits, caches, state


def fit(x, axis: int, n: int):
    """x cut or zero-padded to n along axis."""
    have = x.shape[axis]
    if n <= have:
        return tf.gather(x, tf.range(n), axis=axis)
    return tf.pad(x, [[0, 0]] * axis + [[0, n - have]] + [[0, 0]] * (x.shape.rank - axis - 1))


class Slots:
    """`slots` decoding rows over one cache; rows join and leave between steps (see the module's docstring).

    mode: sample_sequence's ('xla' for float32 weights by default). Every step
    decodes `chunk` tokens for the first `width` slots, up to the highest one
    a row holds, idle ones among them included.
    """

    def __init__(self, model, slots: int, *, chunk: int, mode: Optional[str] = None, decoder: Decoder = DECODER):
        self.model, self.slots, self.chunk, self.decoder = model, slots, chunk, decoder
        mode = mode or compiled.default_mode(model)
        self._begin, self._decode = compiled.shared(begin, model, mode), compiled.shared(decode_slots, model, mode)
        self.occupied = np.zeros(slots, bool)
        self.pads, self.pos, self.made, self.need = (np.zeros(slots, np.int32) for _ in range(4))
        self.temperature, self.top_p = np.zeros(slots, np.float32), np.ones(slots, np.float32)
        self.top_k, self.keys = np.zeros(slots, np.int32), np.zeros([slots, 2], np.int64)
        vocab = model.hparams.n_vocab
        self.logits = self.caches = None  # for the first `width` slots, the ones that decode (see _resize)
        self.penalized = np.zeros(slots, bool)  # rows with penalties; the others' are neutral
        self.penalties = penalties.neutral(slots, vocab)
        self.counts, self.seen = penalties.start_state([[]] * slots, vocab)

    def free(self) -> list:
        """The slots no row holds."""
        return [int(b) for b in np.flatnonzero(~self.occupied)]

    def join(self, slot: int, prompt: list, *, length: int, key, temperature=1.0, top_k=0, top_p=1.0,
             **penalty) -> None:
        """Prefills prompt into `slot` for `length` new tokens drawn with `key` (a pair: the row's own key).
        Every option is checked, and the prefill run, before the slot changes: a join that fails leaves it free.

        penalty: penalties.penalties_for's logit_bias, presence_penalty, frequency_penalty, repetition_penalty.
        """
        hp = self.model.hparams
        prompt = self._check_prompt(slot, prompt)
        validate.check_length(length, hp.n_ctx)
        validate.check_window(len(prompt), length, hp.n_ctx)
        (temperature,), (top_k,), (top_p,) = validate.check_sampling(temperature, top_k, top_p, 1)
        validate.check_seed(key, 1)
        if np.shape(key) not in ((2,), (1, 2)):
            raise validate.GPT2Error(f'key must be a pair of integers (noise.row_keys(seed, 1), or one of its '
                                     f'rows), got shape {list(np.shape(key))}')
        key = np.reshape(np.asarray(key, np.int64), 2)
        found = penalties.penalties_for(1, hp.n_vocab, **penalty)
        padded = bucket(len(prompt))
        context = np.zeros([1, padded], np.int32)
        context[0, padded - len(prompt):] = prompt
        pads = np.array([padded - len(prompt)], np.int32)
        logits, caches = self._begin(self.model, tf.constant(context), pads=tf.constant(pads), size=padded,
                                     decoder=self.decoder)
        try:
            self._set_penalties(slot, prompt, found)
            self.need[slot] = padded + length  # the prompt's slots, then every token fed
            self.occupied[slot] = True
            self._resize()
            at = tf.constant([[slot]])
            self.caches = [tf.tensor_scatter_nd_update(big, at, fit(row, 3, big.shape[3]))
                           for big, row in zip(self.caches, caches)]
            self.logits = tf.tensor_scatter_nd_update(self.logits, at, logits)
        except BaseException:
            self.leave(slot)
            raise
        self.pads[slot], self.pos[slot], self.made[slot] = pads[0], padded, 0
        self.temperature[slot], self.top_k[slot], self.top_p[slot] = temperature, top_k, top_p
        self.keys[slot] = key

    def _check_prompt(self, slot, prompt) -> list:
        """prompt as a list of ids once slot is a free slot and prompt one row of at least one id of the
        vocabulary."""
        if not validate.is_int(slot) or not 0 <= slot < self.slots:
            raise validate.GPT2Error(f'slot must be an integer in [0, {self.slots}), got {validate.shown(slot)}')
        if self.occupied[slot]:
            raise validate.GPT2Error(f'slot {slot} is taken: join one of free(), or leave({slot}) first')
        ids = validate.token_array(prompt, name='the prompt')
        if ids.ndim != 1 or ids.size == 0:
            raise validate.GPT2Error(f'the prompt must be one row of at least one token id, got shape {list(ids.shape)}')
        validate.check_token_ids(ids, self.model.hparams.n_vocab, name="the prompt's token")
        return ids.tolist()

    def _set_penalties(self, slot: int, prompt: list, found: Optional[penalties.Penalties]) -> None:
        self.penalized[slot] = found is not None
        row = found or penalties.neutral(1, self.model.hparams.n_vocab)
        for mine, theirs in zip(self.penalties, row):
            mine[slot] = theirs[0]
        counts, seen = penalties.start_state([prompt], self.model.hparams.n_vocab)
        self.counts[slot], self.seen[slot] = counts[0], seen[0]

    def leave(self, slot: int) -> None:
        self.occupied[slot] = False
        self.penalized[slot] = False
        self.need[slot] = 0
        self.temperature[slot], self.top_k[slot], self.top_p[slot] = 0, 0, 1  # an idle slot is greedy: cheapest

    @property
    def width(self) -> int:
        """How many slots decode: the first ones, up to the highest a row holds, in powers of two."""
        return 0 if self.caches is None else self.caches[0].shape[0]

    def step(self, logprobs: Optional[int] = None) -> dict:
        """Decodes one chunk for the first `width` slots -> {'tokens': int32 [width, chunk]} (numpy), and with
        logprobs=N also 'log_probs' [width, chunk] and 'top_ids', 'top_log_probs' [width, chunk, N]."""
        if not self.occupied.any():
            raise validate.GPT2Error('no slot holds a row; join one first')
        self._resize()
        plan, w = self.plan(logprobs), self.width
        state = (tf.constant(self.counts[:w]), tf.constant(self.seen[:w])) if plan.penalized else ()
        where = dict(pads=self.pads[:w], pos=self.pos[:w], made=self.made[:w])
        out, self.logits, self.caches, state = self._decode(
            self.model, self.logits, self.caches, options=self.options(), plan=plan, decoder=self.decoder,
            state=state, **{name: tf.constant(value) for name, value in where.items()})
        if plan.penalized:
            self.counts[:w] = state[0].numpy()
        self.pos += self.chunk
        self.made += self.chunk
        return {name: value.numpy() for name, value in out.items()}

    def plan(self, logprobs: Optional[int]) -> Plan:
        """The static plan for the rows the slots hold now."""
        rows = self.occupied
        return plan_for(self.temperature[rows], self.top_k[rows], self.model.hparams.n_vocab, chunk=self.chunk,
                        logprobs=logprobs, penalized=bool(self.penalized[rows].any()))

    def options(self) -> Options:
        """Every slot's options as tensors; the penalties only when some row has them."""
        w = self.width
        found = None
        if self.penalized[self.occupied].any():
            found = penalties.Penalties(*(tf.constant(x[:w]) for x in self.penalties))
        return Options(*(tf.constant(x[:w]) for x in (self.temperature, self.top_k, self.top_p, self.keys)),
                       penalties=found)

    def _resize(self) -> None:
        """Sizes the cache for the rows it holds: as many rows as `width`, as many slots as the longest row
        needs (powers of two), grown when a row joins and shrunk once rows leave."""
        held = np.flatnonzero(self.occupied)
        width = min(1 << int(held.max()).bit_length(), self.slots) if held.size else 1
        size = cache_size(int(self.need.max()), self.model.hparams.n_ctx)
        if self.caches is None:
            self.caches = self.decoder.cache(self.model, width, size)
            self.logits = tf.zeros([width, self.model.hparams.n_vocab])
            return
        rows, now = self.caches[0].shape[0], self.caches[0].shape[3]
        if width != rows:
            self.caches = [fit(c, 0, width) for c in self.caches]
            self.logits = fit(self.logits, 0, width)
        if size != now:
            self.caches = [fit(c, 3, size) for c in self.caches]
