"""Type checks of an index dir's contents: ``index.json``, ``items.jsonl`` and ``embeddings.npy``.

The checksums in index.json only prove the files match index.json; whoever edited a file
can recompute them. So every value the code relies on is checked for its type too, and a
wrong one is an error naming the file and the key (or row), never a crash further on.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from receipt_embed.display import quoted, shortened

# bookkeeping columns of a dataset dir's manifest.jsonl that say nothing about the capture
# (mtime_ns only serves to detect files replaced since ingest)
_INTERNAL = ("manifest_path", "line", "mtime_ns")


def item_of(row: dict) -> dict:
    """The index item of a dataset (or manifest) row: the row without ingest's bookkeeping."""
    return {key: value for key, value in row.items() if key not in _INTERNAL}


FEATURES = (None, "backbone", "head")
SOURCE_STRINGS = (
    "kind",
    "checkpoint",
    "checkpoint_sha256",
    "embeddings",
    "embeddings_sha256",
    "manifest",
    "dataset",
    "split",
)
ITEM_STRINGS = ("path", "receipt_id")  # every item has them, as strings
ITEM_OPTIONAL_STRINGS = ("device", "split", "sha256")


def _kind(value) -> str:
    if value is None:
        return "null"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_meta_types(meta: dict, meta_path: Path, error, check_calibration: bool = True) -> None:
    """Raise ``error`` naming the first key of index.json whose value has the wrong type
    (``check_calibration`` false: all but the ``calibration`` block, which ``calibrate`` replaces)."""

    def bad(*keys: str, wanted: str):
        value = meta
        for key in keys:
            value = value[key]
        return error(f"{meta_path}: {'.'.join(keys)} is {_kind(value)} ({value!r:.60}), expected {wanted}")

    for key, low in (("count", 0), ("dim", 1)):
        if not _is_int(meta[key]) or meta[key] < low:
            raise bad(key, wanted=f"an integer >= {low}")
    if "format_version" in meta and not _is_int(meta["format_version"]):
        raise bad("format_version", wanted="an integer")
    for key in ("factory", "metric"):
        if key in meta and not isinstance(meta[key], str):
            raise bad(key, wanted="a string")
    # what every index `receipt-embed index` writes is: readers rely on it (scores are cosines)
    if "metric" in meta and meta["metric"] != "inner_product":
        raise bad("metric", wanted='"inner_product" (receipt-embed indexes L2-normalised vectors by inner product)')
    if "normalised" in meta and meta["normalised"] is not True:
        raise bad("normalised", wanted="true (receipt-embed indexes L2-normalised vectors)")
    if "exact" in meta and not isinstance(meta["exact"], bool):
        raise bad("exact", wanted="true or false")
    if isinstance(meta.get("exact"), bool) and isinstance(meta.get("factory"), str):
        from receipt_embed.indexing.factory import EXACT_FACTORIES

        if meta["exact"] != (meta["factory"].replace(" ", "") in EXACT_FACTORIES):
            raise bad("exact", wanted=f"{str(not meta['exact']).lower()} for a {meta['factory']} index")
    if meta.get("search_params") is not None and not isinstance(meta["search_params"], str):
        raise bad("search_params", wanted='a string such as "nprobe=16"')
    if meta.get("features") not in FEATURES:
        raise bad("features", wanted='null, "backbone" or "head"')
    _check_files_entry(meta, bad)
    if check_calibration:

        def bad_calibration(*keys: str, wanted: str):
            found = bad(*keys, wanted=wanted)
            return error(f"{found}; run `receipt-embed calibrate {meta_path.parent}` to replace the calibration")

        _check_calibration_entry(meta, bad_calibration)
    for key in SOURCE_STRINGS:
        if key in meta["source"] and not isinstance(meta["source"][key], str):
            raise bad("source", key, wanted="a string")
    if meta["source"].get("dataset_sha256") is not None and not isinstance(meta["source"]["dataset_sha256"], str):
        raise bad("source", "dataset_sha256", wanted="a string or null")
    if "split" in meta["source"] and meta["source"]["split"] not in ("train", "val", "heldout", "all"):
        # an unknown split would select no dataset rows and skip the items-against-dataset check
        raise bad("source", "split", wanted='one of "train", "val", "heldout", "all"')


INDEX_DIR_FILES = ("index.faiss", "items.jsonl", "embeddings.npy")  # what index.json's files list


def _check_verifiers_entry(meta: dict, bad) -> tuple[str, ...]:
    """index.json's ``verifiers`` (name -> {file, params, plugin, ...}); returns the files they name."""
    from receipt_embed.indexing.verifier_data import verifier_file
    from receipt_embed.registry import NAME_PATTERN

    verifiers = meta.get("verifiers")
    if verifiers is None:
        return ()
    if not isinstance(verifiers, dict):
        raise bad("verifiers", wanted="an object of verifier records by name")
    for name, record in verifiers.items():
        if not NAME_PATTERN.match(name):
            raise bad("verifiers", wanted=f"component names as keys, not {shortened(repr(name))}")
        if not isinstance(record, dict):
            raise bad("verifiers", name, wanted="an object {file, params, plugin}")
        if record.get("file") != verifier_file(name):
            raise bad("verifiers", name, wanted=f'a record whose file is "{verifier_file(name)}"')
        if not isinstance(record.get("params"), dict):
            raise bad("verifiers", name, wanted="a record with params, an object")
    return tuple(verifier_file(name) for name in verifiers)


def _is_number(value) -> bool:
    import math

    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_calibration_entry(meta: dict, bad) -> None:
    """index.json's ``calibration``: what ``search --threshold auto`` reads and the audit plots
    (thresholds in the range of their score, precision and recall in [0, 1], the curve's points,
    the verifiers by name) has the types ``calibrate`` writes."""
    calibration = meta.get("calibration")
    if calibration is None:
        return
    if not isinstance(calibration, dict):
        raise bad("calibration", wanted="an object (what `receipt-embed calibrate` writes)")
    target = calibration.get("target_precision")
    if "target_precision" in calibration and not (_is_number(target) and 0 < target <= 1):
        raise bad("calibration", "target_precision", wanted="a number in (0, 1]")
    for kind, low in (("embedding", -1), ("verified", 0), ("verified_image", 0)):
        if kind not in calibration:
            continue
        entry = calibration[kind]
        if not isinstance(entry, dict):
            raise bad("calibration", kind, wanted="an object with threshold, precision and recall")
        score = "a cosine similarity" if kind == "embedding" else "a verified score"
        ranges = {
            "threshold": (low, f"{score}: a number in [{low}, 1], or null"),
            "precision": (0, ""),
            "recall": (0, ""),
        }
        for key, (bottom, wanted) in ranges.items():
            value = entry.get(key)
            if value is not None and not (_is_number(value) and bottom <= value <= 1):
                raise bad("calibration", kind, key, wanted=wanted or "a number in [0, 1], or null")
        flagged = entry.get("flagged")
        if flagged is not None and not (_is_int(flagged) and flagged >= 0):
            raise bad("calibration", kind, "flagged", wanted="an integer >= 0, or null")
        verifiers = entry.get("verifiers")
        if "verifiers" in entry and not (isinstance(verifiers, list) and all(isinstance(v, str) for v in verifiers)):
            raise bad("calibration", kind, "verifiers", wanted="a list of verifier names")
        curve = entry.get("curve")
        if "curve" in entry:
            if not isinstance(curve, list):
                raise bad("calibration", kind, "curve", wanted="a list of points {threshold, precision, recall}")
            for point in curve:
                if not (
                    isinstance(point, dict)
                    and all(_is_number(point.get(key)) for key in ("threshold", "precision", "recall"))
                    and all(0 <= point[key] <= 1 for key in ("precision", "recall"))
                ):
                    raise bad(
                        "calibration",
                        kind,
                        "curve",
                        wanted=f"points of numbers {{threshold, precision, recall}}, not {shortened(repr(point))}",
                    )


def _check_files_entry(meta: dict, bad) -> None:
    files = meta["files"]
    if not isinstance(files, dict):
        raise bad("files", wanted="an object of {sha256, bytes} by file name")
    allowed = (*INDEX_DIR_FILES, *_check_verifiers_entry(meta, bad))
    for name, entry in files.items():
        if name not in allowed:
            raise bad("files", wanted=f"entries for {', '.join(allowed)} only, not {shortened(repr(name))}")
        if not isinstance(entry, dict) or "sha256" not in entry or "bytes" not in entry:
            raise bad("files", name, wanted="an object {sha256, bytes}")
        if not isinstance(entry["sha256"], str):
            raise bad("files", name, "sha256", wanted="a hex string")
        if not _is_int(entry["bytes"]) or entry["bytes"] < 0:
            raise bad("files", name, "bytes", wanted="an integer >= 0")


SHARD_INTS = ("count", "dim", "shard", "shards", "total")
SHARD_STRINGS = ("checkpoint", "checkpoint_sha256", "dataset", "split")


SHARD_FILES = ("embeddings.npy", "items.jsonl")  # what `index --shard` writes beside shard.json


def check_shard_meta(meta, shard_path: Path, error) -> None:
    """shard.json: what index-merge reads, by type (files: {name: sha256})."""
    if not isinstance(meta, dict):
        raise error(f"{shard_path} holds {_kind(meta)}, not the object `index --shard` writes; re-run that shard")
    for key in (*SHARD_INTS, *SHARD_STRINGS, "features", "files"):
        if key not in meta:
            raise error(f"{shard_path} lacks {key!r}; re-run that shard")
    wrong = next((key for key in SHARD_INTS if not _is_int(meta[key]) or meta[key] < 0), None)
    wrong = wrong or next((key for key in SHARD_STRINGS if not isinstance(meta[key], str)), None)
    if wrong:
        raise error(
            f"{shard_path}: {wrong} is {_kind(meta[wrong])} ({meta[wrong]!r:.60}), expected "
            f"{'an integer >= 0' if wrong in SHARD_INTS else 'a string'}"
        )
    if meta.get("features") not in FEATURES:
        raise error(f'{shard_path}: features is {meta["features"]!r:.60}, expected null, "backbone" or "head"')
    files = meta["files"]
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise error(f"{shard_path}: files is {_kind(files)}, expected an object of sha256 strings by file name")
    if sorted(files) != sorted(SHARD_FILES):  # never open a path a shard.json names: only the shard's own files
        raise error(
            f"{shard_path}: files names {', '.join(quoted(name) for name in sorted(files)) or 'nothing'}; a shard "
            f"holds exactly {' and '.join(SHARD_FILES)}: re-run that shard"
        )


def check_items(items: list, items_path: Path, error) -> None:
    """Each row a JSON object with string path and receipt_id (and string device/split/sha256 when given)."""
    for row, item in enumerate(items):
        where = f"{items_path}, row {row} (0-based)"
        if not isinstance(item, dict):
            raise error(f"{where} is {_kind(item)}, not a JSON object")
        for key in ITEM_STRINGS:
            if key not in item:
                raise error(f"{where} lacks {key!r}")
        for key in (*ITEM_STRINGS, *ITEM_OPTIONAL_STRINGS):
            optional_none = key in ITEM_OPTIONAL_STRINGS and item.get(key, "") is None
            if key in item and not isinstance(item[key], str) and not optional_none:
                raise error(f"{where}: {key} is {_kind(item[key])} ({item[key]!r:.60}), expected a string")
        if not item["receipt_id"].strip():
            raise error(f"{where}: receipt_id is empty; every capture names its receipt")


def check_embeddings(embeddings: np.ndarray, embeddings_path: Path, error) -> None:
    """float32, 2-D and finite, as ``receipt-embed index`` writes them."""
    dtype = embeddings.dtype
    if dtype.fields is not None or dtype != np.float32:
        kind = "structured" if dtype.fields is not None else dtype.name
        if dtype.fields is None and dtype.byteorder == ">":
            kind = f"big-endian {kind}"  # else it would read "holds float32 values ...; stores float32"
        raise error(f"{embeddings_path} holds {kind} values (dtype {dtype.str}); an index dir stores float32")
    if embeddings.ndim != 2:
        raise error(f"{embeddings_path} has shape {embeddings.shape}; an index dir stores a 2-D (items x dim) array")
    finite = np.isfinite(embeddings).all(axis=1)
    if not finite.all():
        bad = np.flatnonzero(~finite)
        raise error(f"{embeddings_path}: row {bad[0]} (0-based) holds NaN or Inf ({len(bad)} such rows)")


# how many stored rows the load-time check searches for (a few ms even for an IVF-PQ index)
SAMPLE_ROWS = 64
# inner products of L2-normalised vectors lie in [-1, 1]; an exact index returns a row's own
# vector at ~1; lossy codes (PQ, SQ) reconstruct vectors whose norm strays a little past 1
# (1.11 seen with a coarse IVF,PQ4), unnormalised substitutes score far beyond (9.99)
SCORE_SLACK = {True: 1e-3, False: 0.5}


def _structure(index) -> list[str]:
    """The class names (and IVF list counts) of an index and its wrapped sub-indexes."""
    import faiss

    names, stack = [], [index]
    while stack:
        part = faiss.downcast_index(stack.pop(0))
        name = type(part).__name__
        if name in ("IndexFlatIP", "IndexFlatL2"):  # written as IndexFlat, read back by metric
            name = "IndexFlat"
        nlist = getattr(part, "nlist", None)
        names.append(f"{name}(nlist={nlist})" if isinstance(nlist, int) else name)
        for attr in ("index", "base_index", "refine_index", "quantizer"):
            child = getattr(part, attr, None)
            if child is not None and hasattr(child, "ntotal"):
                stack.append(child)
    return names


def check_index_structure(index, meta: dict, index_path: Path, error) -> None:
    """index.faiss must be the kind of index ``factory`` builds: a substituted index (another
    type, another metric) would answer with scores of another kind."""
    import faiss

    try:
        expected = faiss.index_factory(int(meta["dim"]), meta["factory"], faiss.METRIC_INNER_PRODUCT)
    except (RuntimeError, KeyError) as exc:
        raise error(
            f"{index_path}: index.json's factory {meta.get('factory')!r} cannot be built by FAISS "
            f"({str(exc).strip().splitlines()[-1] if str(exc).strip() else 'missing'})"
        ) from None
    found, wanted = _structure(index), _structure(expected)
    if found != wanted or index.metric_type != faiss.METRIC_INNER_PRODUCT:
        raise error(
            f"{index_path} is a {' > '.join(found)} index (metric {index.metric_type}), but index.json's "
            f"factory {meta['factory']!r} builds {' > '.join(wanted)} (inner product): the file was replaced"
        )


# an approximate index must find a sampled row's own vector among its 10 nearest for at least
# this share of its recorded recall@10 (rows shuffled or swapped find themselves almost never)
SELF_HIT_SHARE = 0.5


def check_index_holds_rows(index, embeddings: np.ndarray, meta: dict, index_path: Path, error) -> None:
    """index.faiss must hold row i of embeddings.npy as its vector i: search it (with its search
    parameters set) for a sample of stored rows. Scores past [-1, 1] mean unnormalised vectors;
    an exact index must return each row's own vector (or an identical twin's) first, and an
    approximate one must find most rows among their 10 nearest, or its rows belong to other items
    (reordered or swapped vectors would mark the wrong receipt as the duplicate)."""
    count = len(embeddings)
    if count == 0:
        return
    rows = np.unique(np.linspace(0, count - 1, min(count, SAMPLE_ROWS)).astype(np.int64))
    queries = np.ascontiguousarray(embeddings[rows], dtype=np.float32)
    exact = bool(meta.get("exact"))
    k = 1 if exact else min(10, count)
    scores, ids = index.search(queries, k)
    slack = SCORE_SLACK[exact]
    best = scores[:, 0]
    low = 1 - slack if exact else -1 - slack
    bad = np.flatnonzero(~((best >= low) & (best <= 1 + slack)))
    if len(bad):
        row = int(rows[bad[0]])
        wanted_range = "~1 (its own vector)" if exact else f"[-{1 + slack:g}, {1 + slack:g}]"
        raise error(
            f"{index_path}: searching it for row {row} of embeddings.npy scores {best[bad[0]]:.4f}, "
            f"expected {wanted_range}: the index does not hold the stored vectors"
        )
    valid = (ids >= 0) & (ids < count)
    found = np.where(valid, ids, 0)
    # the returned row's stored vector is the query's own (a row, or a twin with the same vector)
    same = valid & (np.einsum("qkd,qd->qk", embeddings[found], queries) >= 1 - SCORE_SLACK[True])
    hits = same.any(axis=1)
    if exact and not hits.all():
        miss = int(np.flatnonzero(~hits)[0])
        raise error(
            f"{index_path}: searching it for row {int(rows[miss])} of embeddings.npy returns row {int(ids[miss, 0])}, "
            "whose stored vector is another: the index's rows are not the items' rows (reordered or replaced)"
        )
    if exact:
        _check_stored_vectors(index, rows, queries, index_path, error)
    recall = meta.get("recall_at_10")
    expected = float(recall) if isinstance(recall, (int, float)) and 0 < recall <= 1 else 1.0
    if not exact and hits.mean() < SELF_HIT_SHARE * expected:
        raise error(
            f"{index_path}: searching it for {len(rows)} of its stored rows finds only {int(hits.sum())} of them "
            f"among their {k} nearest (index.json records recall@10 {expected:.3f}): the index's rows are not "
            "the items' rows (reordered or replaced)"
        )


# a Flat index keeps the very float32 vectors it was given; anything past rounding is an edit
STORED_VECTOR_SLACK = 1e-5


def _check_stored_vectors(index, rows: np.ndarray, queries: np.ndarray, index_path: Path, error) -> None:
    """An exact index holds row i's vector itself: compare the sampled rows with what it stores.
    Searching alone lets two near-identical rows (cosine within 1e-3: an under-trained model, two
    captures of one receipt) trade places unseen."""
    try:
        stored = index.reconstruct_batch(rows)
    except RuntimeError:  # an index type that cannot give its vectors back: searching is the check
        return
    off = np.abs(np.asarray(stored, dtype=np.float32) - queries).max(axis=1)
    bad = np.flatnonzero(off > STORED_VECTOR_SLACK)
    if len(bad):
        raise error(
            f"{index_path}: its vector {int(rows[bad[0]])} differs from row {int(rows[bad[0]])} of embeddings.npy "
            f"by up to {off[bad[0]]:.2g} ({len(bad)} of {len(rows)} sampled rows): the index's rows are not the "
            "items' rows (reordered or replaced)"
        )


def dataset_rows(source: dict, rows: tuple[int, int] | None = None) -> list[dict] | None:
    """The rows an index (or a shard: ``rows`` = start, end) was built from, read again from the
    dataset dir its source names, when that dir still holds the very manifest it was built from
    (same sha256); None when it cannot be told (no dataset recorded, moved or re-ingested)."""
    import hashlib

    from receipt_embed.data.dataset_dir import select_split
    from receipt_embed.fileio import MAX_JSONL_BYTES, parse_jsonl
    from receipt_embed.userfiles import UnusableFile, read_regular

    if not isinstance(source.get("dataset"), str) or not isinstance(source.get("dataset_sha256"), str):
        return None
    manifest = Path(source["dataset"]) / "manifest.jsonl"
    try:
        data = read_regular(manifest, MAX_JSONL_BYTES)
    except (UnusableFile, OSError):
        return None
    if hashlib.sha256(data).hexdigest() != source["dataset_sha256"]:
        return None
    try:
        chosen = select_split(parse_jsonl(data, manifest), source.get("split", "all")).rows
    except (ValueError, KeyError, TypeError):
        return None
    return chosen[rows[0] : rows[1]] if rows is not None else chosen


def check_items_match_dataset(items: list[dict], source: dict, items_path: Path, error, rows=None) -> None:
    """Each item is the dataset row it was built from, in order: an items.jsonl with rows swapped,
    or a shard holding another shard's rows, would otherwise pass its recomputed checksums and
    name the wrong receipt for a vector. Checked when the dataset dir is unchanged (dataset_rows)."""
    expected = dataset_rows(source, rows)
    if expected is None:
        return
    if len(expected) != len(items):
        raise error(
            f"{items_path} has {len(items)} items, but its dataset {source['dataset']} gives {len(expected)} "
            f"captures for split {source.get('split')}: the index was edited"
        )
    for number, (item, row) in enumerate(zip(items, expected)):  # 0-based, as check_items and embeddings.npy
        listed = item_of(row)
        if item == listed:
            continue
        if item.get("path") != listed.get("path"):
            raise error(
                f"{items_path}, row {number} (0-based): {shortened(repr(item.get('path')))} is not the capture its dataset "
                f"lists there ({shortened(repr(listed.get('path')))}): the index was edited; build it again"
            )
        fields = sorted(set(item) | set(listed), key=str)
        changed = next(key for key in fields if item.get(key, _ABSENT) != listed.get(key, _ABSENT))
        raise error(
            f"{items_path}, row {number} (0-based, {shortened(repr(item.get('path')))}): its {quoted(changed)} is "
            f"{_shown_value(item, changed)} but its dataset has {_shown_value(listed, changed)}: the index was "
            "edited; build it again"
        )


_ABSENT = object()


def _shown_value(item: dict, key) -> str:
    return shortened(repr(item[key])) if key in item else "absent"
