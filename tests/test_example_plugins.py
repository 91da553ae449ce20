"""The worked example plugins in plugins/: loaded by folder discovery, checked against
independent float64 references, and usable by `train`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import registry_with_examples

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def registry():
    return registry_with_examples()


def _batch(b=12, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(2 * b, d, generator=g, dtype=torch.float64)
    return z, torch.arange(b).repeat(2)


def _uniformity_reference(x: np.ndarray, t=2.0) -> float:
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    i, j = np.triu_indices(len(x), k=1)
    return float(np.log(np.mean(np.exp(-t * ((x[i] - x[j]) ** 2).sum(axis=1)))))


def test_examples_load_through_folder_discovery(registry):
    for name in ("align_uniform", "vicreg"):
        info = registry.plugins[registry.get("loss", name).plugin]
        assert info.source == "folder" and Path(info.location) == REPO / "plugins" / f"{name}.py"


def test_align_uniform_matches_a_reference_and_chunks_agree(registry):
    z, labels = _batch()
    loss = registry.create("loss", "align_uniform", temperature=0.1, lam=0.7)
    value = loss(z, labels)
    x, y = z[:12].numpy(), z[12:].numpy()
    xn, yn = x / np.linalg.norm(x, axis=1, keepdims=True), y / np.linalg.norm(y, axis=1, keepdims=True)
    align = np.mean(np.sum((xn - yn) ** 2, axis=1))
    expected = align + 0.7 * (_uniformity_reference(x) + _uniformity_reference(y)) / 2
    assert value.item() == pytest.approx(expected, abs=1e-5)

    # the blocked O(N x chunk) path equals torch.pdist, values and gradients
    big = torch.randn(2 * 150, 16, dtype=torch.float64, requires_grad=True)
    labels = torch.arange(150).repeat(2)
    dense = registry.create("loss", "align_uniform", chunk=4096)(big, labels)
    (g_dense,) = torch.autograd.grad(dense, big)
    blocked = registry.create("loss", "align_uniform", chunk=37)(big, labels)
    (g_blocked,) = torch.autograd.grad(blocked, big)
    assert blocked.item() == pytest.approx(dense.item(), abs=1e-5)
    assert torch.allclose(g_blocked.double(), g_dense.double(), atol=1e-5)


def test_vicreg_matches_a_reference(registry):
    z, labels = _batch(b=16, d=6, seed=1)
    value = registry.create("loss", "vicreg", temperature=0.1)(z, labels).item()
    x, y = z[:16].numpy(), z[16:].numpy()

    def var(a):
        return np.mean(np.maximum(0, 1 - np.sqrt(a.var(axis=0, ddof=1) + 1e-4)))

    def cov(a):
        c = np.cov(a, rowvar=False)
        return (np.sum(c**2) - np.sum(np.diag(c) ** 2)) / a.shape[1]

    expected = 25 * np.mean((x - y) ** 2) + 25 * (var(x) + var(y)) + 1 * (cov(x) + cov(y))
    assert value == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("name", ["align_uniform", "vicreg"])
def test_examples_reject_other_layouts_and_pass_gradients(registry, name):
    z, labels = _batch()
    z.requires_grad_(True)
    loss = registry.create("loss", name)
    (grad,) = torch.autograd.grad(loss(z, labels), z)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    with pytest.raises(ValueError, match="two-view"):
        loss(z, torch.arange(24))


@pytest.mark.parametrize("name", ["align_uniform", "vicreg", "thermal_paper"])
def test_train_uses_the_example_from_the_repository_root(cli, tmp_path, name):
    from receipt_embed.config import load_config
    from receipt_embed.ingest import ingest

    ingest(REPO / "data_samples", tmp_path / "ds", load_config().ingest)
    choice = f"augment.preset={name}" if name == "thermal_paper" else f"loss.name={name}"
    result = cli("train", "--data", tmp_path / "ds", "--out", tmp_path / "run", "-q", "--set", choice,
                 "--set", "train.epochs=1", "--set", "data.image_size=[64,32]", "--set", "train.batch_size=8",
                 "--set", "model.head_hidden=64", "--set", "model.head_dim=32", cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    line = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert np.isfinite(line["loss"])


def test_thermal_paper_preset_keeps_image_rules_and_is_reproducible(registry):
    from PIL import Image

    info = registry.plugins[registry.get("augmentation", "thermal_paper").plugin]
    assert info.source == "folder"
    image = np.asarray(Image.open(REPO / "data_samples" / "images" / "r0000_phone_a.jpg").convert("RGB").resize((90, 170)))
    transform = registry.create("augmentation", "thermal_paper", image_size=(128, 64), fade=1.0, crumple=1.0)
    outputs = []
    for seed in (5, 5, 6):
        transform.set_random_seed(seed)
        outputs.append(transform(image=image)["image"])
    assert all(o.shape == (128, 64, 3) and o.dtype == np.uint8 for o in outputs)
    assert np.array_equal(outputs[0], outputs[1]) and not np.array_equal(outputs[0], outputs[2])
    # warped-in borders are white paper, not coloured
    plain = registry.create("augmentation", "thermal_paper", image_size=(128, 64), fade=0.0, crumple=1.0)
    plain.set_random_seed(1)
    out = plain(image=np.full((170, 90, 3), 255, np.uint8))["image"].astype(int)
    assert np.abs(out[..., 0] - out[..., 2]).max() < 60
    with pytest.raises(ValueError, match="fade must be in"):
        registry.create("augmentation", "thermal_paper", image_size=(128, 64), fade=2.0)
