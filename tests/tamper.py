"""Editing an index dir the way an attacker would: change a file, then recompute its
size and sha256 in index.json, so the checksum check passes and only content checks remain."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from receipt_embed.indexing.index_dir import META_FILE, sha256_file


def copy_index(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def reseal(index_dir: Path, name: str) -> None:
    """Record NAME's current size and sha256 in index.json."""
    meta = json.loads((index_dir / META_FILE).read_text())
    meta["files"][name] = {"sha256": sha256_file(index_dir / name), "bytes": (index_dir / name).stat().st_size}
    (index_dir / META_FILE).write_text(json.dumps(meta))


def rewrite_items(index_dir: Path, change) -> None:
    """Apply ``change(row, item)`` (returns the new item) to every row of items.jsonl, resealed, and
    drop the dataset's sha256 from index.json's source as a forger would: with it, rows that are
    not the dataset's are refused before any other check (tests/test_wrong_content.py tests that),
    and these tests are about the checks behind it."""
    path = index_dir / "items.jsonl"
    items = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    path.write_text("".join(json.dumps(change(row, item)) + "\n" for row, item in enumerate(items)))
    reseal(index_dir, "items.jsonl")
    edit_meta(index_dir, lambda meta: meta["source"].pop("dataset_sha256", None))


def edit_meta(index_dir: Path, change) -> None:
    meta = json.loads((index_dir / META_FILE).read_text())
    change(meta)
    (index_dir / META_FILE).write_text(json.dumps(meta))
