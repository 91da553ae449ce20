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


@pytest.mark.parametrize("name", ["align_uniform", "vicreg", "thermal_paper", "same_merchant"])
def test_train_uses_the_example_from_the_repository_root(cli, tmp_path, name):
    from receipt_embed.config import load_config
    from receipt_embed.ingest import ingest

    ingest(REPO / "data_samples", tmp_path / "ds", load_config().ingest)
    choice = {"thermal_paper": f"augment.preset={name}", "same_merchant": f"sampler.name={name}"}.get(
        name, f"loss.name={name}"
    )
    result = cli(
        "train",
        "--data",
        tmp_path / "ds",
        "--out",
        tmp_path / "run",
        "-q",
        "--set",
        choice,
        "--set",
        "train.epochs=1",
        "--set",
        "data.image_size=[64,32]",
        "--set",
        "train.precision=fp32",
        "--set",
        "train.batch_size=8",
        "--set",
        "model.head_hidden=64",
        "--set",
        "model.head_dim=32",
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    line = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert np.isfinite(line["loss"])
    if name == "same_merchant":
        assert line["sampler"]["same_group_negatives"] > 2 * line["sampler"]["same_group_negatives_random"]


def test_thermal_paper_preset_keeps_image_rules_and_is_reproducible(registry):
    from PIL import Image

    info = registry.plugins[registry.get("augmentation", "thermal_paper").plugin]
    assert info.source == "folder"
    image = np.asarray(
        Image.open(REPO / "data_samples" / "images" / "r0000_phone_a.jpg").convert("RGB").resize((90, 170))
    )
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


def _sample_rows():
    import csv

    rows = list(csv.DictReader(open(REPO / "data_samples" / "manifest.csv")))
    receipts = sorted({row["receipt_id"] for row in rows})
    return rows, [receipts.index(row["receipt_id"]) for row in rows]


def test_same_merchant_sampler_fills_batches_with_one_merchant(registry):
    from receipt_embed.sampling import build_sampler
    from receipt_embed.testing import check_sampler

    rows, labels = _sample_rows()  # 60 receipts x 3 captures, 8 merchants
    sampler = build_sampler(registry, "same_merchant", labels, rows, 8, 0, {})
    check_sampler(sampler, labels)
    merchant = {label: row["merchant"] for label, row in zip(labels, rows)}
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == 8 and sampler.stats["tail_filled"] == 4
        receipts = []
        same = pairs = 0
        for batch in batches:
            first, second = batch[:8], batch[8:]
            # two-view layout: row i and row i + 8 are two different captures of one receipt
            assert [labels[i] for i in first] == [labels[i] for i in second]
            assert all(a != b for a, b in zip(first, second))
            batch_receipts = [labels[i] for i in first]
            assert len(set(batch_receipts)) == 8
            receipts += batch_receipts
            for x in range(8):
                for y in range(x + 1, 8):
                    pairs += 1
                    same += merchant[batch_receipts[x]] == merchant[batch_receipts[y]]
        assert set(receipts) == set(labels) and len(receipts) == 60 + 4  # each receipt, plus the tail fill
        assert sampler.stats["same_group_negatives"] == pytest.approx(same / pairs, abs=1e-4)
        everyone = sorted(set(labels))
        all_same = sum(merchant[a] == merchant[b] for i, a in enumerate(everyone) for b in everyone[i + 1 :])
        assert sampler.stats["same_group_negatives_random"] == pytest.approx(all_same / (60 * 59 / 2), abs=1e-4)
        assert same / pairs > 4 * all_same / (60 * 59 / 2)  # ~0.5 against ~0.11 at random


def test_same_merchant_sampler_with_k_gives_k_captures_of_each_same_merchant_receipt(registry):
    """`k` (issue 15): P receipts x K captures, the pk layout SupCon takes, still grouped by merchant."""
    from receipt_embed.sampling import build_sampler
    from receipt_embed.testing import check_sampler

    rows, labels = _sample_rows()  # 60 receipts x 3 captures, 8 merchants
    rows, labels = rows[1:], labels[1:]  # receipt r0000 keeps two captures
    sampler = build_sampler(registry, "same_merchant", labels, rows, 8, 0, {"k": 3})
    check_sampler(sampler, labels)
    assert sampler.batch_layout == "any"
    merchant = {label: row["merchant"] for label, row in zip(labels, rows)}
    batches = list(sampler)
    seen = []
    for batch in batches:
        assert len(batch) == 24
        receipts = [labels[i] for i in batch[::3]]
        assert len(set(receipts)) == 8
        for slot, receipt in enumerate(receipts):
            block = batch[3 * slot : 3 * slot + 3]
            assert {labels[i] for i in block} == {receipt}
            assert len(set(block)) == (2 if receipt == labels[0] else 3)
        seen += receipts
    assert set(seen) == set(labels) and sampler.stats["extra_views"] == seen.count(labels[0])
    assert sampler.stats["same_group_negatives"] > 4 * sampler.stats["same_group_negatives_random"]
    assert {merchant[r] for r in seen} == set(merchant.values())
    with pytest.raises(ValueError, match="k must be at least 2 captures per receipt, got 1"):
        build_sampler(registry, "same_merchant", labels, rows, 8, 0, {"k": 1})
    # attack round 17 G1: a k in the millions built batches until memory ran out
    with pytest.raises(ValueError, match=r"sampler.params.k must be at most 64 captures per receipt, got 100000000$"):
        build_sampler(registry, "same_merchant", labels, rows, 8, 0, {"k": 100_000_000})


def test_same_merchant_sampler_errors_name_the_row_or_receipt(registry):
    from receipt_embed.sampling import build_sampler

    rows, labels = _sample_rows()
    with pytest.raises(
        ValueError,
        match=r"column 'merchnt' is missing from manifest row 1 \(images/r0000_phone_a.jpg\) "
        r"\(did you mean 'merchant'\?\)",
    ):
        build_sampler(registry, "same_merchant", labels, rows, 8, 0, {"column": "merchnt"})
    with pytest.raises(ValueError, match="column 'device' varies within receipt 'r0000'"):
        build_sampler(registry, "same_merchant", labels, rows, 8, 0, {"column": "device"})
    # attack round 22 MB9: values were quoted with repr, so an ESC read as \\x1b once the message was shown
    escaped = [{**row, "device": f"\x1b[31m{row['device']}"} for row in rows]
    with pytest.raises(ValueError) as varies:
        build_sampler(registry, "same_merchant", labels, escaped, 8, 0, {"column": "device"})
    assert "'\x1b[31m" in str(varies.value) and "\\x1b" not in str(varies.value)
    blank = [{**row, "merchant": "" if row["receipt_id"] in ("r0000", "r0001") else row["merchant"]} for row in rows]
    sampler = build_sampler(registry, "same_merchant", labels, blank, 8, 0, {})
    list(sampler)
    assert sampler.stats["ungrouped"] == 2


def test_hubness_check_matches_a_reference_and_flags_a_hub(registry):
    from scipy.stats import skew

    from receipt_embed.audit.checks import AuditContext

    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 16)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    items = [{"receipt_id": f"r{i // 2}", "device": "d"} for i in range(200)]
    check = registry.create("audit_check", "hubness")
    result = check(AuditContext(x, items, np.arange(200) // 2, ["device"], 10, Path(".")))
    similarity = x @ x.T
    np.fill_diagonal(similarity, -np.inf)
    counts = np.bincount(np.argsort(-similarity, axis=1)[:, :10].ravel(), minlength=200)
    assert result["figures"]["skewness"] == pytest.approx(skew(counts), abs=1e-9)
    assert result["figures"]["max_k_occurrence"] == counts.max()
    assert result["figures"]["anti_hub_share"] == pytest.approx(np.mean(counts == 0))
    assert not result["flagged"] and hasattr(result["plot"], "savefig")

    # a ring at 60 degrees around a direction c, plus c itself: c (similarity 0.5 to all) is
    # nearer to every ring point than the ring points (about 0.25) are to each other
    d = 64
    centre = np.eye(d)[0]
    u = rng.normal(size=(200, d))
    u[:, 0] = 0
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    hubby = np.cos(np.pi / 3) * centre + np.sin(np.pi / 3) * u
    hubby[0] = centre
    result = check(AuditContext(hubby.astype(np.float32), items, np.arange(200) // 2, ["device"], 10, Path(".")))
    assert result["flagged"] and result["figures"]["max_k_occurrence"] == 199 and result["figures"]["skewness"] > 3
    assert result["figures"]["max_k_occurrence_receipt"] == "r0"


def test_metrics_csv_mirrors_metrics_jsonl_through_on_epoch_end(tmp_path):
    import csv

    from conftest import TINY_TRAINING

    from receipt_embed.config import load_config
    from receipt_embed.ingest import ingest
    from receipt_embed.training.trainer import train

    ingest(REPO / "data_samples", tmp_path / "ds", load_config().ingest)
    registry = registry_with_examples()
    train(
        load_config(overrides=[*TINY_TRAINING, "train.epochs=2"]),
        tmp_path / "ds",
        tmp_path / "run",
        registry,
        progress=False,
        log=lambda m: None,
    )
    lines = [json.loads(t) for t in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    table = list(csv.DictReader(open(tmp_path / "run" / "metrics.csv")))
    assert [int(r["epoch"]) for r in table] == [1, 2]
    for row, line in zip(table, lines):
        assert float(row["loss"]) == line["loss"]
        assert float(row["val.head.recall_at_1"]) == line["val"]["head"]["recall_at_1"]
        assert float(row["sampler.tail_filled"]) == line["sampler"]["tail_filled"]
