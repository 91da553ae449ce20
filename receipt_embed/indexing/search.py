"""Searching an index dir: query images -> nearest captures (the all-pairs sweep is ``pairs``).

Queries embed with the very checkpoint that built the index (its sha256 is in index.json):
vectors from another model live in another space, so a missing or different checkpoint is
an error, never a silent wrong answer.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from receipt_embed.errors import BadInputLines
from receipt_embed.indexing.index_dir import IndexDir, IndexDirError, sha256_file
from receipt_embed.training.checkpoint import MAX_CHECKPOINT_BYTES
from receipt_embed.userfiles import DEFAULT_MAX_BYTES, UnusableFile, check_regular, read_regular

# float32 cosine similarities of identical vectors can land a hair under 1.0: thresholds
# are compared with this tolerance, so T = 1 finds exact duplicates in both search modes
SIMILARITY_TOLERANCE = 1e-6


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
    fields: dict | None = None,
) -> list[dict]:
    """Top-k neighbours of each query image; with ``threshold``, a duplicate verdict on the
    captures other than the query's own file (``already_indexed``: its row when the query is
    byte-identical to an indexed capture, found among the top k + 1). Queries
    are decoded within :func:`query_limits` (``max_pixels`` / ``max_bytes``: the user's own).

    ``verify`` (verifier names; ``[]``: every verifier the index stores) re-ranks the embedding's
    top ``shortlist`` by the verified score, the mean of the verifiers' scores (each in [0, 1]),
    and gives each neighbour ``verified`` (that score and each verifier's figures); the verdict
    is then on the verified score, and ``duplicate`` is None (no verdict) when every verifier
    abstained on every other capture. ``fields``: the query's printed fields (one query), which a
    verifier of manifest rows compares with the indexed captures' columns."""
    from receipt_embed.embedding import embed_paths, load_model
    from receipt_embed.indexing.verification import check_pairs, check_query_fields, verifiers_of

    checks = None if verify is None else verifiers_of(index_dir, verify, registry)
    if checks is not None:
        check_query_fields(checks, fields)
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
            hits = check_pairs(checks, registry, str(path), hits, limits, fields)
        itself = next((hit for hit in hits if hit["same_file"]), None)
        result = {
            "query": str(path),
            "neighbours": hits[:k],
            "already_indexed": None if itself is None else itself["row"],
        }
        if threshold is not None:  # the verdict is about the other captures, never the query's own file
            score = (lambda hit: hit["similarity"]) if checks is None else (lambda hit: hit["verified"]["score"])
            others = [hit for hit in hits if not hit["same_file"] and score(hit) is not None]
            best = others[0] if others else None
            match = best if best and float(score(best)) >= threshold - SIMILARITY_TOLERANCE else None
            # no verdict (None) when no other capture got a score: every verifier abstained on each
            alone = not any(not hit["same_file"] for hit in hits)  # the index holds no other capture
            result["duplicate"] = (match is not None) if others or checks is None or alone else None
            if alone:
                result["no_other_capture"] = True
            result["match"] = match
            result["threshold"] = float(threshold)  # what the verdict was judged against, and on which score
            result["score"] = "similarity" if checks is None else "verified"
        results.append(result)
    return results
