"""Exact duplicates: captures whose bytes are identical (same sha256).

Same bytes under one receipt_id is the same capture listed twice: keep the first, count
the rest as merged. Same bytes under different receipt_ids is a labelling conflict the
user must decide on: by default both rows are kept and flagged; ``merge`` joins the
identities (connected components over shared content) under the smallest receipt_id.
"""

from __future__ import annotations

from collections import defaultdict


def _components(groups: list[set[str]]) -> dict[str, str]:
    """Union-find over receipt_ids; returns receipt_id -> canonical (smallest) receipt_id."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for group in groups:
        first, *rest = sorted(group)
        for other in rest:
            a, b = find(first), find(other)
            if a != b:
                parent[max(a, b)] = min(a, b)
    return {x: find(x) for x in parent}


def resolve_duplicates(rows: list[dict], merge: bool) -> tuple[list[dict], dict]:
    """Return the rows to keep (input order) and the report section on duplicates."""
    by_hash: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        by_hash[row["sha256"]].append(row)
    conflicts = [group for group in by_hash.values() if len({r["receipt_id"] for r in group}) > 1]
    report: dict = {"conflicts": [], "joined_identities": [], "merged": []}
    for group in conflicts:
        report["conflicts"].append(
            {
                "sha256": group[0]["sha256"],
                "receipt_ids": sorted({r["receipt_id"] for r in group}),
                "paths": [r["manifest_path"] for r in group],
                "lines": [r["line"] for r in group],
                "resolution": "joined" if merge else "kept both, flagged",
            }
        )
    if merge and conflicts:
        canonical = _components([{r["receipt_id"] for r in group} for group in conflicts])
        joined: dict[str, list[str]] = defaultdict(list)
        for receipt_id, target in sorted(canonical.items()):
            if receipt_id != target:
                joined[target].append(receipt_id)
        report["joined_identities"] = [{"receipt_id": t, "joined": ids} for t, ids in sorted(joined.items())]
        for row in rows:
            target = canonical.get(row["receipt_id"], row["receipt_id"])
            if target != row["receipt_id"]:
                row["source_receipt_id"] = row["receipt_id"]
                row["receipt_id"] = target
    elif conflicts:
        for group in conflicts:
            for row in group:
                row["duplicate_conflict"] = True

    kept, first_seen = [], {}
    for row in rows:
        key = (row["sha256"], row["receipt_id"])
        if key in first_seen:
            entry = first_seen[key]
            entry.setdefault("merged", []).append({"path": row["manifest_path"], "line": row["line"]})
            continue
        first_seen[key] = {"sha256": row["sha256"], "receipt_id": row["receipt_id"], "kept": row["manifest_path"]}
        kept.append(row)
    report["merged"] = [entry for entry in first_seen.values() if "merged" in entry]
    return kept, report
