"""A child that must not outlive its parent: ``PR_SET_PDEATHSIG`` (Linux; elsewhere nothing).

``train --nproc`` holds the run dir's lock in the launcher; were torchrun and its ranks to go on
after the launcher died (kill -9, SIGHUP, the OOM killer), they would write a run dir whose lock
is free. Each of them asks the kernel for SIGTERM when its parent goes."""

from __future__ import annotations

import os
import signal

PARENT_PID_ENV = "RECEIPT_EMBED_TORCHRUN_PID"  # set by train --nproc's torchrun for its ranks: its pid


def stop_with_parent(parent: int | None = None, signum: int = signal.SIGTERM) -> bool:
    """Have ``signum`` sent to this process when its parent dies; returns False where that is not
    supported. ``parent``: the pid the parent had, so a parent that died before this call (the
    kernel then sends nothing) stops this process at once, with the same signal."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(signum), 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
            return False
    except (OSError, AttributeError):
        return False
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), signum)
    return True
