"""How SIGINT, SIGTERM and SIGHUP stop a command: one line, the signal's exit code, nothing half-written.

SIGHUP (the terminal closed) stops a command as SIGTERM does, unless the command was started
with SIGHUP ignored (``nohup``): then it stays ignored.

In the main thread a stop signal raises :class:`StoppedBySignal` (a ``SystemExit`` with code 130
or 143), so a writer unwinds through its ``finally`` blocks: its lock is released and its
staging copy removed, and the innermost writer says in one line which dir was left as it was.
Training installs its own handler inside (a flag checked between steps, so ``last.pt`` is saved
after a whole step); the program's exit path is in ``receipt_embed.cli.run``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class StoppedBySignal(SystemExit):
    """SIGTERM arrived while a writer held its lock: unwinds it (exit code 143) so it cleans up."""

    reported = False  # the innermost lock it unwinds says so in one line


class SaysWhatTheStopLeft:
    """Mixed into an exception that reports a stop itself, saying what was kept (training's
    TrainingInterrupted: ``last.pt`` saved, continue with --resume): a lock it unwinds adds nothing."""


class StopAlreadySaid(SaysWhatTheStopLeft, SystemExit):
    """The exit (130, 143) of a stop whose line has been printed (``train`` saying ``last.pt`` was saved)."""


received: list[int] = []  # exit codes of the stop signals this command (or library call) received
_first_stop_at: list[float] = []  # when the first stop signal of this process arrived
_in_command: list[bool] = []  # inside signals_stop_the_command: a whole command, one per process
REPEAT_WINDOW_S = 1.0  # a stop signal this soon after the first is the same stop sent twice
_stopped_while: list[str] = []  # what was running when the stop arrived (a plugin's code), for its line


def stop_signals() -> tuple[signal.Signals, ...]:
    """The signals that stop a command: SIGINT, SIGTERM, and SIGHUP unless it is ignored (nohup)."""
    hangup = () if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else (signal.SIGHUP,)
    return (signal.SIGINT, signal.SIGTERM, *hangup)


def as_stop(exc: BaseException, out) -> StoppedBySignal | None:
    """The stop ``exc`` stands for, said once in one line; None for an ordinary error. The signal's
    exception may arrive as another one (raised inside an import or C extension that wraps what it
    catches): a signal received means a stop all the same."""
    stop = stop_of(exc)
    if (
        stop is not None and not stop.reported and not _told_by_outer
    ):  # its staging copy is gone: the dir is the old one
        stop.reported = True
        from receipt_embed.display import printable

        state = "already replaced by its new copy" if os.path.abspath(out) in _swapped_in else "left as it was"
        print(printable(f"{stop_line(stop)}: {out} {state}"), file=sys.stderr, flush=True)
    return stop


_told_by_outer: list[bool] = []  # inside told_by_the_caller: the writers within stay quiet about a stop


@contextmanager
def told_by_the_caller() -> Iterator[None]:
    """Within this block a stop is told by the caller alone (the demo, whose steps write parts of
    its OUT): an inner writer's "OUT/index left as it was" beside the demo's line on what OUT holds
    would be two accounts of one stop, and could read as contradicting each other."""
    _told_by_outer.append(True)
    try:
        yield
    finally:
        _told_by_outer.pop()


_swapped_in: set[str] = set()  # dirs whose new copy is in place: a stop after that leaves the new one


def note_swapped_in(out) -> None:
    """Record that ``out`` now is its new, complete copy (``staging.swap_in``), for the stop's line."""
    _swapped_in.add(os.path.abspath(out))


def forget_swapped_in(out) -> None:
    """A new write of ``out`` begins: until its own swap, a stop leaves the dir as it was."""
    _swapped_in.discard(os.path.abspath(out))


def stop_of(exc: BaseException) -> StoppedBySignal | None:
    """The stop signal ``exc`` stands for (itself, or one received that a library's exception hides), else None."""
    if isinstance(exc, StoppedBySignal):
        return exc
    return StoppedBySignal(received[-1]) if received and not isinstance(exc, SaysWhatTheStopLeft) else None


def stopped_while() -> str:
    """`` while calling on_epoch_end of plugin 'x'`` when a plugin's code ran as the stop arrived, else ''."""
    return f" while {_stopped_while[0]}" if _stopped_while else ""


def stop_line(stop: SystemExit) -> str:
    """``stopped by SIGTERM``, and what was running when it arrived if that was a plugin's code
    (``while loading plugin 'slow'``): the user learns which plugin to skip or fix."""
    return f"stopped by {signal_name(stop)}{stopped_while()}"


def note_stopped_while(what: str) -> None:
    """Record what was running when this command's stop signal arrived (the first such record wins)."""
    if received and not _stopped_while:
        _stopped_while.append(what)


def raise_if_stopped() -> None:
    """Deliver a stop signal whose exception a library swallowed. The handler's exception is raised
    wherever the main thread happens to be, and code that catches broadly eats it: torch's first
    optimizer step imports triton behind ``except ImportError``, and a SIGTERM landing in that import
    arrives as an ImportError and is dropped, so training ran to its end and exited 0. Long phases
    (the training loop, a writer's final swap) call this before they begin: a stop recorded in
    ``received`` stops the command there."""
    if received:
        _deferred.clear()  # delivered now: a retry still pending would be the same stop again
        _raised_at[:] = _raised_at or [time.monotonic()]
        raise StoppedBySignal(received[-1])


def is_real_stop(exc: BaseException) -> bool:
    """Whether ``exc``, caught around a plugin's code, is a stop signal (to pass on) rather than
    something the plugin raised itself (an exit, a KeyboardInterrupt, GeneratorExit, even a
    StoppedBySignal of its own making: its failure). Only a signal this process received is a stop."""
    return bool(received) and not isinstance(exc, Exception)


def is_repeat() -> bool:
    """Whether a stop signal arriving now repeats one already being handled: ``timeout`` sends
    SIGTERM to the command and then to its process group, so it lands twice. A repeat is ignored,
    so the first stop's cleanup is not cut short and its line is printed once; a signal sent
    later (a second Ctrl-C) stops at once as usual."""
    now = time.monotonic()
    if _first_stop_at and now - _first_stop_at[0] < REPEAT_WINDOW_S:
        return True
    if not _first_stop_at:
        _first_stop_at.append(now)
    return False


_deferred: list[float] = []  # [signal, since when] of a stop held back while an import ran; sent again shortly
IMPORT_RETRY_S = 0.05  # how soon a stop that landed inside an import is delivered again
IMPORT_WAIT_S = 2.0  # how long a stop waits for an import to end: one that never ends (a plugin's loop) must not hang


_raised_at: list[float] = []  # when a stop was first raised as StoppedBySignal in this process
_hard_exit = os._exit  # the real one, kept before any plugin's code runs (receipt_embed.plugin_watch)


def _raise_stop(signum, frame):
    redelivered = bool(_deferred)
    if not redelivered and is_repeat():
        return
    if not redelivered and _raised_at and time.monotonic() - _raised_at[0] >= REPEAT_WINDOW_S:
        # a stop was raised and the command is still running: code that catches everything (a
        # plugin's `except BaseException` in a loop) swallowed it. A stop sent again ends the
        # process at once; what it leaves is what a kill -9 leaves, which the next writer cleans up.
        os.write(
            2,
            f"stopped by {signal.Signals(signum).name}: sent again, the command had not stopped; "
            "exiting at once\n".encode(),
        )
        _hard_exit(128 + signum)
    if not redelivered:
        received.append(128 + signum)
    since = _deferred[1] if redelivered else time.monotonic()
    if _inside_an_import(frame) and time.monotonic() - since < IMPORT_WAIT_S:
        # an exception raised inside an import leaves the module half-initialised: numpy then
        # recursed until RecursionError, and a C++ extension initialising (pybind11) aborted the
        # process. The stop is recorded and sent again until it lands outside the import, or until
        # IMPORT_WAIT_S have passed: a plugin whose import never ends (a loop at its top level)
        # would otherwise make the command deaf to every stop signal.
        _deferred[:] = [signum, since]
        retry = threading.Timer(IMPORT_RETRY_S, _send_again, (signum,))
        retry.daemon = True
        retry.start()
        return
    _deferred.clear()
    _raised_at[:] = _raised_at or [time.monotonic()]
    raise StoppedBySignal(128 + signum)


def _inside_an_import(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


def _send_again(signum: int) -> None:
    os.kill(os.getpid(), signum)


@contextmanager
def _stopping_on(signals: tuple, restore: bool = True) -> Iterator[None]:
    """``signals`` raise :class:`StoppedBySignal` in the main thread while inside (elsewhere: left alone)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _raise_stop) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items() if restore else ():
            signal.signal(sig, handler)


@contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """SIGTERM raises SystemExit(143) in the main thread, so a writer stopped by it removes its lock
    and its staging dir on the way out (a handler installed inside, e.g. training's, takes precedence)."""
    if not _in_command:  # a library call: its own record (a command keeps one from its start)
        received.clear()
        _first_stop_at.clear()
        _stopped_while.clear()
        _raised_at.clear()
    with _stopping_on((signal.SIGTERM,)):
        yield


@contextmanager
def signals_stop_the_command(restore: bool = True) -> Iterator[None]:
    """For a whole command: SIGINT, SIGTERM and SIGHUP raise :class:`StoppedBySignal` (exit 130, 143, 129), so a
    stop outside any lock is the same one line and exit code as inside one, not click's "Aborted!"
    with exit 1 nor a silent death by the signal. The program itself keeps them to its end
    (``restore=False``); its exit path takes over in ``receipt_embed.cli.run``."""
    received.clear()
    _first_stop_at.clear()
    _stopped_while.clear()
    _raised_at.clear()
    _in_command.append(True)
    try:
        with _stopping_on(stop_signals(), restore):
            yield
    finally:
        _in_command.pop()


def signal_name(stop: SystemExit) -> str:
    """``SIGTERM`` for the stop ``StoppedBySignal(143)``."""
    try:
        return signal.Signals(stop.code - 128).name
    except (TypeError, ValueError):
        return "a signal"
