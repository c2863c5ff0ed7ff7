"""The OpenAI completions protocol: the request, the response and error shapes, with OpenAI's field names.

`CompletionRequest.to_sampling` is the one place a request turns into checked
token rows and sampling options; every check it makes is validate.py's.
"""

from __future__ import annotations

import dataclasses
import re
import secrets
from typing import Dict, List, Optional, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from ..encoder import END_OF_TEXT, Encoder
from ..hparams import HParams
from ..validate import (MAX_LOGIT_BIAS, MAX_PENALTY, GPT2Error, check_sampling, check_seed,
                        check_token_ids, check_window)

MAX_LOGPROBS = 5  # top log-probs per token, as OpenAI's completions
MAX_CHOICES = 16  # n, and best_of, per prompt


class APIError(Exception):
    """An error in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None,
                 kind: str = 'invalid_request_error', headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def response(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorBody(message=self.message, type=self.kind, param=self.param, code=self.code))

    def body(self) -> dict:
        return self.response().model_dump()


def invalid(error: GPT2Error, param: Optional[str] = None) -> APIError:
    """A failed validate.py check as a 400."""
    return APIError(400, str(error), param=param)


def invalid_request(errors: Sequence[dict], content_type: str = 'application/json') -> APIError:
    """The first of pydantic's errors as a 400 (OpenAI answers 400 where FastAPI would answer 422); a body sent
    as another type (a form, plain text) is not read as JSON, so that is what the message names."""
    first = errors[0] if errors else {}
    if 'json' not in content_type.lower() and tuple(first.get('loc', ())) == ('body',):
        sent = f'as {content_type.split(";")[0]}' if content_type else 'without a Content-Type header'
        return APIError(400, f'the body was sent {sent}: send JSON, with the header Content-Type: application/json')
    if first.get('type') == 'json_invalid':  # loc is ('body', character offset)
        at = first.get('loc', ('body', '?'))[1:2] or ('?',)
        reason = (first.get('ctx') or {}).get('error', 'JSON decode error')
        return APIError(400, f'the body is not valid JSON ({reason} at character {at[0]}): send a JSON object')
    if tuple(first.get('loc', ())) == ('body',) and first.get('type') != 'value_error':  # missing, or not an object
        return APIError(400, 'the body must be a JSON object, such as {"prompt": "Hello", "max_tokens": 16}')
    param = '.'.join(str(p) for p in first.get('loc', ())[1:2]) or None
    message = first.get('msg', 'invalid request').removeprefix('Value error, ')
    if first.get('type') == 'extra_forbidden':
        message = f"unknown field {'.'.join(str(p) for p in first['loc'][1:])!r}"
    elif param == 'prompt':  # the first of the union's failures says little
        message = 'must be a string, a list of strings, a list of token ids (integers) or a list of such lists'
    return APIError(400, f'{param}: {message}' if param else message, param=param)


def check_model(requested: Optional[str], served: Sequence[str]) -> None:
    """A request may name any of the served ids, or none."""
    if requested is not None and requested not in served:
        names = ', '.join(repr(name) for name in served)
        raise APIError(404, f'model {requested!r} is not served here; this server serves {names}',
                       param='model', code='model_not_found')


# --- the request --------------------------------------------------------------------------------

Prompt = Union[str, List[str], List[StrictInt], List[List[StrictInt]], None]  # strict: true is not token 1


@dataclasses.dataclass(frozen=True)
class Sampling:
    """A request as the engine takes it: checked token rows and per-row options."""

    prompts: List[List[int]]  # one row per prompt, <|endoftext|> for an empty one; n choices of each are drawn
    options: dict  # temperature, top_k, top_p, logit_bias, presence_penalty, frequency_penalty: the library's names
    seed: int  # row i of the request draws with the key (seed, i)
    best_of: int  # rows drawn per prompt; the n of them with the highest mean token log-prob are returned
    given: List[List[int]]  # the prompts as sent ([] for an empty one): what echo returns and usage counts


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra='forbid', strict=True)

    include_usage: Optional[bool] = None  # null is its default, off


class CompletionRequest(BaseModel):
    """POST /v1/completions, with OpenAI's field names and meanings; top_k is an extension."""

    model_config = ConfigDict(extra='forbid', strict=True)  # strict: true is not 1, nor "yes" true; 2 is 2.0

    model: Optional[str] = None
    prompt: Prompt = None  # omitted: unconditional, after <|endoftext|>
    max_tokens: int = Field(16, ge=0)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: Union[str, List[str], None] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    user: Optional[str] = None
    best_of: Optional[int] = None  # rows drawn per prompt (default n); not with stream
    logit_bias: Optional[Dict[str, float]] = None  # {"token id": bias}, added to the logits before the filters
    presence_penalty: float = 0.0  # logit -= count * frequency_penalty + (count > 0) * presence_penalty,
    frequency_penalty: float = 0.0  # counting the tokens this choice has generated so far
    suffix: Optional[str] = None  # accepted so that clients sending the default work; anything else is refused

    @model_validator(mode='before')
    @classmethod
    def _nulls(cls, data):
        """null for a field is its default, as OpenAI's nullable fields (max_tokens, temperature, n, ...) take it."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None or key not in cls.model_fields}
        return data

    @field_validator('stop')
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError('stop takes up to 4 non-empty strings')
        return stops

    @field_validator('stream_options')
    @classmethod
    def _streamed(cls, value, info):
        if value is not None and not info.data.get('stream'):
            raise ValueError('only allowed with stream=true')
        return value

    @field_validator('presence_penalty', 'frequency_penalty')
    @classmethod
    def _penalty(cls, value, info):
        if not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise ValueError(f'must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}')
        return value

    @field_validator('suffix')
    @classmethod
    def _unsupported(cls, value):
        raise ValueError('not supported by this server: leave it out')

    def choices(self) -> int:
        """Rows drawn per prompt: best_of, in [n, MAX_CHOICES] and not streamed, or n."""
        if self.best_of is None:
            return self.n
        if not self.n <= self.best_of <= MAX_CHOICES:
            raise APIError(400, f'best_of must be an integer in [n, {MAX_CHOICES}] (n = {self.n}), got {self.best_of}',
                           param='best_of')
        if self.stream and self.best_of > 1:
            raise APIError(400, 'best_of cannot be streamed: send stream=false, or leave out best_of',
                           param='best_of')
        return self.best_of

    @property
    def prompted(self) -> bool:
        """Whether a prompt was given (an empty one counts as none)."""
        return self.prompt not in (None, '', [])

    def to_sampling(self, encoder: Encoder, hparams: HParams) -> Sampling:
        """The request's rows and options, after validate.py's checks; raises APIError 400."""
        best_of = self.choices()
        given = self.prompts(encoder, hparams.n_vocab)
        end = encoder.encoder.get(END_OF_TEXT)
        if not all(given) and (end is None or end >= hparams.n_vocab):
            raise APIError(400, "an empty prompt starts after <|endoftext|>, which this model's vocabulary does not "
                                "have: send some text", param='prompt')
        prompts = [row or [end] for row in given]  # an empty prompt: after <|endoftext|>
        for i, prompt in enumerate(prompts):
            try:
                if self.max_tokens:
                    check_window(len(prompt), self.max_tokens, hparams.n_ctx, what=f'prompt {i}', name='max_tokens')
                elif len(prompt) > hparams.n_ctx:  # no token drawn: the prompt must still fit, as the model reads it
                    scored = self.echo and self.logprobs is not None
                    raise GPT2Error(f'prompt {i}: {len(prompt)} tokens, more than the {hparams.n_ctx} this model '
                                    f'reads; ' + ('an echoed prompt is scored in one call: shorten it' if scored
                                                  else 'shorten it'))
            except GPT2Error as e:
                raise invalid(e, 'max_tokens' if self.max_tokens else 'prompt') from None
        try:
            temperature, top_k, top_p = check_sampling(self.temperature, self.top_k, self.top_p, 1)
        except GPT2Error as e:
            raise invalid(e, str(e).split()[0]) from None  # each message starts with the option's name
        if self.seed is None:
            seed = secrets.randbits(63)
        else:
            try:
                check_seed(self.seed, 1)
            except GPT2Error as e:
                raise invalid(e, 'seed') from None
            seed = self.seed
        options = dict(temperature=float(temperature[0]), top_k=int(top_k[0]), top_p=float(top_p[0]),
                       logit_bias=self.biases(hparams.n_vocab), presence_penalty=float(self.presence_penalty),
                       frequency_penalty=float(self.frequency_penalty))
        return Sampling(prompts, options, seed, best_of, given)

    def biases(self, n_vocab: int) -> Optional[Dict[int, float]]:
        """logit_bias with int token ids, each checked to be in the vocabulary, each bias in [-100, 100]."""
        if not self.logit_bias:
            return None
        biases = {}
        for key, bias in self.logit_bias.items():
            token = int(key) if re.fullmatch(r'\s*-?[0-9]+\s*', key) else None  # ASCII digits: '²' is no id
            if token is None or not 0 <= token < n_vocab:
                raise APIError(400, f'logit_bias: {key!r} is not a token id: use ids in [0, {n_vocab - 1}] '
                               f'as strings, such as "50256"', param='logit_bias')
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise APIError(400, f'logit_bias: the bias of token {token} is {bias}; use values in '
                               f'[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]', param='logit_bias')
            biases[token] = float(bias)
        return biases

    def prompts(self, encoder: Encoder, n_vocab: int) -> List[List[int]]:
        """The prompts as checked lists of token ids, as sent: [] for an omitted or empty one."""
        prompt = self.prompt
        if not self.prompted:
            return [[]]
        if isinstance(prompt, str):
            rows = [encoder.encode(prompt)]
        elif all(isinstance(p, str) for p in prompt):
            rows = [encoder.encode(p) for p in prompt]
        elif all(isinstance(p, int) for p in prompt):
            rows = [list(prompt)]
        else:
            rows = [list(p) for p in prompt]
        for i, row in enumerate(rows):
            try:
                check_token_ids(row, n_vocab, name=f'prompt {i}: token')
            except GPT2Error as e:
                raise invalid(e, 'prompt') from None
        return rows


# --- the responses ------------------------------------------------------------------------------

class ErrorBody(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class Logprobs(BaseModel):
    tokens: List[str]
    token_logprobs: List[Optional[float]]  # the prompt's first token has none
    top_logprobs: List[Optional[Dict[str, float]]]
    text_offset: List[int]


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: Optional[Logprobs] = None
    finish_reason: Optional[str] = None  # 'stop' or 'length'; None in a stream until the choice ends


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    """A completion, or one chunk of a stream (whose usage, when asked for, comes in a last chunk)."""

    id: str
    object: str = 'text_completion'
    created: int
    model: str
    choices: List[CompletionChoice]
    usage: Optional[Usage] = None


class ModelCard(BaseModel):
    id: str
    object: str = 'model'
    created: int
    owned_by: str = 'gpt2_tf'


class ModelList(BaseModel):
    object: str = 'list'
    data: List[ModelCard]


class Health(BaseModel):
    status: str = 'ok'
