"""Existing receipt scans as a sample source: which files, which receipt each is, and its metadata.

A scans folder holds image files directly, or lists them in a ``receipts.jsonl`` (one JSON
object per scan: ``path`` relative to the folder, an optional ``scan_id``, and metadata such as
``company``, ``date`` and ``total``), as the SROIE subset does. Listed metadata goes into the
set's manifest, ``company`` as ``merchant`` (a ``merchant`` field is the merchant only without a
``company``; with one it is kept as ``merchant_given``), so an audit or a benchmark can tell a same-shop
sibling from the receipt itself. Byte-identical scans are one paper receipt: they share one
receipt id (the first one's), so a true duplicate is never counted as a false alarm nor split
between train and held-out.
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from receipt_embed.display import quoted, shortened
from receipt_embed.errors import BadInput
from receipt_embed.fileio import lone_surrogate, lone_surrogate_detail, parse_json
from receipt_embed.ingest.manifest import RESERVED_COLUMNS
from receipt_embed.userfiles import UnusableFile, read_regular, read_regular_text

LISTING = "receipts.jsonl"
SCAN_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".tif", ".tiff", ".bmp", ".webp"})
MAX_LISTING_BYTES = 64 * 1024 * 1024
MAX_SCAN_BYTES = 64 * 1024 * 1024
MAX_NAME_BYTES = 200  # a scan's name becomes its captures' file names, NAME_DEVICE.jpg (255 bytes at most)
# listing fields that are not carried as metadata: where the scan is, its id, `company` (the
# merchant), and the scan's size (ingest measures each capture's own; it names any other clash)
_NOT_METADATA = {"path", "scan_id", "company", "width", "height"}
# a listing field that ingest writes itself (sha256, bytes, line, ...) is kept under this suffix,
# as ingest asks of a manifest: copied as it is, the set's own manifest would be refused; so is
# `split`, which ingest assigns (a listing's would override that, or get rows of the set refused)
GIVEN_SUFFIX = "_given"
_WRITTEN_BY_INGEST = frozenset({*RESERVED_COLUMNS, "split"})
# columns make-samples writes itself (merchant from `company`, receipt id and device per capture):
# a listing's are kept under the suffix too, never dropped; a `merchant` without a `company` is the merchant
_WRITTEN_BY_MAKE_SAMPLES = frozenset({"receipt_id", "device", "merchant"})


@dataclass(frozen=True)
class Scan:
    """One scan file: ``name`` names its captures, ``receipt_id`` is shared by byte-identical scans."""

    path: Path
    name: str
    receipt_id: str
    metadata: dict[str, str] = field(default_factory=dict)  # manifest columns, e.g. merchant, date, total
    sha256: str = ""  # of the bytes checked when the scan was read (empty: not read yet)


def read_scans(folder: str | Path) -> list[Scan]:
    """The scans of ``folder``: those its ``receipts.jsonl`` lists, else its image files (sorted)."""
    folder = Path(folder)
    listing = folder / LISTING
    if listing.exists() or listing.is_symlink():
        scans = _listed_scans(folder, listing)
    else:
        paths = sorted(p for p in folder.iterdir() if p.suffix.lower() in SCAN_SUFFIXES)
        scans = [Scan(p, p.stem, p.stem) for p in paths if _scan_inside(p, folder)]
    return same_receipt_for_identical_bytes(scans)


def _scan_inside(path: Path, folder: Path) -> bool:
    """True for a regular file inside ``folder``; anything else with a scan's name (a link out of
    the folder, a FIFO, a device, a folder, a broken link) is refused by name, as a listed scan is,
    rather than read or silently left out."""
    try:
        inside = path.resolve().is_relative_to(folder.resolve())
        regular = path.is_file()
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a name the OS cannot take
        inside = regular = False
    if inside and regular:
        return True
    what = "a link out of the folder" if regular else "not a regular file"
    raise BadInput(
        f"{quoted(shortened(str(path)))} is {what}: a scan must be a file inside {quoted(str(folder))} "
        "(move it out, or list the scans in receipts.jsonl)"
    )


def scans_of_paths(paths) -> list[Scan]:
    """Scans named by file, without metadata (each file's stem is its id)."""
    return same_receipt_for_identical_bytes([Scan(Path(p), Path(p).stem, Path(p).stem) for p in paths])


def check_scan_name(name: str, where: str) -> str:
    """``name`` if it can name capture files inside the set's images/ folder: one plain file name
    (no ``/``, no ``..``, no control or invisible characters, at most MAX_NAME_BYTES), so a
    listing can never make make-samples write outside the set or print a line it did not write."""
    encoded = name.encode("utf-8", "surrogateescape")
    if (
        not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or not name.isprintable()
        or len(encoded) > MAX_NAME_BYTES
    ):
        raise BadInput(
            f"{where}: scan name {quoted(shortened(name))} cannot name capture files: use a plain "
            f"file name (no slashes or backslashes, not '..', no control characters; at most {MAX_NAME_BYTES} bytes)"
        )
    return name


def same_receipt_for_identical_bytes(scans: list[Scan]) -> list[Scan]:
    """Byte-identical scans get the receipt id and metadata of the first of them; names must be unique."""
    for scan in scans:
        check_scan_name(scan.name, str(scan.path))
    repeated = sorted(name for name, n in Counter(s.name for s in scans).items() if n > 1)
    if repeated:
        raise BadInput(
            f"scan names (file stems or scan_id) must be unique stems of the captures: {', '.join(repeated[:10])}"
        )
    first: dict[str, Scan] = {}
    out = []
    for scan in scans:
        digest = hashlib.sha256(read_scan_bytes(scan.path)).hexdigest()
        original = first.setdefault(digest, scan)
        out.append(Scan(scan.path, scan.name, original.receipt_id, original.metadata, digest))
    return out


def read_scan_bytes(path: Path) -> bytes:
    """The bytes of one scan, read as a regular file (a FIFO, a device or a folder is refused by
    name, never opened so that it blocks), at most MAX_SCAN_BYTES."""
    try:
        return read_regular(path, MAX_SCAN_BYTES)
    except UnusableFile as exc:
        raise BadInput(f"cannot read scan {quoted(shortened(str(path)))}: {exc.detail}") from None
    except OSError as exc:
        raise BadInput(f"cannot read scan {quoted(shortened(str(path)))}: {exc.strerror or exc}") from None


def checked_scan_bytes(scan: Scan) -> bytes:
    """The bytes of ``scan`` read again, refused unless they are the ones :func:`read_scans` checked
    and hashed: a scan swapped meanwhile (another image, a link out of the folder, a FIFO) is
    named, never captured into the set."""
    data = read_scan_bytes(scan.path)
    if scan.sha256 and hashlib.sha256(data).hexdigest() != scan.sha256:
        raise BadInput(
            f"scan {quoted(shortened(str(scan.path)))} changed while make-samples ran (its bytes are not the "
            "ones checked at the start): leave the scans folder as it is until the set is written, and run it again"
        )
    return data


def _listed_scans(folder: Path, listing: Path) -> list[Scan]:
    try:
        text = read_regular_text(listing, MAX_LISTING_BYTES)
    except (UnusableFile, OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"{listing}: {exc}") from None
    root = folder.resolve()
    scans = []
    renamed: set[str] = set()  # fields kept as KEY_given
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = parse_json(line)
        except json.JSONDecodeError as exc:
            raise BadInput(f"{listing}, line {number}: invalid JSON ({exc.msg})") from None
        where = f"{listing}, line {number}"
        if not isinstance(row, dict) or not isinstance(row.get("path"), str) or not row["path"]:
            raise BadInput(f"{where}: expected a JSON object with a 'path' (the scan, relative to {folder})")
        _refuse_lone_surrogates(row, where)
        path = folder / row["path"]
        try:
            inside = path.resolve().is_relative_to(root) and path.is_file()
        except (OSError, RuntimeError, ValueError):  # a NUL byte, a symlink loop, a name too long
            inside = False
        if not inside:
            raise BadInput(f"{where}: {quoted(shortened(row['path']))} is not a file inside {folder}")
        name = check_scan_name(_scan_id(row, path, where), where)
        metadata = {"merchant": _text(row.get("company"), where, "company")}
        for key, value in row.items():
            _check_field_name(key, where)
            if key in _NOT_METADATA:
                continue
            if key == "merchant" and row.get("company") is None:
                metadata["merchant"] = _text(value, where, key)
                continue
            column = _metadata_column(key, row, where)
            if column != key:
                renamed.add(key)
            metadata[column] = _text(value, where, key)
        scans.append(Scan(path, name, name, metadata))
    if not scans:
        raise BadInput(f"{listing} lists no scans")
    by_ingest = sorted(renamed & _WRITTEN_BY_INGEST)
    if by_ingest:
        warnings.warn(
            f"{listing}: field(s) {', '.join(by_ingest)} are written by ingest itself; "
            f"the manifest keeps them as {', '.join(k + GIVEN_SUFFIX for k in by_ingest)}",
            stacklevel=2,
        )
    by_make_samples = sorted(renamed & _WRITTEN_BY_MAKE_SAMPLES)
    if by_make_samples:
        warnings.warn(
            f"{listing}: field(s) {', '.join(by_make_samples)} are written by make-samples itself (merchant "
            "from company, receipt_id and device for each capture); the manifest keeps them as "
            f"{', '.join(k + GIVEN_SUFFIX for k in by_make_samples)}",
            stacklevel=2,
        )
    return scans


def _refuse_lone_surrogates(row: dict, where: str) -> None:
    """No field name or value may hold a lone surrogate (JSON's ``"\\ud800"``): no file name,
    manifest or CSV of the set could write it."""
    for key, value in row.items():
        if lone_surrogate(key) is not None:
            raise BadInput(f"{where}: {lone_surrogate_detail('field name', key, LISTING)}")
        if (text := lone_surrogate(value)) is not None:
            raise BadInput(f"{where}: {lone_surrogate_detail(key, text, LISTING)}")


def _scan_id(row: dict, path: Path, where: str) -> str:
    """A listed scan's name: its ``scan_id`` (a non-empty string or a number, so ``0`` is ``"0"``),
    or the file's stem when none is given (absent or null)."""
    value = row.get("scan_id")
    if value is None:
        return path.stem
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (isinstance(value, str) and value.strip()) and not (number and math.isfinite(value)):
        shown = quoted(shortened(value)) if isinstance(value, (str, float)) else type(value).__name__
        raise BadInput(f"{where}: scan_id {shown} is not a non-empty string or a finite number")
    return str(value)


def _check_field_name(key: str, where: str) -> None:
    """A listing field becomes a manifest column: its name must be visible text, with no spaces
    around it (a CSV header is read stripped), no control or invisible characters."""
    if not key.strip() or key != key.strip() or not key.isprintable():
        raise BadInput(
            f"{where}: field name {quoted(shortened(key))} cannot name a manifest column: it is empty, has "
            "spaces around it, or holds control or invisible characters; rename it"
        )


def _metadata_column(key: str, row: dict, where: str) -> str:
    """The manifest column for listing field ``key``: ``key`` itself, or ``key_given`` for a
    column ingest or make-samples writes itself, ``split`` included (refused if the listing also
    has ``key_given``)."""
    if key not in _WRITTEN_BY_INGEST and key not in _WRITTEN_BY_MAKE_SAMPLES:
        return key
    column = key + GIVEN_SUFFIX
    if column in row:
        writer = "ingest" if key in _WRITTEN_BY_INGEST else "make-samples"
        raise BadInput(
            f"{where}: fields {quoted(key)} and {quoted(column)} both given; {quoted(key)} is written by "
            f"{writer} itself and would be kept as {quoted(column)}: drop or rename one of them"
        )
    return column


def _text(value, where: str, key: str) -> str:
    if value is None:
        return ""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise BadInput(f"{where}: {key} is {type(value).__name__}; metadata must be text or a number")
    return str(value).strip()
