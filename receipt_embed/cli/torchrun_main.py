"""torchrun as ``train --nproc`` runs it: stopped with its launcher, and a failed rank said in one line.

``python -m receipt_embed.cli.torchrun_main LAUNCHER_PID RUN_DIR NPROC TORCHRUN_ARGS...``. It asks for
SIGTERM when the launcher (which holds the run dir's lock) dies, and names itself to the ranks
(``PARENT_PID_ENV``) so they do the same with it. A rank killed by a signal (kill -9, the OOM killer)
becomes one line naming it and how to continue, not torchrun's ``ChildFailedError`` traceback; a rank
that exited with a code has said why itself, and that code is the exit code."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from receipt_embed.orphans import PARENT_PID_ENV, stop_with_parent

_KILLED_BY = {"SIGKILL": " (kill -9, or the out-of-memory killer)"}


def failure_report(failures: dict, run_dir, nproc: int) -> tuple[int, str | None]:
    """(the exit code, the line to print or None) for torchrun's ``{rank: ProcessFailure}``: the
    rank that failed first on its own (not one that stopped because another had gone)."""
    from receipt_embed.distributed import PEER_GONE_EXIT

    own = {rank: failure for rank, failure in failures.items() if failure.exitcode != PEER_GONE_EXIT}
    pool = own or failures
    rank = min(pool, key=lambda r: (pool[r].exitcode >= 0, pool[r].timestamp, r))  # signal deaths first
    failure = pool[rank]
    last = Path(run_dir) / "checkpoints" / "last.pt"
    after = (
        f"{last} holds the last saved state: continue with `receipt-embed train --out {shlex.quote(str(run_dir))} --resume --nproc {nproc}`"
        if last.exists()
        else f"no checkpoint was saved in {run_dir} yet: start the run again"
    )
    if failure.exitcode < 0:
        name = failure.signal_name()
        return 1, f"Error: rank {rank} (pid {failure.pid}) was killed by {name}{_KILLED_BY.get(name, '')}; {after}"
    if failure.exitcode == PEER_GONE_EXIT:  # every rank lost the others, none said why
        return 1, f"Error: rank {rank} (pid {failure.pid}) lost its connection to the other ranks; {after}"
    return failure.exitcode, None  # it printed its own message


def main(argv: list[str]) -> int:
    launcher, run_dir, nproc, args = int(argv[0]), argv[1], int(argv[2]), argv[3:]
    stop_with_parent(launcher)
    os.environ[PARENT_PID_ENV] = str(os.getpid())
    import logging

    logging.disable(logging.ERROR)  # torchrun's log lines; a failure is said in one line below
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(args)
    except ChildFailedError as exc:
        code, line = failure_report(exc.failures, run_dir, nproc)
        if line:
            from receipt_embed.display import printable

            print(printable(line), file=sys.stderr, flush=True)
        return code
    except SignalException as exc:  # it stopped the ranks (rank 0 saved last.pt and said so)
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
