"""Running the app: a listening socket, checked before anything is said, then uvicorn on it."""

from __future__ import annotations

import errno
import socket
import sys
import threading
from typing import Optional, Sequence

from ..encoder import Encoder
from ..runtime import Model
from ..validate import GPT2Error
from .app import create_app


DRAIN = 30.0  # seconds the requests in flight have to finish once the server is told to stop
CLOSING = 2.0  # seconds after the drain for the requests it failed to say so, before their connections close


class PortTaken(GPT2Error):
    """Another program listens on the port."""


def bind(host: str, port: int) -> socket.socket:
    """A socket listening on host:port. A port in use raises PortTaken, naming a free one to try."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise GPT2Error(f'cannot listen on {host!r} ({e.strerror}): give an address such as 127.0.0.1') from None
    # proto is IPPROTO_TCP, not 0: asyncio then turns Nagle's algorithm off on each connection, as it does
    # for the sockets it opens itself (otherwise each streamed chunk can wait for the client's delayed ACK).
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
        return sock
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise PortTaken(f'port {port} on {host} is taken; try --port {free_port(host, port)}') from None
        raise GPT2Error(f'cannot listen on {host}:{port} ({e.strerror}): try another --port or --host') from None


def free_port(host: str, taken: int) -> int:
    """The first free port after `taken` (within 100), or any free one."""
    for port in [*range(taken + 1, min(taken + 100, 65535) + 1), 0]:
        try:
            with bind(host, port) as sock:
                return sock.getsockname()[1]
        except PortTaken:
            continue
    raise AssertionError('port 0 is always free')


def check_port(host: str, port: int) -> None:
    """Raises PortTaken (a GPT2Error) now, before a model is loaded, if serve could not listen there."""
    bind(host, port).close()


def serve(model: Model, encoder: Encoder, *, model_id: str, aliases: Sequence[str] = (), host: str = '127.0.0.1',
          port: int = 8000, api_key: Optional[str] = None, capacity: int = 16, queue_size: int = 256,
          mode: Optional[str] = None, quiet: bool = False, drain: Optional[float] = None) -> None:
    """Serves create_app(...) with uvicorn until interrupted; says where once it listens there.

    Each request then writes one access-log line to stderr, unless quiet. On Ctrl-C or SIGTERM it takes no
    new connection and lets the requests in flight finish for at most `drain` seconds (see draining; None:
    DRAIN).
    """
    sock = bind(host, port)
    try:
        app = create_app(model, encoder, model_id=model_id, aliases=aliases, api_key=api_key, capacity=capacity,
                         queue_size=queue_size, mode=mode, access_log=None if quiet else sys.stderr)
        where = f'[{host}]' if ':' in host else host
        print(f'gpt2-tf: serving {model_id} on http://{where}:{port}/v1 (Ctrl-C to stop)', file=sys.stderr,
              flush=True)
        draining(app, DRAIN if drain is None else drain).run(sockets=[sock])
    finally:
        sock.close()


def draining(app, drain: float):
    """A uvicorn Server of the app whose drain has a limit: `drain` seconds after the first Ctrl-C or SIGTERM,
    the rows still queued or decoding, and the echoes still being scored, fail ('the server is shutting down'),
    so that their clients get an error in OpenAI's shape, not a cut connection; CLOSING seconds later the
    requests still open are ended (a client still sending its body gets a 503), and the server exits once a
    thread scoring an echo has finished its group. (A second Ctrl-C exits at once, as uvicorn's.)"""
    import uvicorn

    batcher = app.state.batcher

    class Draining(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not self.should_exit:
                timer = threading.Timer(drain, batcher.close)
                timer.daemon = True  # a server that drained sooner exits without waiting for it
                timer.start()
            super().handle_exit(sig, frame)

    return Draining(uvicorn.Config(app, log_level='warning', timeout_graceful_shutdown=drain + CLOSING))
