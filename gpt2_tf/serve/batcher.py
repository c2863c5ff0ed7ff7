"""Scheduling: the Batcher runs waves of rows (every prompt times n) as one decode call each.

A row carries its own options and seed, so rows of different requests share a
wave and each draws the tokens it would draw alone.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, List, Optional

import numpy as np

from ..sample import sample_chunks
from ..validate import GPT2Error, check_window, room_for_prompt
from .protocol import APIError

STREAM_CHUNK = 8  # tokens per compiled call: the first text of a stream arrives early


class Row:
    """One choice of one request: a prompt, its options, and where its tokens go.

    deliver(tokens, log_probs) takes each chunk, then deliver(None, None) ends the
    row; deliver(None, None, error=message) fails it.
    """

    def __init__(self, prompt: list, max_tokens: int, options: dict, key, logprobs: Optional[int],
                 deliver: Callable):
        self.prompt, self.max_tokens, self.options, self.key = prompt, max_tokens, options, key
        self.logprobs, self.deliver = logprobs, deliver
        self.done = False  # finished, or its client went away

    def fail(self, message: str) -> None:
        self.done = True
        self.deliver(None, None, error=message)


def wave_size(rows: int, capacity: int) -> int:
    """Waves run padded to 1, 2, 4, ... rows, at most the capacity: the compiled loop then sees a few batch
    sizes rather than every one (each new shape compiles for seconds). Unlike compiled.bucket's lengths,
    a batch starts at 1: every padded row is a whole row of decoding."""
    return min(1 << (rows - 1).bit_length(), max(capacity, rows))


class Batcher:
    """A queue of at most `queue_size` rows, run by one worker thread in waves of at most `capacity` rows.

    A wave takes the waiting rows that fit the window together (the longest prompt
    with the longest max_tokens). Once a row waits, the worker waits up to
    `timeout` seconds for a full wave before it runs a partial one. A row that can
    never fit fails with validate.check_window's message; a wave stops early once
    every row is done. generate is sample_chunks, or a fake of it in tests.
    """

    def __init__(self, model, *, capacity: int = 16, queue_size: int = 256, timeout: float = 0.005,
                 chunk: int = STREAM_CHUNK, mode: Optional[str] = None, generate: Callable = sample_chunks):
        self.model, self.capacity, self.queue_size, self.timeout = model, capacity, queue_size, timeout
        self.chunk, self.mode, self.generate = chunk, mode, generate
        self.n_ctx = model.hparams.n_ctx
        self.pending: List[Row] = []
        self.lock = threading.Condition()
        self.stopped = False
        self.waves = 0  # waves run, for tests and logs
        self._running = 0
        self.thread = threading.Thread(target=self._work, name='gpt2_tf-batcher', daemon=True)
        self.thread.start()

    def submit(self, rows: List[Row]) -> None:
        """Queues the rows, or raises APIError 503 when the queue is full. A row that cannot fit fails now."""
        if len(rows) > self.queue_size:
            raise APIError(400, f'the request asks for {len(rows)} rows (prompts times n); this server queues at most '
                           f'{self.queue_size}: send fewer prompts or a smaller n')
        fitting = []
        for row in rows:
            try:
                check_window(len(row.prompt), row.max_tokens, self.n_ctx)
                fitting.append(row)
            except GPT2Error as e:
                row.fail(str(e))
        with self.lock:
            if len(self.pending) + len(fitting) > self.queue_size:
                raise APIError(503, f'the server is busy ({len(self.pending)} rows waiting); retry shortly',
                               kind='server_error', code='overloaded', headers={'Retry-After': '1'})
            self.pending.extend(fitting)
            self.lock.notify()

    @property
    def waiting(self) -> int:
        """Rows queued, not yet running."""
        with self.lock:
            return sum(not row.done for row in self.pending)

    @property
    def running(self) -> int:
        """Rows being decoded now."""
        return self._running

    def close(self) -> None:
        with self.lock:
            self.stopped = True
            self.lock.notify()

    def _next_wave(self) -> List[Row]:
        """Blocks until a wave can run, and returns its rows; [] once closed."""
        with self.lock:
            while not self.stopped:
                if self.pending:
                    self._gather()
                    wave = self._take()
                    if wave:
                        return wave
                self.lock.wait()  # nothing to run until a submit or close
            return []

    def _gather(self) -> None:
        """Waits up to `timeout` for a full wave (the lock is free while it waits)."""
        deadline = time.monotonic() + self.timeout
        while len(self.pending) < self.capacity and not self.stopped:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self.lock.wait(left)

    def _take(self) -> List[Row]:
        """The rows of the next wave, in queue order; the rest wait. Rows whose clients left are dropped."""
        wave, rest, longest, length = [], [], 0, 0
        for row in self.pending:
            if row.done:
                continue
            prompt, tokens = max(longest, len(row.prompt)), max(length, row.max_tokens)
            if len(wave) < self.capacity and prompt <= room_for_prompt(tokens, self.n_ctx):
                wave.append(row)
                longest, length = prompt, tokens
            else:
                rest.append(row)
        self.pending = rest
        return wave

    def _work(self) -> None:
        while True:
            wave = self._next_wave()
            if not wave:
                return
            self.waves += 1
            self._running = len(wave)
            try:
                self._run(wave)
            except Exception as e:  # a failed wave fails its rows, never the server
                for row in wave:
                    row.fail(str(e))
            finally:
                self._running = 0

    def _run(self, wave: List[Row]) -> None:
        first = wave[0]
        filler = [Row(first.prompt, first.max_tokens, first.options, (0, 0), None, lambda *a, **k: None)
                  for _ in range(wave_size(len(wave), self.capacity) - len(wave))]
        for row in filler:
            row.done = True  # idle: it only fills a place in the compiled batch
        rows = wave + filler
        wanted = [row.logprobs for row in rows if row.logprobs is not None]
        options = {name: [row.options[name] for row in rows] for name in ('temperature', 'top_k', 'top_p')}
        chunks = self.generate(self.model, max(row.max_tokens for row in rows), context=[row.prompt for row in rows],
                               seed=np.array([row.key for row in rows], np.int64), mode=self.mode,
                               chunk=self.chunk, logprobs=max(wanted) if wanted else None, **options)
        try:
            self._deliver(rows, chunks)
        finally:
            chunks.close()

    @staticmethod
    def _deliver(rows: List[Row], chunks) -> None:
        """Hands each row its share of each chunk; stops once every row has all its tokens or is done."""
        step, ended = 0, set()  # ended: rows that got all their tokens
        for out in chunks:
            tokens = out['tokens'] if isinstance(out, dict) else out
            for i, row in enumerate(rows):
                if row.done or i in ended:
                    continue
                take = min(tokens.shape[1], row.max_tokens - step)
                if take > 0:
                    log_probs = {k: v[i, :take] for k, v in out.items()} if isinstance(out, dict) else None
                    row.deliver(tokens[i, :take], log_probs)
                if step + take >= row.max_tokens:
                    ended.add(i)
                    row.deliver(None, None)
            step += tokens.shape[1]
            if all(row.done or i in ended for i, row in enumerate(rows)):
                return  # every row has stopped or gone: the rest of the wave is not computed
