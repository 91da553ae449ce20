"""The audit's second stage (``audit-shortcuts --verify``): what retrieval looks like once the
index's verifiers have re-ranked each item's shortlist, beside the embedding alone.

Each item is a query against the others (leave-one-out, as in ``calibrate``): its ``shortlist``
nearest by embedding are re-ranked by the verified score (every stored verifier, each capture
with its own data), and the rest follow in embedding order. The same keys as the embedding's
``retrieval`` are computed on that ranking (recall@k, mAP, cross-attribute recall@1), and the
precision-recall curves of "the best other capture is the same receipt" for both scores.
"""

from __future__ import annotations

import time

import numpy as np

from receipt_embed.indexing.index_dir import IndexDir


def verified_figures(
    index_dir: IndexDir,
    registry,
    labels: np.ndarray,
    attributes: dict[str, np.ndarray],
    shortlist: int = 10,
    ks=(1, 5, 10),
    progress: bool = False,
) -> tuple[dict, dict]:
    """``retrieval.verified`` (the embedding retrieval's keys on the verified ranking, with
    ``shortlist``, ``verifiers`` and ``seconds``; under ``image``, the same with only the verifiers
    that read the image, as a bare query image is judged, when some verifiers read rows) and the
    precision-recall curves by score kind. ``attributes``: name -> value per item, for
    cross-attribute recall@1."""
    import faiss

    from receipt_embed.evaluation.retrieval import l2_normalise
    from receipt_embed.indexing.calibration import best_neighbours, best_verified, pr_curve, thinned
    from receipt_embed.indexing.verification import fused, shortlist_scores, verifiers_of

    started = time.monotonic()
    checks = verifiers_of(index_dir, [], registry)
    rows, per = shortlist_scores(index_dir, checks, shortlist, registry, progress=progress)
    verified = fused(rows, per, list(checks))
    x = np.ascontiguousarray(l2_normalise(index_dir.embeddings), dtype=np.float32)
    groups: dict = {}
    for name, values in attributes.items():
        for i, key in enumerate(zip(labels.tolist(), values.tolist())):
            groups.setdefault((name, key), []).append(i)
    twins = max((len(group) for group in groups.values()), default=1)
    depth = min(len(x), max(max(ks), shortlist, twins) + 1)
    flat = faiss.IndexFlatIP(x.shape[1])
    flat.add(x)
    _, deep = flat.search(x, depth)
    counts = np.bincount(labels)
    queries = counts[labels] > 1

    def figures_of(scores: np.ndarray, names: list[str]) -> dict:
        rankings = [_ranking(query, rows[query], scores[query], deep[query]) for query in range(len(x))]
        retrieval: dict = {"n_queries": int(queries.sum())}
        for k in ks:
            hits = [bool(np.any(labels[r[:k]] == labels[q])) for q, r in enumerate(rankings) if queries[q]]
            retrieval[f"recall_at_{k}"] = float(np.mean(hits)) if hits else None
        retrieval["map"] = _mean_average_precision(x, labels, queries, rankings, shortlist)
        retrieval["cross_attribute"] = {
            name: _cross_recall(labels, values, rankings, groups, name) for name, values in attributes.items()
        }
        return {**retrieval, "shortlist": shortlist, "verifiers": names}

    retrieval = figures_of(verified, list(checks))
    positives = int(np.sum(queries))
    scored = {"embedding": best_neighbours(index_dir), "verified": best_verified(rows, verified)}
    image = [name for name, (verifier, _) in checks.items() if getattr(verifier, "needs_image", True) is not False]
    if image and len(image) < len(checks):  # as calibrate: a bare query image is scored by these alone
        image_scores = fused(rows, per, image)
        retrieval["image"] = figures_of(image_scores, image)
        scored["verified_image"] = best_verified(rows, image_scores)
    retrieval["seconds"] = round(time.monotonic() - started, 3)
    curves = {
        kind: thinned(pr_curve(scores, labels[best] == labels, positives)) for kind, (scores, best) in scored.items()
    }
    return retrieval, curves


def _ranking(query: int, short: np.ndarray, scores: np.ndarray, deep: np.ndarray) -> np.ndarray:
    """The shortlist by verified score (ties: embedding order), then the embedding's order."""
    valid = short >= 0
    ranked = short[valid][np.argsort(-scores[valid], kind="stable")]
    taken = set(ranked.tolist())
    rest = [int(j) for j in deep if j >= 0 and j != query and j not in taken]
    return np.array([*ranked.tolist(), *rest], dtype=np.int64)


def _mean_average_precision(x, labels, queries, rankings, shortlist: int, chunk: int = 256) -> float | None:
    """mAP over the full verified ranking: a positive in the shortlist takes its re-ranked place;
    one outside keeps its embedding rank (every shortlisted item ranked above it either way)."""
    members: dict = {}
    for row, label in enumerate(labels.tolist()):
        members.setdefault(label, []).append(row)
    query_ids = np.flatnonzero(queries)
    if not len(query_ids):
        return None
    columns = np.arange(len(x))
    total = 0.0
    for start in range(0, len(query_ids), chunk):
        rows = query_ids[start : start + chunk]
        sims = x[rows] @ x.T
        sims[np.arange(len(rows)), rows] = -np.inf
        for r, row in enumerate(rows):
            placed = {int(j): n + 1 for n, j in enumerate(rankings[row][:shortlist].tolist())}
            scores = sims[r]
            ranks = []
            for p in (m for m in members[labels[row]] if m != row):
                if p in placed:
                    ranks.append(placed[p])
                else:
                    above = np.count_nonzero(scores > scores[p]) + np.count_nonzero(
                        (scores == scores[p]) & (columns < p)
                    )
                    ranks.append(1 + int(above))
            ranks.sort()
            total += float(np.mean(np.arange(1, len(ranks) + 1) / np.array(ranks)))
    return total / len(query_ids)


def _cross_recall(labels, values, rankings, groups, name) -> dict:
    """recall@1 on the verified ranking when same-receipt items with the query's own value are
    excluded (as the embedding's ``cross_attribute``)."""
    by_label: dict = {}
    for i, label in enumerate(labels.tolist()):
        by_label.setdefault(label, set()).add(values[i])
    hits = []
    for row, label in enumerate(labels.tolist()):
        if len(by_label[label]) < 2:
            continue
        excluded = set(groups[(name, (label, values[row]))])
        first = next((int(j) for j in rankings[row] if int(j) not in excluded), None)
        hits.append(first is not None and labels[first] == label)
    return {"recall_at_1": float(np.mean(hits)) if hits else None, "n_queries": len(hits)}
