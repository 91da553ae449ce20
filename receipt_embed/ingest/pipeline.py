"""The ingest pipeline: validate rows, decode every file, resolve exact duplicates, split by
identity, and write ``manifest.jsonl`` + ``ingest_report.json``.

Nothing is dropped silently: every row that does not make it into the manifest is either
listed in the report's ``rejected`` (with its line and a reason code) or in
``exact_duplicates.merged``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from receipt_embed.config import IngestConfig, load_config
from receipt_embed.display import printable
from receipt_embed.errors import BadInput
from receipt_embed.fileio import atomic_write_json, atomic_write_jsonl
from receipt_embed.images import ImageRejected, decode_image
from receipt_embed.ingest.duplicates import resolve_duplicates
from receipt_embed.ingest.manifest import (
    REQUIRED_COLUMNS,
    ManifestError,
    ManifestRow,
    check_reserved_columns,
    find_manifest,
    read_manifest,
)
from receipt_embed.ingest.splits import SPLITS, assign_splits
from receipt_embed.locking import write_lock
from receipt_embed.outdir import check_replaceable, refuse_own_input
from receipt_embed.staging import replace_dir
from receipt_embed.userfiles import UnusableFile, open_regular

MANIFEST_FILE = "manifest.jsonl"
REPORT_FILE = "ingest_report.json"


@dataclass
class IngestResult:
    out_dir: Path
    rows: list[dict]
    report: dict
    rejected: list[dict] = field(default_factory=list)

    def warnings(self) -> list[str]:
        """Outcomes that are legal but almost certainly not what the user wanted."""
        found = []
        if not self.rows:
            found.append("no capture was accepted: the dataset dir is empty")
        else:
            for split, counts in self.report["per_split"].items():
                if counts["identities"] == 0:
                    found.append(f"the {split} split has no identities (too few receipts for the split ratios?)")
        return found

    def summary(self) -> str:
        c = self.report["counts"]
        reasons = Counter(r["reason"] for r in self.rejected)
        reason_text = f" ({', '.join(f'{n} {k}' for k, n in sorted(reasons.items()))})" if reasons else ""
        splits = ", ".join(
            f"{name} {s['identities']} identities / {s['captures']} captures"
            for name, s in self.report["per_split"].items()
        )
        dup = self.report["exact_duplicates"]
        lines = [
            f"Read {c['rows']} rows from {printable(self.report['source'])}",
            f"  accepted {c['accepted']}, rejected {c['rejected']}{reason_text}, "
            f"merged exact duplicates {c['merged_duplicates']}",
            f"  {c['identities']} identities, {len(self.report['per_device'])} devices",
            f"  splits: {splits}",
        ]
        if dup["conflicts"]:
            verdict = "joined" if dup["joined_identities"] else "kept and flagged (see --merge-duplicates)"
            lines.append(f"  {len(dup['conflicts'])} identical file(s) under different receipt_ids: {verdict}")
        lines.append(f"Wrote {printable(self.out_dir / MANIFEST_FILE)} and {printable(self.out_dir / REPORT_FILE)}")
        return "\n".join(lines)


def _reject(rejected: list, row: ManifestRow, reason: str, detail: str) -> None:
    path = row.fields.get("path")
    rejected.append(
        {"line": row.line, "path": path if isinstance(path, str) else None, "reason": reason, "detail": detail}
    )


# control characters (NUL, ESC, CR, ...) in a name would corrupt paths, reports and terminals
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _as_text(value) -> str:
    """A manifest value as text: a JSON object or list (metadata only) as compact JSON, not a Python repr."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return str(value)


def _invalid_value(fields: dict) -> str | None:
    """Why a required column's value cannot name a capture, or None: it must be a string or a
    plain finite number (a JSON manifest may hold objects, lists, booleans, 1e400), with no control characters."""
    for column in REQUIRED_COLUMNS:
        value = fields[column]
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            return f"{column} is a JSON {type(value).__name__} ({json.dumps(value)[:40]}), expected a string"
        if isinstance(value, float) and not math.isfinite(value):
            return f"{column} is {value}, expected a string or a finite number"
        # a NUL byte in a path stays `unresolvable_path` (the OS cannot name such a file)
        if isinstance(value, str) and _CONTROL.search(value.replace("\0", "") if column == "path" else value):
            return f"{column} {value[:60]} holds a control character"  # printed escaped (display.printable)
    return None


def _validate_rows(rows: list[ManifestRow], root: Path, settings: IngestConfig, rejected: list) -> list[dict]:
    """Field and path checks that need no file access; returns candidate rows."""
    candidates, seen = [], {}
    for row in rows:
        fields = {k: _as_text(v) for k, v in row.fields.items()}
        missing = [c for c in REQUIRED_COLUMNS if row.fields.get(c) is None]
        empty = [c for c in REQUIRED_COLUMNS if c not in missing and not fields[c]]
        if missing:
            _reject(rejected, row, "missing_field", f"line {row.line}: missing {', '.join(missing)}")
            continue
        invalid = _invalid_value(row.fields)
        if invalid:
            _reject(rejected, row, "invalid_value", f"line {row.line}: {invalid}")
            continue
        if "receipt_id" in empty:
            _reject(rejected, row, "empty_receipt_id", f"line {row.line}: receipt_id is empty")
            continue
        if empty:
            _reject(rejected, row, "missing_field", f"line {row.line}: empty {', '.join(empty)}")
            continue
        raw_path = fields["path"]
        is_absolute = Path(raw_path).is_absolute()
        if is_absolute and not settings.allow_absolute_paths:
            _reject(
                rejected,
                row,
                "absolute_path",
                f"line {row.line}: absolute path {raw_path} (allow with --allow-absolute-paths)",
            )
            continue
        try:
            resolved = (root / raw_path).resolve()
        except (OSError, RuntimeError, ValueError) as exc:  # a symlink loop, a NUL byte
            _reject(rejected, row, "unresolvable_path", f"line {row.line}: path {raw_path!r} {_unresolvable(exc)}")
            continue
        if not is_absolute and not resolved.is_relative_to(root):
            _reject(
                rejected, row, "path_escapes", f"line {row.line}: path {raw_path} escapes the manifest folder {root}"
            )
            continue
        split = fields.get("split", "").lower()
        if split and split not in SPLITS:
            _reject(
                rejected,
                row,
                "invalid_split",
                f"line {row.line}: split {fields['split']!r} is not one of {', '.join(SPLITS)}",
            )
            continue
        if resolved in seen:
            first = seen[resolved]
            _reject(rejected, row, "repeated_row", f"line {row.line}: same file as line {first} ({raw_path})")
            continue
        seen[resolved] = row.line
        candidates.append(
            {**fields, "split": split, "path": str(resolved), "manifest_path": raw_path, "line": row.line}
        )
    return candidates


def _unresolvable(exc: Exception) -> str:
    """Why ``Path.resolve`` failed, in words."""
    if isinstance(exc, ValueError):
        return "contains a NUL byte"
    if isinstance(exc, RuntimeError) or getattr(exc, "errno", None) == errno.ELOOP:
        return "cannot be resolved: too many levels of symbolic links (a symlink loop?)"
    return f"cannot be resolved ({getattr(exc, 'strerror', None) or exc})"


def _read_capture(candidate: dict, max_bytes: int) -> tuple[bytes, os.stat_result] | dict:
    """The bytes of one capture file and their size and mtime, or the rejection: only a
    regular file of at most ``max_bytes`` is opened (a FIFO, device or folder never is)."""
    path, line, named = Path(candidate["path"]), candidate["line"], candidate["manifest_path"]
    try:
        with open_regular(path, max_bytes) as handle:
            info = os.fstat(handle.fileno())
            data = handle.read(max_bytes + 1)
    except UnusableFile as exc:
        if exc.reason == "missing_file":
            return {"reason": "missing_file", "detail": f"line {line}: file not found: {named} ({path})"}
        return {"reason": exc.reason, "detail": f"line {line}: {named}: {exc.detail}"}
    except OSError as exc:  # a read error after a good open (an I/O error, a vanished network share)
        return {"reason": "unreadable", "detail": f"line {line}: cannot read {named} ({exc.strerror or exc})"}
    if len(data) > max_bytes:
        return {"reason": "too_large", "detail": f"line {line}: {named} grew past the limit of {max_bytes} bytes"}
    return data, info


def _inspect(candidate: dict, max_pixels: int, max_bytes: int) -> dict:
    """Read and fully decode one file; returns its checked facts or the rejection."""
    read = _read_capture(candidate, max_bytes)
    if isinstance(read, dict):
        return read
    data, info = read
    try:
        decoded = decode_image(data, max_pixels, name=f"line {candidate['line']}: {candidate['manifest_path']}")
    except ImageRejected as exc:
        return {"reason": exc.reason, "detail": exc.detail}
    width, height = decoded.image.size
    return {
        "sha256": hashlib.sha256(data).hexdigest(),
        "width": width,
        "height": height,
        "format": decoded.format,
        "mode": decoded.source_mode,
        "bytes": len(data),  # size and mtime: later commands detect a file replaced since ingest
        "mtime_ns": info.st_mtime_ns,
    }


def _check_files(candidates: list[dict], settings: IngestConfig, rejected: list, progress: bool) -> list[dict]:
    workers = min(4, os.cpu_count() or 1)
    checked = []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = pool.map(lambda c: _inspect(c, settings.max_pixels, settings.max_bytes), candidates)
        try:
            for candidate, facts in tqdm(
                zip(candidates, results),
                total=len(candidates),
                desc="checking files",
                unit="file",
                disable=not progress,
            ):
                if "reason" in facts:
                    rejected.append({"line": candidate["line"], "path": candidate["manifest_path"], **facts})
                else:
                    checked.append({**candidate, **facts})
        except BaseException:  # SIGTERM, Ctrl-C: stop at once instead of decoding the rest first
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    return checked


def _explicit_splits(rows: list[dict]) -> dict[str, str]:
    given: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        if row["split"]:
            given[row["receipt_id"]][row["split"]].append(row["line"])
    fixed = {}
    for receipt_id, by_split in given.items():
        if len(by_split) > 1:
            where = "; ".join(f"{s} on lines {', '.join(map(str, lines))}" for s, lines in sorted(by_split.items()))
            raise ManifestError(
                f"receipt_id {receipt_id!r} is given more than one split ({where}); one receipt must stay in one split"
            )
        fixed[receipt_id] = next(iter(by_split))
    return fixed


def _report(
    source: Path, rows_read: int, kept: list[dict], rejected: list, duplicates: dict, settings: IngestConfig
) -> dict:
    per_split = {s: {"identities": 0, "captures": 0} for s in SPLITS}
    identities_by_split: dict[str, set] = defaultdict(set)
    per_device: dict[str, dict] = {}
    captures = Counter(row["receipt_id"] for row in kept)
    for row in kept:
        per_split[row["split"]]["captures"] += 1
        identities_by_split[row["split"]].add(row["receipt_id"])
        device = per_device.setdefault(row["device"], {"captures": 0, **{s: 0 for s in SPLITS}})
        device["captures"] += 1
        device[row["split"]] += 1
    for split, ids in identities_by_split.items():
        per_split[split]["identities"] = len(ids)
    merged = sum(len(entry["merged"]) for entry in duplicates["merged"])
    return {
        "source": str(source),
        "settings": settings.model_dump(mode="json"),
        "counts": {
            "rows": rows_read,
            "accepted": len(kept),
            "rejected": len(rejected),
            "merged_duplicates": merged,
            "identities": len(captures),
            "duplicate_conflicts": len(duplicates["conflicts"]),
        },
        "rejected": sorted(rejected, key=lambda r: r["line"]),
        "rejected_by_reason": dict(sorted(Counter(r["reason"] for r in rejected).items())),
        "exact_duplicates": duplicates,
        "per_split": per_split,
        "per_device": dict(sorted(per_device.items())),
        "captures_per_identity": {str(k): v for k, v in sorted(Counter(captures.values()).items())},
    }


def ingest(
    source: str | Path,
    out_dir: str | Path,
    settings: IngestConfig | None = None,
    progress: bool = False,
    force: bool = False,
) -> IngestResult:
    """Check a manifest's captures and write the dataset dir; raises ManifestError for an
    unreadable manifest, records every rejected row otherwise.

    The dir is written beside the old one and swapped in whole, under a writer lock, so
    ``manifest.jsonl`` and ``ingest_report.json`` are always a matching pair; an existing
    dataset dir is replaced only with ``force``, and never one that holds the source."""
    settings = settings or load_config().ingest
    manifest_path = find_manifest(source)
    root = manifest_path.parent.resolve()
    refuse_own_input(out_dir, {"manifest folder": root})
    with write_lock(out_dir):
        check_replaceable(out_dir, "dataset", force)
        ordered, report = _checked_rows(manifest_path, root, settings, progress)
        _refuse_captures_inside(out_dir, ordered)
        with replace_dir(out_dir, "dataset", force) as staging:
            atomic_write_jsonl(staging / MANIFEST_FILE, ordered)
            atomic_write_json(staging / REPORT_FILE, report)
    return IngestResult(Path(out_dir), ordered, report, report["rejected"])


def _refuse_captures_inside(out_dir, rows: list[dict]) -> None:
    """Replacing ``out_dir`` would delete captures stored in it (paths are resolved already)."""
    target = Path(out_dir).resolve()
    if not target.is_dir():
        return
    prefix = str(target).rstrip(os.sep) + os.sep
    inside = next((row for row in rows if row["path"].startswith(prefix)), None)
    if inside is not None:
        raise BadInput(
            f"--out {out_dir} holds the capture {inside['path']} (line {inside['line']}) this command "
            "reads; writing there would destroy its own input: choose another --out"
        )


def _checked_rows(manifest_path: Path, root: Path, settings: IngestConfig, progress: bool) -> tuple[list[dict], dict]:
    """The manifest's accepted rows (in dataset order) and the report."""
    rows = read_manifest(manifest_path)
    columns = set().union(*(row.fields for row in rows)) if rows else set()
    absent = [c for c in REQUIRED_COLUMNS if c not in columns]
    if rows and absent:
        lowered = {c.lower(): c for c in columns}
        hints = [f"{lowered[c]!r} -> {c!r}" for c in absent if c in lowered]
        hint = f"; column names are case-sensitive: rename {', '.join(hints)}" if hints else ""
        raise ManifestError(
            f"{manifest_path}: required column(s) {', '.join(absent)} not found (columns: {', '.join(sorted(columns))}){hint}"
        )
    check_reserved_columns(manifest_path, columns)

    rejected: list[dict] = []
    candidates = _validate_rows(rows, root, settings, rejected)
    checked = _check_files(candidates, settings, rejected, progress)
    kept, duplicates = resolve_duplicates(checked, merge=settings.merge_duplicates)
    assignment = assign_splits(
        [r["receipt_id"] for r in kept], settings.split_ratios, settings.seed, _explicit_splits(kept)
    )

    ordered = []
    for row in kept:
        row["split"] = assignment[row["receipt_id"]]
        head = {k: row.pop(k) for k in ("path", "receipt_id", "device", "split", "sha256", "width", "height")}
        ordered.append({**head, **row})

    return ordered, _report(root / manifest_path.name, len(rows), ordered, rejected, duplicates, settings)
