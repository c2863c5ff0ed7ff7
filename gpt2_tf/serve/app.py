"""The app: FastAPI routes of a few lines each over the protocol, the Batcher and Completion.

POST /v1/completions, GET /v1/models, GET /health, GET /metrics (Prometheus).
/v1/chat/completions is out of scope: GPT-2 has no chat format. Every refusal,
an unknown route's included, leaves in OpenAI's error shape; Gate, the ASGI
middleware in front, checks the key, bounds the body as it arrives, and
counts and logs each request.
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations, and Request is imported
# inside create_app (the package imports without the server extra), so they must be objects, not names.
import asyncio
import contextlib
import secrets
import sys
import time
from typing import Optional, Sequence, TextIO

from ..encoder import Encoder
from ..runtime import Model
from ..validate import GPT2Error, check_api_key
from .batcher import Batcher, cut_short, shutting_down
from .completion import Completion
from .metrics import CLIENT_GONE, Metrics, log_access
from .protocol import (APIError, CompletionRequest, CompletionResponse, Health, ModelCard, ModelList, check_model,
                       invalid, invalid_request)

MAX_BODY = 1 << 20  # bytes in a request body
UNCOUNTED = ('/metrics',)  # scrapes are neither counted nor logged


def create_app(model: Model, encoder: Encoder, *, model_id: str, aliases: Sequence[str] = (),
               api_key: Optional[str] = None, capacity: int = 16, queue_size: int = 256, mode: Optional[str] = None,
               timeout: float = 0.005, access_log: Optional[TextIO] = None):
    """The FastAPI app serving `model` as model_id (listed by /v1/models) and as each of its aliases.

    capacity, queue_size and timeout are the Batcher's; mode is sample_chunks'. access_log,
    if given, takes one line per request (metrics.access_line).
    """
    from fastapi import FastAPI, Request
    from fastapi.responses import Response, StreamingResponse

    check_api_key(api_key)
    batcher = Batcher(model, capacity=capacity, queue_size=queue_size, timeout=timeout, mode=mode)
    served = (model_id, *[name for name in aliases if name != model_id])
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_):
        yield
        batcher.close()

    app = FastAPI(title='gpt2_tf', docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.batcher = batcher
    app.state.metrics = metrics = Metrics(batcher)
    _answer_errors(app)
    app.add_middleware(Gate, api_key=api_key, metrics=metrics, log=access_log)

    @app.get('/health', response_model=Health)
    async def health():
        return Health()

    @app.get('/v1/models', response_model=ModelList)
    async def models():
        return ModelList(data=[ModelCard(id=model_id, created=created)])

    @app.get('/metrics', include_in_schema=False)
    async def scrape():
        return Response(metrics.scrape(), media_type=Metrics.CONTENT_TYPE)

    @app.post('/v1/completions', response_model=CompletionResponse)
    async def completions(request: CompletionRequest, http: Request):
        check_model(request.model, served)
        completion = Completion(request, request.to_sampling(encoder, model.hparams), encoder, model_id)
        completion.submit(model, batcher)
        http.state.completion = completion  # for Gate's metrics and access log
        if request.stream:
            return StreamingResponse(completion.stream(), media_type='text/event-stream')
        return await answered(completion, http)

    return app


async def answered(completion: Completion, http, *, every: float = 0.25):
    """The whole response; or, once the client has gone (looked for every `every` seconds), 499 and the
    completion cancelled, so that its rows leave their slots at the next chunk as a stream's do."""
    task = asyncio.ensure_future(completion.response())
    while not (await asyncio.wait({task}, timeout=every))[0]:
        if await http.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return error_response(APIError(CLIENT_GONE, 'the client closed the connection before the response',
                                           code='client_closed_request'))
    return task.result()


def error_response(error: APIError):
    from fastapi.responses import JSONResponse

    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _answer_errors(app) -> None:
    """Every error the app raises leaves in OpenAI's shape."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    @app.exception_handler(APIError)
    async def api_error(_, error: APIError):
        return error_response(error)

    @app.exception_handler(GPT2Error)
    async def checked(_, error: GPT2Error):
        return error_response(invalid(error))

    @app.exception_handler(RequestValidationError)
    async def malformed(request, error: RequestValidationError):
        return error_response(invalid_request(error.errors(), request.headers.get('content-type', '')))

    @app.exception_handler(HTTPException)
    async def routing(request, error: HTTPException):
        return error_response(http_error(request.method, request.url.path, error))

    @app.exception_handler(Exception)
    async def unexpected(_, error: Exception):  # a bug: still OpenAI's shape (and the traceback in the log)
        return error_response(APIError(500, f'the server failed on this request ({type(error).__name__}); '
                                            f'its log has the details', kind='server_error'))


def http_error(method: str, path: str, error) -> APIError:
    """Starlette's and FastAPI's own errors (unknown route, wrong method, unparsable body) in OpenAI's shape."""
    cause = error.__cause__
    if isinstance(cause, RecursionError):  # json.loads gives up past about 1,000 levels
        return APIError(400, 'the body nests too deeply to parse: send a flat JSON object of the completions fields')
    if isinstance(cause, UnicodeDecodeError):
        return APIError(400, f'the body is not UTF-8 (byte 0x{cause.object[cause.start]:02x} at byte {cause.start}): '
                             f'send JSON in UTF-8')
    if isinstance(cause, ValueError) and 'digits' in str(cause):  # Python's int() refuses past 4300 digits
        return APIError(400, f'the body holds a number of more than {sys.get_int_max_str_digits()} digits: send '
                             f'each field within its range')
    if error.status_code == 404:
        return APIError(404, f'no route {method} {path}: this server answers POST /v1/completions, GET /v1/models, '
                             f'GET /health and GET /metrics', code='not_found')
    if error.status_code == 405:
        return APIError(405, f'{method} is not allowed on {path}', code='method_not_allowed',
                        headers=dict(error.headers or {}))
    return APIError(error.status_code, str(error.detail), headers=dict(error.headers or {}))


def refusal(path: str, headers, api_key: Optional[str]) -> Optional[APIError]:
    """Why a request is refused before its body is read: a wrong API key, or a declared body over MAX_BODY."""
    if api_key is not None and path.startswith('/v1/') and \
            not secrets.compare_digest(headers.get('authorization', '').encode(), f'Bearer {api_key}'.encode()):
        return APIError(401, 'invalid API key: send it as "Authorization: Bearer KEY"',
                        kind='authentication_error', code='invalid_api_key')
    size = headers.get('content-length')
    if size is not None and size.isdigit() and int(size) > MAX_BODY:
        return APIError(413, f'the request body is {int(size):,} bytes; the limit is {MAX_BODY:,}')
    return None


async def read_body(receive) -> tuple:
    """The body's messages, counted as they arrive: (messages, None), or (None, APIError 413) once past MAX_BODY
    (a chunked body has no Content-Length to refuse it by)."""
    messages, size = [], 0
    while True:
        message = await receive()
        messages.append(message)
        if message['type'] != 'http.request':
            return messages, None  # the client went away
        size += len(message.get('body', b''))
        if size > MAX_BODY:
            return None, APIError(413, f'the request body is over {MAX_BODY:,} bytes, the limit')
        if not message.get('more_body', False):
            return messages, None


class Gate:
    """ASGI middleware: refuses a wrong key or an oversized body, then counts and logs each request as it ends.

    The body is read here, bounded, and handed to the app as it came.
    """

    def __init__(self, app, *, api_key: Optional[str], metrics: Metrics, log: Optional[TextIO]):
        self.app, self.api_key, self.metrics, self.log = app, api_key, metrics, log

    async def __call__(self, scope, receive, send):
        if scope['type'] != 'http':
            return await self.app(scope, receive, send)
        from starlette.datastructures import Headers

        started, state, status, begun = time.monotonic(), scope.setdefault('state', {}), [500], []

        async def sending(message):
            if message['type'] == 'http.response.start':
                status[0] = message['status']
                begun.append(True)
            await send(message)

        try:
            error = refusal(scope['path'], Headers(scope=scope), self.api_key)
            messages = None
            if error is None:
                try:
                    messages, error = await read_body(receive)
                except asyncio.CancelledError:  # the server's drain ended while the body still came: say so
                    error = shutting_down()
            if error is not None:
                return await error_response(error)(scope, receive, sending)
            if messages[-1]['type'] == 'http.disconnect':  # gone before its body ended: nobody to answer
                status[0] = CLIENT_GONE
                return
            replay = iter(messages)
            try:
                await self.app(scope, lambda: _next(replay, receive), sending)
            except asyncio.CancelledError:  # a forced exit (a second Ctrl-C) cut it: said in OpenAI's shape
                if begun:  # a stream under way ends where it was
                    raise
                await error_response(cut_short())(scope, receive, sending)
        finally:
            completion = state.get('completion')
            if completion is not None:  # a stream that never started runs no finally of its own
                completion.close()
            if scope['path'] not in UNCOUNTED:
                self.metrics.record(status[0], completion)
                log_access(self.log, scope['method'], scope['path'], status[0], completion, started)


async def _next(replay, receive):
    """The body's messages as they came, then the client's own (a disconnect)."""
    message = next(replay, None)
    return message if message is not None else await receive()
