"""Index dirs from a trained checkpoint, or from embeddings made by any other model.

Both paths end in the same index dir, so ``search`` and ``audit-shortcuts`` can judge a
competitor's or a baseline's embeddings exactly like ours.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from receipt_embed.display import shortened
from receipt_embed.errors import BadInput
from receipt_embed.indexing.contents import ITEM_OPTIONAL_STRINGS, item_of
from receipt_embed.indexing.factory import DEFAULT_TRAIN_SIZE, build_index, check_factory, check_factory_sizes
from receipt_embed.indexing.index_dir import sha256_file, write_index_dir
from receipt_embed.locking import write_lock
from receipt_embed.outdir import check_replaceable, refuse_own_input
from receipt_embed.training.checkpoint import MAX_CHECKPOINT_BYTES

MIN_LENGTH = float(np.finfo(np.float32).tiny)  # a row's length must be a normal positive float32
MAX_LENGTH = float(np.finfo(np.float32).max)
UNIT_TOLERANCE = 1e-4  # how far a normalised row's length may be from 1 (readers want a self-score ~1)


def checkpoint_source(checkpoint: str | Path) -> dict:
    checkpoint = Path(checkpoint).resolve()
    return {
        "kind": "checkpoint",
        "checkpoint": str(checkpoint),
        "checkpoint_sha256": sha256_file(checkpoint, max_bytes=MAX_CHECKPOINT_BYTES),
    }


def index_dataset(
    checkpoint: str | Path,
    data_dir: str | Path,
    out: str | Path,
    registry,
    *,
    split: str = "all",
    factory: str = "Flat",
    features: str = "backbone",
    batch_size: int = 128,
    progress: bool = False,
    shard: tuple[int, int] | None = None,
    log=lambda message: None,
    force: bool = False,
    verifiers: dict[str, dict] | None = None,
    **build_options,
) -> dict:
    """Embed a dataset dir's captures with a checkpoint and write an index dir (or, with
    ``shard=(i, n)``, a shard dir holding rows i/n of them for ``index-merge``). ``verifiers``
    (name -> params): each one's per-item data is extracted from every capture and stored too.

    ``out`` is locked for the whole job and replaced whole at the end; an existing index (or
    shard) dir only with ``force``; an ``out`` that is or holds the dataset or checkpoint never."""
    refuse_own_input(out, {"dataset dir": data_dir, "checkpoint": checkpoint})
    with write_lock(out):  # held from the checks to the swap: a second writer is refused before embedding
        check_replaceable(out, "index" if shard is None else "shard", force)
        return _index_dataset(
            checkpoint,
            data_dir,
            out,
            registry,
            split=split,
            factory=factory,
            features=features,
            batch_size=batch_size,
            progress=progress,
            shard=shard,
            log=log,
            force=force,
            verifiers=verifiers or {},
            **build_options,
        )


def _index_dataset(
    checkpoint,
    data_dir,
    out,
    registry,
    *,
    split,
    factory,
    features,
    batch_size,
    progress,
    shard,
    log,
    force,
    verifiers,
    **build_options,
) -> dict:
    from receipt_embed.embedding import embedding_dim, load_model

    if verifiers and shard is not None:
        raise BadInput("--verify does not go with --shard yet: index without --shard to store verifier data")
    built_verifiers = {name: registry.create("verifier", name, **params) for name, params in verifiers.items()}
    captures = _present_captures(data_dir, split)
    train_size = build_options.get("train_size", DEFAULT_TRAIN_SIZE)
    if shard is None:  # a factory too large for the captures is refused before minutes of embedding
        check_factory_sizes(factory, len(captures), train_size)
    source = {
        **checkpoint_source(checkpoint),
        "dataset": str(Path(data_dir).resolve()),
        # the manifest the items come from: loading checks them against it while it is unchanged
        "dataset_sha256": sha256_file(Path(data_dir) / "manifest.jsonl"),
        "split": split,
    }
    loaded = load_model(checkpoint, registry)
    if shard is not None:
        return _index_shard(loaded, captures, data_dir, out, source, shard, features, batch_size, progress, log, force)
    # and one FAISS cannot build for the model's dim (a typo such as Flt) before the first capture
    check_factory(factory, len(captures), train_size, embedding_dim(loaded, features))
    log(f"embedding {len(captures)} captures ({split}) with {features} features of {checkpoint}")
    embeddings = embed_paths_checked(loaded, captures.paths, features, batch_size, progress, captures.digests)
    if (Path(out) / "shard.json").exists():
        raise BadInput(f"--out {out} is a shard dir; write the index to its own dir")
    vectors = built_vectors(embeddings, lambda row: f"the embedding of {captures.paths[row]}")
    built = build_index(embeddings, factory, log=log, **build_options)
    stored = _verifier_data(built_verifiers, verifiers, captures, loaded, registry, progress, log)
    items = [item_of(r) for r in captures.rows]
    return write_index_dir(out, built, vectors, items, source, features, force=force, verifiers=stored)


def _verifier_data(built_verifiers: dict, params: dict, captures, loaded, registry, progress, log) -> dict:
    """Each verifier's data of every capture, with its index.json record (params, plugin, cost)."""
    from receipt_embed.indexing.search import query_limits
    from receipt_embed.indexing.verifier_data import extract_items
    from receipt_embed.registry import plugin_errors

    stored = {}
    limits = query_limits(loaded.config.ingest)
    for name, verifier in built_verifiers.items():
        plugin = registry.get("verifier", name).plugin
        log(f"verifier {name} ({plugin}): extracting from {len(captures)} captures")

        def errors(path, name=name):
            return plugin_errors(registry, "verifier", name, f"extracting from {path}")

        if callable(getattr(verifier, "check_rows", None)):  # optional: a verifier of manifest rows says what it lacks
            import warnings

            with plugin_errors(registry, "verifier", name, "checking the captures' rows"):
                notes = verifier.check_rows([dict(row) for row in captures.rows])
            for note in notes or ():
                warnings.warn(str(note), stacklevel=2)

        data, seconds = extract_items(
            verifier, name, captures.paths, captures.rows, limits, progress=progress, errors=errors
        )
        record = {
            "params": dict(params[name]),
            "plugin": plugin,
            "extract_seconds": round(seconds, 3),
            "bytes_per_item": round(data.nbytes() / max(1, len(captures))),
        }
        log(
            f"verifier {name}: {seconds / max(1, len(captures)) * 1000:.1f} ms and "
            f"{record['bytes_per_item'] / 1024:.1f} KiB per capture"
        )
        stored[name] = (data, record)
    return stored


def _present_captures(data_dir, split: str):
    """The split's captures, each still on disk and unchanged since ingest."""
    from receipt_embed.data.dataset_dir import check_captures_present, load_dataset_dir, select_split, verify_captures

    captures = select_split(load_dataset_dir(data_dir), split)
    if not len(captures):
        raise BadInput(f"{data_dir} has no captures in split {split!r}")
    check_captures_present(captures.paths, Path(data_dir) / "manifest.jsonl")
    verify_captures(captures.rows)
    return captures


def _index_shard(loaded, captures, data_dir, out, source, shard, features, batch_size, progress, log, force) -> dict:
    """Shard i/n of ``index --shard``: its rows' vectors and items, joined later by ``index-merge``."""
    from receipt_embed.indexing.shards import shard_rows, write_shard

    start, end = shard_rows(len(captures.rows), *shard)
    if start == end:
        raise BadInput(
            f"shard {shard[0]}/{shard[1]} of {len(captures.rows)} captures is empty; use at most {len(captures.rows)} shards"
        )
    rows = captures.rows[start:end]
    log(f"shard {shard[0]}/{shard[1]}: rows {start}..{end - 1} of {len(captures)} captures ({source['split']})")
    embeddings = embed_paths_checked(
        loaded, [r["path"] for r in rows], features, batch_size, progress, [r.get("sha256") for r in rows]
    )
    meta = {
        **source,
        "features": features,
        "shard": shard[0],
        "shards": shard[1],
        "total": len(captures),
        "rows": [start, end],
    }
    vectors = built_vectors(embeddings, lambda row: f"the embedding of {rows[row]['path']}")
    return write_shard(out, vectors, [item_of(r) for r in rows], meta, force=force)


def embed_paths_checked(loaded, paths, features, batch_size, progress, digests=None) -> np.ndarray:
    from receipt_embed.embedding import embed_paths

    embeddings = embed_paths(loaded, paths, features, batch_size=batch_size, progress=progress, digests=digests)
    bad = np.flatnonzero(~np.isfinite(embeddings).all(axis=1))
    if len(bad):
        raise BadInput(f"the model produced non-finite embeddings for {len(bad)} images, first {paths[bad[0]]}")
    return embeddings


def built_vectors(embeddings: np.ndarray, row_name=lambda row: f"row {row} (0-based)") -> np.ndarray:
    """The rows an index dir stores, at unit length (its ``index.json`` says ``normalised``); a row
    that does not come out of normalising at length ~1 is refused, named by ``row_name(row)``."""
    from receipt_embed.evaluation.retrieval import l2_normalise

    vectors = l2_normalise(embeddings)
    off = np.flatnonzero(np.abs(row_lengths(vectors) - 1) > UNIT_TOLERANCE)
    if len(off):
        length = row_lengths(np.asarray(embeddings)[off[:1]])[0]
        raise BadInput(
            f"{row_name(off[0])} has (near-)zero length ({length:.3g}) and cannot be normalised to unit "
            f"length ({len(off)} such rows)"
        )
    return vectors


def _refuse_lone_surrogates(path: Path, row) -> None:
    """A user's manifest is held to ingest's rule: no column name or value with a lone surrogate
    (a JSON ``"\\ud800"``), which no items.jsonl, CSV or plot could write."""
    from receipt_embed.fileio import lone_surrogate, lone_surrogate_detail

    for key, value in row.fields.items():
        if lone_surrogate(key) is not None:
            raise BadInput(f"{path}, line {row.line}: {lone_surrogate_detail('column name', key)}")
        if (text := lone_surrogate(value)) is not None:
            raise BadInput(f"{path}, line {row.line}: {lone_surrogate_detail(f'column {key}: value', text)}")


def read_items_manifest(manifest: str | Path) -> tuple[Path, list[dict]]:
    """Rows of a manifest (CSV/JSONL, or a dataset dir) as items, paths made absolute."""
    from receipt_embed.ingest.manifest import check_column_spellings, find_manifest, read_manifest
    from receipt_embed.ingest.pipeline import MANIFEST_FILE, REPORT_FILE

    path = find_manifest(manifest)
    # a dataset an older ingest wrote may hold lone surrogates: kept, as `index --data` keeps them
    written_by_ingest = path.name == MANIFEST_FILE and (path.parent / REPORT_FILE).is_file()
    items = []
    rows = read_manifest(path)
    if not written_by_ingest:  # a `Split` or `Receipt_ID` column would be kept as metadata, unread
        check_column_spellings(path, set().union(*(row.fields for row in rows)))
    for row in rows:
        missing = [key for key in ("path", "receipt_id") if row.fields.get(key) in (None, "")]
        if missing:
            raise BadInput(f"{path}, line {row.line}: missing {', '.join(missing)}")
        if not written_by_ingest:
            _refuse_lone_surrogates(path, row)
        item = item_of(row.fields)
        for key in ("path", "receipt_id", *ITEM_OPTIONAL_STRINGS):  # what every reader of items.jsonl takes as text
            value = item.get(key)
            if isinstance(value, (bool, list, dict)):
                raise BadInput(
                    f"{path}, line {row.line}: {key} is {shortened(json.dumps(value))}, expected text "
                    "(a number is taken as its digits)"
                )
            if isinstance(value, (int, float)):
                item[key] = str(value)
        item["path"] = str((path.parent / str(item["path"])).resolve())
        items.append(item)
    return path, items


def load_embeddings(path: str | Path) -> np.ndarray:
    """A (N, D) array from .npy; non-numeric, non-finite or all-zero rows are named."""
    from receipt_embed.npyfile import BadNpyFile, load_npy
    from receipt_embed.userfiles import UnusableFile, open_regular

    path = Path(path)
    try:
        handle = open_regular(path, None)  # a FIFO or device is refused, never read
    except UnusableFile as exc:
        if exc.reason == "missing_file":
            raise FileNotFoundError(f"embeddings file not found: {path}") from None
        raise BadInput(f"embeddings file {exc}") from None
    with handle:
        magic = handle.read(6)
        if magic.startswith(b"PK"):
            raise BadInput(
                f"{path}: expected a single .npy array, got an .npz archive (save one array with numpy.save)"
            )
        if magic != b"\x93NUMPY":
            raise BadInput(f"{path}: not a .npy file (no NumPy header); write the (N, D) array with numpy.save")
    try:
        array = load_npy(path)  # the header is checked against the file's size before any allocation
    except BadNpyFile:
        raise
    except ValueError as exc:
        reason = "it holds Python objects, not numbers" if "pickle" in str(exc) else str(exc)
        raise BadInput(f"{path}: cannot be read as a numeric array: {reason}") from None
    if array.ndim != 2:
        raise BadInput(f"{path}: expected a 2-D array (items x dims), got shape {array.shape}")
    if not np.issubdtype(array.dtype, np.number) or np.iscomplexobj(array):
        raise BadInput(f"{path}: expected real numbers, got dtype {array.dtype}")
    bad = np.flatnonzero(~np.isfinite(array).all(axis=1))
    if len(bad):
        raise BadInput(f"{path}: row {bad[0]} (0-based) holds NaN or Inf ({len(bad)} such rows)")
    huge = np.flatnonzero((np.abs(array) > np.finfo(np.float32).max).any(axis=1))
    if len(huge):
        raise BadInput(f"{path}: row {huge[0]} (0-based) holds values beyond float32 range ({len(huge)} such rows)")
    array = array.astype(np.float32)
    zero = np.flatnonzero(~array.any(axis=1))  # a norm of 1e20s would overflow (and warn)
    if len(zero):
        raise BadInput(f"{path}: row {zero[0]} (0-based) is all zeros and has no direction ({len(zero)} such rows)")
    lengths = row_lengths(array)
    short = np.flatnonzero(lengths < MIN_LENGTH)  # denormal rows: their squares underflow to zero
    if len(short):
        raise BadInput(
            f"{path}: row {short[0]} (0-based) has (near-)zero length {lengths[short[0]]:.3g}, below the smallest "
            f"normal float32 ({MIN_LENGTH:.3g}), so it has no direction to normalise ({len(short)} such rows)"
        )
    long = np.flatnonzero(lengths > MAX_LENGTH)
    if len(long):
        raise BadInput(
            f"{path}: row {long[0]} (0-based) has length {lengths[long[0]]:.3g}, beyond float32 range "
            f"({MAX_LENGTH:.3g}); scale the embeddings down ({len(long)} such rows)"
        )
    return array


def row_lengths(array: np.ndarray) -> np.ndarray:
    """Each row's Euclidean length, computed in float64: float32 squares of tiny values underflow
    to zero and those of huge ones overflow to inf."""
    return np.sqrt(np.square(array, dtype=np.float64).sum(axis=1))


def index_embeddings(
    embeddings_path: str | Path,
    manifest: str | Path,
    out: str | Path,
    *,
    factory: str = "Flat",
    log=lambda message: None,
    force: bool = False,
    **build_options,
) -> dict:
    """An index dir from another model's embeddings; row i belongs to the manifest's row i.
    ``out`` is replaced whole (an existing index dir only with ``force``), never an input."""
    refuse_own_input(out, {"embeddings file": embeddings_path, "manifest": manifest})
    with write_lock(out):
        check_replaceable(out, "index", force)
        return _index_embeddings(embeddings_path, manifest, out, factory=factory, log=log, force=force, **build_options)


def _index_embeddings(embeddings_path, manifest, out, *, factory, log, force, **build_options) -> dict:
    embeddings = load_embeddings(embeddings_path)
    manifest_path, items = read_items_manifest(manifest)
    if len(items) != len(embeddings):
        raise BadInput(
            f"{embeddings_path} has {len(embeddings)} rows but {manifest_path} has {len(items)} "
            "captures; row i of the embeddings must be row i of the manifest"
        )
    source = {
        "kind": "embeddings",
        "embeddings": str(Path(embeddings_path).resolve()),
        "embeddings_sha256": sha256_file(embeddings_path),
        "manifest": str(manifest_path.resolve()),
    }
    vectors = built_vectors(embeddings, lambda row: f"{embeddings_path}: row {row} (0-based)")
    built = build_index(embeddings, factory, log=log, **build_options)
    return write_index_dir(out, built, vectors, items, source, None, force=force)
