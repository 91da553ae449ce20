"""Reading a capture manifest (CSV with a header, or JSON lines), row by row.

Rows keep their source line number so every later rejection can name it. Structural
problems with the file itself (bad CSV quoting, an invalid JSON line, no header) raise
:class:`ManifestError`; problems with one row are left for validation to reject.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

REQUIRED_COLUMNS = ("path", "receipt_id", "device")
MANIFEST_NAMES = ("manifest.csv", "manifest.jsonl")


class ManifestError(ValueError):
    """The manifest file cannot be read; the message names the file and line."""


@dataclass
class ManifestRow:
    line: int
    fields: dict


def find_manifest(source: str | Path) -> Path:
    """``source`` is a manifest file, or a folder holding manifest.csv / manifest.jsonl."""
    source = Path(source)
    if source.is_dir():
        for name in MANIFEST_NAMES:
            if (source / name).is_file():
                return source / name
        raise ManifestError(f"{source} is a folder without {' or '.join(MANIFEST_NAMES)}")
    if not source.is_file():
        raise ManifestError(f"manifest not found: {source}")
    return source


def _not_utf8(path: Path, exc: UnicodeDecodeError) -> ManifestError:
    """Name the first line that is not UTF-8 (decoding runs ahead in blocks, so find it)."""
    for number, raw in enumerate(path.read_bytes().splitlines(), start=1):
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return ManifestError(f"{path}, line {number}: not UTF-8 text ({exc.reason})")
    return ManifestError(f"{path}: not UTF-8 text ({exc.reason})")


def _read_csv(path: Path) -> list[ManifestRow]:
    rows = []
    with open(path, newline="", encoding="utf-8-sig") as handle:
        reader = csv.reader(handle, strict=True)
        start = 1  # the line where the row being read begins
        try:
            header = next(reader, None)
            if not header or not any(cell.strip() for cell in header):
                raise ManifestError(f"{path}: empty file or missing header line")
            header = [cell.strip() for cell in header]
            duplicated = sorted({c for c in header if header.count(c) > 1})
            if duplicated:
                raise ManifestError(f"{path}, line 1: repeated column(s) {', '.join(duplicated)}")
            start = reader.line_num + 1
            for cells in reader:
                if not any(cell.strip() for cell in cells):
                    start = reader.line_num + 1
                    continue
                if len(cells) != len(header):
                    raise ManifestError(
                        f"{path}, line {start}: expected {len(header)} fields ({', '.join(header)}), "
                        f"found {len(cells)}"
                    )
                rows.append(ManifestRow(start, {k: v.strip() for k, v in zip(header, cells)}))
                start = reader.line_num + 1
        except csv.Error as exc:
            raise ManifestError(f"{path}, line {start}: malformed CSV ({exc})") from None
        except UnicodeDecodeError as exc:
            raise _not_utf8(path, exc) from None
    return rows


def _read_jsonl(path: Path) -> list[ManifestRow]:
    rows = []
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except UnicodeDecodeError as exc:
        raise _not_utf8(path, exc) from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ManifestError(f"{path}, line {number}: invalid JSON ({exc.msg}, column {exc.colno})") from None
        if not isinstance(record, dict):
            raise ManifestError(f"{path}, line {number}: expected a JSON object, got {type(record).__name__}")
        fields = {k: (v.strip() if isinstance(v, str) else v) for k, v in record.items()}
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
