"""Embedding a large archive as parallel jobs: ``index --shard i/n`` writes one slice of the
vectors to a shard dir, and ``index-merge`` joins the shards into one index dir.

The merge checks that the shards belong together (same checkpoint, dataset, split and
features; each of 0..n-1 exactly once; contiguous rows) and then builds the FAISS index
once over all vectors, so an approximate index trains one quantizer on a sample drawn from
every shard and all shards are added to it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from receipt_embed.display import shortened
from receipt_embed.errors import BadInput
from receipt_embed.fileio import atomic_write_json, atomic_write_jsonl, parse_json, read_jsonl
from receipt_embed.indexing.contents import check_embeddings, check_items, check_shard_meta
from receipt_embed.indexing.index_dir import MAX_META_BYTES, IndexDirError, sha256_file
from receipt_embed.npyfile import load_npy
from receipt_embed.userfiles import UnusableFile, check_regular, is_regular, read_regular_text

SHARD_FILE, ITEMS_FILE, EMBEDDINGS_FILE = "shard.json", "items.jsonl", "embeddings.npy"
_SHARD = re.compile(r"^(\d+)/(\d+)$")


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/n"`` (0 <= i < n) -> (i, n)."""
    match = _SHARD.match(text.strip())
    if not match or not int(match[1]) < int(match[2]):
        raise BadInput(f"--shard takes i/n with 0 <= i < n (e.g. 0/4 ... 3/4), got {text!r}")
    return int(match[1]), int(match[2])


def shard_rows(total: int, shard: int, shards: int) -> tuple[int, int]:
    """Rows [start, end) of shard ``shard`` of ``shards`` over ``total`` rows (sizes differ by at most 1)."""
    return total * shard // shards, total * (shard + 1) // shards


def write_shard(out: str | Path, vectors: np.ndarray, items: list[dict], meta: dict, force: bool = False) -> dict:
    """A shard dir, written beside the old one and swapped in whole (``staging.replace_dir``)."""
    from receipt_embed.staging import replace_dir

    if (Path(out) / "index.json").exists():
        raise BadInput(f"--out {out} holds an index dir; write the shard to its own dir")
    with replace_dir(out, "shard", force) as staging:
        return _write_shard_files(staging, vectors, items, meta)


def _write_shard_files(out: Path, vectors: np.ndarray, items: list[dict], meta: dict) -> dict:
    from receipt_embed.indexing.index_dir import save_npy

    save_npy(out / EMBEDDINGS_FILE, vectors)
    atomic_write_jsonl(out / ITEMS_FILE, items)
    meta = {
        **meta,
        "count": len(items),
        "dim": int(vectors.shape[1]),
        "files": {name: sha256_file(out / name) for name in (EMBEDDINGS_FILE, ITEMS_FILE)},
    }
    atomic_write_json(out / SHARD_FILE, meta)
    return meta


def _refuse(exc: UnusableFile, what: str) -> IndexDirError:
    return IndexDirError(f"{exc}: {what}; re-run that shard")


def read_shard(path: str | Path) -> tuple[dict, np.ndarray, list[dict]]:
    """A shard dir's vectors and items, checked against shard.json (only regular files are read)."""
    path = Path(path)
    try:
        meta = parse_json(read_regular_text(path / SHARD_FILE, MAX_META_BYTES))
        files = meta["files"]
    except UnusableFile as exc:
        if exc.reason == "missing_file":
            raise IndexDirError(
                f"{path / SHARD_FILE} not found: {path} is not a complete shard from `index --shard`"
            ) from None
        raise _refuse(exc, "not a shard.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise IndexDirError(f"{path / SHARD_FILE} is damaged ({exc}); re-run that shard") from None
    check_shard_meta(meta, path / SHARD_FILE, IndexDirError)
    check_shard_slice(meta, path / SHARD_FILE)
    for name, digest in files.items():
        if not is_regular(path / name) or sha256_file(path / name) != digest:
            raise IndexDirError(
                f"{path / name} is missing, not a regular file or does not match {SHARD_FILE}: re-run that shard"
            )
    try:
        vectors = load_npy(path / EMBEDDINGS_FILE)  # header checked against the size first
        check_regular(path / ITEMS_FILE)
    except UnusableFile as exc:
        raise _refuse(exc, "a shard holds only the regular files `index --shard` writes") from None
    except ValueError as exc:  # a lying header, Python objects, a torn file
        raise IndexDirError(f"{path / EMBEDDINGS_FILE} cannot be read: {exc}") from None
    items = read_jsonl(path / ITEMS_FILE)
    if len(items) != meta["count"] or vectors.shape != (meta["count"], meta["dim"]):
        raise IndexDirError(f"{path}: {SHARD_FILE} records {meta['count']} rows, the files disagree")
    check_items(items, path / ITEMS_FILE, IndexDirError)
    check_embeddings(vectors, path / EMBEDDINGS_FILE, IndexDirError)  # float32, 2-D, finite
    return meta, vectors, items


def _shown(value) -> str:
    return shortened(json.dumps(value))


def check_shard_slice(meta: dict, shard_path: Path) -> None:
    """kind and rows are exactly what `index --shard` writes for shard i/n of total rows: the
    merge records a checkpoint source and compares each shard's items with its rows of the
    dataset, so an edited rows would slice the dataset blindly or pass a shard off as another's."""
    for key in ("kind", "rows"):
        if key not in meta:
            raise IndexDirError(f"{shard_path} lacks {key!r}; re-run that shard")
    if meta["kind"] != "checkpoint":
        raise IndexDirError(
            f'{shard_path}: kind is {_shown(meta["kind"])}, expected "checkpoint" (`index --shard` embeds '
            "with a checkpoint); re-run that shard"
        )
    total, count, shard, shards = (meta[key] for key in ("total", "count", "shard", "shards"))
    if not shard < shards:
        raise IndexDirError(f"{shard_path}: shard is {shard} of shards {shards}, expected 0 <= shard < shards")
    start, end = shard_rows(total, shard, shards)
    rows = meta["rows"]
    # type checks first: [90.0, 180.0] and [True, 180] compare equal to integer lists
    if not (type(rows) is list and len(rows) == 2 and all(type(row) is int for row in rows) and rows == [start, end]):
        raise IndexDirError(
            f"{shard_path}: rows is {_shown(rows)}, expected [{start}, {end}] (two integers: the rows "
            f"[start, end) that shard {shard}/{shards} of {total} covers); re-run that shard"
        )
    if count != end - start:
        raise IndexDirError(
            f"{shard_path}: count is {count}, but rows [{start}, {end}] of shard {shard}/{shards} hold "
            f"{end - start}; re-run that shard"
        )


def check_shards(metas: list[tuple[Path, dict]]) -> None:
    """The shards come from one job and cover it exactly once."""
    first_path, first = metas[0]
    same = ("checkpoint_sha256", "dataset", "dataset_sha256", "split", "features", "shards", "total")
    for path, meta in metas[1:]:
        for key in same:
            if meta.get(key) != first.get(key):
                what = "the dataset's manifest.jsonl (its sha256)" if key == "dataset_sha256" else key
                raise BadInput(
                    f"shards differ in {what}: {first_path} has {first.get(key)!r}, {path} has {meta.get(key)!r}"
                )
    seen: dict[int, Path] = {}
    for path, meta in metas:
        if meta["shard"] in seen:
            raise BadInput(f"shard {meta['shard']}/{meta['shards']} given twice: {seen[meta['shard']]} and {path}")
        seen[meta["shard"]] = path
    count = first["shards"]
    missing = sorted(set(range(count)) - set(seen))
    if missing:
        names = ", ".join(f"{i}/{count}" for i in missing)
        raise BadInput(f"missing shard(s) {names} of the {first['total']} rows")


def merge_shards(
    shard_dirs: list[str | Path],
    out: str | Path,
    *,
    factory: str = "Flat",
    log=lambda message: None,
    force: bool = False,
    **build_options,
) -> dict:
    """One index dir from all shards of a job, in row order; ``out`` is replaced whole (an
    existing index dir only with ``force``) and may not be or hold a shard."""
    from receipt_embed.locking import write_lock
    from receipt_embed.outdir import check_replaceable, refuse_own_input

    target = Path(out).resolve()
    for shard_dir in shard_dirs:
        if Path(shard_dir).resolve() == target:
            raise BadInput(f"--out {out} is one of the shards being merged; write the index elsewhere")
    if (target / SHARD_FILE).exists():
        raise BadInput(f"--out {out} is a shard dir; write the merged index to a new dir")
    refuse_own_input(out, {f"shard dir #{number}": path for number, path in enumerate(shard_dirs, start=1)})
    with write_lock(out):
        check_replaceable(out, "index", force)
        return _merge_shards(shard_dirs, out, factory=factory, log=log, force=force, **build_options)


def _merge_shards(shard_dirs, out, *, factory, log, force, **build_options) -> dict:
    from receipt_embed.indexing.contents import check_items_match_dataset
    from receipt_embed.indexing.factory import build_index
    from receipt_embed.indexing.index_dir import write_index_dir

    loaded = [(Path(p), *read_shard(p)) for p in shard_dirs]
    check_shards([(path, meta) for path, meta, _, _ in loaded])
    for path, meta, _, shard_items in loaded:  # each shard holds its own rows, not another's
        check_items_match_dataset(shard_items, meta, path / ITEMS_FILE, IndexDirError, rows=tuple(meta["rows"]))
    loaded.sort(key=lambda entry: entry[1]["shard"])
    vectors = np.concatenate([v for _, _, v, _ in loaded])
    items = [item for _, _, _, shard_items in loaded for item in shard_items]
    meta = loaded[0][1]
    log(f"merging {len(loaded)} shards: {len(items)} items of dim {vectors.shape[1]}")
    built = build_index(vectors, factory, log=log, **build_options)
    source = {
        "kind": "checkpoint",
        "checkpoint": meta["checkpoint"],
        "checkpoint_sha256": meta["checkpoint_sha256"],
        "dataset": meta["dataset"],
        "dataset_sha256": meta.get("dataset_sha256"),
        "split": meta["split"],
        "shards": meta["shards"],
    }
    return write_index_dir(out, built, vectors, items, source, meta["features"], force=force)
