"""The server's Batcher over in-flight slots, with a fake model: who runs when, and what each row gets."""

import os
import threading
import time

import pytest
import tensorflow as tf

from gpt2_tf.sample import Decoder

from conftest import require
from support import FakeModel

require('fastapi')

V_FAKE = 50


def echo_step(model, X, *, pads, caches, index):
    """The next token is (3 x + 1) % V_FAKE after token x, and sure: every row's tokens are known in advance."""
    return tf.one_hot((3 * X[:, -1] + 1) % V_FAKE, V_FAKE) * 30.0, caches


def slot_cache(model, batch, size):
    return [tf.zeros([batch, 1, 1, size, 1])]


ECHO = Decoder(step=echo_step, cache=slot_cache)


def expected(prompt, n):
    out, last = [], prompt[-1]
    for _ in range(n):
        last = (3 * last + 1) % V_FAKE
        out.append(last)
    return out


class Inbox:
    """A row's deliver: collects its tokens, its end and its error, and when each came."""

    def __init__(self, batcher=None):
        self.tokens, self.error, self.ended, self.batcher = [], None, threading.Event(), batcher
        self.chunks = []  # the batcher's chunk count at each delivery

    def __call__(self, tokens, log_probs, *, error=None):
        if self.batcher is not None:
            self.chunks.append(self.batcher.chunks)
        if error is not None or tokens is None:
            self.error = error
            self.ended.set()
        else:
            self.tokens.extend(int(t) for t in tokens)


def batcher(**options):
    from gpt2_tf.serve import Batcher

    defaults = dict(capacity=2, chunk=4, mode='eager', decoder=ECHO, timeout=0)
    return Batcher(FakeModel(V_FAKE, options.pop('n_ctx', 64)), **{**defaults, **options})


def row(prompt, max_tokens, inbox, **options):
    from gpt2_tf.serve import Row

    return Row(prompt, max_tokens, dict(temperature=0.0, top_k=0, top_p=1.0, **options), (0, 0), None, inbox)


def test_every_row_gets_its_own_tokens_through_fewer_slots_than_rows():
    queue = batcher(capacity=2)
    try:
        prompts = [[1], [2, 3], [4, 5, 6], [7], [8, 9]]
        lengths = [9, 2, 13, 5, 1]
        inboxes = [Inbox() for _ in prompts]
        queue.submit([row(p, n, inbox) for p, n, inbox in zip(prompts, lengths, inboxes)])
        assert all(inbox.ended.wait(30) for inbox in inboxes)
    finally:
        queue.close()
    for prompt, n, inbox in zip(prompts, lengths, inboxes):
        assert inbox.error is None and inbox.tokens == expected(prompt, n)


def test_a_short_row_does_not_wait_for_a_long_one():
    queue = batcher(capacity=2, chunk=4)
    try:
        long, short = Inbox(queue), Inbox(queue)
        queue.submit([row([1], 60, long)])
        while not long.tokens:
            time.sleep(0.01)
        queue.submit([row([2], 4, short)])
        assert short.ended.wait(30)
        started = short.chunks[0]
        assert short.chunks[-1] - started <= 1  # joined at the next chunk and ran one chunk
        assert not long.ended.is_set() and len(long.tokens) < 60
        assert long.ended.wait(30) and long.tokens == expected([1], 60)
    finally:
        queue.close()


def test_a_freed_slot_goes_to_the_request_holding_the_fewest_not_to_the_first_in_the_queue():
    queue = batcher(capacity=2, chunk=4)
    try:
        many, short = [Inbox(queue) for _ in range(6)], Inbox(queue)
        queue.submit([row([i + 1], 20, inbox) for i, inbox in enumerate(many)])  # n=6: three rounds of 5 chunks
        while not many[0].tokens:
            time.sleep(0.01)
        queue.submit([row([9], 4, short)])
        assert short.ended.wait(30) and all(inbox.ended.wait(30) for inbox in many)
    finally:
        queue.close()
    assert short.chunks[0] - many[0].chunks[0] <= 6  # at the first freed slots (in queue order: after 10 chunks)
    assert short.tokens == expected([9], 4) and all(inbox.tokens == expected([i + 1], 20)
                                                    for i, inbox in enumerate(many))
    assert many[2].chunks[0] <= short.chunks[0]  # the earlier request took the first of the two slots


def test_a_row_whose_client_left_frees_its_slot_at_the_next_chunk():
    queue = batcher(capacity=1, chunk=4)
    try:
        gone, next_one = Inbox(queue), Inbox(queue)
        leaving = row([1], 60, gone)
        queue.submit([leaving, row([3], 4, next_one)])
        while not gone.tokens:
            time.sleep(0.01)
        leaving.done = True  # what Completion.close does when the client goes away
        seen = len(gone.tokens)  # what came before it was left, or while it was being left
        assert next_one.ended.wait(30) and next_one.tokens == expected([3], 4)
        # at most the chunk in flight (4 tokens) after that, and no end; counted from the moment it was left, so
        # a loaded machine that delays this thread cannot make it fail
        assert len(gone.tokens) <= seen + 4 and not gone.ended.is_set()
    finally:
        queue.close()
    assert queue.running == 0 and queue.waiting == 0


def test_penalties_reach_the_slots():
    queue = batcher(capacity=2)
    try:
        banned, plain = Inbox(), Inbox()
        first = expected([1], 1)[0]
        queue.submit([row([1], 3, banned, logit_bias={first: -100.0}), row([1], 3, plain)])
        assert banned.ended.wait(30) and plain.ended.wait(30)
    finally:
        queue.close()
    assert plain.tokens == expected([1], 3)
    assert banned.tokens[0] != first


def test_a_request_that_can_never_be_queued_is_a_400_and_a_full_queue_a_503():
    from gpt2_tf.serve import APIError

    queue = batcher(capacity=1, queue_size=3, timeout=60)  # the first row waits 60 s for company
    try:
        with pytest.raises(APIError, match='asks for 4 rows') as never:
            queue.submit([row([1], 2, Inbox()) for _ in range(4)])
        assert never.value.status == 400
        queue.submit([row([1], 2, Inbox()) for _ in range(3)])
        with pytest.raises(APIError, match='busy') as busy:
            queue.submit([row([1], 2, Inbox())])
        assert busy.value.status == 503
    finally:
        queue.close()


def thread_cpu_seconds(thread) -> float:
    """The user and system CPU time a thread has used, from /proc (fields 14 and 15 of its stat line)."""
    with open(f'/proc/self/task/{thread.native_id}/stat') as f:
        fields = f.read().rsplit(')', 1)[1].split()  # fields from the 3rd on: the name may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')


def test_a_row_that_can_never_fit_fails_with_the_window_message_and_the_worker_waits():
    if not os.path.exists('/proc/self/task'):
        pytest.skip('measures the worker thread through /proc')
    queue = batcher(n_ctx=8)
    try:
        never = Inbox()
        queue.submit([row([1] * 8, 2, never)])  # 8 + 2 - 1 = 9 > n_ctx = 8
        assert never.ended.wait(10)
        assert never.error == ('prompt: 8 tokens + length 2 exceeds the window by 1 '
                               '(needs prompt + length - 1 <= n_ctx = 8): shorten the prompt or ask for fewer '
                               'new tokens')
        before = thread_cpu_seconds(queue.thread)
        time.sleep(2)
        spent = thread_cpu_seconds(queue.thread) - before
        assert spent < 0.1, f'the idle worker used {spent:.2f} CPU-seconds in 2 s: it spins'  # blocked: ~0
        fits = Inbox()
        queue.submit([row([1] * 7, 2, fits)])  # 7 + 2 - 1 = 8: the exact fit still runs
        assert fits.ended.wait(10) and fits.error is None and fits.tokens == expected([1], 2)
    finally:
        queue.close()


def test_a_first_row_waits_up_to_the_timeout_for_company_and_a_full_batch_starts_at_once():
    queue = batcher(capacity=2, timeout=60)
    try:
        first, second = Inbox(queue), Inbox(queue)
        queue.submit([row([1], 2, first)])
        assert not first.ended.wait(0.5)  # waiting for a second row, up to 60 s
        queue.submit([row([2], 2, second)])
        assert first.ended.wait(10) and second.ended.wait(10)
    finally:
        queue.close()
    assert first.chunks == second.chunks  # they ran side by side


def failing_step(model, X, *, pads, caches, index):
    """A graph error, as TensorFlow's ops raise them: a gather past its table."""
    return tf.gather(tf.zeros([4, V_FAKE]), tf.fill(tf.shape(X)[:1], 9)), caches


def test_a_failure_fails_its_rows_in_one_line_and_the_server_log_has_the_traceback(caplog):
    queue = batcher(mode='function', decoder=Decoder(step=failing_step, cache=slot_cache))
    try:
        inbox = Inbox()
        queue.submit([row([1, 2], 3, inbox)])
        assert inbox.ended.wait(30)
    finally:
        queue.close()
    assert inbox.error.startswith('indices[0] = 9 is not in [0, 4)') and '\n' not in inbox.error, inbox.error
    assert any(r.exc_info and 'Graph execution error' in str(r.exc_info[1]) for r in caplog.records)


@pytest.mark.parametrize('options', [dict(capacity=0), dict(queue_size=0)])
def test_no_slots_or_no_queue_is_refused_in_one_line(options):
    from gpt2_tf.validate import GPT2Error

    with pytest.raises(GPT2Error, match='capacity and queue_size must be at least 1'):
        batcher(**options)


def test_closing_fails_the_rows_left_and_refuses_new_ones():
    from gpt2_tf.serve.protocol import APIError

    queue = batcher(capacity=2, timeout=60)  # the first row waits for company, up to 60 s
    waiting = Inbox()
    queue.submit([row([1], 2, waiting)])
    queue.close()
    assert waiting.ended.wait(10) and waiting.error == 'the server is shutting down'
    with pytest.raises(APIError, match='shutting down') as refused:
        queue.submit([row([2], 2, Inbox())])
    assert refused.value.status == 503


def test_a_row_whose_event_loop_has_closed_leaves_without_raising_on_the_worker():
    import asyncio

    from gpt2_tf.serve.completion import Completion

    completion = Completion.__new__(Completion)  # only what _deliver and close read
    completion.loop = asyncio.new_event_loop()
    completion.loop.close()
    completion.inbox, completion.rows = asyncio.Queue(), {0: row([1], 2, Inbox())}
    completion.group = completion.reserved = None  # no echo scored
    completion._deliver(0, [5], None)  # call_soon_threadsafe raises RuntimeError on a closed loop
    assert completion.rows[0].done


def test_a_row_prefilling_when_the_batcher_closes_still_ends(monkeypatch):
    from gpt2_tf.serve import Row

    join, joining = Row.join, threading.Event()

    def slow_join(self, slots, slot):
        joining.set()
        time.sleep(1)  # close() comes now, while the row is neither waiting nor held
        join(self, slots, slot)

    monkeypatch.setattr(Row, 'join', slow_join)
    queue = batcher(capacity=1)
    inbox = Inbox()
    queue.submit([row([1], 40, inbox)])
    assert joining.wait(10)
    queue.close()
    assert inbox.ended.wait(10) and inbox.error == 'the server is shutting down'
