"""Ctrl-C and SIGTERM around work that must not stop halfway (a training step and its count, a token file and
its sidecar moving into place): held for the block, then handled."""

from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def deferred():
    """SIGINT and SIGTERM that arrive inside the block are handled at its end (once each, by the handler they
    had: Ctrl-C's KeyboardInterrupt, a command's own), not in its middle. Only a handler set from Python is
    held, and only on the main thread, where handlers can be set; elsewhere the signals act as they would."""
    main = threading.current_thread() is threading.main_thread()
    held = {s: handler for s in (signal.SIGINT, signal.SIGTERM)
            if main and callable(handler := signal.getsignal(s))}
    caught = []
    for s in held:
        signal.signal(s, lambda signum, frame: caught.append((signum, frame)))
    try:
        yield
    finally:
        for s, handler in held.items():
            signal.signal(s, handler)
    for signum, frame in dict(caught).items():  # in the order they came, once each
        held[signum](signum, frame)
