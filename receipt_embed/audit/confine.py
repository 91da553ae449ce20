"""Which image files an index dir may make the audit read.

An index dir can come from someone else, and its items.jsonl names files by path. Reading
whatever it names would put any file the user can read (``/etc/passwd``, a key, another
project's photos) into the HTML report the user then shares. So the report only reads
captures under the folders the index's dataset came from, or under folders the user
names (``audit-shortcuts --images-root``); every other path is refused and counted.

The capture folder of a dataset dir is the folder of the manifest ``ingest`` read
(``ingest_report.json`` records it as ``source``; ingest resolves every capture path
inside it). An index from external embeddings records its manifest: a dataset dir's
``manifest.jsonl`` leads to that dataset's capture folder, any other manifest's paths are
relative to its own folder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

INGEST_REPORT = "ingest_report.json"


def _capture_folder(folder: Path) -> Path | None:
    """The folder ``ingest`` resolved a dataset dir's captures in, or None if unrecorded."""
    from receipt_embed.fileio import MAX_JSONL_BYTES, read_json

    try:  # within the cap of the dataset's own manifest.jsonl: a report lists every rejected row
        report = read_json(folder / INGEST_REPORT, MAX_JSONL_BYTES)  # a FIFO or /dev/zero is refused, never read
    except (OSError, ValueError):
        return None
    source = report.get("source") if isinstance(report, dict) else None
    if not isinstance(source, str) or not source:
        return None
    if Path(source).is_absolute():
        return Path(source).parent
    return _folder_of_relative_source(folder, Path(source).parent)


def _folder_of_relative_source(folder: Path, typed: Path) -> Path | None:
    """Older reports hold the manifest path as typed (``data_samples/manifest.csv``). Every
    capture of the dataset lies under that folder, resolved: the deepest ancestor of the
    first capture whose trailing names are the typed ones, if every capture is under it."""
    from receipt_embed.fileio import read_jsonl

    names = typed.parts
    if not names or any(name in ("..", ".") for name in names):
        return None  # the folder ingest ran in is not recorded
    try:
        paths = [row.get("path") for row in read_jsonl(folder / "manifest.jsonl") if isinstance(row, dict)]
    except (OSError, ValueError):
        return None
    if not paths or not all(isinstance(path, str) and Path(path).is_absolute() for path in paths):
        return None
    candidates = [parent for parent in Path(paths[0]).parents if parent.parts[-len(names) :] == names]
    if not candidates:
        return None
    root = candidates[0]
    return root if all(Path(path).is_relative_to(root) for path in paths) else None


def recorded_roots(meta: dict) -> list[Path]:
    """The capture folders an index dir's index.json leads to (dataset or manifest)."""
    source = meta.get("source") if isinstance(meta.get("source"), dict) else {}
    dataset, manifest = source.get("dataset"), source.get("manifest")
    if isinstance(dataset, str) and dataset:
        folder = _capture_folder(Path(dataset))
        return [folder] if folder is not None else []
    if isinstance(manifest, str) and manifest:
        manifest_path = Path(manifest)
        folder = _capture_folder(manifest_path.parent) if manifest_path.name == "manifest.jsonl" else None
        return [folder if folder is not None else manifest_path.parent]
    return []


def recorded_captures(meta: dict) -> set[Path]:
    """The captures (resolved) of the dataset an index dir records, when that dataset was ingested
    with ``allow_absolute_paths``: its captures may lie anywhere, and each one it accepted is one the
    user handed over, so it may be shown although it is outside the manifest's folder."""
    from receipt_embed.fileio import MAX_JSONL_BYTES, read_json, read_jsonl

    source = meta.get("source") if isinstance(meta.get("source"), dict) else {}
    dataset, manifest = source.get("dataset"), source.get("manifest")
    if isinstance(dataset, str) and dataset:
        folder = Path(dataset)
    elif isinstance(manifest, str) and Path(manifest).name == "manifest.jsonl":
        folder = Path(manifest).parent
    else:
        return set()
    try:
        report = read_json(folder / INGEST_REPORT, MAX_JSONL_BYTES)
        settings = report.get("settings") if isinstance(report, dict) else None
        if not (isinstance(settings, dict) and settings.get("allow_absolute_paths") is True):
            return set()
        rows = read_jsonl(folder / "manifest.jsonl")
    except (OSError, ValueError):
        return set()
    captures = set()
    for row in rows:
        path = row.get("path") if isinstance(row, dict) else None
        if isinstance(path, str) and Path(path).is_absolute():
            try:
                captures.add(Path(path).resolve())
            except (OSError, RuntimeError, ValueError):
                continue
    return captures


def too_wide_root(root: Path) -> bool:
    """Whether a capture folder derived from index or dataset metadata is too wide to confine
    reads to: ``/``, a top-level folder (``/tmp``, ``/home``), or the user's home folder or one
    above it. A forged ``ingest_report.json`` naming ``/manifest.csv`` would otherwise allow
    every file; ``--images-root`` still allows any folder the user names."""
    if len(root.parts) < 3:  # "/" and "/name"
        return True
    try:
        home = Path.home().resolve()
    except (RuntimeError, OSError, KeyError):
        return False
    return home == root or home.is_relative_to(root)


@dataclass
class ImageRoots:
    """Folders image reads are confined to (symlinks resolved), and the reads refused."""

    roots: list[Path]
    refused: list[tuple[int, str]] = field(default_factory=list)  # (row, path) per refused read
    too_wide: list[Path] = field(default_factory=list)  # recorded roots not trusted (see too_wide_root)
    captures: set[Path] = field(default_factory=set)  # accepted captures outside the roots (recorded_captures)
    unresolvable: list[tuple[int, str]] = field(default_factory=list)  # paths naming no file (a NUL byte, a loop)

    @classmethod
    def for_index(cls, meta: dict, extra=()) -> ImageRoots:
        recorded = [Path(root).resolve() for root in recorded_roots(meta)]
        wide = [root for root in recorded if too_wide_root(root)]
        kept = [root for root in recorded if root not in wide]
        roots = [*kept, *(Path(root).resolve() for root in extra)]
        return cls(roots, too_wide=wide, captures=recorded_captures(meta))

    def allows(self, path: str) -> bool:
        return self._verdict(path) == "allowed"

    def _verdict(self, path: str) -> str:
        """Where path lies: allowed, outside the roots, or unresolvable (a NUL byte, a symlink loop)."""
        try:
            resolved = Path(path).resolve()
        except (OSError, RuntimeError, ValueError):
            return "unresolvable"
        inside = resolved in self.captures or any(resolved.is_relative_to(root) for root in self.roots)
        return "allowed" if inside else "outside"

    def check(self, row: int, path) -> bool:
        """Whether row's path may be read; a refusal is recorded once per row (a path that names no
        file at all, with a NUL byte or in a symlink loop, is recorded as unresolvable instead)."""
        if not isinstance(path, str) or not path:
            return False
        verdict = self._verdict(path)
        if verdict == "allowed":
            return True
        refusals = self.unresolvable if verdict == "unresolvable" else self.refused
        if (row, path) not in refusals:
            refusals.append((row, path))
        return False

    def warning(self) -> str | None:
        """One line for all refusals, naming the first, or None when nothing was refused."""
        wide = ""
        if self.too_wide:
            wide = (
                f"the capture folder index.json leads to ({', '.join(map(str, self.too_wide))}) is too wide to "
                "trust (/, a top-level folder, or your home folder or above), so no thumbnail is read from it; "
            )
        if not self.refused:
            return wide + "pass --images-root DIR to allow a folder" if wide else None
        row, path = self.refused[0]  # the CLI prints warnings escaped
        where = ", ".join(str(root) for root in self.roots) or "none recorded in index.json"
        more = f" and {len(self.refused) - 1} more" if len(self.refused) > 1 else ""
        return (
            f"{wide}{len(self.refused)} gallery image(s) outside the dataset's capture folders were not read "
            f"(row {row}: {path}{more}); allowed: {where}; pass --images-root DIR to allow another folder"
        )
