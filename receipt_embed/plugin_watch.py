"""A plugin's own code while it runs (its import, its register hooks, its pipeline hooks): the
places where someone else's code can hang or end the process behind the command's back.

Inside :func:`plugin_code`:

- a stop signal raises at once, also where the command would otherwise only note it (training
  checks a flag between steps, which a hook that never returns never reaches), and the stop's line
  names the plugin (``stopped by SIGTERM while loading plugin 'slow'``);
- after ``NOTICE_AFTER_S`` a line on stderr says which plugin is still running and how to skip it,
  so a hang has a name before anyone reaches for ``kill -9``;
- ``os._exit`` called by the plugin in this process raises :class:`PluginCalledExit` instead of
  ending the command silently with the plugin's exit code (a child process it forks exits as usual,
  and one that leaves the plugin's code another way, returning or raising, exits there);
- a stop that arrives while it runs stops the command, even when the plugin's code swallows it or
  turns it into an error of its own.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from receipt_embed import stops
from receipt_embed.display import printable, quoted

DISABLE_ENV = "RECEIPT_EMBED_DISABLE_PLUGINS"  # comma-separated plugin names blocked before they load
NOTICE_AFTER_S = 10.0  # a plugin's code running this long gets a line naming it


class PluginCalledExit(BaseException):
    """A plugin called ``os._exit``, which would end the command at once with no message and the
    plugin's exit code; it counts as that plugin's failure instead."""


def skip_advice(name: str) -> str:
    """How to run without plugin ``name``: the variable when it can hold the name as written, else
    moving the plugin away (a comma or a space in the name would be read as two names or stripped)."""
    if name and name == name.strip() and "," not in name and name.isprintable():  # read back as written
        shown = f'"{name}"' if " " in name else name
        return f"skip it with {DISABLE_ENV}={shown}"
    return (
        f"skip it by moving its file away or uninstalling its package (its name cannot be written in {DISABLE_ENV}, "
        "which splits names at commas and strips spaces around them)"
    )


@contextmanager
def plugin_code(name: str, doing: str) -> Iterator[None]:
    """Run a plugin's code: ``doing`` says what in words (``loading``, ``calling on_epoch_end of``)."""
    what = f"{doing} plugin {quoted(name)}"
    notice = threading.Timer(NOTICE_AFTER_S, _say_still_running, (what, name))
    notice.daemon = True
    notice.start()
    pid, active = os.getpid(), [True]

    def guarded_exit(*args, **kwargs) -> None:
        if os.getpid() != pid or not active:  # a child the plugin forked, or a copy kept for later: as asked
            stops._hard_exit(*args, **kwargs)
        shown = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
        raise PluginCalledExit(f"it called os._exit({shown})")

    stops_before = len(stops.received)
    previous_exit, os._exit = os._exit, guarded_exit
    try:
        with stops._stopping_on(_caught_signals()):
            yield
            _end_a_forked_child(pid, 0)
            if len(stops.received) > stops_before:  # a stop arrived and the plugin's code swallowed it
                stops.raise_if_stopped()
    except BaseException as exc:
        _end_a_forked_child(pid, exc.code if isinstance(exc, SystemExit) else 1)
        stops.note_stopped_while(what)  # only when a stop signal has arrived
        if len(stops.received) > stops_before and not isinstance(exc, stops.StoppedBySignal):
            # the plugin turned the stop into an error of its own (``except BaseException: raise
            # RuntimeError``): it is the stop all the same, never a plugin failure to go on after
            raise stops.StoppedBySignal(stops.received[-1]) from None
        raise
    finally:
        active.clear()
        os._exit = previous_exit
        notice.cancel()


@contextmanager
def forks_end_here() -> Iterator[None]:
    """Around a plugin component's code (a forward, a loss, a view): a child process it forks exits
    when it leaves the block, however it leaves, as one forked in a hook does."""
    pid = os.getpid()
    try:
        yield
    except BaseException as exc:
        _end_a_forked_child(pid, exc.code if isinstance(exc, SystemExit) else 1)
        raise
    _end_a_forked_child(pid, 0)


def forks_end_after_each_forward(module) -> None:
    """A third-party torch module's forward that forks: the child exits as the forward returns (or
    raises), before receipt-embed's own code after it runs (a projection head's matrix multiply
    deadlocks in a forked child: torch's thread pool does not survive a fork)."""
    started: list[int] = []

    def before(_module, _inputs) -> None:
        started.append(os.getpid())

    def after(_module, _inputs, _output) -> None:
        if started:
            _end_a_forked_child(started.pop(), 0)

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after, always_call=True)


PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h): the signal a process gets when its parent dies
_forked_from: list[int] = []  # the pid that forked, noted just before each fork
_set_death_signal: list = []  # libc's prctl, once children_end_with_the_command has run


def children_end_with_the_command() -> None:
    """Every child forked in this process (by a plugin's code, wherever it forked: a property read
    between components, a forward whose child deadlocks in torch) is killed when this process ends,
    so none outlives the command holding its output pipe or its dir's lock. Linux only (prctl's
    parent-death signal); elsewhere children still end where they leave a plugin's code."""
    if _set_death_signal or not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    _set_death_signal.append(prctl)
    os.register_at_fork(before=_note_the_parent, after_in_child=_die_with_the_parent)


def _note_the_parent() -> None:
    _forked_from[:] = [os.getpid()]


def _die_with_the_parent() -> None:
    import signal

    _set_death_signal[0](PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if _forked_from and os.getppid() != _forked_from[0]:  # the parent died before the signal was set
        stops._hard_exit(1)


def end_a_copy_forked_from(pid: int, where: str) -> None:
    """Called by receipt-embed's own code before it writes ``where``: a process that is not ``pid``
    (the one that took the dir's lock) is a child a plugin forked that returned into receipt-embed's
    code (from a property read, say); it ends here with a line, before it writes as a second writer."""
    if os.getpid() == pid:
        return
    line = (
        f"process {os.getpid()}, forked by a plugin in process {pid}, reached receipt-embed's writes of {where}; "
        "it exits there (the command goes on in its own process)"
    )
    try:
        print(printable(line), file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
    _end_a_forked_child(pid, 1)


def _end_a_forked_child(pid: int, code) -> None:
    """A child process the plugin forked never returns into the command (it would go on as a second
    trainer or writer in the same dir): leaving the plugin's code, however it leaves, it exits."""
    if os.getpid() == pid:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    stops._hard_exit(code if isinstance(code, int) else (0 if code is None else 1))


def _caught_signals() -> tuple:
    """The stop signals this process catches itself (the command's handlers, training's flag): those
    raise at once inside plugin code. One left to Python's default (a KeyboardInterrupt) or the OS's
    (death by SIGTERM) already stops a library caller at once, and is left as it is."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        return ()
    return tuple(
        sig
        for sig in stops.stop_signals()
        if callable(signal.getsignal(sig)) and signal.getsignal(sig) is not signal.default_int_handler
    )


def _say_still_running(what: str, name: str) -> None:
    line = f"still {what} after {NOTICE_AFTER_S:g} s; if it hangs, stop with Ctrl-C and {skip_advice(name)}"
    try:
        print(printable(line), file=sys.stderr, flush=True)
    except (OSError, ValueError):  # stderr closed: nothing to tell
        pass
