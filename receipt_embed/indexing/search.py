"""Searching an index dir: query images -> nearest captures, and the all-pairs sweep.

Queries embed with the very checkpoint that built the index (its sha256 is in index.json):
vectors from another model live in another space, so a missing or different checkpoint is
an error, never a silent wrong answer.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from receipt_embed.errors import BadInput, BadInputLines
from receipt_embed.indexing.index_dir import IndexDir, IndexDirError, sha256_file
from receipt_embed.training.checkpoint import MAX_CHECKPOINT_BYTES
from receipt_embed.userfiles import DEFAULT_MAX_BYTES, UnusableFile, check_regular, read_regular

# float32 cosine similarities of identical vectors can land a hair under 1.0: thresholds
# are compared with this tolerance, so T = 1 finds exact duplicates in both search modes
SIMILARITY_TOLERANCE = 1e-6

PAIR_COLUMNS = (
    "row_a",
    "row_b",
    "similarity",
    "same_receipt",
    "receipt_id_a",
    "receipt_id_b",
    "device_a",
    "device_b",
    "path_a",
    "path_b",
)


def resolve_checkpoint(index_dir: IndexDir, override: str | Path | None = None) -> Path:
    """The checkpoint that built the index, verified by sha256 (``override``: a moved copy)."""
    source = index_dir.meta["source"]
    if source.get("kind") != "checkpoint":
        raise IndexDirError(
            f"{index_dir.path} was built from external embeddings ({source.get('embeddings')}), so there is no "
            "model to embed query images with; use --all-pairs, or index with --checkpoint"
        )
    recorded = Path(source["checkpoint"])
    path = Path(override) if override else recorded
    try:
        check_regular(path)  # /dev/zero or a FIFO is named as such, not "not found"
    except UnusableFile as exc:
        if exc.reason != "missing_file":
            raise IndexDirError(
                f"checkpoint {exc}"
                + ("" if override else f" ({index_dir.path} records it; pass --checkpoint PATH to use a copy)")
            ) from None
        from receipt_embed.training.replacement import set_aside_advice

        if (advice := set_aside_advice(path)) is not None:
            raise IndexDirError(f"checkpoint {path} not found: {advice}") from None
        if override:
            raise IndexDirError(f"checkpoint {path} not found") from None
        raise IndexDirError(
            f"checkpoint {path} not found: {index_dir.path} was built with it; pass --checkpoint PATH if it moved"
        ) from None
    if sha256_file(path, max_bytes=MAX_CHECKPOINT_BYTES) != source["checkpoint_sha256"]:
        raise IndexDirError(
            f"checkpoint {path} is not the one that built {index_dir.path} (sha256 differs from index.json): "
            "its embeddings would not be comparable; rebuild the index or pass the original checkpoint"
        )
    return path


def query_limits(ingest, max_pixels: int | None = None, max_bytes: int | None = None) -> tuple[int, int]:
    """The pixel and byte limits for decoding query images: what the user gave (search
    ``--max-pixels`` / ``--max-bytes``), else the defaults, lowered where the checkpoint's
    ``ingest`` settings are lower. A checkpoint is a data file, possibly from elsewhere: it may
    tighten the decompression-bomb limits, never lift them."""
    from receipt_embed.images import DEFAULT_MAX_PIXELS

    return (
        max_pixels if max_pixels is not None else min(ingest.max_pixels, DEFAULT_MAX_PIXELS),
        max_bytes if max_bytes is not None else min(ingest.max_bytes, DEFAULT_MAX_BYTES),
    )


def check_queries(paths: list[str], max_pixels: int, max_bytes: int | None = DEFAULT_MAX_BYTES) -> list[str]:
    """Every query is a regular file of at most ``max_bytes`` that decodes and is not blank,
    else one error listing each bad one (a FIFO or device is named, never opened); returns
    each sha256. A limit's error names the search option that raises it."""
    from receipt_embed.images import ImageRejected, decode_image

    digests, problems = [], []
    for path in paths:
        try:
            data = read_regular(path, max_bytes)
            decode_image(data, max_pixels, name=str(path), max_pixels_key="search --max-pixels N")
            digests.append(hashlib.sha256(data).hexdigest())
        except UnusableFile as exc:
            if exc.reason == "too_large":
                problems.append(f"{exc} (raise search --max-bytes N if it is genuine)")
            else:
                problems.append(f"{path}: not found" if exc.reason == "missing_file" else str(exc))
        except ImageRejected as exc:
            problems.append(exc.detail)
    if problems:
        raise BadInputLines(
            f"{len(problems)} of {len(paths)} query images cannot be used (no search was run):", problems
        )
    return digests


def neighbours(index_dir: IndexDir, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    from receipt_embed.evaluation.retrieval import l2_normalise

    if queries.shape[1] != index_dir.meta["dim"]:
        raise IndexDirError(f"query vectors have dim {queries.shape[1]}, the index holds dim {index_dir.meta['dim']}")
    k = min(k, index_dir.count)
    return index_dir.index.search(l2_normalise(queries), k)


def search_images(
    index_dir: IndexDir,
    images: list[str],
    registry,
    *,
    k: int = 5,
    threshold: float | None = None,
    checkpoint: str | Path | None = None,
    batch_size: int = 128,
    max_pixels: int | None = None,
    max_bytes: int | None = None,
    verify: list[str] | None = None,
    shortlist: int = 10,
) -> list[dict]:
    """Top-k neighbours of each query image; with ``threshold``, a duplicate verdict on the
    captures other than the query's own file (``already_indexed``: its row when the query is
    byte-identical to an indexed capture, found among the top k + 1). Queries
    are decoded within :func:`query_limits` (``max_pixels`` / ``max_bytes``: the user's own).

    ``verify`` (verifier names; ``[]``: every verifier the index stores) re-ranks the embedding's
    top ``shortlist`` by the verified score, the mean of the verifiers' scores (each in [0, 1]),
    and gives each neighbour ``verified`` (that score and each verifier's figures); the verdict
    is then on the verified score."""
    from receipt_embed.embedding import embed_paths, load_model
    from receipt_embed.indexing.verification import check_pairs, verifiers_of

    checks = None if verify is None else verifiers_of(index_dir, verify, registry)
    loaded = load_model(resolve_checkpoint(index_dir, checkpoint), registry)
    limits = query_limits(loaded.config.ingest, max_pixels, max_bytes)
    digests = check_queries(images, *limits)
    vectors = embed_paths(
        loaded, [str(p) for p in images], index_dir.meta["features"], batch_size=batch_size, limits=limits
    )
    # one more: a query that is itself indexed still gets k (or --shortlist) others to judge
    wanted = k if checks is None else max(k, shortlist)
    sims, ids = neighbours(index_dir, vectors, wanted + 1)
    results = []
    for path, digest, row_sims, row_ids in zip(images, digests, sims, ids):
        hits = []
        for sim, row in zip(row_sims, row_ids):
            if row < 0:
                continue
            item = index_dir.items[row]
            hits.append(
                {
                    "row": int(row),
                    "similarity": round(float(sim), 6),
                    "receipt_id": item.get("receipt_id"),
                    "device": item.get("device"),
                    "path": item.get("path"),
                    "same_file": item.get("sha256") == digest,
                }
            )
        if not any(hit["same_file"] for hit in hits):
            hits = hits[:wanted]
        if checks is not None:
            hits = check_pairs(checks, registry, str(path), hits, limits)
        itself = next((hit for hit in hits if hit["same_file"]), None)
        result = {
            "query": str(path),
            "neighbours": hits[:k],
            "already_indexed": None if itself is None else itself["row"],
        }
        if threshold is not None:  # the verdict is about the other captures, never the query's own file
            score = (lambda hit: hit["similarity"]) if checks is None else (lambda hit: hit["verified"]["score"])
            others = [hit for hit in hits if not hit["same_file"]]
            best = others[0] if others else None
            match = best if best and float(score(best)) >= threshold - SIMILARITY_TOLERANCE else None
            result["duplicate"] = match is not None
            result["match"] = match
        results.append(result)
    return results


# the all-pairs sweep's memory: one range search returns at most about CHUNK_RESULTS candidates
# (its queries x the indexed items, 12 bytes each: 100 MB), and at most MAX_PAIRS pairs are kept and
# sorted (about 1 GB with the CSV rows made from them); a threshold that matches more is refused
CHUNK_RESULTS = 2**23
MAX_PAIRS = 10_000_000


class TooManyPairs(BadInput):
    """More pairs at or above the threshold than ``MAX_PAIRS``."""


def all_pairs(
    embeddings: np.ndarray, threshold: float, chunk: int = 4096, max_pairs: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every pair (i < j) with cosine similarity >= threshold (less SIMILARITY_TOLERANCE), by
    exact FAISS range search.

    Runs over the exact stored vectors (not an approximate index's lossy codes), in chunks of
    at most ``chunk`` queries and ``CHUNK_RESULTS`` candidates; more than ``max_pairs``
    (``MAX_PAIRS``) pairs is :class:`TooManyPairs`, so memory stays bounded. Returns rows a,
    rows b and similarities, sorted by similarity (highest first), then by rows."""
    import faiss

    limit = MAX_PAIRS if max_pairs is None else max_pairs
    vectors = np.ascontiguousarray(embeddings, dtype=np.float32)
    flat = faiss.IndexFlatIP(vectors.shape[1])
    flat.add(vectors)
    chunk = max(1, min(chunk, CHUNK_RESULTS // max(1, len(vectors))))
    # FAISS keeps scores strictly above the radius
    radius = float(threshold - SIMILARITY_TOLERANCE)
    rows_a, rows_b, sims = [], [], []
    kept = 0
    try:
        for start in range(0, len(vectors), chunk):
            queries = vectors[start : start + chunk]
            # FAISS cannot report a failed allocation inside its threads (the process aborts):
            # claim this chunk's worst case first (ids and scores, twice while FAISS gathers them,
            # with a third more for its buffers); the numpy work after it raises MemoryError itself
            np.empty(len(queries) * len(vectors) * 32, dtype=np.uint8)  # and freed at once
            lims, scores, ids = flat.range_search(queries, radius)
            query = start + np.repeat(np.arange(len(lims) - 1), np.diff(lims.astype(np.int64)))
            keep = ids > query
            kept += int(np.count_nonzero(keep))
            if kept > limit:
                done = min(len(vectors), start + chunk)
                raise TooManyPairs(
                    f"--all-pairs --threshold {threshold}: {kept} pairs among the first {done} of {len(vectors)} "
                    f"items already, over the limit of {limit} pairs; raise --threshold"
                )
            rows_a.append(query[keep])
            rows_b.append(ids[keep])
            sims.append(scores[keep])
            del lims, scores, ids, query, keep
        a, b, s = (np.concatenate(x) if x else np.zeros(0) for x in (rows_a, rows_b, sims))
        del rows_a, rows_b, sims
        order = np.lexsort((b, a, -s))
        return (
            a[order].astype(np.int64, copy=False),
            b[order].astype(np.int64, copy=False),
            s[order].astype(np.float32, copy=False),
        )
    except MemoryError:
        raise BadInput(
            f"out of memory in --all-pairs over {len(vectors)} items after {kept} pairs (a memory limit such "
            f"as `ulimit -v`, or too little RAM; a range search takes up to {CHUNK_RESULTS * 32 // 2**20} MiB): "
            "raise the limit, or --threshold to keep fewer pairs"
        ) from None


def pair_rows(index_dir: IndexDir, a: np.ndarray, b: np.ndarray, sims: np.ndarray):
    """CSV rows for pairs: same_receipt is true/false when both receipt ids are known, else blank."""
    items = index_dir.items
    for start in range(0, len(a), 65536):  # a slice at a time: ten million Python ints would take 1 GB
        yield from _pair_rows(items, a[start : start + 65536], b[start : start + 65536], sims[start : start + 65536])


def _pair_rows(items, a: np.ndarray, b: np.ndarray, sims: np.ndarray):
    for i, j, sim in zip(a.tolist(), b.tolist(), sims.tolist()):
        x, y = items[i], items[j]
        known = x.get("receipt_id") not in (None, "") and y.get("receipt_id") not in (None, "")
        same = ("true" if x["receipt_id"] == y["receipt_id"] else "false") if known else ""
        yield (
            i,
            j,
            f"{sim:.6f}",
            same,
            x.get("receipt_id", ""),
            y.get("receipt_id", ""),
            x.get("device", ""),
            y.get("device", ""),
            x.get("path", ""),
            y.get("path", ""),
        )
