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

LAST_CHECKPOINT = Path("checkpoints") / "last.pt"
KEPT = "dataset"  # the samples `train` ingests into RUN_DIR/dataset when no --data is given: not the run's


def run_entries(run_dir: Path) -> list[str]:
    """What belongs to the run (its files and those its plugins wrote), ``checkpoints`` first."""
    if not run_dir.is_dir():
        return []
    names = [p.name for p in run_dir.iterdir() if p.name != KEPT and not p.name.startswith(f".{KEPT}.")]
    return sorted(names, key=lambda name: (name != "checkpoints", name))


def _aside_dirs(run_dir: Path) -> list[Path]:
    """Siblings ``.NAME.old-PID`` a killed ``--force`` writer left: real folders (not links) of a PID
    no longer running that hold a run's files; a user's folder with such a name is never touched."""
    from receipt_embed.outdir import _pid_running

    if not run_dir.parent.is_dir():
        return []
    prefix = f".{run_dir.name}.old-"
    found = []
    for path in run_dir.parent.iterdir():
        pid = path.name[len(prefix) :]
        if not path.name.startswith(prefix) or not pid.isdigit() or _pid_running(int(pid)):
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

    def failed(self) -> None:
        if self.aside is not None:
            restore(self.run_dir, self.aside)
            self.aside = None


# what a run writes at its top level (plugins may add files, but only a run with a checkpoint is known to be ours)
RUN_FILES = {"config.yaml", "data.json", "metrics.jsonl", "checkpoints", KEPT}
SWEEP_FILES = {"sweep.json", KEPT}
FOREIGN = (
    "holds files that receipt-embed did not write, not a run dir; it is never replaced or written into "
    "(not even with --force): choose another --out"
)


def _entries(path: Path) -> set[str]:
    from receipt_embed.outdir import _ours_hidden

    return {entry.name for entry in path.iterdir() if not _ours_hidden(entry.name)}


def _is_data_record(path: Path) -> bool:
    """A ``data.json`` as a run writes it (a user's own data.json is not taken for one)."""
    import json

    try:
        record = json.loads(path.read_text(encoding="utf-8")) if path.is_file() and not path.is_symlink() else None
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and set(record) == {"data_dir", "manifest_sha256"}


def is_run_dir(run_dir: str | os.PathLike) -> bool:
    """True for a dir ``train`` may write into: absent, empty, a run with ``checkpoints/last.pt``
    (whatever its plugins added), a run stopped before its first checkpoint (its ``data.json`` and
    nothing but a run's files), or just the samples ``train`` ingested into ``dataset/``."""
    run_dir = Path(run_dir)
    if not run_dir.exists() and not run_dir.is_symlink():
        return True
    if run_dir.is_symlink() or not run_dir.is_dir():
        return False
    if (run_dir / LAST_CHECKPOINT).is_file():
        return True
    entries = _entries(run_dir)
    if not entries <= RUN_FILES:
        return False
    if entries - {KEPT} and not _is_data_record(run_dir / "data.json"):
        return False
    checkpoints = run_dir / "checkpoints"
    if checkpoints.exists() and (not checkpoints.is_dir() or any(not n.endswith(".pt") for n in _entries(checkpoints))):
        return False
    return KEPT not in entries or _is_our_dataset(run_dir / KEPT)


def _is_our_dataset(path: Path) -> bool:
    from receipt_embed.outdir import dir_kind

    return dir_kind(path) in (None, "dataset")


def is_sweep_dir(out: str | os.PathLike) -> bool:
    """True for a dir ``train --sweep`` may write into: absent, empty, or its sweep.json, dataset/ and
    KEY=VALUE run dirs (each of them is checked as a run dir when it is trained)."""
    out = Path(out)
    if not out.exists() and not out.is_symlink():
        return True
    if out.is_symlink() or not out.is_dir():
        return False
    for name in _entries(out):
        if name in SWEEP_FILES:
            continue
        if "=" not in name or not (out / name).is_dir():
            return False
    return KEPT not in _entries(out) or _is_our_dataset(out / KEPT)


def check_run_out(run_dir: str | os.PathLike, sweep: bool = False) -> None:
    """Refuse a ``train --out`` (fresh, ``--force`` or ``--resume``) that receipt-embed did not write,
    or one inside a dataset, index, shard or audit dir (those are replaced whole)."""
    from receipt_embed.outdir import refuse_nested

    refuse_nested(run_dir, "run")
    if is_sweep_dir(run_dir) if sweep else is_run_dir(run_dir):
        return
    if Path(run_dir).is_dir() and not Path(run_dir).is_symlink():
        raise ValueError(f"{run_dir} {FOREIGN}")
    raise ValueError(
        f"{run_dir} is not a folder (a file or a link), not a run dir; it is never replaced or written "
        "into (not even with --force): choose another --out"
    )


def dataset_sources(data_dir: str | os.PathLike) -> list[Path]:
    """What reading dataset ``data_dir`` reads: the dir, its ingest source folder and its captures."""
    import json

    from receipt_embed.userfiles import read_regular_text

    data_dir = Path(data_dir)
    sources = [data_dir]
    # only regular files, capped: a FIFO or a device here must not hang or flood this check
    # (loading the dataset afterwards names such a file as the error)
    try:
        report = json.loads(read_regular_text(data_dir / "ingest_report.json", 16 * 1024 * 1024))
        source = Path(report["source"]) if isinstance(report, dict) and isinstance(report.get("source"), str) else None
    except (OSError, ValueError, KeyError):
        source = None
    if source is not None:
        sources.append(source.parent if source.suffix.lower() in (".csv", ".jsonl") else source)
    try:
        lines = read_regular_text(data_dir / "manifest.jsonl", 256 * 1024 * 1024).splitlines()
    except (OSError, ValueError):
        lines = []
    for line in lines:
        try:
            path = json.loads(line).get("path")
        except (ValueError, AttributeError):
            continue
        if isinstance(path, str) and path:
            sources.append(Path(path))
    return sources


def refuse_dataset_inside(out: str | os.PathLike, data_dir: str | os.PathLike | None, role: str = "dataset") -> None:
    """Refuse an ``out`` that is or holds the dataset a run reads, its source folder or its captures
    (the run's own ``OUT/dataset``, ingested by ``train`` itself, excepted)."""
    if data_dir is None:
        return
    target = Path(os.path.abspath(out)).resolve()
    data = Path(os.path.abspath(data_dir)).resolve()
    if data == target / KEPT:
        return
    for source in dataset_sources(data_dir):
        resolved = Path(os.path.abspath(source)).resolve()
        if resolved == target or resolved.is_relative_to(target):
            what = ("is" if resolved == target else "holds") + (
                f" the {role} {data_dir}" if source == Path(data_dir) else f" {source}, read by the {role} {data_dir}"
            )
            raise ValueError(f"--out {out} {what}; training there would destroy its own input: choose another --out")
