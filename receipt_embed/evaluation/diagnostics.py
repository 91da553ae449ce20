"""Embedding diagnostics: is the space aligned, uniform, and not collapsed?

- alignment (Wang & Isola 2020): mean squared distance between normalised positives.
- uniformity (Wang & Isola 2020): log mean exp(-2 ||u - v||^2) over all pairs, computed in
  chunks so memory stays O(N x chunk).
- effective rank (Roy & Vetterli 2007): exp of the entropy of the normalised singular
  values; near 1 means collapse to a line.
- per-dimension std of the normalised embeddings: a dimension with std ~0 is dead.
- positive / negative cosine similarity quantiles.
"""

from __future__ import annotations

import math

import numpy as np

from receipt_embed.evaluation.retrieval import l2_normalise

QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


def positive_pairs(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """All unordered pairs (i < j) with the same label."""
    order = np.argsort(labels, kind="stable")
    firsts, seconds = [], []
    start = 0
    sorted_labels = labels[order]
    for end in range(1, len(order) + 1):
        if end == len(order) or sorted_labels[end] != sorted_labels[start]:
            members = np.sort(order[start:end])
            i, j = np.triu_indices(len(members), k=1)
            firsts.append(members[i])
            seconds.append(members[j])
            start = end
    if not firsts:
        return np.zeros(0, int), np.zeros(0, int)
    return np.concatenate(firsts), np.concatenate(seconds)


def uniformity(x: np.ndarray, t: float = 2.0, chunk: int = 2048) -> float:
    """log E_{i<j} exp(-t ||x_i - x_j||^2) for unit vectors, via a chunked log-sum-exp."""
    n = len(x)
    if n < 2:
        return float("nan")
    logs = []
    for start in range(0, n, chunk):
        block = x[start : start + chunk].astype(np.float64)
        sq = np.clip(2.0 - 2.0 * block @ x.T.astype(np.float64), 0.0, None)
        rows = np.arange(start, start + len(block))
        mask = np.arange(n)[None, :] > rows[:, None]  # pairs i < j only
        values = -t * sq[mask]
        if values.size:
            top = values.max()
            logs.append(top + math.log(np.exp(values - top).sum()))
    top = max(logs)
    total = top + math.log(sum(math.exp(v - top) for v in logs))
    return float(total - math.log(n * (n - 1) / 2))


def effective_rank(x: np.ndarray) -> float:
    singular = np.linalg.svd(x.astype(np.float64) - x.mean(axis=0), compute_uv=False)
    p = singular / max(singular.sum(), 1e-12)
    p = p[p > 0]
    return float(np.exp(-(p * np.log(p)).sum()))


def similarity_quantiles(x: np.ndarray, labels: np.ndarray, max_items: int = 2048, seed: int = 0) -> dict:
    """Cosine similarity quantiles of all positive pairs, and of all negative pairs among
    at most ``max_items`` items (a seeded random subset when there are more)."""
    i, j = positive_pairs(labels)
    positives = np.einsum("nd,nd->n", x[i], x[j]) if len(i) else np.zeros(0)
    subset = np.arange(len(x))
    if len(x) > max_items:
        subset = np.sort(np.random.default_rng(seed).choice(len(x), max_items, replace=False))
    sims = x[subset] @ x[subset].T
    upper = np.triu(np.ones_like(sims, dtype=bool), k=1)
    negatives = sims[upper & (labels[subset][:, None] != labels[subset][None, :])]

    def describe(values):
        if not len(values):
            return {"mean": None, **{f"q{int(q * 100):02d}": None for q in QUANTILES}}
        return {
            "mean": float(values.mean()),
            **{f"q{int(q * 100):02d}": float(np.quantile(values, q)) for q in QUANTILES},
        }

    return {"positive": describe(positives), "negative": describe(negatives)}


def embedding_diagnostics(embeddings: np.ndarray, labels, max_items: int | None = None, seed: int = 0) -> dict:
    """All diagnostics; uniformity and effective rank (O(N^2), O(N d^2)) on a seeded subset
    of ``max_items`` items when there are more (alignment and std always use every item)."""
    labels = np.asarray(labels)
    x = l2_normalise(embeddings)
    i, j = positive_pairs(labels)
    alignment = float(((x[i] - x[j]) ** 2).sum(axis=1).mean()) if len(i) else None
    std = x.std(axis=0)
    sample = x
    if max_items is not None and len(x) > max_items:
        sample = x[np.sort(np.random.default_rng(seed).choice(len(x), max_items, replace=False))]
    return {
        "alignment": alignment,
        "uniformity": uniformity(sample),
        "effective_rank": effective_rank(sample),
        "min_dim_std": float(std.min()),
        "mean_dim_std": float(std.mean()),
        "similarity": similarity_quantiles(x, labels),
    }
