"""What the server counts and says: Prometheus metrics for GET /metrics, and one access-log line per request.

Metrics keeps its instruments in its own CollectorRegistry (two apps in one
process do not collide), named after vLLM's: the rows running and waiting read
the Batcher when scraped; tokens, time to first token, time per output token and
requests by status code and outcome are recorded once a request has ended.
"""

from __future__ import annotations

import time
from typing import Optional, TextIO

NAMESPACE = 'gpt2_tf'
OUTCOMES = ('completed', 'refused', 'failed', 'disconnected')  # 2xx, 4xx (and 503), 5xx, a request its client left
BUSY = 503  # a full queue or a shutdown: load shed on purpose, refused rather than failed
CLIENT_GONE = 499  # the status an access line gives a response whose client left first (nginx's)
FIRST_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)  # seconds
PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)  # seconds


def outcome(status: int, completion=None) -> str:
    """One of OUTCOMES: how a request ended, from its status code and its completion (if it made one)."""
    if status >= 500 and status != BUSY:
        return 'failed'
    if status == CLIENT_GONE:
        return 'disconnected'
    if status >= 400:
        return 'refused'
    if completion is not None and completion.failed:  # a stream whose 200 had gone before it failed
        return 'failed'
    return 'disconnected' if completion is not None and not completion.complete else 'completed'


class Metrics:
    """The server's instruments in a registry of their own; scrape() is the /metrics body."""

    CONTENT_TYPE = 'text/plain; version=0.0.4; charset=utf-8'

    def __init__(self, batcher):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry = CollectorRegistry(auto_describe=True)
        running = Gauge('num_requests_running', 'Rows (prompts times best_of) being decoded now, and echoed '
                        'prompts being scored', namespace=NAMESPACE, registry=registry)
        running.set_function(lambda: batcher.running + batcher.scoring)
        waiting = Gauge('num_requests_waiting', 'Rows queued, not yet decoding', namespace=NAMESPACE,
                        registry=registry)
        waiting.set_function(lambda: batcher.waiting)
        self.prompt_tokens = Counter('prompt_tokens', 'Prompt tokens of the requests that ran '
                                     '(usage.prompt_tokens; disconnected and failed ones included)',
                                     namespace=NAMESPACE, registry=registry)
        self.generation_tokens = Counter('generation_tokens', 'Tokens generated (usage.completion_tokens, as above)',
                                         namespace=NAMESPACE, registry=registry)
        self.first_token = Histogram('time_to_first_token_seconds', 'From a request\'s arrival to its first token',
                                     namespace=NAMESPACE, registry=registry, buckets=FIRST_TOKEN_BUCKETS)
        self.per_token = Histogram('time_per_output_token_seconds',
                                   'A request\'s time from its first chunk of tokens to its last, per token '
                                   'after the first chunk of its longest choice (none for a single chunk)',
                                   namespace=NAMESPACE, registry=registry, buckets=PER_TOKEN_BUCKETS)
        self.requests = Counter('requests', 'Requests answered, by status code and outcome', ['code', 'outcome'],
                                namespace=NAMESPACE, registry=registry)

    def record(self, status: int, completion=None) -> None:
        """Counts one request that has ended, with what its completion (if any) made."""
        self.requests.labels(code=str(status), outcome=outcome(status, completion)).inc()
        if completion is None:
            return
        usage = completion.usage()
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.generation_tokens.inc(usage.completion_tokens)
        if completion.first_token is not None:
            self.first_token.observe(completion.first_token - completion.started)
            later = completion.longest() - completion.first_count  # the choices decode side by side: one's tokens
            if later > 0:  # after the first chunk's, which all arrive at first_token
                self.per_token.observe((completion.last_token - completion.first_token) / later)

    def scrape(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


def access_line(method: str, path: str, status: int, completion, seconds: float) -> str:
    """One request: `POST /v1/completions 200 prompt_tokens=5 completion_tokens=16 latency_ms=412`."""
    usage = completion.usage() if completion is not None else None
    tokens = f' prompt_tokens={usage.prompt_tokens} completion_tokens={usage.completion_tokens}' if usage else ''
    return f'{method} {path} {status}{tokens} latency_ms={seconds * 1e3:.0f}'


def log_access(log: Optional[TextIO], method: str, path: str, status: int, completion, started: float) -> None:
    """Writes access_line(...) to log, unless log is None (serve --quiet)."""
    if log is not None:
        print(f'gpt2-tf: {access_line(method, path, status, completion, time.monotonic() - started)}', file=log,
              flush=True)
