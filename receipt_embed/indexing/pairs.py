"""The all-pairs sweep: every near-duplicate pair among the indexed items, verified or not.

Without verifiers it is every pair whose embedding similarity reaches the lowest threshold, by
exact range search over the stored vectors. With verifiers (``index --verify``) the candidates are
each item's ``shortlist`` nearest others (at or above a loose ``min_similarity``), and each pair
is scored by the verifiers on both items' stored data: the score an image search gives a query
with its fields. A reviewer reads the result against every same-receipt pair the index holds
(:func:`summarise`): how many pairs each threshold flags, how many of them are one receipt, and
the share of all duplicates it catches.
"""

from __future__ import annotations

import sys

import numpy as np

from receipt_embed.errors import BadInput
from receipt_embed.indexing.index_dir import IndexDir
from receipt_embed.indexing.search import SIMILARITY_TOLERANCE

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


def shortlist_pairs(
    embeddings: np.ndarray, shortlist: int, min_similarity: float | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The candidate pairs (i < j, each once) in which j is among i's ``shortlist`` nearest other
    items or i among j's, with similarity >= ``min_similarity`` when given; sorted like
    :func:`all_pairs`."""
    from receipt_embed.evaluation.retrieval import knn

    vectors = np.ascontiguousarray(embeddings, dtype=np.float32)
    sims, ids = knn(vectors, shortlist)
    query = np.repeat(np.arange(len(vectors)), ids.shape[1])
    ids, sims = ids.reshape(-1), sims.reshape(-1)
    keep = ids >= 0
    if min_similarity is not None:
        keep &= sims >= min_similarity - SIMILARITY_TOLERANCE
    a, b, s = np.minimum(query, ids)[keep], np.maximum(query, ids)[keep], sims[keep]
    _, first = np.unique(a * len(vectors) + b, return_index=True)
    a, b, s = a[first], b[first], s[first]
    order = np.lexsort((b, a, -s))
    return a[order].astype(np.int64), b[order].astype(np.int64), s[order].astype(np.float32)


def verify_pairs(checks: dict, registry, a: np.ndarray, b: np.ndarray, progress: bool = False) -> dict:
    """Each pair's verified score (``"score"``) and each verifier's score (by name), from the
    stored data of both items (``checks``: :func:`receipt_embed.indexing.verification.verifiers_of`);
    NaN where a verifier abstained, and a verified score of NaN where every one did (no evidence:
    never at or above a threshold)."""
    from tqdm import tqdm

    from receipt_embed.indexing.verification import score_figures, verified_score
    from receipt_embed.registry import plugin_errors

    scores = {name: np.zeros(len(a), dtype=np.float32) for name in checks}
    fused = np.zeros(len(a), dtype=np.float32)
    with tqdm(total=len(a), desc="verifying pairs", unit="pair", disable=not progress, file=sys.stderr) as bar:
        for n, (i, j) in enumerate(zip(a.tolist(), b.tolist())):
            figures = []
            for name, (verifier, data) in checks.items():
                with plugin_errors(registry, "verifier", name, f"scoring rows {i} and {j}"):
                    result = score_figures(name, verifier.score(data.item(i), data.item(j)))
                scores[name][n] = np.nan if result["score"] is None else result["score"]
                figures.append(result)
            score = verified_score(figures)
            fused[n] = np.nan if score is None else score
            bar.update()
    return {"score": fused, **scores}


def same_receipt_pairs(items: list[dict]) -> int | None:
    """How many pairs of items are captures of one receipt (None when some item has no receipt id):
    the count a recall is read against."""
    receipts = [item.get("receipt_id") for item in items]
    if any(r in (None, "") for r in receipts):
        return None
    counts = np.unique(np.array(receipts, dtype=str), return_counts=True)[1].astype(np.int64)
    return int(np.sum(counts * (counts - 1) // 2))


def same_receipt(items: list[dict], a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per pair: 1 same receipt, 0 different, -1 unknown (an item without a receipt id)."""
    out = np.empty(len(a), dtype=np.int8)
    for n, (i, j) in enumerate(zip(a.tolist(), b.tolist())):
        x, y = items[i].get("receipt_id"), items[j].get("receipt_id")
        out[n] = -1 if x in (None, "") or y in (None, "") else int(x == y)
    return out


def summarise(scores: np.ndarray, same: np.ndarray, thresholds: list[float], duplicates: int | None) -> list[dict]:
    """Per threshold (ascending): the pairs at or above it, how many are one receipt, different
    receipts or unlabelled, precision among the labelled ones, and recall against ``duplicates``
    (every same-receipt pair of the index)."""
    rows = []
    for threshold in sorted(thresholds):
        flagged = scores >= threshold - SIMILARITY_TOLERANCE
        right, wrong = int(np.sum(flagged & (same == 1))), int(np.sum(flagged & (same == 0)))
        rows.append(
            {
                "threshold": float(threshold),
                "pairs": int(np.sum(flagged)),
                "same_receipt": right,
                "different_receipts": wrong,
                "unlabelled": int(np.sum(flagged & (same == -1))),
                "precision": right / (right + wrong) if right + wrong else None,
                "recall": right / duplicates if duplicates else None,
            }
        )
    return rows


def manifest_columns(items: list[dict]) -> list[str]:
    """The manifest's own columns the items carry (merchant, date, total...): every key but the
    three required ones and those ingest writes itself, in first-seen order."""
    from receipt_embed.ingest.manifest import REQUIRED_COLUMNS, RESERVED_COLUMNS

    skip = {*REQUIRED_COLUMNS, *RESERVED_COLUMNS, "split"}
    seen: dict[str, None] = {}
    for item in items:
        for key in item:
            if key not in skip and key not in seen:
                seen[key] = None
    return list(seen)


def pair_columns(verifiers: list[str], extras: list[str]) -> list[str]:
    """The CSV header: PAIR_COLUMNS, then ``verified`` and each verifier's score, then each extra
    manifest column for a and b (``merchant_a``, ``merchant_b``)."""
    columns = [*PAIR_COLUMNS, *(["verified", *(f"{name}_score" for name in verifiers)] if verifiers else [])]
    taken = set(columns)
    for extra in extras:
        for side in ("a", "b"):
            name = f"{extra}_{side}"
            while name in taken:  # a clash with ours, or with another manifest column: prefixed until unique
                name = f"manifest.{name}"
            columns.append(name)
            taken.add(name)
    return columns


def pair_rows(index_dir: IndexDir, a, b, sims, verified: dict | None = None, extras: list[str] = ()):
    """CSV rows for pairs, in :func:`pair_columns` order: same_receipt is true/false when both
    receipt ids are known, else blank."""
    for start in range(0, len(a), 65536):  # a slice at a time: ten million Python ints would take 1 GB
        part = slice(start, start + 65536)
        scores = None if verified is None else {name: values[part] for name, values in verified.items()}
        yield from _pair_rows(index_dir.items, a[part], b[part], sims[part], scores, extras)


def _pair_rows(items, a, b, sims, verified, extras):
    names = [name for name in (verified or {}) if name != "score"]
    for n, (i, j, sim) in enumerate(zip(a.tolist(), b.tolist(), sims.tolist())):
        x, y = items[i], items[j]
        known = x.get("receipt_id") not in (None, "") and y.get("receipt_id") not in (None, "")
        same = ("true" if x["receipt_id"] == y["receipt_id"] else "false") if known else ""
        row = [
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
        ]
        if verified is not None:  # blank: the verifier abstained (no evidence either way)
            row += [_score_text(verified["score"][n]), *(_score_text(verified[name][n]) for name in names)]
        for extra in extras:
            row += [_text(x.get(extra)), _text(y.get(extra))]
        yield tuple(row)


def _score_text(value) -> str:
    return "" if np.isnan(value) else f"{float(value):.6f}"


def _text(value) -> str:
    return "" if value is None else value if isinstance(value, str) else str(value)
