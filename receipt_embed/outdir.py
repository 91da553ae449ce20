"""Output dirs: which dirs are ours, and where a command may write.

A dir is ours (a dataset, index, shard, audit, run or samples dir) only by its marker files
and when it holds nothing we did not write, so a user's folder that happens to hold an
``index.json`` is never taken for an index dir. Replacing needs ``force``, and only a dir of
the same kind is ever replaced: another kind, or a folder we did not write, is refused even
with ``force``. No command writes over its own input, inside a dir that is replaced whole,
or through a symbolic link. Writing a dir whole (staged, then swapped) is ``staging.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

from receipt_embed.errors import BadInput
from receipt_embed.fileio import parse_json

# what each kind of dir holds; a dir is of a kind when it holds all its marker files
MARKERS = {
    "dataset": ("manifest.jsonl", "ingest_report.json"),
    "index": ("index.json",),
    "shard": ("shard.json",),
    "audit": ("audit.json",),
    "run": ("checkpoints/last.pt",),
    "samples": ("manifest.csv", "samples.json"),
}
# files an interrupted older writer may have left without its marker (still ours)
PARTIAL = {
    "index": ("index.faiss", "items.jsonl", "embeddings.npy"),
    "shard": ("embeddings.npy", "items.jsonl"),
    "audit": ("audit.html",),
    "run": ("config.yaml", "metrics.jsonl"),
}
WHAT = {
    "pairs": "a pairs CSV",
    "samples": "a samples dir",
    "dataset": "a dataset dir",
    "index": "an index dir",
    "shard": "a shard dir",
    "audit": "an audit report dir",
    "run": "a run dir",
    "demo": "a demo run",
}


def dir_kind(path: str | os.PathLike) -> str | None:
    """``dataset``/``index``/``shard``/``audit``/``run`` for a dir we wrote, None for a missing
    or empty dir (ignoring our own hidden lock and staging names), ``other`` for anything else.

    A dir is ours only when its marker files are there and it holds nothing we did not write
    (a run dir excepted: plugins write into it, and it is never replaced whole), so a user's
    folder that happens to hold an ``index.json`` is not mistaken for an index dir."""
    path = Path(path)
    if not path.is_dir():
        return "other" if path.exists() or path.is_symlink() else None
    entries = {entry.name for entry in path.iterdir() if not _ours_hidden(entry.name)}
    if not entries:
        return None
    for kind, markers in MARKERS.items():
        if all((path / name).exists() for name in markers):
            known = _written_by_us(path, kind)
            if known is None:
                return kind
            return kind if entries <= known and _inner_entries_ours(path, kind, entries) else "other"
    for kind, names in PARTIAL.items():
        if entries <= {*names, *MARKERS[kind]}:
            return kind
    return "other"


def _written_by_us(path: Path, kind: str) -> set[str] | None:
    """The top-level names a ``kind`` dir of ours may hold (None: any, for run dirs)."""
    if kind == "run":
        return None
    names = {*MARKERS[kind], *PARTIAL.get(kind, ())}
    if kind == "samples":
        names.add("images")
    if kind == "index":
        names.add("audit")  # audit-shortcuts' default report dir
    if kind in ("index", "shard"):  # and whatever files its record lists (e.g. verifier data)
        try:
            record = parse_json((path / MARKERS[kind][0]).read_text(encoding="utf-8"))
            names |= {Path(name).parts[0] for name in record.get("files", {}) if Path(name).parts}
        except (OSError, ValueError, AttributeError, TypeError):
            pass
    return names


# the folders inside a dir of ours, and what each may hold; every other name we write is a file
SAMPLE_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")


def _inner_entries_ours(path: Path, kind: str, entries: set[str]) -> bool:
    """Below the top level too, nothing we did not write: a user's ``INDEX/audit/notes.txt`` or a
    folder named ``audit.json`` makes the dir theirs, so ``--force`` never deletes it."""
    listed = _listed_folders(path, kind)
    for name in entries:
        entry = path / name
        if entry.is_symlink() or is_mount_point(entry):  # another file system mounted there is never ours
            return False
        if kind == "index" and name == "audit":
            if dir_kind(entry) not in (None, "audit"):
                return False
        elif kind == "samples" and name == "images":
            if not entry.is_dir() or any(
                not image.is_file() or image.is_symlink() or not image.name.lower().endswith(SAMPLE_IMAGE_SUFFIXES)
                for image in entry.iterdir()
            ):
                return False
        elif name not in listed and not entry.is_file():
            return False
    return True


def is_mount_point(path: Path) -> bool:
    """Whether something is mounted at ``path``; a bind mount from the same file system shares its
    device with the parent, so ``os.path.ismount`` misses it and the kernel's mount table decides."""
    if os.path.ismount(path):
        return True
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as table:
            points = {line.split()[4] for line in table if len(line.split()) > 4}
    except OSError:
        return False
    escaped = str(Path(path).resolve()).replace("\\", "\\134").replace(" ", "\\040").replace("\t", "\\011")
    return escaped.replace("\n", "\\012") in points


def _listed_folders(path: Path, kind: str) -> set[str]:
    """Top-level folders an index or shard record lists files in (written by a plugin's verifier data)."""
    if kind not in ("index", "shard"):
        return set()
    try:
        record = parse_json((path / MARKERS[kind][0]).read_text(encoding="utf-8"))
        return {Path(name).parts[0] for name in record.get("files", {}) if len(Path(name).parts) > 1}
    except (OSError, ValueError, AttributeError, TypeError):
        return set()


def _ours_hidden(name: str) -> bool:
    return name.startswith(".") and (
        name.endswith(".lock") or ".staging-" in name or ".old-" in name or name.endswith(".tmp")
    )


# dirs written whole: nothing else may be written inside one, or replacing it would be refused
# (or, for a nested dir of ours, lost); an index dir's own audit/ report dir is the one exception
# `train --force` replaces a run dir whole too, and `make-samples --force` a samples dir
WHOLE = ("dataset", "index", "shard", "audit", "run", "samples")
# (enclosing kind, kind) -> the one name it may have there: INDEX/audit (any name), RUN/dataset (the
# samples `train` ingests when no --data is given; a run's replacement keeps it)
NESTED_OK = {("index", "audit"): None, ("run", "dataset"): "dataset"}


def enclosing_dir(out: str | os.PathLike) -> tuple[Path, str] | None:
    """The nearest folder above ``out`` that is a dataset, index, shard, audit, run or samples dir of ours, and its kind."""
    out = Path(os.path.abspath(out))
    for parent in [*out.parents, *Path(out).resolve().parents]:
        for kind in WHOLE:
            if all((parent / name).is_file() for name in MARKERS[kind]):
                return parent, kind
    return None


def refuse_nested(out: str | os.PathLike, kind: str) -> None:
    """Refuse an ``out`` inside a dir that receipt-embed writes whole (``DATASET/run``, ``INDEX/idx``,
    ``SAMPLES/pairs.csv``)."""
    found = enclosing_dir(out)
    if found is None:
        return
    parent, parent_kind = found
    where = Path(os.path.abspath(out))
    if (
        (parent_kind, kind) in NESTED_OK
        and where.parent == parent
        and NESTED_OK[parent_kind, kind] in (None, where.name)
    ):
        return
    raise BadInput(
        f"--out {out} is inside {WHAT[parent_kind]} ({parent}); that dir is replaced whole by the "
        f"command that wrote it, so {WHAT[kind]} must not be written inside it: choose another --out"
    )


def refuse_current_dir(out: str | os.PathLike) -> None:
    """Refuse an ``out`` that is, or holds, the current directory: it is swapped whole, and the shell
    that ran the command would be left in a deleted directory (``--out .``, ``--out ..``)."""
    try:
        here, target = Path(os.getcwd()).resolve(), Path(out).resolve()
    except (OSError, RuntimeError):  # the current directory is gone already, or a link loop (refused later)
        return
    if here == target:
        raise BadInput(f"--out {out} is the current directory; give a path to a new or existing output dir")
    if here.is_relative_to(target):
        raise BadInput(
            f"--out {out} holds the current directory ({here}), and it is replaced whole: give a path to "
            "another output dir, or cd out of it first"
        )


def refuse_current_dir_in(out: str | os.PathLike, parts, replaces: str) -> None:
    """Refuse an ``out`` whose ``parts`` (folders in it that the command removes or replaces while
    ``out`` itself stays) hold the current directory, as :func:`refuse_current_dir` does for a dir
    replaced whole; ``replaces`` says who replaces them (``--force replaces``)."""
    try:
        here = Path(os.getcwd()).resolve()
        targets = [(part, Path(part).resolve()) for part in parts]
    except (OSError, RuntimeError):  # the current directory is gone already, or a link loop (refused later)
        return
    for part, target in targets:
        if here.is_relative_to(target):
            raise BadInput(
                f"--out {out} holds the current directory ({here}), and {replaces} {part} whole: give a path to "
                "another output dir, or cd out of it first"
            )


def check_replaceable(out: str | os.PathLike, kind: str, force: bool) -> None:
    """Refuse to write ``kind`` into ``out`` unless it is absent, empty, or ours of that kind with ``force``,
    never inside another dir that is replaced whole, and never the current directory."""
    refuse_current_dir(out)
    refuse_nested(out, kind)
    if Path(out).is_symlink():
        raise BadInput(
            f"{out} is a symbolic link (to {os.readlink(Path(out))}); an output dir is never replaced through a link: "
            "give the folder itself as --out"
        )
    found = dir_kind(out)
    if found is None:
        return
    if found == kind:
        if not force:
            raise BadInput(f"{out} already holds {WHAT[kind]}; pass --force to replace it, or choose another --out")
        return
    what = "a file" if not Path(out).is_dir() else WHAT.get(found, "files that receipt-embed did not write")
    raise BadInput(
        f"{out} holds {what}, not {WHAT[kind]}; it is never replaced (not even with --force): choose another --out"
    )


def refuse_own_input(out: str | os.PathLike, inputs: dict[str, str | os.PathLike | None]) -> None:
    """Refuse an ``out`` that is, or holds, one of the inputs the command reads (by role)."""
    target = Path(out).resolve()
    for role, given in inputs.items():
        if given is None:
            continue
        source = Path(given).resolve()
        if source == target or source.is_relative_to(target):
            where = "is" if source == target else "holds"
            raise BadInput(
                f"--out {out} {where} the {role} {given} this command reads; writing there would "
                "destroy its own input: choose another --out"
            )


__all__ = [
    "MARKERS",
    "check_replaceable",
    "dir_kind",
    "refuse_current_dir",
    "refuse_current_dir_in",
    "refuse_nested",
    "refuse_own_input",
]
