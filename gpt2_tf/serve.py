"""An OpenAI-compatible completions server over the library, in three parts:

- protocol: the request schema (the OpenAI field names and meanings; validation
  lives here) and the response and error shapes;
- scheduling: `Batcher`, a queue with a capacity that runs waves of rows (every
  prompt times n) as one decode call, with per-row options and seeds, and
  delivers each row's tokens chunk by chunk;
- the app: thin handlers that check, enqueue, and stream or collect.

POST /v1/completions, GET /v1/models, GET /health. /v1/chat/completions is out
of scope: GPT-2 has no chat format.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import threading
import time
from typing import Dict, List, Optional, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .encoder import END_OF_TEXT, Encoder
from .model import Model
from .sample import sample_chunks
from .scoring import score
from .validate import MAX_TEMPERATURE

MAX_BODY = 1 << 20  # bytes in a request body
STREAM_CHUNK = 8  # tokens per compiled call when streaming: the first text arrives early
MAX_LOGPROBS = 5


# --- protocol -----------------------------------------------------------------------------------

class APIError(Exception):
    """An error in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None,
                 kind: str = 'invalid_request_error', headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {'error': {'message': self.message, 'type': self.kind, 'param': self.param, 'code': self.code}}


Prompt = Union[str, List[str], List[int], List[List[int]], None]


class CompletionRequest(BaseModel):
    """POST /v1/completions, with OpenAI's field names and meanings; top_k is an extension."""

    model_config = ConfigDict(extra='forbid')

    model: Optional[str] = None
    prompt: Prompt = None  # omitted: unconditional, after <|endoftext|>
    max_tokens: int = Field(16, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float = Field(1.0, ge=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    n: int = Field(1, ge=1, le=16)
    stop: Union[str, List[str], None] = None
    seed: Optional[int] = Field(None, ge=-2**63, le=2**63 - 1)
    stream: bool = False
    stream_options: Optional[dict] = None
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    user: Optional[str] = None
    # Accepted so that clients sending the defaults work; anything else is refused by name.
    best_of: Optional[int] = None
    logit_bias: Optional[Dict[str, float]] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    suffix: Optional[str] = None

    @field_validator('stop')
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError('stop takes up to 4 non-empty strings')
        return stops

    @model_validator(mode='after')
    def _unsupported(self):
        for name, unsupported in (('best_of', (self.best_of or 1) > 1), ('logit_bias', bool(self.logit_bias)),
                                  ('presence_penalty', self.presence_penalty != 0),
                                  ('frequency_penalty', self.frequency_penalty != 0),
                                  ('suffix', self.suffix is not None)):
            if unsupported:
                raise ValueError(f'{name} is not supported by this server')
        return self


def prompts_of(request: CompletionRequest, encoder: Encoder, n_vocab: int) -> list:
    """The request's prompts as lists of token ids; an omitted or empty prompt is <|endoftext|>."""
    start = [encoder.encoder[END_OF_TEXT]]
    prompt = request.prompt
    if prompt is None or prompt == '' or prompt == []:
        return [start]
    if isinstance(prompt, str):
        rows = [encoder.encode(prompt)]
    elif all(isinstance(p, str) for p in prompt):
        rows = [encoder.encode(p) for p in prompt]
    elif all(isinstance(p, int) for p in prompt):
        rows = [list(prompt)]
    else:
        rows = [list(p) for p in prompt]
    for row in rows:
        bad = [t for t in row if not 0 <= t < n_vocab]
        if bad:
            raise APIError(400, f'prompt token id {bad[0]} is outside the vocabulary [0, {n_vocab})', param='prompt')
    return [row or start for row in rows]


# --- scheduling ---------------------------------------------------------------------------------

class Row:
    """One choice of one request: a prompt, its options, and where its tokens go."""

    def __init__(self, prompt: list, max_tokens: int, options: dict, key, logprobs: Optional[int], deliver):
        self.prompt, self.max_tokens, self.options, self.key = prompt, max_tokens, options, key
        self.logprobs, self.deliver = logprobs, deliver
        self.done = False  # finished, or its client went away


class Batcher:
    """Runs waves of up to `capacity` rows as one decode call each, on one worker thread.

    Rows wait in a queue of at most `queue_size`; a wave takes the rows that fit
    together (the longest prompt plus the longest max_tokens within the window).
    Each row's tokens go to its deliver(tokens, log_probs) callback chunk by
    chunk, then deliver(None, None); a wave stops early once every row is done.
    """

    def __init__(self, model: Model, *, capacity: int = 16, queue_size: int = 256, chunk: int = STREAM_CHUNK,
                 mode: Optional[str] = None):
        self.model, self.capacity, self.queue_size, self.chunk, self.mode = model, capacity, queue_size, chunk, mode
        self.pending: List[Row] = []
        self.lock = threading.Condition()
        self.stopped = False
        self.waves = 0  # waves run, for tests and logs
        self.thread = threading.Thread(target=self._work, name='gpt2_tf-batcher', daemon=True)
        self.thread.start()

    def submit(self, rows: List[Row]) -> None:
        with self.lock:
            if len(self.pending) + len(rows) > self.queue_size:
                raise APIError(503, f'the server is busy ({len(self.pending)} rows waiting); retry shortly',
                               kind='server_error', code='overloaded', headers={'Retry-After': '1'})
            self.pending.extend(rows)
            self.lock.notify()

    def close(self):
        with self.lock:
            self.stopped = True
            self.lock.notify()

    def _next_wave(self) -> List[Row]:
        with self.lock:
            while not self.pending and not self.stopped:
                self.lock.wait()
            if self.stopped:
                return []
            n_ctx = self.model.hparams.n_ctx
            wave, rest = [], []
            for row in self.pending:
                if row.done:
                    continue
                longest = max([len(r.prompt) for r in wave] + [len(row.prompt)])
                length = max([r.max_tokens for r in wave] + [row.max_tokens])
                if len(wave) < self.capacity and longest + length - 1 <= n_ctx:
                    wave.append(row)
                else:
                    rest.append(row)
            self.pending = rest
            return wave

    def _work(self):
        while True:
            wave = self._next_wave()
            if not wave:
                if self.stopped:
                    return
                continue
            self.waves += 1
            try:
                self._run(wave)
            except Exception as e:  # a failed wave fails its rows, never the server
                for row in wave:
                    row.deliver(None, None, error=str(e))

    def _run(self, wave: List[Row]) -> None:
        # Waves are padded to 1, 2, 4, ... rows with idle copies of the first row, so that the compiled
        # loop sees a few batch sizes rather than every one (each new shape compiles for seconds).
        size = min(1 << (len(wave) - 1).bit_length(), max(self.capacity, len(wave)))
        filler = [Row(wave[0].prompt, wave[0].max_tokens, wave[0].options, (0, 0), None, lambda *a, **k: None)
                  for _ in range(size - len(wave))]
        for row in filler:
            row.done = True
        wave = wave + filler
        length = max(row.max_tokens for row in wave)
        wanted = [row.logprobs for row in wave if row.logprobs is not None]
        options = {name: [row.options[name] for row in wave] for name in ('temperature', 'top_k', 'top_p')}
        chunks = sample_chunks(self.model, length, context=[row.prompt for row in wave],
                               seed=np.array([row.key for row in wave], np.int64), mode=self.mode,
                               chunk=self.chunk, logprobs=max(wanted) if wanted else None, **options)
        step, ended = 0, set()  # ended: rows that got all their tokens
        try:
            for out in chunks:
                tokens = out['tokens'] if isinstance(out, dict) else out
                for i, row in enumerate(wave):
                    if row.done or i in ended:
                        continue
                    take = min(tokens.shape[1], row.max_tokens - step)
                    if take > 0:
                        lp = {k: v[i, :take] for k, v in out.items()} if isinstance(out, dict) else None
                        row.deliver(tokens[i, :take], lp)
                    if step + take >= row.max_tokens:
                        ended.add(i)
                        row.deliver(None, None)
                step += tokens.shape[1]
                if all(row.done or i in ended for i, row in enumerate(wave)):
                    break  # every row has stopped or gone: the rest of the wave is not computed
        finally:
            chunks.close()


# --- choices: tokens to text, stops, log-probs ----------------------------------------------------

class Choice:
    """One choice as it grows: its text, finish reason and OpenAI logprobs object."""

    def __init__(self, index: int, encoder: Encoder, stops: list, logprobs: Optional[int], prefix: str = '',
                 prefix_logprobs: Optional[dict] = None):
        self.index, self.encoder, self.stops, self.logprobs = index, encoder, stops, logprobs
        self.end = encoder.encoder[END_OF_TEXT]
        self.tokens: List[int] = []
        self.sent = 0  # characters of text already handed out
        self.prefix = prefix  # the echoed prompt
        self.finish_reason: Optional[str] = None
        self.entries = prefix_logprobs or {'tokens': [], 'token_logprobs': [], 'top_logprobs': [], 'text_offset': []}

    def add(self, tokens, log_probs) -> str:
        """Takes new tokens; returns the text ready to send (held back while a stop may still form)."""
        for i, token in enumerate(map(int, tokens)):
            if self.finish_reason:
                break
            if token == self.end:
                self.finish_reason = 'stop'
                break
            self.tokens.append(token)
            if self.logprobs is not None and log_probs is not None:
                piece = self.encoder.decode([token])
                offset = len(self.prefix) + len(self.encoder.decode(self.tokens[:-1]))
                top = {self.encoder.decode([int(t)]): float(p) for t, p in
                       zip(log_probs['top_ids'][i][:self.logprobs], log_probs['top_log_probs'][i][:self.logprobs])}
                self._entry(piece, float(log_probs['log_probs'][i]), top, offset)
        text = self.encoder.decode(self.tokens)
        for stop in self.stops:
            at = text.find(stop)
            if at >= 0:
                text, self.finish_reason = text[:at], 'stop'
        if not self.finish_reason:
            text = text.rstrip('\ufffd')  # a token may end inside a UTF-8 character: wait for the rest
            hold = max((len(s) - 1 for s in self.stops), default=0)  # a stop may be forming at the end
            text = text[:max(len(text) - hold, self.sent)]
        new = text[self.sent:]
        self.sent = len(text)
        return new

    def finish(self, reason: str = 'length') -> str:
        self.finish_reason = self.finish_reason or reason
        text = self.encoder.decode(self.tokens)
        for stop in self.stops:
            at = text.find(stop)
            if at >= 0:
                text, self.finish_reason = text[:at], 'stop'
        new = text[self.sent:]
        self.sent = len(text)
        return new

    def _entry(self, piece, log_prob, top, offset):
        self.entries['tokens'].append(piece)
        self.entries['token_logprobs'].append(log_prob)
        self.entries['top_logprobs'].append(top)
        self.entries['text_offset'].append(offset)

    def logprobs_object(self) -> Optional[dict]:
        if self.logprobs is None:
            return None
        kept = len(self.entries['tokens'])
        if self.finish_reason == 'stop' and self.stops:  # drop the entries past a stop string
            limit = len(self.prefix) + self.sent
            kept = sum(1 for offset in self.entries['text_offset'] if offset < limit)
        return {name: values[:kept] for name, values in self.entries.items()}


def echo_logprobs(model: Model, encoder: Encoder, prompt: list, top: int) -> dict:
    """The prompt's own logprobs object, from scoring (the first token has none)."""
    entries = {'tokens': [], 'token_logprobs': [], 'top_logprobs': [], 'text_offset': []}
    lp, ids, top_lp = (None, None, None)
    if len(prompt) >= 2 and len(prompt) <= model.hparams.n_ctx:
        lp, ids, top_lp = score(model, [prompt], top=max(top, 1))
        lp, ids, top_lp = lp[0], ids[0], top_lp[0]
    offset = 0
    for i, token in enumerate(prompt):
        piece = encoder.decode([token])
        entries['tokens'].append(piece)
        entries['text_offset'].append(offset)
        if i == 0 or lp is None:
            entries['token_logprobs'].append(None)
            entries['top_logprobs'].append(None)
        else:
            entries['token_logprobs'].append(float(lp[i - 1]))
            entries['top_logprobs'].append({encoder.decode([int(t)]): float(p)
                                            for t, p in zip(ids[i - 1][:top], top_lp[i - 1][:top])})
        offset += len(piece)
    return entries


# --- the app ------------------------------------------------------------------------------------

def create_app(model: Model, encoder: Encoder, *, model_id: str, api_key: Optional[str] = None,
               capacity: int = 16, queue_size: int = 256, mode: Optional[str] = None):
    """The FastAPI app. Handlers check, enqueue rows with the Batcher, and collect or stream."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.concurrency import run_in_threadpool

    batcher = Batcher(model, capacity=capacity, queue_size=queue_size, mode=mode)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        yield
        batcher.close()

    app = FastAPI(title='gpt2_tf', docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.batcher = batcher
    n_ctx, n_vocab = model.hparams.n_ctx, model.hparams.n_vocab
    created = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(_, error: APIError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, error: RequestValidationError):  # OpenAI answers 400, not FastAPI's 422
        first = error.errors()[0]
        param = '.'.join(str(p) for p in first.get('loc', ())[1:2]) or None
        message = first.get('msg', 'invalid request').removeprefix('Value error, ')
        if first.get('type') == 'extra_forbidden':
            message = f'unknown field {param!r}'
        return JSONResponse(APIError(400, f'{param}: {message}' if param else message, param=param).body(),
                            status_code=400)

    @app.middleware('http')
    async def guard(request: Request, call_next):
        if api_key is not None and request.url.path.startswith('/v1/') and \
                request.headers.get('authorization') != f'Bearer {api_key}':
            error = APIError(401, 'invalid API key: send it as "Authorization: Bearer KEY"',
                             kind='authentication_error', code='invalid_api_key')
            return JSONResponse(error.body(), status_code=401)
        size = request.headers.get('content-length')
        if size is not None and size.isdigit() and int(size) > MAX_BODY:
            error = APIError(413, f'the request body is {int(size):,} bytes; the limit is {MAX_BODY:,}')
            return JSONResponse(error.body(), status_code=413)
        return await call_next(request)

    @app.get('/health')
    async def health():
        return {'status': 'ok'}

    @app.get('/v1/models')
    async def models():
        return {'object': 'list', 'data': [{'id': model_id, 'object': 'model', 'created': created,
                                            'owned_by': 'gpt2_tf'}]}

    @app.post('/v1/completions')
    async def completions(request: CompletionRequest):
        if request.model is not None and request.model != model_id:
            raise APIError(404, f'model {request.model!r} is not served here; this server serves {model_id!r}',
                           param='model', code='model_not_found')
        prompts = prompts_of(request, encoder, n_vocab)
        for i, prompt in enumerate(prompts):
            if request.max_tokens and len(prompt) + request.max_tokens - 1 > n_ctx:
                over = len(prompt) + request.max_tokens - 1 - n_ctx
                raise APIError(400, f'prompt {i} ({len(prompt)} tokens) plus max_tokens {request.max_tokens} is '
                                    f'{over} token(s) over the window (prompt + max_tokens - 1 <= {n_ctx})',
                               param='max_tokens')
            if request.echo and request.logprobs is not None and len(prompt) > n_ctx:
                raise APIError(400, f'prompt {i} has {len(prompt)} tokens, more than n_ctx = {n_ctx}',
                               param='prompt')
        seed = request.seed if request.seed is not None else secrets.randbits(63)
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()
        choices, rows = [], []
        for i, prompt in enumerate(prompts):
            prefix, prefix_lp = '', None
            if request.echo:
                prefix = encoder.decode(prompt) if request.prompt not in (None, '', []) else ''
                if request.logprobs is not None and prefix:
                    prefix_lp = await run_in_threadpool(echo_logprobs, model, encoder, prompt, request.logprobs)
            for j in range(request.n):
                index = i * request.n + j
                choices.append(Choice(index, encoder, request.stop or [], request.logprobs, prefix,
                                      json.loads(json.dumps(prefix_lp)) if prefix_lp else None))
                if request.max_tokens == 0:
                    continue

                def deliver(tokens, log_probs, *, error=None, index=index):
                    loop.call_soon_threadsafe(inbox.put_nowait, (index, tokens, log_probs, error))

                rows.append(Row(prompt, request.max_tokens, dict(temperature=request.temperature,
                                top_k=request.top_k, top_p=request.top_p), (seed, index), request.logprobs, deliver))
        if rows:
            batcher.submit(rows)
        by_index = {row.key[1]: row for row in rows}
        completion_id = f'cmpl-{secrets.token_hex(12)}'
        base = {'id': completion_id, 'object': 'text_completion', 'created': int(time.time()), 'model': model_id}
        usage_prompt = sum(len(p) for p in prompts) * request.n

        async def events():
            """Yields (choice, new text, finished) as rows deliver; every row ends with a finish."""
            open_rows = len(rows)
            for choice in choices:
                if choice.prefix:
                    yield choice, choice.prefix, False
                if request.max_tokens == 0:
                    choice.finish('length')
                    yield choice, '', True
            while open_rows:
                index, tokens, log_probs, error = await inbox.get()
                row, choice = by_index[index], choices[index]
                if error is not None:
                    raise APIError(500, f'generation failed: {error}', kind='server_error')
                if row.done:
                    continue
                if tokens is None:
                    row.done = True
                    open_rows -= 1
                    yield choice, choice.finish('length'), True
                    continue
                text = choice.add(tokens, log_probs)
                if choice.finish_reason:
                    row.done = True
                    open_rows -= 1
                    yield choice, text + choice.finish(), True
                elif text:
                    yield choice, text, False

        def usage():
            completion = sum(len(c.tokens) for c in choices)
            return {'prompt_tokens': usage_prompt, 'completion_tokens': completion,
                    'total_tokens': usage_prompt + completion}

        if not request.stream:
            texts = {c.index: '' for c in choices}
            try:
                async for choice, text, _ in events():
                    texts[choice.index] += text
            finally:
                for row in rows:
                    row.done = True
            return {**base, 'choices': [{'text': texts[c.index], 'index': c.index,
                                         'logprobs': c.logprobs_object(), 'finish_reason': c.finish_reason}
                                        for c in choices], 'usage': usage()}

        async def stream():
            try:
                async for choice, text, finished in events():
                    lp = choice.logprobs_object() if finished else None
                    chunk = {**base, 'choices': [{'text': text, 'index': choice.index, 'logprobs': lp,
                                                  'finish_reason': choice.finish_reason if finished else None}]}
                    yield f'data: {json.dumps(chunk)}\n\n'
                if (request.stream_options or {}).get('include_usage'):
                    yield f'data: {json.dumps({**base, "choices": [], "usage": usage()})}\n\n'
                yield 'data: [DONE]\n\n'
            finally:  # also when the client goes away: its rows stop taking a place in the wave
                for row in rows:
                    row.done = True

        return StreamingResponse(stream(), media_type='text/event-stream')

    return app


def serve(model: Model, encoder: Encoder, *, model_id: str, host: str = '127.0.0.1', port: int = 8000,
          api_key: Optional[str] = None, capacity: int = 16, queue_size: int = 256, mode: Optional[str] = None) -> None:
    """Runs the server with uvicorn until interrupted."""
    import uvicorn

    app = create_app(model, encoder, model_id=model_id, api_key=api_key, capacity=capacity, queue_size=queue_size,
                     mode=mode)
    uvicorn.run(app, host=host, port=port, log_level='warning')

