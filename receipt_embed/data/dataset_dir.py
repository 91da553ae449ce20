"""A dataset dir written by ``ingest``: its captures and their identities, by split."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from receipt_embed.fileio import read_jsonl
from receipt_embed.ingest.pipeline import MANIFEST_FILE
from receipt_embed.ingest.splits import SPLITS


@dataclass(frozen=True)
class Captures:
    """Rows of one split (or all), with identity labels as integers 0..n_identities-1."""

    rows: list[dict]
    labels: list[int]
    identities: list[str]  # label -> receipt_id

    @property
    def paths(self) -> list[str]:
        return [row["path"] for row in self.rows]

    def __len__(self) -> int:
        return len(self.rows)


def load_dataset_dir(path: str | Path) -> list[dict]:
    """All rows of ``DATASET_DIR/manifest.jsonl``; a missing file says how to make one. A
    dataset dir swapped for a new copy by ``ingest --force`` while it was read is read again."""
    from receipt_embed.outdir import consistent_read

    return consistent_read(_load_dataset_dir_once, path)


def _load_dataset_dir_once(path: str | Path) -> list[dict]:
    manifest = Path(path) / MANIFEST_FILE
    if not manifest.is_file():
        raise FileNotFoundError(f"{manifest} not found: is {path} a dataset dir written by `receipt-embed ingest`?")
    rows = read_jsonl(manifest)
    for number, row in enumerate(rows, start=1):
        missing = [k for k in ("path", "receipt_id", "device", "split") if k not in row]
        if missing:
            raise ValueError(f"{manifest}, line {number}: missing {', '.join(missing)}")
    return rows


def select_split(rows: list[dict], split: str) -> Captures:
    """Captures of one split (``all`` for every row), labelled by identity."""
    if split != "all" and split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {', '.join(SPLITS)} or all")
    chosen = [row for row in rows if split == "all" or row["split"] == split]
    identities = sorted({row["receipt_id"] for row in chosen})
    index = {receipt_id: i for i, receipt_id in enumerate(identities)}
    return Captures(chosen, [index[row["receipt_id"]] for row in chosen], identities)
