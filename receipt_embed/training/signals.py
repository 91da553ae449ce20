"""SIGINT/SIGTERM (and SIGHUP, unless ignored) during training: a flag checked between steps, so a stop saves ``last.pt``
after a whole step instead of killing the process mid-write.

A step that does not end (a plugin encoder or loss that hangs) never reaches the check, so the
stop is not the last word: after ``STILL_FINISHING_S`` a line says the step is still running, and
a second stop signal (sent later than ``stops.REPEAT_WINDOW_S``: not the same one delivered twice)
stops at once, from wherever the step is, keeping the ``last.pt`` saved before. A plugin's hook
is stopped at once by the first signal (``receipt_embed.plugin_watch``)."""

from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager

from receipt_embed import stops
from receipt_embed.stops import stop_signals

STILL_FINISHING_S = 10.0  # a step still running this long after a stop gets a line saying how to stop at once


@contextmanager
def stop_on_signals():
    """Turn the stop signals into a flag checked between steps; a second one stops at once."""
    received: list[str] = []
    handlers = {}
    notices: list[threading.Timer] = []

    def handler(signum, frame):
        if received and not stops.is_repeat():  # sent again, later: the user will not wait for the step
            stops._raise_stop(signum, frame)
            return
        if not received:
            stops.is_repeat()  # notes when the first stop arrived, so the same stop sent twice is told apart
            notice = threading.Timer(STILL_FINISHING_S, _say_still_finishing, (signal.Signals(signum).name,))
            notice.daemon = True
            notice.start()
            notices.append(notice)
        received.append(signal.Signals(signum).name)

    for sig in stop_signals():
        try:
            handlers[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread: leave signals alone
            pass
    try:
        yield received
    finally:
        for notice in notices:
            notice.cancel()
        for sig, previous in handlers.items():
            signal.signal(sig, previous)


def _say_still_finishing(name: str) -> None:
    line = (
        f"{name} received {STILL_FINISHING_S:g} s ago and the current step has not ended; "
        f"send it again (Ctrl-C) to stop at once, keeping the last.pt saved before this step"
    )
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
