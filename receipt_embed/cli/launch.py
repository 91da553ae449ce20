"""``train --nproc N``: the same command line re-run under torchrun, the launcher holding the lock."""

from __future__ import annotations

import sys
from pathlib import Path

import click


def launch_torchrun(nproc: int, out: Path) -> int:
    """Re-run this command line under torchrun with ``nproc`` processes; returns its exit code.

    SIGINT/SIGTERM are passed on to torchrun (which stops the ranks; rank 0 saves last.pt)
    and the launcher waits for it, then exits with 128 + the signal's number (130, 143) as a single-process run would. The
    launcher holds the run dir's writer lock and tells the ranks so (``HELD_LOCKS_ENV``)."""
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
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "receipt_embed",
        *args,
    ]
    click.echo(
        "launching "
        + shlex.join(["torchrun", "--standalone", f"--nproc-per-node={nproc}", "-m", "receipt_embed", *args]),
        err=True,
    )
    from receipt_embed.locking import held_locks_env

    child = subprocess.Popen(command, env={**os.environ, **held_locks_env(out)})
    received = []

    def forward(signum, frame):
        received.append(signum)
        if child.poll() is None:
            child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = child.wait()
        while child.poll() is None:  # a signal interrupted the wait
            code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 + received[0] if received else code
