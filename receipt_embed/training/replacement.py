"""Replacing a run with ``train --force`` without ever leaving the user with neither run.

A run dir is updated in place (checkpoints are atomic, metrics are appended), so it is not
swapped whole like an index dir. Instead ``--force`` moves the old run's files into a sibling
``PARENT/.NAME.old-PID`` and deletes them only once the new run has written its first
checkpoint; a new run that fails before that gets the old files back. A writer killed in
between leaves the sibling, and the next writer (under the lock) settles it: the new run has a
checkpoint, so the old files go; it has none, so they come back.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

from receipt_embed.training.rundir import KEPT, LAST_CHECKPOINT, RUN_FILES


def run_entries(run_dir: Path) -> list[str]:
    """What belongs to the run (its files and those its plugins wrote), ``checkpoints`` first."""
    if not run_dir.is_dir():
        return []
    names = [p.name for p in run_dir.iterdir() if p.name != KEPT and not p.name.startswith(f".{KEPT}.")]
    return sorted(names, key=lambda name: (name != "checkpoints", name))


def _aside_dirs(run_dir: Path) -> list[Path]:
    """Siblings ``.NAME.old-PID`` a killed ``--force`` writer left: real folders (not links) of a PID
    no longer running that hold a run's files; a user's folder with such a name is never touched."""
    from receipt_embed.locking import pid_running

    if not run_dir.parent.is_dir():
        return []
    prefix = f".{run_dir.name}.old-"
    found = []
    for path in run_dir.parent.iterdir():
        pid = path.name[len(prefix) :]
        if not path.name.startswith(prefix) or not pid.isdigit() or pid_running(int(pid)):
            continue
        if path.is_symlink() or not path.is_dir():
            continue
        entries = {entry.name for entry in path.iterdir()}
        if entries and ("checkpoints" in entries or entries <= RUN_FILES):
            found.append(path)
    return sorted(found)


def leftovers_of(run_dir: str | os.PathLike) -> list[Path]:
    """The old runs interrupted ``train --force`` writers left beside ``run_dir``."""
    return _aside_dirs(Path(os.path.abspath(run_dir)))


def set_aside_holding(path: str | os.PathLike) -> tuple[Path, Path] | None:
    """For a missing file of a run dir (e.g. ``RUN/checkpoints/best.pt``): the run dir and the old
    run beside it, set aside by an interrupted ``--force`` writer, that holds the file; None if none does."""
    path = Path(os.path.abspath(path))
    for run_dir in path.parents[:2]:  # RUN/checkpoints/best.pt: the run dir is two up
        for aside in _aside_dirs(run_dir):
            if (aside / path.relative_to(run_dir)).is_file():
                return run_dir, aside
    return None


def set_aside_advice(path: str | os.PathLike) -> str | None:
    """Where a run's missing file is and how to get it back, when an interrupted ``train --force``
    or ``demo --force`` set its run aside (None otherwise): ``train --resume`` puts that run back
    first (see :func:`settle_leftovers`), and trains no further if it had finished."""
    try:
        found = set_aside_holding(path)
    except (OSError, ValueError):  # a folder it cannot list, a name the OS cannot take: no advice
        return None
    if found is None:
        return None
    run_dir, aside = found
    advice = (
        f"the run in {run_dir} was set aside in {aside} by a `--force` run that was stopped before "
        f"its first checkpoint: put it back with `receipt-embed train --out {run_dir} --resume` "
        "(a finished run trains no further)"
    )
    out = run_dir.parent
    if run_dir.name == "run" and (out / "dataset").is_dir() and (out / "index").is_dir():
        advice += f", or rerun the demo with `receipt-embed demo --out {out} --force`"
    return advice


def set_aside(run_dir: str | os.PathLike) -> Path | None:
    """Move the run's files (all but ``dataset/``) into a sibling; returns it (None when there were none).

    ``checkpoints/`` moves first, so at every moment either ``run_dir`` still holds its
    ``last.pt`` (nothing moved yet) or the sibling holds it (see :func:`settle_leftovers`)."""
    run_dir = Path(os.path.abspath(run_dir))
    present = run_entries(run_dir)
    if not present:
        return None
    aside = run_dir.parent / f".{run_dir.name}.old-{os.getpid()}"
    aside.mkdir(exist_ok=True)
    for name in present:
        os.rename(run_dir / name, aside / name)
    return aside


def restore(run_dir: str | os.PathLike, aside: Path) -> None:
    """Put the old run's files back over whatever the new run wrote, and remove the sibling."""
    run_dir = Path(run_dir)
    old = {entry.name for entry in aside.iterdir()}
    for name in run_entries(run_dir):  # the new run's files go, also those the old run did not have
        if name not in old:
            _remove(run_dir / name)
    for name in sorted(old, key=lambda name: name == "checkpoints"):  # checkpoints last: last.pt means done
        _remove(run_dir / name)
        os.rename(aside / name, run_dir / name)
    shutil.rmtree(aside, ignore_errors=True)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def discard(aside: Path | None) -> None:
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def settle_leftovers(run_dir: str | os.PathLike, log=None) -> None:
    """Under the run's lock: finish what a ``--force`` writer killed mid-way left beside it, and
    remove the temporary files of atomic writes a killed writer left in it."""
    run_dir = Path(os.path.abspath(run_dir))
    temporary = [
        p
        for folder in (run_dir, run_dir / "checkpoints")
        if folder.is_dir()
        for p in folder.glob(".*.tmp")
        if p.is_file()
    ]
    for path in temporary:
        path.unlink(missing_ok=True)
    if temporary:
        (log or warnings.warn)(
            f"removed {len(temporary)} temporary file(s) of an interrupted write in {run_dir} "
            f"({', '.join(p.name for p in temporary[:3])}{', ...' if len(temporary) > 3 else ''})"
        )
    for aside in _aside_dirs(run_dir):
        if (run_dir / LAST_CHECKPOINT).exists():
            discard(aside)
            note = f"removed {aside.name}, the replaced run an interrupted `train --force` left beside {run_dir}"
        else:
            restore(run_dir, aside)
            note = (
                f"restored the run in {run_dir} from {aside.name}: the `train --force` that replaced it "
                "was interrupted before its first checkpoint"
            )
        (log or warnings.warn)(note)


class Replacement:
    """The old run of a ``--force`` run: set aside at the start, dropped at the first checkpoint."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.aside = set_aside(run_dir)

    def checkpoint_written(self) -> None:
        discard(self.aside)
        self.aside = None

    def failed(self) -> bool:
        """Put the old run back; False when there was none (``--force`` into a new or empty dir)."""
        if self.aside is None:
            return False
        restore(self.run_dir, self.aside)
        self.aside = None
        return True
