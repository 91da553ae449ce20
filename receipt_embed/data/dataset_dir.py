"""A dataset dir written by ``ingest``: its captures and their identities, by split."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from receipt_embed.data.cache import REINGEST, CaptureChanged, ImageCache
from receipt_embed.display import quoted, shortened
from receipt_embed.errors import BadInput
from receipt_embed.fileio import MAX_JSONL_BYTES, parse_json, parse_jsonl
from receipt_embed.ingest.pipeline import MANIFEST_FILE, REPORT_FILE
from receipt_embed.ingest.splits import SPLITS
from receipt_embed.userfiles import UnusableFile, check_regular, read_regular, read_regular_text


@dataclass(frozen=True)
class Captures:
    """Rows of one split (or all), with identity labels as integers 0..n_identities-1."""

    rows: list[dict]
    labels: list[int]
    identities: list[str]  # label -> receipt_id

    @property
    def paths(self) -> list[str]:
        return [row["path"] for row in self.rows]

    @property
    def digests(self) -> list[str | None]:
        """The sha256 ingest recorded per capture (None where a row lacks one)."""
        return [row.get("sha256") for row in self.rows]

    def __len__(self) -> int:
        return len(self.rows)


def load_dataset_dir(path: str | Path) -> list[dict]:
    """All rows of ``DATASET_DIR/manifest.jsonl``; a missing file says how to make one. A
    dataset dir swapped for a new copy by ``ingest --force`` while it was read is read again."""
    from receipt_embed.staging import consistent_read

    return consistent_read(_load_dataset_dir_once, path)


def _load_dataset_dir_once(path: str | Path) -> list[dict]:
    manifest = Path(path) / MANIFEST_FILE
    try:
        check_regular(manifest)  # a FIFO or device is named as such, not reported missing
    except UnusableFile as exc:
        if exc.reason != "missing_file":
            raise
        if (Path(path) / "manifest.csv").is_file():  # the captures' own folder, not yet ingested
            raise FileNotFoundError(
                f"{manifest} not found: {path} holds a manifest.csv, not a dataset dir; ingest it first, "
                f"`receipt-embed ingest {path} --out DATASET_DIR`, and pass DATASET_DIR"
            ) from None
        raise FileNotFoundError(
            f"{manifest} not found: is {path} a dataset dir written by `receipt-embed ingest`?"
        ) from None
    data = read_regular(manifest, MAX_JSONL_BYTES)
    _check_seal(Path(path), manifest, data)
    rows = parse_jsonl(data, manifest)
    _check_rows(manifest, rows)
    return rows


def _check_seal(path: Path, manifest: Path, data: bytes) -> None:
    """Refuse a manifest.jsonl whose bytes differ from those ingest wrote beside its report: a
    row added, deleted, relabelled or moved to another split by hand would otherwise be trained
    on and indexed as if ingest had checked it. The record is part of a dataset dir: without it
    (the report deleted, emptied or edited) the manifest cannot be told from a hand-made one."""
    report_path = path / REPORT_FILE
    try:
        report = parse_json(read_regular_text(report_path, MAX_JSONL_BYTES))
    except UnusableFile as exc:
        if exc.reason == "missing_file":
            raise BadInput(
                f"{report_path} is missing: a dataset dir is what `receipt-embed ingest` writes, its manifest.jsonl "
                f"and the report that records the manifest's sha256; {REINGEST}"
            ) from None
        raise
    except ValueError as exc:
        raise BadInput(f"{report_path}: not valid JSON ({shortened(str(exc))}); {REINGEST}") from None
    sealed = report.get("manifest_sha256") if isinstance(report, dict) else None
    if not isinstance(sealed, str):
        raise BadInput(
            f"{report_path} does not record the sha256 of {MANIFEST_FILE} (written by hand, edited, or by a "
            f"receipt-embed older than the record), so the manifest cannot be trusted as ingest checked it; {REINGEST}"
        )
    if hashlib.sha256(data).hexdigest() != sealed:
        raise BadInput(
            f"{manifest} was changed after ingest wrote it (its sha256 differs from the one "
            f"{REPORT_FILE} records): edit the source manifest instead and run `receipt-embed ingest` again"
        )


def _check_rows(manifest: Path, rows: list[dict]) -> None:
    """The rules every dataset dir keeps, sealed or not: each row names its capture, identity,
    device and a known split as text; no capture is listed twice, and no receipt is in two
    splits (its captures would be negatives of each other across the train/held-out line)."""
    seen_paths: dict[str, int] = {}
    split_of: dict[str, tuple[str, int]] = {}
    for number, row in enumerate(rows, start=1):
        where = f"{manifest}, line {number}"
        if not isinstance(row, dict):
            raise BadInput(f"{where}: a row must be a JSON object")
        missing = [k for k in ("path", "receipt_id", "device", "split") if k not in row]
        if missing:
            raise BadInput(f"{where}: missing {', '.join(missing)}")
        for key in ("path", "receipt_id", "device", "split"):
            if not isinstance(row[key], str) or not row[key]:
                raise BadInput(f"{where}: {key} must be a non-empty string, not {shortened(repr(row[key]))}")
        if row["split"] not in SPLITS:
            raise BadInput(f"{where}: unknown split {quoted(row['split'])} (one of {', '.join(SPLITS)})")
        if row["path"] in seen_paths:
            raise BadInput(f"{where}: {quoted(row['path'])} is listed again (first on line {seen_paths[row['path']]})")
        seen_paths[row["path"]] = number
        first = split_of.setdefault(row["receipt_id"], (row["split"], number))
        if first[0] != row["split"]:
            raise BadInput(
                f"{where}: receipt {quoted(row['receipt_id'])} is in split {row['split']}, but in "
                f"{first[0]} on line {first[1]}: a receipt's captures must share one split"
            )


def select_split(rows: list[dict], split: str) -> Captures:
    """Captures of one split (``all`` for every row), labelled by identity."""
    if split != "all" and split not in SPLITS:
        raise BadInput(f"unknown split {split!r}; use one of {', '.join(SPLITS)} or all")
    chosen = [row for row in rows if split == "all" or row["split"] == split]
    identities = sorted({row["receipt_id"] for row in chosen})
    index = {receipt_id: i for i, receipt_id in enumerate(identities)}
    return Captures(chosen, [index[row["receipt_id"]] for row in chosen], identities)


def _change_of(row: dict) -> str | None:
    """What changed in one capture file since ingest recorded its size and mtime, or None.

    Rows from dataset dirs written before ingest recorded them are not checked. A file whose
    size is the same but whose mtime moved (touched, or copied without keeping times) is
    hashed: only a different content counts as a change."""
    if not isinstance(row.get("bytes"), int) or not isinstance(row.get("mtime_ns"), int):
        return None
    path = row["path"]
    try:
        info = check_regular(path)
        if info.st_size != row["bytes"]:
            return f"{path} changed since ingest: {info.st_size} bytes, was {row['bytes']}"
        if info.st_mtime_ns != row["mtime_ns"] and row.get("sha256"):
            if hashlib.sha256(read_regular(path, None)).hexdigest() != row["sha256"]:
                return f"{path} changed since ingest: same size, but its content (sha256) differs from manifest.jsonl"
    except UnusableFile as exc:
        if exc.reason == "missing_file":
            return f"{path} is missing (moved or deleted since ingest?)"
        return f"{exc}, unlike at ingest"
    return None


def check_captures_present(paths: list[str], manifest) -> None:
    """Refuse captures gone since ingest (how many, the first) and, by what it is, the first one
    now a FIFO, directory, device or unresolvable link: a file that is there is never "missing"."""
    gone = []
    for path in paths:
        try:
            check_regular(path)
        except UnusableFile as exc:
            if exc.reason != "missing_file":
                raise CaptureChanged(f"{exc}, unlike at ingest; {REINGEST}") from None
            gone.append(path)
    if gone:
        count = "1 capture" if len(gone) == 1 else f"{len(gone)} captures"
        raise FileNotFoundError(
            f"{count} listed in {manifest} {'is' if len(gone) == 1 else 'are'} missing, first {gone[0]}; "
            "were they moved since `receipt-embed ingest`? Re-run it"
        )


def verify_captures(rows: list[dict]) -> None:
    """Refuse captures replaced, edited or removed since ingest (one error: the first, and how many)."""
    problems = [problem for problem in map(_change_of, rows) if problem]
    if problems:
        more = f" ({len(problems) - 1} more captures changed too)" if len(problems) > 1 else ""
        raise CaptureChanged(f"{problems[0]}{more}; {REINGEST}")


def cache_captures(
    captures: Captures, size: tuple[int, int], settings, progress: bool = False, crop_page: bool = False
) -> ImageCache:
    """The decoded cache of some captures, each checked against its manifest.jsonl record;
    ``settings`` (an IngestConfig) caps the bytes read and the pixels decoded per file;
    ``crop_page`` (``data.page_crop``) cuts each capture to its page."""
    verify_captures(captures.rows)
    return ImageCache(
        captures.paths,
        size,
        progress=progress,
        max_pixels=settings.max_pixels,
        max_bytes=settings.max_bytes,
        digests=captures.digests,
        crop_page=crop_page,
    )
