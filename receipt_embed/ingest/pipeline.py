"""The ingest pipeline: validate rows, decode every file, resolve exact duplicates, split by
identity, and write ``manifest.jsonl`` + ``ingest_report.json``.

Nothing is dropped silently: every row that does not make it into the manifest is either
listed in the report's ``rejected`` (with its line and a reason code) or in
``exact_duplicates.merged``.
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from receipt_embed.config import IngestConfig, load_config
from receipt_embed.display import printable, quoted, shortened
from receipt_embed.errors import BadInput
from receipt_embed.fileio import atomic_write_json, atomic_write_jsonl, sha256_file
from receipt_embed.ingest.captures import check_files
from receipt_embed.ingest.duplicates import resolve_duplicates
from receipt_embed.ingest.manifest import (
    REQUIRED_COLUMNS,
    ManifestError,
    check_column_spellings,
    check_reserved_columns,
    find_manifest,
    read_manifest,
)
from receipt_embed.ingest.rows import validate_rows
from receipt_embed.ingest.splits import SPLITS, assign_splits
from receipt_embed.locking import write_lock
from receipt_embed.outdir import check_replaceable, refuse_own_input
from receipt_embed.staging import replace_dir

MANIFEST_FILE = "manifest.jsonl"
REPORT_FILE = "ingest_report.json"


def _lookalike_receipt_ids(receipt_ids) -> list[str]:
    """Receipt ids that differ only in Unicode normalisation ("é" as one code point or as "e" and a
    combining accent: one text to a reader, two receipts to ingest), which a manifest joined from
    two systems can hold; the ids are kept apart as written, and said."""
    import unicodedata

    spellings: dict[str, set[str]] = {}
    for receipt_id in receipt_ids:
        spellings.setdefault(unicodedata.normalize("NFC", receipt_id), set()).add(receipt_id)
    groups = [
        " and ".join(f"{s!r} ({len(s)} code points)" for s in sorted(group))
        for group in spellings.values()
        if len(group) > 1
    ]
    if not groups:
        return []
    more = f" (and {len(groups) - 3} more such groups)" if len(groups) > 3 else ""
    return [
        f"receipt_ids {'; '.join(groups[:3])}{more} differ only in Unicode normalisation (NFC/NFD): "
        "they are kept as different receipts; write each the same way if it is one receipt"
    ]


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
            ratios = dict(zip(SPLITS, self.report["settings"]["split_ratios"]))
            for split, counts in self.report["per_split"].items():
                if counts["identities"] == 0 and ratios.get(split, 1) > 0:  # a ratio of 0 asked for it empty
                    found.append(f"the {split} split has no identities (too few receipts for the split ratios?)")
        found.extend(_lookalike_receipt_ids(row["receipt_id"] for row in self.rows))
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
                f"receipt_id {quoted(shortened(receipt_id))} is given more than one split ({shortened(where)}); "
                "one receipt must stay in one split"
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
            # the pair's seal: train and index refuse a manifest edited after ingest
            report["manifest_sha256"] = sha256_file(staging / MANIFEST_FILE)
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
    check_column_spellings(manifest_path, columns)

    rejected: list[dict] = []
    candidates = validate_rows(rows, root, settings, rejected, progress)
    checked = check_files(candidates, settings, rejected, progress)
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
