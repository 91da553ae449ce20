"""model.whiten: learned whitening of the backbone features, fitted on the training captures after
training and stored in the checkpoint (receipt_embed/models/whitening.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import REPO, builtin_registry, run_cli, train_tiny

from receipt_embed.embedding import embed_paths, embedding_dim, load_model
from receipt_embed.evaluation.retrieval import retrieval_metrics
from receipt_embed.models.whitening import CannotWhiten, Whitening, fit_whitening
from receipt_embed.training.checkpoint import load_checkpoint, save_checkpoint


def _receipts(seed: int, receipts: int = 60, captures: int = 4, dim: int = 24, nuisance: float = 3.0):
    """Receipts a little apart, each capture shifted a lot along a few device directions: the case
    learned whitening is for (a cosine sees mostly the device)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(receipts, dim))
    # 3 orthonormal device directions, the same for every set of receipts (the devices are the same)
    directions = np.linalg.qr(np.random.default_rng(99).normal(size=(dim, 3)))[0].T
    x, labels = [], []
    for r in range(receipts):
        for _ in range(captures):
            shift = nuisance * rng.normal(size=3) @ directions
            x.append(10 + centres[r] * 0.3 + shift + 0.05 * rng.normal(size=dim))
            labels.append(r)
    return np.asarray(x, dtype=np.float32), np.asarray(labels)


def _scatter(x: np.ndarray, labels: np.ndarray, mean: np.ndarray) -> np.ndarray:
    """The within-receipt scatter of L2-normalised, centred features, written out independently."""
    x = x.astype(np.float64)
    z = x / np.linalg.norm(x, axis=1, keepdims=True) - mean
    rows = []
    for label in np.unique(labels):
        group = z[labels == label]
        rows.extend(group - group.mean(axis=0))
    rows = np.asarray(rows)
    return rows.T @ rows / len(rows)


def test_the_projection_makes_the_within_receipt_scatter_the_identity():
    x, labels = _receipts(0)
    mean, projection = fit_whitening(x, labels, dims=24, shrink=0.0)
    np.testing.assert_allclose(projection.T @ _scatter(x, labels, mean) @ projection, np.eye(24), atol=1e-6)
    normalised = x.astype(np.float64) / np.linalg.norm(x.astype(np.float64), axis=1, keepdims=True)
    np.testing.assert_allclose(mean, normalised.mean(axis=0), atol=1e-12)
    spread = np.var((normalised - mean) @ projection, axis=0)
    assert np.all(np.diff(spread) <= 1e-9), "axes come in order of decreasing spread"


def test_whitening_finds_the_captures_a_device_direction_hides():
    x, labels = _receipts(1)
    before = retrieval_metrics(x, labels, ks=(1,), with_map=False)["recall_at_1"]
    mean, projection = fit_whitening(x, labels, dims=24)
    module = Whitening(24)
    module.set(mean, projection)
    held, held_labels = _receipts(2)  # other receipts, fitted on none of them
    after = retrieval_metrics(module(torch.from_numpy(held)).numpy(), held_labels, ks=(1,), with_map=False)
    raw = retrieval_metrics(held, held_labels, ks=(1,), with_map=False)["recall_at_1"]
    assert before < 0.5 and raw < 0.5
    assert after["recall_at_1"] > 0.95


def test_the_module_is_the_identity_until_fitted_and_then_the_formula():
    x = torch.randn(5, 8)
    module = Whitening(8, dims=4)
    assert module(x) is x and module.dim_for(8) == 8
    rng = np.random.default_rng(3)
    mean, projection = rng.normal(size=8), rng.normal(size=(8, 4))
    module.set(mean, projection)
    reference = (x.numpy() / np.linalg.norm(x.numpy(), axis=1, keepdims=True) - mean) @ projection
    reference /= np.linalg.norm(reference, axis=1, keepdims=True)
    np.testing.assert_allclose(module(x).numpy(), reference, atol=1e-5)
    assert module.dim_for(8) == 4
    module.reset()
    assert module(x) is x


def test_receipts_of_one_capture_each_cannot_be_whitened():
    with pytest.raises(CannotWhiten, match="no training receipt has two captures"):
        fit_whitening(np.random.default_rng(0).normal(size=(6, 4)), [0, 1, 2, 3, 4, 5], dims=4)
    with pytest.raises(CannotWhiten, match="same features"):
        fit_whitening(np.ones((6, 4)), [0, 0, 1, 1, 2, 2], dims=4)


@pytest.fixture(scope="module")
def whitened(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("whiten"))


def test_training_whitens_both_checkpoints_and_index_embeds_with_it(whitened, tmp_path):
    dataset, best = whitened
    for name in ("best.pt", "last.pt"):
        weights = load_checkpoint(best.parent / name)["model"]
        assert bool(weights["whitening.fitted"]), name
        assert weights["whitening.projection"].abs().sum() > 0
    loaded = load_model(best, builtin_registry())
    paths = sorted(str(p) for p in (REPO / "data_samples" / "images").iterdir())[:6]
    features = embed_paths(loaded, paths, "backbone")
    assert features.shape == (6, embedding_dim(loaded))
    np.testing.assert_allclose(np.linalg.norm(features, axis=1), 1.0, atol=1e-5)
    loaded.model.whitening.reset()  # the same checkpoint unwhitened gives other features
    assert not np.allclose(embed_paths(loaded, paths, "backbone"), features, atol=1e-3)


def test_a_checkpoint_written_before_model_whiten_existed_loads_without_it(whitened, tmp_path):
    _, best = whitened
    state = load_checkpoint(best)
    state["config"]["model"].pop("whiten")
    state["model"] = {k: v for k, v in state["model"].items() if not k.startswith("whitening.")}
    save_checkpoint(tmp_path / "old.pt", state)
    loaded = load_model(tmp_path / "old.pt", builtin_registry())
    assert loaded.model.whitening is None and loaded.config.model.whiten is False


def test_train_says_it_whitened_and_whiten_false_leaves_the_features_raw(tmp_path):
    from conftest import TINY_TRAINING

    run_cli("ingest", REPO / "data_samples", "--out", tmp_path / "ds", "-q")
    sets = [f"--set={item}" for item in TINY_TRAINING]
    said = run_cli("train", "--data", tmp_path / "ds", "--out", tmp_path / "run", *sets)
    assert said.returncode == 0, said.stderr
    assert "whitened the backbone features of best.pt, last.pt on" in said.stderr
    assert "training captures of" in said.stderr and "val recall@1" in said.stderr
    raw = run_cli("train", "--data", tmp_path / "ds", "--out", tmp_path / "raw", *sets, "--set=model.whiten=false")
    assert raw.returncode == 0 and "whitened" not in raw.stderr, raw.stderr
    assert not any(k.startswith("whitening.") for k in load_checkpoint(tmp_path / "raw/checkpoints/best.pt")["model"])


def test_a_fit_is_reused_only_for_the_same_weights(whitened):
    """best.pt and last.pt of one epoch share a fit; any other weight, however small the change, gets its own."""
    from receipt_embed.training.whitening import _weights_digest

    _, best = whitened
    weights = load_checkpoint(best)["model"]
    same = {k: v.clone() for k, v in weights.items()}
    same["whitening.projection"] = torch.zeros_like(same["whitening.projection"])  # the fit itself is not the key
    assert _weights_digest(same) == _weights_digest(weights)
    name = next(k for k, v in weights.items() if v.is_floating_point() and not k.startswith("whitening."))
    changed = {k: v.clone() for k, v in weights.items()}
    first = changed[name].view(-1)[:1]
    first.copy_(torch.nextafter(first, first + 1))  # one float32 step
    assert _weights_digest(changed) != _weights_digest(weights)
