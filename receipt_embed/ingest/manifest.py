"""Reading a capture manifest (CSV with a header, or JSON lines), row by row.

Rows keep their source line number so every later rejection can name it. Structural
problems with the file itself (bad CSV quoting, an invalid JSON line, no header) raise
:class:`ManifestError`; problems with one row are left for validation to reject.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from receipt_embed.display import quoted, shortened
from receipt_embed.errors import BadInput
from receipt_embed.fileio import parse_json
from receipt_embed.outdir import MARKERS
from receipt_embed.userfiles import DEFAULT_MAX_BYTES, UnusableFile, check_regular, read_regular

REQUIRED_COLUMNS = ("path", "receipt_id", "device")
# columns ingest itself writes into manifest.jsonl (split is not one: a manifest may give it)
RESERVED_COLUMNS = (
    "sha256",
    "width",
    "height",
    "format",
    "mode",
    "bytes",
    "mtime_ns",
    "line",
    "manifest_path",
    "duplicate_conflict",
    "source_receipt_id",
)
# a manifest is text, one short line per capture: millions of rows fit well below this
MAX_MANIFEST_BYTES = DEFAULT_MAX_BYTES
MANIFEST_NAMES = ("manifest.csv", "manifest.jsonl")


class ManifestError(BadInput):
    """The manifest file cannot be read; the message names the file and line."""


@dataclass
class ManifestRow:
    line: int
    fields: dict


def _check_manifest_file(path: Path) -> None:
    """A manifest must be a regular file: a FIFO or a device would block or never end."""
    try:
        check_regular(path)
    except UnusableFile as exc:
        if exc.reason == "missing_file":
            raise ManifestError(f"manifest not found: {path}") from None
        raise ManifestError(f"manifest {exc}") from None


def find_manifest(source: str | Path) -> Path:
    """``source`` is a manifest file, or a folder holding manifest.csv / manifest.jsonl."""
    source = Path(source)
    if source.is_dir():
        for name in MANIFEST_NAMES:
            if os.path.lexists(source / name):
                _check_manifest_file(source / name)
                return source / name
        raise ManifestError(f"{source} is a folder without {' or '.join(MANIFEST_NAMES)}")
    _check_manifest_file(source)
    return source


def _read_text(path: Path) -> str:
    """The whole manifest as text (one capped read of a regular file)."""
    try:
        data = read_regular(path, MAX_MANIFEST_BYTES)
    except UnusableFile as exc:
        raise ManifestError(f"manifest {exc}") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise _not_utf8(path, data, exc) from None


def _not_utf8(path: Path, data: bytes, exc: UnicodeDecodeError) -> ManifestError:
    """Name the first line that is not UTF-8."""
    for number, raw in enumerate(data.splitlines(), start=1):
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return ManifestError(f"{path}, line {number}: not UTF-8 text ({exc.reason})")
    return ManifestError(f"{path}: not UTF-8 text ({exc.reason})")


def _without_surrogates(text: str) -> str:
    return "".join(c for c in text if not 0xD800 <= ord(c) <= 0xDFFF)


def check_column_spellings(path: Path, columns) -> None:
    """Refuse a column without a name or with invisible characters in it, and a column that is one of ingest's own names in other letter case (``Split``,
    ``SHA256``, ``Receipt_ID`` beside ``receipt_id``): kept as metadata, a ``Split`` column's splits
    would be ignored and a ``SHA256`` would slip past the reserved-name check."""
    if "" in columns:
        raise ManifestError(
            f"{path}: a column has no name (an empty header cell or JSON key); name it, or delete the column"
        )
    # (a lone surrogate, which only JSON can write, rejects its row with its own reason: rows.py)
    hidden = sorted((c for c in columns if not _without_surrogates(c).isprintable()), key=str)
    if hidden:  # make-samples refuses them too: a name shown in reports and tables must be visible text
        raise ManifestError(
            f"{path}: column name {quoted(shortened(hidden[0]))} holds control or invisible characters (a newline, "
            "ESC, NUL, a direction override); rename it"
        )
    own = {name.lower(): name for name in (*REQUIRED_COLUMNS, "split", *RESERVED_COLUMNS)}
    variants = sorted(c for c in columns if c.lower() in own and c != own[c.lower()])
    if variants:
        renames = ", ".join(f"{c!r} -> {own[c.lower()]!r}" for c in variants)
        raise ManifestError(
            f"{path}: column(s) {', '.join(variants)} differ from ingest's own column names only in "
            f"letter case, and column names are case-sensitive: rename them ({renames}) to be read as "
            "ingest's, or to another name to keep them as metadata"
        )


def check_reserved_columns(path: Path, columns) -> None:
    """Refuse manifest columns that ingest writes itself: they would be overwritten, or
    (``duplicate_conflict``, ``source_receipt_id``) trusted as if ingest had found them."""
    clashing = [column for column in RESERVED_COLUMNS if column in columns]
    if clashing and path.name in MARKERS["dataset"] and all((path.parent / n).is_file() for n in MARKERS["dataset"]):
        raise ManifestError(
            f"{path.parent} is a dataset dir written by ingest, not a manifest to ingest: pass it to "
            "`train --data` or `index --data` as it is, or ingest the manifest it was made from "
            "(its ingest_report.json names it as source)"
        )
    if clashing:
        renames = ", ".join(f"{c!r} -> {c + '_given'!r}" for c in clashing)
        raise ManifestError(
            f"{path}: column(s) {', '.join(clashing)} are written by ingest itself; "
            f"rename them in the manifest (e.g. {renames})"
        )


MAX_COLUMNS = 1000  # path, receipt_id, device and metadata: far more is a malformed or hostile file


def _listed(names: list[str], most: int = 20) -> str:
    shown = ", ".join(names[:most])
    return shown if len(names) <= most else f"{shown}, ... ({len(names) - most} more)"


def _read_csv(path: Path) -> list[ManifestRow]:
    rows = []
    reader = csv.reader(io.StringIO(_read_text(path), newline=""), strict=True)
    start = 1  # the line where the row being read begins
    try:
        header = next(reader, None)
        if not header or not any(cell.strip() for cell in header):
            raise ManifestError(f"{path}: empty file or missing header line")
        header = [cell.strip() for cell in header]
        if len(header) > MAX_COLUMNS:
            raise ManifestError(f"{path}, line 1: {len(header)} columns; a manifest has at most {MAX_COLUMNS}")
        counts = Counter(header)
        duplicated = sorted(c for c, n in counts.items() if n > 1)
        if duplicated:
            raise ManifestError(f"{path}, line 1: repeated column(s) {', '.join(duplicated)}")
        start = reader.line_num + 1
        for cells in reader:
            if not any(cell.strip() for cell in cells):
                start = reader.line_num + 1
                continue
            if len(cells) != len(header):
                raise ManifestError(
                    f"{path}, line {start}: expected {len(header)} fields ({_listed(header)}), found {len(cells)}"
                )
            rows.append(ManifestRow(start, {k: v.strip() for k, v in zip(header, cells)}))
            start = reader.line_num + 1
    except csv.Error as exc:
        if "field larger than field limit" in str(exc):  # a value, not the file's syntax
            raise ManifestError(
                f"{path}, line {start}: a value is longer than {csv.field_size_limit():,} characters, the most a "
                "manifest value may have"
            ) from None
        raise ManifestError(f"{path}, line {start}: malformed CSV ({exc})") from None
    return rows


def _check_value_lengths(path: Path, number: int, fields: dict) -> None:
    """A JSON-lines value is held to the CSV reader's limit: a multi-megabyte receipt id or device
    would be copied into every index, search line and audit report built from it."""
    limit = csv.field_size_limit()
    for key, value in fields.items():
        if isinstance(value, str) and len(value) > limit:
            raise ManifestError(
                f"{path}, line {number}: the value of {quoted(key)} has {len(value):,} characters; a manifest "
                f"value has at most {limit:,}"
            )


def _read_jsonl(path: Path) -> list[ManifestRow]:
    rows = []
    for number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = parse_json(line, unique_keys=True)
        except json.JSONDecodeError as exc:
            where = f", column {exc.colno}" if exc.pos else ""  # a repeated key has no one column
            raise ManifestError(f"{path}, line {number}: invalid JSON ({exc.msg}{where})") from None
        if not isinstance(record, dict):
            raise ManifestError(f"{path}, line {number}: expected a JSON object, got {type(record).__name__}")
        if len(record) > MAX_COLUMNS:
            raise ManifestError(f"{path}, line {number}: {len(record)} fields; a manifest has at most {MAX_COLUMNS}")
        fields = {k.strip(): (v.strip() if isinstance(v, str) else v) for k, v in record.items()}
        _check_value_lengths(path, number, fields)
        if len(fields) < len(record):  # " split" and "split": one column once spaces are stripped, as in a CSV
            repeated = sorted({k.strip() for k in record if sum(j.strip() == k.strip() for j in record) > 1})
            raise ManifestError(
                f"{path}, line {number}: key(s) {', '.join(map(repr, repeated))} given twice "
                "(keys are read without their surrounding spaces)"
            )
        rows.append(ManifestRow(number, fields))
    return rows


def read_manifest(path: Path) -> list[ManifestRow]:
    """All rows of a CSV or JSONL manifest (format chosen by the file extension)."""
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return _read_csv(path)
    if suffix in (".jsonl", ".ndjson"):
        return _read_jsonl(path)
    raise ManifestError(f"{path}: unknown manifest format {suffix!r}; use .csv or .jsonl")
