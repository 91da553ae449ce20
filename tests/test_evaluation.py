"""Retrieval figures and diagnostics against brute-force numpy computations."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from receipt_embed.evaluation.diagnostics import embedding_diagnostics, positive_pairs, uniformity
from receipt_embed.evaluation.retrieval import retrieval_metrics


def _brute_force(x, labels, k):
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    sims = x @ x.T
    hits, aps = [], []
    for q in range(len(x)):
        if (labels == labels[q]).sum() < 2:
            continue
        others = [i for i in range(len(x)) if i != q]
        ranked = sorted(others, key=lambda i: -sims[q, i])
        relevant = [labels[i] == labels[q] for i in ranked]
        hits.append(any(relevant[:k]))
        found, precisions = 0, []
        for rank, rel in enumerate(relevant, start=1):
            if rel:
                found += 1
                precisions.append(found / rank)
        aps.append(np.mean(precisions))
    return np.mean(hits), np.mean(aps)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_recall_and_map_match_brute_force(seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 15, 60)
    centres = rng.normal(size=(15, 8))
    x = centres[labels] + rng.normal(scale=0.9, size=(60, 8))
    result = retrieval_metrics(x, labels, ks=(1, 5, 10))
    for k in (1, 5, 10):
        assert result[f"recall_at_{k}"] == pytest.approx(_brute_force(x, labels, k)[0], abs=1e-12)
    assert result["map"] == pytest.approx(_brute_force(x, labels, 1)[1], abs=1e-6)
    singles = sum((labels == l).sum() == 1 for l in np.unique(labels))
    assert result["n_queries"] == 60 - singles


def test_perfect_and_no_query_cases():
    labels = np.array([0, 0, 1, 1, 2])
    x = np.array([[1, 0], [1, 0.01], [0, 1], [0.01, 1], [-1, -1]], dtype=float)
    result = retrieval_metrics(x, labels)
    assert result["recall_at_1"] == 1.0 and result["map"] == 1.0 and result["n_queries"] == 4
    assert retrieval_metrics(x[:1], labels[:1])["recall_at_1"] is None


def test_diagnostics_against_definitions():
    rng = np.random.default_rng(0)
    labels = np.array([0, 0, 0, 1, 1, 2, 3, 3])
    x = rng.normal(size=(8, 5))
    d = embedding_diagnostics(x, labels)
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    pairs = [(i, j) for i, j in itertools.combinations(range(8), 2)]
    pos = [(i, j) for i, j in pairs if labels[i] == labels[j]]
    assert sorted(zip(*positive_pairs(labels))) == pos
    assert d["alignment"] == pytest.approx(np.mean([np.sum((u[i] - u[j]) ** 2) for i, j in pos]))
    expected_uniformity = math.log(np.mean([math.exp(-2 * np.sum((u[i] - u[j]) ** 2)) for i, j in pairs]))
    assert d["uniformity"] == pytest.approx(expected_uniformity, rel=1e-6)
    assert uniformity(u, chunk=3) == pytest.approx(expected_uniformity, rel=1e-6)
    s = np.linalg.svd(u - u.mean(0), compute_uv=False)
    p = s / s.sum()
    assert d["effective_rank"] == pytest.approx(math.exp(-(p * np.log(p)).sum()))
    assert d["min_dim_std"] == pytest.approx(u.std(0).min())
    assert d["similarity"]["positive"]["mean"] == pytest.approx(np.mean([u[i] @ u[j] for i, j in pos]))
    neg = [u[i] @ u[j] for i, j in pairs if labels[i] != labels[j]]
    assert d["similarity"]["negative"]["mean"] == pytest.approx(np.mean(neg), rel=1e-6)
    assert d["similarity"]["negative"]["q50"] == pytest.approx(np.quantile(neg, 0.5), rel=1e-6)


def test_collapse_is_visible():
    rng = np.random.default_rng(1)
    collapsed = np.outer(rng.normal(size=50), rng.normal(size=16)) + 1e-6 * rng.normal(size=(50, 16))
    spread = rng.normal(size=(50, 16))
    labels = np.repeat(np.arange(25), 2)
    assert embedding_diagnostics(collapsed, labels)["effective_rank"] < 1.5
    assert embedding_diagnostics(spread, labels)["effective_rank"] > 10


def test_attribute_lift_against_brute_force():
    from receipt_embed.evaluation.shortcuts import attribute_lift

    rng = np.random.default_rng(3)
    labels = np.repeat(np.arange(20), 3)
    devices = np.tile(np.arange(3), 20)
    for alpha, expect_high in ((0.0, False), (3.0, True)):
        x = rng.normal(size=(20, 16))[labels] * 0.5 + alpha * np.eye(16)[devices] + rng.normal(size=(60, 16)) * 0.3
        result = attribute_lift(x, labels, devices, k=5)
        u = x / np.linalg.norm(x, axis=1, keepdims=True)
        agree, base = [], []
        for i in range(60):
            others = [j for j in np.argsort(-(u @ u[i]), kind="stable") if labels[j] != labels[i]][:5]
            agree.append(np.mean(devices[others] == devices[i]))
            pool = [j for j in range(60) if labels[j] != labels[i]]
            base.append(np.mean(devices[pool] == devices[i]))
        assert result["knn_agreement"] == pytest.approx(np.mean(agree))
        assert result["base_rate"] == pytest.approx(np.mean(base))
        assert (result["lift"] > 2.0) == expect_high


def _sims(x):
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    return x @ x.T


def _nearest(sims, q, allowed):
    candidates = [i for i in range(len(sims)) if i != q and allowed(i)]
    return max(candidates, key=lambda i: sims[q, i])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_breakdown_figures_match_a_loop_over_queries(seed, monkeypatch):
    """Cross-device recall, sibling figures and recall of a query subset, against plain loops
    (the chunked code runs with chunks of 7 rows so blocks split the queries)."""
    import receipt_embed.evaluation.breakdown as breakdown

    monkeypatch.setattr(breakdown, "CHUNK", 7)
    rng = np.random.default_rng(seed)
    n = 60
    labels = rng.integers(0, 22, n)
    devices = rng.choice(["phone", "scan", "cam"], n)
    shops = rng.choice(["a", "b", "c", ""], n)
    shops = np.array([shops[labels[i] % n] for i in range(n)], dtype=object)  # a receipt has one shop
    x = rng.normal(size=(n, 6)) + 1.5 * np.eye(22)[labels][:, :6]
    sims = _sims(x)
    has_positive = [sum(labels == labels[q]) > 1 for q in range(n)]

    cross = [q for q in range(n) if len(set(devices[labels == labels[q]])) > 1]
    expected = np.mean([labels[_nearest(sims, q, lambda i, q=q: devices[i] != devices[q])] == labels[q] for q in cross])
    assert breakdown.cross_device_recall_at_1(x, labels, devices) == pytest.approx(expected)

    subset = devices == "cam"
    chosen = [q for q in range(n) if has_positive[q] and subset[q]]
    expected = np.mean([labels[_nearest(sims, q, lambda i: True)] == labels[q] for q in chosen])
    assert breakdown.recall_at_1_of(x, labels, subset) == pytest.approx(expected)

    queries = [q for q in range(n) if has_positive[q]]
    above = misses = sibling_misses = 0
    for q in queries:
        true = max(sims[q, i] for i in range(n) if i != q and labels[i] == labels[q])
        siblings = [sims[q, i] for i in range(n) if labels[i] != labels[q] and shops[i] == shops[q] and shops[q]]
        above += bool(siblings) and max(siblings) > true
        nearest = _nearest(sims, q, lambda i: True)
        if labels[nearest] != labels[q]:
            misses += 1
            sibling_misses += bool(shops[q]) and shops[nearest] == shops[q]
    figures = breakdown.sibling_figures(x, labels, shops)
    assert figures["queries"] == len(queries) and figures["misses"] == misses > 0
    assert figures["sibling_above_true"] == pytest.approx(above / len(queries))
    assert figures["sibling_share_of_misses"] == pytest.approx(sibling_misses / misses)


def test_breakdown_edge_cases():
    from receipt_embed.evaluation.breakdown import cross_device_recall_at_1, recall_at_1_of, sibling_figures

    x = np.eye(4, dtype=np.float32)
    labels = np.array([0, 0, 1, 2])
    assert cross_device_recall_at_1(x, labels, ["d"] * 4) is None, "no receipt was captured by two devices"
    assert recall_at_1_of(x, labels, np.array([False, False, True, True])) is None
    perfect = np.array([[1, 0], [1, 0], [0, 1], [0, 1]], dtype=np.float32)
    assert sibling_figures(perfect, [0, 0, 1, 1], ["s"] * 4)["sibling_share_of_misses"] is None
    assert sibling_figures(perfect, [0, 0, 1, 1], ["s"] * 4)["sibling_above_true"] == 0.0
