"""``train --nproc N``: the same command line re-run under torchrun, the launcher holding the lock."""

from __future__ import annotations

import sys
from pathlib import Path

import click


def launch_torchrun(nproc: int, out: Path) -> int:
    """Re-run this command line under torchrun with ``nproc`` processes; returns its exit code.

    SIGINT/SIGTERM (and SIGHUP, as SIGTERM) are passed on to torchrun (which stops the ranks; rank 0 saves last.pt)
    and the launcher waits for it, then exits with 128 + the signal's number (130, 143, 129) as a single-process run would. The
    launcher holds the run dir's writer lock and tells the ranks so (``HELD_LOCKS_ENV``); torchrun inherits the lock's
    descriptor, so the lock stays held while a rank may still write, and is stopped when the launcher dies however it
    dies (``receipt_embed.cli.torchrun_main``); a rank whose launcher is gone never writes again
    (``locking.check_still_held``)."""
    import os
    import shlex
    import signal
    import subprocess

    args, skip = [], False
    for arg in sys.argv[1:]:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            args.append(arg)
    command = [
        sys.executable,
        "-m",
        "receipt_embed.cli.torchrun_main",  # torchrun, stopped with this launcher; a failed rank in one line
        str(os.getpid()),
        str(out),
        str(nproc),
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "receipt_embed",
        *args,
    ]
    from receipt_embed.display import printable

    click.echo(
        printable(
            "launching "
            + shlex.join(["torchrun", "--standalone", f"--nproc-per-node={nproc}", "-m", "receipt_embed", *args])
        ),
        err=True,
    )
    from receipt_embed.locking import held_descriptor, held_locks_env

    lock = held_descriptor(out)  # torchrun keeps the lock held until its ranks are gone, even if this process dies
    child = subprocess.Popen(
        command, env={**os.environ, **held_locks_env(out)}, pass_fds=() if lock is None else (lock,)
    )
    received = []

    def forward(signum, frame):
        received.append(signum)
        if child.poll() is None:  # SIGHUP (a closed terminal) as SIGTERM: the ranks save last.pt and stop
            child.send_signal(signal.SIGTERM if signum == signal.SIGHUP else signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        code = child.wait()
        while child.poll() is None:  # a signal interrupted the wait
            code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 + received[0] if received else code
