"""Scheduling: the Batcher runs every row (each prompt times n) in a slot of one in-flight batch (gpt2_tf.slots).

Between chunks, finished rows leave and waiting rows join, so no row waits for
another to finish while a slot is free; when every slot is held, a freed slot
goes to the request that holds the fewest, so one request's many rows do not
keep later requests waiting round after round. A row carries its own options
and key, so it draws the tokens it would draw alone, whatever else runs beside
it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import List, Optional

from ..sample import DECODER, Decoder
from ..slots import Slots
from ..validate import GPT2Error, check_drawn, check_window, first_line
from .protocol import MAX_LOGPROBS, APIError

LOG = logging.getLogger(__name__)  # a failed chunk's or prefill's traceback: the client gets its one line
STREAM_CHUNK = 8  # tokens per compiled call: the first text of a stream arrives early
SHUTTING_DOWN = 'the server is shutting down'  # what rows left when the Batcher closes fail with


def shutting_down() -> APIError:
    """The 503 of a request the server no longer takes (a new one, or a body still coming as it stops)."""
    return APIError(503, f'{SHUTTING_DOWN}; retry on another', kind='server_error', code='shutting_down')


def cut_short() -> APIError:
    """The 500 of a request the server stopped before it ended (its drain over, or a second Ctrl-C)."""
    return APIError(500, f'generation failed: {SHUTTING_DOWN}', kind='server_error')


PENALTIES = ('logit_bias', 'presence_penalty', 'frequency_penalty', 'repetition_penalty')  # Slots.join's names


class Row:
    """One choice of one request: a prompt, its options, and where its tokens go.

    deliver(tokens, log_probs) takes each chunk, then deliver(None, None) ends the
    row; deliver(None, None, error=message) fails it. done: finished, or its
    client went away (set by either side); a running row then leaves its slot
    at the next chunk.
    """

    def __init__(self, prompt: list, max_tokens: int, options: dict, key, logprobs: Optional[int], deliver):
        self.prompt, self.max_tokens, self.options, self.key = prompt, max_tokens, options, key
        self.logprobs, self.deliver = logprobs, deliver
        self.done = False
        self.sent = 0  # tokens delivered
        self.request = None  # the rows submitted with it share it (Batcher.submit)

    def fail(self, message: str) -> None:
        self.done = True
        self.deliver(None, None, error=message)

    def join(self, slots: Slots, slot: int) -> None:
        options = self.options
        slots.join(slot, self.prompt, length=self.max_tokens, key=self.key, temperature=options['temperature'],
                   top_k=options['top_k'], top_p=options['top_p'],
                   **{name: options[name] for name in PENALTIES if options.get(name) is not None})

    def take(self, out: dict, slot: int, n_vocab: int) -> None:
        """Delivers this row's share of a chunk's outputs; ends the row once it has all its tokens, or fails it
        when its logits were NaN (validate.check_drawn)."""
        n = min(out['tokens'].shape[1], self.max_tokens - self.sent)
        try:
            check_drawn(out['tokens'][slot, :n], n_vocab)
        except GPT2Error as e:
            self.fail(str(e))
            return
        log_probs = {name: value[slot, :n] for name, value in out.items()} if self.logprobs is not None else None
        self.deliver(out['tokens'][slot, :n], log_probs)
        self.sent += n
        if self.sent >= self.max_tokens:
            self.done = True
            self.deliver(None, None)


class Batcher:
    """A queue of at most `queue_size` rows, run by one worker thread in `capacity` slots (gpt2_tf.slots).

    At every chunk boundary, rows that are done (all their tokens, or their client
    gone) leave and waiting rows join (next_rows: fairly between requests). When nothing runs, the
    worker waits up to `timeout` seconds after the first row for others to start
    with it. A row that can never fit the window fails with validate.check_window's
    message. decoder: the model's own decode, or a fake in tests.
    """

    def __init__(self, model, *, capacity: int = 16, queue_size: int = 256, timeout: float = 0.005,
                 chunk: int = STREAM_CHUNK, mode: Optional[str] = None, decoder: Decoder = DECODER):
        if capacity < 1 or queue_size < 1:
            raise GPT2Error(f'capacity and queue_size must be at least 1, got {capacity} and {queue_size}')
        self.capacity, self.queue_size, self.timeout, self.n_ctx = capacity, queue_size, timeout, model.hparams.n_ctx
        self.slots = Slots(model, capacity, chunk=chunk, mode=mode, decoder=decoder)
        self.held: List[Optional[Row]] = [None] * capacity  # the row in each slot
        self.pending: List[Row] = []
        self.scoring = 0  # prompts being scored off the queue (submit's scored), counted against queue_size too
        self.lock = threading.Condition()
        self.stopped = False
        self.chunks = 0  # chunks decoded, for tests and logs
        self.thread = threading.Thread(target=self._work, name='gpt2_tf-batcher', daemon=True)
        self.thread.start()

    def check_rows(self, count: int) -> None:
        """Raises APIError 400 when a request of `count` rows could never be queued."""
        if count > self.queue_size:
            raise APIError(400, f'the request asks for {count} rows (prompts times best_of, n by default, and each '
                           f'prompt whose echo is scored); this server queues at most {self.queue_size}: send fewer '
                           f'prompts, or a smaller n or best_of')

    def submit(self, rows: List[Row], *, scored: int = 0) -> None:
        """Queues the rows, and counts `scored` prompts whose log-probs the request scores off the queue (an
        echo's) until release(scored); or raises APIError: 400 when they could never all be queued, 503 when
        the queue is full now. A row that cannot fit the window fails now."""
        self.check_rows(len(rows) + scored)
        fitting, request = [], object()
        for row in rows:
            row.request = request
            try:
                check_window(len(row.prompt), row.max_tokens, self.n_ctx)
                fitting.append(row)
            except GPT2Error as e:
                row.fail(str(e))
        with self.lock:
            self._check_room(len(fitting) + scored)
            self.pending.extend(fitting)
            self.scoring += scored
            self.lock.notify()

    def release(self, count: int) -> None:
        with self.lock:
            self.scoring -= count

    def _check_room(self, count: int) -> None:
        """Under the lock: 503 when closed, or when `count` more rows would pass queue_size."""
        if self.stopped:
            raise shutting_down()
        if len(self.pending) + self.scoring + count > self.queue_size:
            raise APIError(503, f'the server is busy ({len(self.pending) + self.scoring} rows waiting or being '
                                f'scored); retry shortly', kind='server_error', code='overloaded',
                           headers={'Retry-After': '1'})

    @property
    def waiting(self) -> int:
        """Rows queued, not yet running."""
        with self.lock:
            return sum(not row.done for row in self.pending)

    @property
    def running(self) -> int:
        """Rows in a slot now."""
        return sum(row is not None for row in self.held)

    def close(self) -> None:
        """Stops the worker after its chunk, failing the rows still waiting or running; later submits get 503."""
        with self.lock:
            self.stopped = True
            self.lock.notify()

    def _work(self) -> None:
        while self._admit():
            try:
                self._decode()
            except Exception as e:  # a failed chunk fails its rows, never the server
                LOG.exception('a decode step failed; its rows fail')
                for slot, row in enumerate(self.held):
                    if row is not None:
                        row.fail(first_line(e))
                        self._leave(slot)
        with self.lock:  # closed: nothing joins now, and every row left ends
            left, self.pending = self.pending + [row for row in self.held if row is not None], []
        for row in left:
            if not row.done:
                row.fail(SHUTTING_DOWN)

    def _admit(self) -> bool:
        """Blocks until some row can run, then moves waiting rows into free slots; False once closed."""
        with self.lock:
            while not self.stopped:
                self.pending = [row for row in self.pending if not row.done]
                if self.pending and not self.running:
                    self._gather()
                if self.pending or self.running:
                    break
                self.lock.wait()  # nothing to run until a submit or close
            if self.stopped:
                return False
            free = [slot for slot, row in enumerate(self.held) if row is None]
            joining = next_rows(self.pending, self.held, len(free))
            self.pending = [row for row in self.pending if row not in joining]
        for slot, row in zip(free, joining):  # prefills run outside the lock: submits go on meanwhile
            try:
                row.join(self.slots, slot)
                self.held[slot] = row
            except Exception as e:
                if not isinstance(e, GPT2Error):
                    LOG.exception('a prefill failed; its row fails')
                row.fail(first_line(e))
        return True

    def _gather(self) -> None:
        """Waits up to `timeout` for enough rows to fill every slot (the lock is free while it waits)."""
        deadline = time.monotonic() + self.timeout
        while len(self.pending) < self.capacity and not self.stopped:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self.lock.wait(left)

    def _decode(self) -> None:
        """One chunk for every slot; each row takes its share, and rows that are done leave."""
        if not self.running:
            return
        wanted = any(row is not None and row.logprobs is not None for row in self.held)
        out = self.slots.step(logprobs=MAX_LOGPROBS if wanted else None)  # one shape for every logprobs asked
        self.chunks += 1
        for slot, row in enumerate(self.held):
            if row is None:
                continue
            if not row.done:
                row.take(out, slot, self.slots.model.hparams.n_vocab)
            if row.done:
                self._leave(slot)

    def _leave(self, slot: int) -> None:
        self.held[slot] = None
        self.slots.leave(slot)


def next_rows(pending: List[Row], held: List[Optional[Row]], free: int) -> List[Row]:
    """The waiting rows that take `free` slots: one slot at a time, to the request that holds the fewest (the
    slots given here counted), the earliest of those that hold as few; a request's own rows in their order."""
    holding = {}
    for row in held:
        if row is not None:
            holding[row.request] = holding.get(row.request, 0) + 1
    queues = {}  # request -> its waiting rows, requests in the order their first row waits
    for row in pending:
        queues.setdefault(row.request, []).append(row)
    chosen = []
    for _ in range(min(free, len(pending))):
        request = min(queues, key=lambda r: holding.get(r, 0))  # min keeps the first of equals: the earliest
        chosen.append(queues[request].pop(0))
        holding[request] = holding.get(request, 0) + 1
        if not queues[request]:
            del queues[request]
    return chosen
