"""The app: FastAPI routes of a few lines each over the protocol, the Batcher and Completion.

POST /v1/completions, GET /v1/models, GET /health. /v1/chat/completions is out
of scope: GPT-2 has no chat format.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from typing import Optional, Sequence

from ..encoder import Encoder
from ..runtime import Model
from ..validate import GPT2Error
from .batcher import Batcher
from .completion import Completion
from .protocol import (APIError, CompletionRequest, CompletionResponse, Health, ModelCard, ModelList, check_model,
                       invalid, invalid_request)

MAX_BODY = 1 << 20  # bytes in a request body


def create_app(model: Model, encoder: Encoder, *, model_id: str, aliases: Sequence[str] = (),
               api_key: Optional[str] = None, capacity: int = 16, queue_size: int = 256, mode: Optional[str] = None,
               timeout: float = 0.005):
    """The FastAPI app serving `model` as model_id (listed by /v1/models) and as each of its aliases.

    capacity, queue_size and timeout are the Batcher's; mode is sample_chunks'.
    """
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    batcher = Batcher(model, capacity=capacity, queue_size=queue_size, timeout=timeout, mode=mode)
    served = (model_id, *[name for name in aliases if name != model_id])
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_):
        yield
        batcher.close()

    app = FastAPI(title='gpt2_tf', docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.batcher = batcher
    _answer_errors(app)
    _guard(app, api_key)

    @app.get('/health', response_model=Health)
    async def health():
        return Health()

    @app.get('/v1/models', response_model=ModelList)
    async def models():
        return ModelList(data=[ModelCard(id=model_id, created=created)])

    @app.post('/v1/completions', response_model=CompletionResponse)
    async def completions(request: CompletionRequest):
        check_model(request.model, served)
        completion = Completion(request, request.to_sampling(encoder, model.hparams), encoder, model_id)
        await completion.submit(model, batcher)
        if request.stream:
            return StreamingResponse(completion.stream(), media_type='text/event-stream')
        return await completion.response()

    return app


def error_response(error: APIError):
    from fastapi.responses import JSONResponse

    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _answer_errors(app) -> None:
    """Every error the app raises leaves in OpenAI's shape."""
    from fastapi.exceptions import RequestValidationError

    @app.exception_handler(APIError)
    async def api_error(_, error: APIError):
        return error_response(error)

    @app.exception_handler(GPT2Error)
    async def checked(_, error: GPT2Error):
        return error_response(invalid(error))

    @app.exception_handler(RequestValidationError)
    async def malformed(_, error: RequestValidationError):
        return error_response(invalid_request(error.errors()))


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


def _guard(app, api_key: Optional[str]) -> None:
    @app.middleware('http')
    async def guard(request, call_next):
        error = refusal(request.url.path, request.headers, api_key)
        return error_response(error) if error else await call_next(request)
