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
