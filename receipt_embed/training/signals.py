"""SIGINT/SIGTERM during training: a flag checked between steps, so a stop saves ``last.pt``
after a whole step instead of killing the process mid-write."""

from __future__ import annotations

import signal
from contextlib import contextmanager


@contextmanager
def stop_on_signals():
    """Turn SIGINT/SIGTERM into a flag checked between steps."""
    received: list[str] = []
    handlers = {}

    def handler(signum, frame):
        received.append(signal.Signals(signum).name)

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            handlers[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread: leave signals alone
            pass
    try:
        yield received
    finally:
        for sig, previous in handlers.items():
            signal.signal(sig, previous)
