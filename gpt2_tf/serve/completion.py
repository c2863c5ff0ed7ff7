"""A completion in flight: its choices grow from the rows' tokens into OpenAI's response or stream.

Choice turns one row's tokens into text, with stop strings, held-back partial
characters and the logprobs object; Completion makes a request's choices and
rows, collects what the Batcher delivers, and builds the response or the
server-sent events.
"""

from __future__ import annotations

import asyncio
import bisect
import codecs
import copy
import functools
import json
import logging
import secrets
import time
from typing import AsyncIterator, List, Optional

from ..compiled import bucket
from ..encoder import END_OF_TEXT, Encoder
from ..runtime import Model
from ..scoring import score
from ..validate import GPT2Error
from .batcher import Batcher, Row, cut_short
from .protocol import APIError, CompletionChoice, CompletionRequest, CompletionResponse, Sampling, Usage


LOG = logging.getLogger(__name__)  # a failed stream's traceback: the client gets an error event


class Offsets:
    """Where each token of a text starts in the whole text's characters (on the character it continues, when
    the tokens before it left one unfinished), without decoding the text again for each."""

    def __init__(self, encoder: Encoder):
        self.encoder, self.length = encoder, 0
        self.text = codecs.getincrementaldecoder('utf-8')(encoder.errors)  # holds an unfinished character back

    def take(self, token: int) -> int:
        """The next token's offset; then reads its bytes."""
        at = self.length
        self.length += len(self.text.decode(self.encoder.token_bytes(token)))
        return at


class Choice:
    """One choice as it grows: its text, finish reason and OpenAI logprobs object."""

    def __init__(self, index: int, encoder: Encoder, stops: list, logprobs: Optional[int], prefix: str = ''):
        self.index, self.encoder, self.stops, self.logprobs = index, encoder, stops, logprobs
        self.end = encoder.encoder.get(END_OF_TEXT)  # None: a vocabulary without it never ends a choice there
        self.tokens: List[int] = []
        self.sent = 0  # characters of text already handed out
        self.prefix = prefix  # the echoed prompt
        self.finish_reason: Optional[str] = None
        self.cut: Optional[int] = None  # where a stop string cut the text, if one did
        self.stop_end: Optional[int] = None  # where that stop string ends
        self.handed = 0  # logprobs entries already handed out (a stream's chunks)
        self.drawn: List[float] = []  # the log-prob of each token drawn, the end of text included (for best_of)
        # the echoed prompt's entries first (Completion sets them), then each token's
        self.entries = no_entries()
        self.offsets = Offsets(encoder)

    def add(self, tokens, log_probs) -> str:
        """Takes new tokens; returns the text ready to send (held back while a stop may still form)."""
        for i, token in enumerate(map(int, tokens)):
            if self.finish_reason:
                break
            log_prob = None if log_probs is None else float(log_probs['log_probs'][i])
            if log_prob is not None:
                self.drawn.append(log_prob)
            if token == self.end:
                self.finish_reason = 'stop'
                break
            self.tokens.append(token)
            if self.logprobs is not None and log_probs is not None:
                piece, offset = token_piece(self.encoder, token), len(self.prefix) + self.offsets.take(token)
                top = top_logprobs(self.encoder, piece, log_prob, log_probs['top_ids'][i],
                                   log_probs['top_log_probs'][i], top=self.logprobs)
                self._entry(piece, log_prob, top, offset)
        text = self.stopped(self.encoder.decode(self.tokens))
        if not self.finish_reason:
            text = text.rstrip('\ufffd')  # a token may end inside a UTF-8 character: wait for the rest
            hold = max((len(s) - 1 for s in self.stops), default=0)  # a stop may be forming at the end
            text = text[:max(len(text) - hold, self.sent)]
        new = text[self.sent:]
        self.sent = len(text)
        return new

    def finish(self, reason: str = 'length') -> str:
        self.finish_reason = self.finish_reason or reason
        text = self.stopped(self.encoder.decode(self.tokens))
        new = text[self.sent:]
        self.sent = len(text)
        return new

    def stopped(self, text: str) -> str:
        """The text up to the stop string that ends first in it (which finishes the choice; of two that end
        together, the longer), or all of it. Where each stop ends does not depend on the order of the stops, nor
        on how the text arrived, token by token or a chunk at once (but for a stop holding U+FFFD, which a
        character not yet whole shows as)."""
        found = [(at + len(stop), at) for stop in self.stops if (at := text.find(stop)) >= 0]
        if found:
            self.stop_end, at = min(found)
            text, self.finish_reason, self.cut = text[:at], 'stop', at
        return text

    def kept(self) -> int:
        """The tokens behind the text returned: those that start before a stop string's cut (usage counts these)."""
        return len(self.tokens) if self.cut is None else self._reaching(self.cut)

    def _reaching(self, end: int) -> int:
        """The fewest tokens whose text reaches end characters."""
        # By bisection: a prefix's text grows with it, so log n decodes.
        return bisect.bisect_left(range(len(self.tokens) + 1), end,
                                  key=lambda i: len(self.encoder.decode(self.tokens[:i])))

    def _entry(self, piece, log_prob, top, offset):
        self.entries['tokens'].append(piece)
        self.entries['token_logprobs'].append(log_prob)
        self.entries['top_logprobs'].append(top)
        self.entries['text_offset'].append(offset)

    def mean_logprob(self) -> float:
        """best_of's ranking: the mean log-prob of the tokens drawn up to what ended the choice: the end of text,
        or the tokens through the stop string (so that a choice cut to nothing by one, at 0, never outranks the
        others), or all of them at max_tokens."""
        drawn = self.drawn if self.cut is None else self.drawn[:self._reaching(self.stop_end)]
        return sum(drawn) / len(drawn) if drawn else 0.0

    def logprobs_object(self) -> Optional[dict]:
        """The logprobs of the whole text: the echoed prompt's, then each token's behind the text returned."""
        if self.logprobs is None:
            return None
        return {name: values[:self._entries_sent()] for name, values in self.entries.items()}

    def new_logprobs(self) -> Optional[dict]:
        """A stream chunk's logprobs: the entries of the tokens whose text starts in what was handed out since
        the last call (all that remain once the choice has finished)."""
        if self.logprobs is None:
            return None
        start, self.handed = self.handed, max(self.handed, self._entries_sent())
        return {name: values[start:self.handed] for name, values in self.entries.items()}

    def _entries_sent(self) -> int:
        """Entries whose token starts in the text handed out so far (echoed prompt included)."""
        if self.finish_reason and self.cut is None:
            return len(self.entries['tokens'])
        limit = len(self.prefix) + self.sent
        return sum(1 for offset in self.entries['text_offset'] if offset < limit)


ECHO_TOKENS = 1024  # padded prompt tokens scored in one call: the logits of one 124M window (206 MB)
STOP_CHECK = 0.25  # seconds between looks at a stopping server while a group is scored


def echo_logprobs(model: Model, encoder: Encoder, prompt: list, top: int) -> dict:
    """The prompt's own logprobs object, from scoring (its first token has none)."""
    return echo_entries(model, encoder, [prompt], top)[0]


def echo_entries(model: Model, encoder: Encoder, prompts: list, top: int) -> list:
    """Each prompt's echo_logprobs, from one scoring call over them all (padded to a power of two of rows with
    2-token rows, so that the compiled scorer sees few shapes)."""
    scorable = [i for i, prompt in enumerate(prompts) if len(prompt) >= 2]  # to_sampling checked the window
    scored = {}
    if scorable:
        rows = [prompts[i] for i in scorable]
        rows += [[0, 0]] * (_rows(len(rows)) - len(rows))
        scored = dict(zip(scorable, zip(*score(model, rows, top=max(top, 1)))))
    return [_echo_entries(encoder, prompt, *scored.get(i, (None, None, None)), top=top)
            for i, prompt in enumerate(prompts)]


def token_piece(encoder: Encoder, token) -> str:
    """A token as OpenAI's logprobs write it: its text, or where its bytes are part of a character, `bytes:` and
    the bytes as \\xNN (so that no two tokens share a top_logprobs key, as every such piece would as U+FFFD)."""
    raw = encoder.token_bytes(int(token))
    try:
        return raw.decode('utf-8')
    except UnicodeDecodeError:
        return 'bytes:' + ''.join(f'\\x{b:02x}' for b in raw)


def no_entries() -> dict:
    """An OpenAI logprobs object's lists, empty."""
    return {'tokens': [], 'token_logprobs': [], 'top_logprobs': [], 'text_offset': []}


def top_logprobs(encoder: Encoder, piece: str, log_prob: float, ids, log_probs, *, top: int) -> dict:
    """One token's top_logprobs: the `top` likeliest pieces, and the token's own (its piece) always (OpenAI's
    rule)."""
    entry = {token_piece(encoder, t): float(p) for t, p in zip(ids[:top], log_probs[:top])}
    entry.setdefault(piece, log_prob)
    return entry


def _rows(count: int) -> int:
    return 1 << (count - 1).bit_length()  # the power of two at or above count


def _echo_entries(encoder: Encoder, prompt: list, lp, ids, top_lp, *, top: int) -> dict:
    entries = no_entries()
    offsets = Offsets(encoder)
    for i, token in enumerate(prompt):
        piece = token_piece(encoder, token)
        entries['tokens'].append(piece)
        entries['text_offset'].append(offsets.take(token))
        if i == 0 or lp is None:
            entries['token_logprobs'].append(None)
            entries['top_logprobs'].append(None)
        else:
            entries['token_logprobs'].append(float(lp[i - 1]))
            entries['top_logprobs'].append(top_logprobs(encoder, piece, float(lp[i - 1]), ids[i - 1], top_lp[i - 1],
                                                        top=top))
    return entries


def echo_groups(prompts: list, tokens: int) -> list:
    """The prompts' indices in order, in groups of at most `tokens` padded tokens, rows padded to a power of
    two (one prompt at least)."""
    groups, group, longest = [], [], 0
    for i, prompt in enumerate(prompts):
        if group and _rows(len(group) + 1) * bucket(max(longest, len(prompt))) > tokens:
            groups.append(group)
            group, longest = [], 0
        group.append(i)
        longest = max(longest, len(prompt))
    return groups + [group] if group else groups


def _retrieved(group: asyncio.Future) -> None:
    """Reads a scoring group's outcome, so that a failure nobody awaits any more (its client gone) is not
    reported as never retrieved."""
    if not group.cancelled():
        group.exception()


class Completion:
    """One request: its choices (prompt-major, best_of per prompt), the rows they draw from, and what they make.

    With best_of > n, each prompt's n choices with the highest mean token log-prob
    are returned, renumbered prompt-major; usage counts every choice's tokens.
    """

    def __init__(self, request: CompletionRequest, sampling: Sampling, encoder: Encoder, model_id: str):
        self.request, self.sampling, self.encoder = request, sampling, encoder
        self.id = f'cmpl-{secrets.token_hex(12)}'
        self.created = int(time.time())
        self.model = request.model or model_id  # the id the client asked for, as vLLM answers
        self.loop = asyncio.get_running_loop()
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.choices: List[Choice] = []
        self.rows = {}  # choice index -> its Row; none when max_tokens is 0
        self.started = time.monotonic()  # for the metrics: time to first token, time per output token
        self.first_token: Optional[float] = None
        self.last_token: Optional[float] = None
        self.first_count = 0  # tokens of the first chunk: they arrive together, at first_token
        self.complete = False  # the whole response or stream was handed out
        self.failed = False  # a stream that failed after its first bytes (it ends with an error event)
        self.scorer: Optional[Model] = None  # the model, when the echoed prompts' logprobs are to be scored
        self.batcher: Optional[Batcher] = None  # the queue the request went to (submit)
        self.reserved: Optional[Batcher] = None  # the same, while it counts the prompts being scored
        self.group: Optional[asyncio.Future] = None  # the group of prompts being scored now, on another thread

    def submit(self, model: Model, batcher: Batcher) -> None:
        """Makes the choices and queues their rows; an echo's log-probs are scored when its events start."""
        request, best_of = self.request, self.sampling.best_of
        self.batcher = batcher
        batcher.check_rows(len(self.sampling.prompts) * best_of)  # rows or not: every choice costs the loop work
        self.scorer = model if request.echo and request.logprobs is not None else None
        scored = len(self.sampling.prompts) if self.scorer is not None else 0  # submit counts them with the rows
        ranked = best_of > request.n and request.logprobs is None  # the ranking needs each token's log-prob
        for i, (prompt, given) in enumerate(zip(self.sampling.prompts, self.sampling.given)):
            prefix = self.encoder.decode(given) if request.echo else ''  # an empty prompt echoes as ''
            for j in range(best_of):
                index = i * best_of + j
                self.choices.append(Choice(index, self.encoder, request.stop or [], request.logprobs, prefix))
                if request.max_tokens:
                    self.rows[index] = Row(prompt, request.max_tokens, self.sampling.options,
                                           (self.sampling.seed, index), 0 if ranked else request.logprobs,
                                           functools.partial(self._deliver, index))
        if self.rows or scored:
            batcher.submit(list(self.rows.values()), scored=scored)
            self.reserved = batcher if scored else None

    def _release(self, *_) -> None:
        """Takes the prompts being scored off the queue's count, once, when no group of them is being scored
        (a thread, which a client's leaving does not stop: then once that group is done)."""
        if self.group is not None and not self.group.done():
            self.group.add_done_callback(self._release)
            return
        if self.reserved is not None:
            self.reserved.release(len(self.sampling.prompts))
            self.reserved = None

    def _check_running(self) -> None:
        """Echo scoring stops at a server's stop, as the rows left in its Batcher fail."""
        if self.batcher.stopped:
            raise cut_short()

    async def _score_echoes(self) -> None:
        """The echoed prompts' logprobs, scored off the event loop a group at a time: a client that goes away
        (its task cancelled), or a server that stops, stops the scoring at the next group."""
        given, best_of, top = self.sampling.given, self.sampling.best_of, self.request.logprobs
        try:
            for group in echo_groups(given, ECHO_TOKENS):
                self._check_running()
                prompts = [given[i] for i in group]
                self.group = asyncio.ensure_future(asyncio.to_thread(echo_entries, self.scorer, self.encoder,
                                                                     prompts, top))
                self.group.add_done_callback(_retrieved)
                while not (await asyncio.wait({self.group}, timeout=STOP_CHECK))[0]:  # a cancelled wait, or a
                    self._check_running()  # stop, leaves the thread to finish its group
                scored = self.group.result()
                for i, entries in zip(group, scored):
                    if given[i]:  # an empty prompt echoes nothing
                        for choice in self.choices[i * best_of:(i + 1) * best_of]:
                            choice.entries = copy.deepcopy(entries)
        finally:
            self._release()

    def _deliver(self, index: int, tokens, log_probs, *, error: Optional[str] = None) -> None:
        # Called on the Batcher's thread: hand over to the event loop.
        try:
            self.loop.call_soon_threadsafe(self.inbox.put_nowait, (index, tokens, log_probs, error))
        except RuntimeError:  # the event loop has closed: nobody waits for these rows, which leave their slots
            self.close()

    def close(self) -> None:
        """Done, or the client went away: their rows leave their slots at the next chunk, and prompts not yet
        scored leave the queue's count."""
        for row in self.rows.values():
            row.done = True
        self._release()

    async def events(self) -> AsyncIterator[tuple]:
        """Yields (choice, new text, finished) as rows deliver; every choice ends with a finish."""
        if self.scorer is not None:
            await self._score_echoes()
        for choice in self.choices:
            if choice.prefix:
                yield choice, choice.prefix, False
            if not self.request.max_tokens:
                yield choice, choice.finish('length'), True
        open_rows = set(self.rows)  # not row.done: the Batcher may set that before its last chunk arrives here
        while open_rows:
            index, tokens, log_probs, error = await self.inbox.get()
            choice = self.choices[index]
            if error is not None:
                raise APIError(500, f'generation failed: {error}', kind='server_error')
            if index not in open_rows:
                continue
            try:
                text = choice.add(tokens, log_probs) if tokens is not None else ''
            except GPT2Error as e:  # a token the model drew that its vocabulary cannot write (a padded n_vocab)
                raise APIError(500, f'generation failed: {e}', kind='server_error') from None
            if tokens is not None and len(tokens):
                self.last_token = time.monotonic()
                if self.first_token is None:
                    self.first_token, self.first_count = self.last_token, len(tokens)
            if tokens is None or choice.finish_reason:
                self.rows[index].done = True
                open_rows.discard(index)
                yield choice, text + choice.finish('length'), True
            elif text:
                yield choice, text, False

    def usage(self) -> Usage:
        """Prompt tokens (as sent) once per prompt, whatever n and best_of, as OpenAI and vLLM count them;
        completion tokens of every choice drawn (best_of of them), each up to its stop string."""
        prompt = sum(len(p) for p in self.sampling.given)
        completion = sum(c.kept() for c in self.choices)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def longest(self) -> int:
        """The most tokens one choice drew: the decode steps the request took."""
        return max((len(c.tokens) for c in self.choices), default=0)

    def chunk(self, choices: List[CompletionChoice], usage: Optional[Usage] = None) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)

    async def response(self) -> CompletionResponse:
        """The whole completion, once every choice has finished."""
        texts = {choice.index: '' for choice in self.choices}
        try:
            async for choice, text, _ in self.events():
                texts[choice.index] += text
        finally:
            self.close()
        self.complete = True
        return self.chunk([CompletionChoice(text=texts[c.index], index=index, logprobs=c.logprobs_object(),
                                            finish_reason=c.finish_reason) for index, c in enumerate(self.best())],
                          self.usage())

    def best(self) -> List[Choice]:
        """The n choices of each prompt to return, prompt-major: the likeliest best_of ones if best_of > n."""
        n, best_of = self.request.n, self.sampling.best_of
        if best_of == n:
            return self.choices
        kept = []
        for i in range(0, len(self.choices), best_of):
            drawn = self.choices[i:i + best_of]
            kept += sorted(drawn, key=lambda c: -c.mean_logprob())[:n]  # stable: ties keep their order
        return kept

    async def stream(self) -> AsyncIterator[str]:
        """Server-sent events: a chunk per new text, the usage when asked for, then [DONE]."""
        try:
            async for choice, text, finished in self.events():
                part = CompletionChoice(text=text, index=choice.index, logprobs=choice.new_logprobs(),
                                        finish_reason=choice.finish_reason if finished else None)
                yield f'data: {self.chunk([part]).model_dump_json()}\n\n'
            if self.request.stream_options and self.request.stream_options.include_usage:
                yield f'data: {self.chunk([], self.usage()).model_dump_json()}\n\n'
            yield 'data: [DONE]\n\n'
            self.complete = True
        except Exception as error:  # the headers have gone: an error event (as vLLM sends), then the end
            self.failed = True
            if not isinstance(error, APIError):  # a bug: its traceback goes to the log, its name to the client
                LOG.exception("a completion stream failed")
                error = APIError(500, f'the server failed on this request ({type(error).__name__}); its log has '
                                      f'the details', kind='server_error')
            yield f'data: {json.dumps(error.body())}\n\n'
            yield 'data: [DONE]\n\n'
        finally:  # also when the client goes away
            self.close()
