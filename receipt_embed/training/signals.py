"""SIGINT/SIGTERM (and SIGHUP, unless ignored) during training: a flag checked between steps, so a stop saves ``last.pt``
after a whole step instead of killing the process mid-write."""

from __future__ import annotations

import signal
from contextlib import contextmanager

from receipt_embed.stops import stop_signals


@contextmanager
def stop_on_signals():
    """Turn the stop signals into a flag checked between steps."""
    received: list[str] = []
    handlers = {}

    def handler(signum, frame):
        received.append(signal.Signals(signum).name)

    for sig in stop_signals():
        try:
            handlers[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread: leave signals alone
            pass
    try:
        yield received
    finally:
        for sig, previous in handlers.items():
            signal.signal(sig, previous)
