"""A run dir: what it holds, how it is told from other folders, and what it may not hold.

Layout: ``config.yaml`` (the resolved config), ``data.json`` (the dataset dir and its
manifest's sha256), ``metrics.jsonl`` (a line per epoch), ``checkpoints/last.pt`` and
``checkpoints/best.pt``, ``whitening.json`` (what the fit of ``model.whiten`` changed), whatever
plugins add, and ``dataset/`` when ``train`` ingested the
samples itself. A folder is a run dir of ours only by those files, so ``train --out`` never
writes into a user's folder, a dataset or an index.
"""

from __future__ import annotations

import os
from pathlib import Path

from receipt_embed.errors import BadInput
from receipt_embed.fileio import parse_json

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"
DATA_FILE = "data.json"  # the dataset dir a run trains on, and its manifest's sha256
WHITENING_FILE = (
    "whitening.json"  # the whitening fit of each checkpoint: captures, receipts, val recall@1 before and after
)
LAST, BEST = "checkpoints/last.pt", "checkpoints/best.pt"
LAST_CHECKPOINT = Path(LAST)
KEPT = "dataset"  # the samples `train` ingests into RUN_DIR/dataset when no --data is given: not the run's

# what a run writes at its top level (plugins may add files, but only a run with a checkpoint is known to be ours)
RUN_FILES = {CONFIG_FILE, DATA_FILE, METRICS_FILE, WHITENING_FILE, "checkpoints", KEPT}
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

    try:
        record = parse_json(path.read_text(encoding="utf-8")) if path.is_file() and not path.is_symlink() else None
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
    checkpoints = run_dir / "checkpoints"
    if (
        checkpoints.is_dir()
        and not checkpoints.is_symlink()
        and any(  # a user's file there is never replaced
            not n.endswith(".pt") or not (checkpoints / n).is_file() for n in _entries(checkpoints)
        )
    ):
        return False
    if (run_dir / LAST_CHECKPOINT).is_file():
        return True
    entries = _entries(run_dir)
    if not entries <= RUN_FILES:
        return False
    if entries - {KEPT} and not _is_data_record(run_dir / "data.json"):
        return False
    if checkpoints.exists() and not checkpoints.is_dir():
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
    for name in (
        "checkpoints",
        METRICS_FILE,
        DATA_FILE,
        WHITENING_FILE,
    ):  # written into or appended to: never through a link
        if (Path(run_dir) / name).is_symlink():
            raise BadInput(
                f"{Path(run_dir) / name} is a symbolic link, not a regular file or folder of the run; a run dir's "
                "files are never written through a link (remove the link, or choose another --out)"
            )
    if is_sweep_dir(run_dir) if sweep else is_run_dir(run_dir):
        return
    if not sweep and is_sweep_dir(run_dir):
        raise BadInput(
            f"{run_dir} is a sweep dir (a run dir per value, KEY=VALUE), not a run dir: pass --sweep "
            "KEY=V1,V2 to sweep there again, or choose another --out"
        )
    if sweep and is_run_dir(run_dir) and Path(run_dir, "checkpoints").exists():
        raise BadInput(f"{run_dir} is a run dir, not a sweep dir: train without --sweep, or choose another --out")
    if Path(run_dir).is_dir() and not Path(run_dir).is_symlink():
        raise BadInput(f"{run_dir} {FOREIGN}")
    raise BadInput(
        f"{run_dir} is not a folder (a file or a link), not a run dir; it is never replaced or written "
        "into (not even with --force): choose another --out"
    )


def dataset_sources(data_dir: str | os.PathLike) -> list[Path]:
    """What reading dataset ``data_dir`` reads: the dir, its ingest source folder and its captures."""

    from receipt_embed.fileio import MAX_JSONL_BYTES
    from receipt_embed.userfiles import read_regular_text

    data_dir = Path(data_dir)
    sources = [data_dir]
    # only regular files, capped: a FIFO or a device here must not hang or flood this check; the
    # report lists every rejected row, so it is capped as the manifest is, not as a small record
    # (loading the dataset afterwards names such a file as the error)
    try:
        report = parse_json(read_regular_text(data_dir / "ingest_report.json", MAX_JSONL_BYTES))
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
            path = parse_json(line).get("path")
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
            raise BadInput(f"--out {out} {what}; training there would destroy its own input: choose another --out")


def refuse_other_kinds(run_dir, data_dir=None) -> None:
    """A dataset, index, shard or report dir, a user's folder, or one holding the data the run reads, is
    never turned into a run dir."""
    from receipt_embed.outdir import WHAT, dir_kind

    kind = dir_kind(run_dir)
    if kind in ("dataset", "index", "shard", "audit"):
        raise BadInput(f"{run_dir} holds {WHAT[kind]}, not a run; train into another --out")
    check_run_out(run_dir)
    refuse_dataset_inside(run_dir, data_dir)
