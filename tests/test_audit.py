"""audit-shortcuts: figures where the truth is known, end to end on data_samples, the report."""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import browser_page, train_tiny
from PIL import Image

from receipt_embed.audit.figures import FlagRule, audit_figures

REPO = Path(__file__).resolve().parents[1]


def synthetic(alpha: float, receipts: int = 120, devices: int = 3, dim: int = 48, seed: int = 0, shuffle: bool = False):
    """identity component + alpha x device component + capture noise; labels known."""
    rng = np.random.default_rng(seed)
    identity = rng.normal(size=(receipts, dim))
    device = rng.normal(size=(devices, dim))
    labels = np.repeat(np.arange(receipts), devices)
    dev = np.tile(np.arange(devices), receipts)
    x = identity[labels] + alpha * device[dev] + 0.6 * rng.normal(size=(len(labels), dim))
    shown = rng.permutation(dev) if shuffle else dev
    items = [{"receipt_id": f"r{l}", "device": f"d{d}"} for l, d in zip(labels, shown)]
    return x, items, labels, shown


def test_shortcut_figures_rise_with_the_device_component():
    lifts, probes = [], []
    for alpha in (0.0, 0.4, 0.8, 1.6):
        x, items, _, _ = synthetic(alpha)
        figures = audit_figures(x, items, ["device"])
        device = figures["shortcuts"]["device"]
        lifts.append(device["lift"])
        probes.append(device["probe_accuracy"])
        if alpha == 0.0:
            assert not device["flagged"] and figures["flagged"] == []
            assert device["lift"] == pytest.approx(1.0, abs=0.15)
            assert device["probe_accuracy"] < 0.6 and device["probe_chance"] == pytest.approx(1 / 3, abs=0.1)
        if alpha == 1.6:
            assert device["flagged"] and figures["flagged"] == ["device"] and device["reasons"]
    assert lifts == sorted(lifts) and lifts[-1] > 2.0
    assert probes[-1] > 0.95 and probes[-1] > probes[0]


def test_shuffled_device_labels_are_not_flagged():
    x, items, _, _ = synthetic(1.6, shuffle=True)
    device = audit_figures(x, items, ["device"])["shortcuts"]["device"]
    assert not device["flagged"] and device["lift"] == pytest.approx(1.0, abs=0.2)


def test_flag_rule_is_configurable():
    x, items, _, _ = synthetic(0.4)
    loose = audit_figures(x, items, ["device"], rule=FlagRule(max_lift=50, max_probe_gain=1.0))
    strict = audit_figures(x, items, ["device"], rule=FlagRule(max_lift=1.0, max_probe_gain=0.0))
    assert not loose["shortcuts"]["device"]["flagged"] and strict["shortcuts"]["device"]["flagged"]


def _brute_force(x, labels, values):
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    sims = x.astype(np.float64) @ x.T.astype(np.float64)
    np.fill_diagonal(sims, -np.inf)
    order = np.argsort(-sims, axis=1, kind="stable")
    queries = [i for i in range(len(x)) if (labels == labels[i]).sum() > 1]
    recall = {k: np.mean([(labels[order[i, :k]] == labels[i]).any() for i in queries]) for k in (1, 5, 10)}
    aps = []
    for i in queries:
        relevant = labels[order[i, :-1]] == labels[i]
        hits = np.cumsum(relevant)
        aps.append(np.sum(hits[relevant] / (np.flatnonzero(relevant) + 1)) / relevant.sum())
    cross, cross_queries = [], 0
    for i in range(len(x)):
        others = (labels == labels[i]) & (values != values[i])
        if not others.any():
            continue
        cross_queries += 1
        allowed = ~((labels == labels[i]) & (values == values[i]))
        allowed[i] = False
        best = np.flatnonzero(allowed)[np.argmax(sims[i, allowed])]
        cross.append(labels[best] == labels[i])
    upper = np.triu(np.ones_like(sims, dtype=bool), 1)
    same = labels[:, None] == labels[None, :]
    same_value = values[:, None] == values[None, :]
    return {
        "recall": recall,
        "map": np.mean(aps),
        "cross": np.mean(cross),
        "cross_queries": cross_queries,
        "positive_mean": sims[upper & same].mean(),
        "negative_mean": sims[upper & ~same].mean(),
        "same_attr_negative_mean": sims[upper & ~same & same_value].mean(),
        "cross_attr_negative_mean": sims[upper & ~same & ~same_value].mean(),
        "alignment": np.mean([np.sum((x[i] - x[j]) ** 2) for i, j in zip(*np.nonzero(upper & same))]),
    }


def test_retrieval_and_similarity_figures_match_brute_force():
    x, items, labels, dev = synthetic(0.9, receipts=80, seed=3)
    # uneven identities: some receipts lose captures, one has a single capture
    keep = np.ones(len(items), bool)
    keep[[1, 2, 4, 10, 11]] = False
    x, labels, dev = x[keep], labels[keep], dev[keep]
    items = [item for item, k in zip(items, keep) if k]
    figures = audit_figures(x, items, ["device"])
    truth = _brute_force(x, labels, dev)
    retrieval = figures["retrieval"]
    for k in (1, 5, 10):
        assert retrieval[f"recall_at_{k}"] == pytest.approx(truth["recall"][k], abs=1e-9)
    assert retrieval["map"] == pytest.approx(truth["map"], abs=1e-6)
    assert retrieval["cross_attribute"]["device"]["recall_at_1"] == pytest.approx(truth["cross"], abs=1e-9)
    assert retrieval["cross_attribute"]["device"]["n_queries"] == truth["cross_queries"]
    similarity = figures["similarity"]
    for key in ("positive_mean", "negative_mean", "same_attr_negative_mean", "cross_attr_negative_mean"):
        assert similarity[key] == pytest.approx(truth[key], abs=1e-5), key
    assert figures["diagnostics"]["alignment"] == pytest.approx(truth["alignment"], abs=1e-5)
    assert {"uniformity", "effective_rank", "min_dim_std"} <= set(figures["diagnostics"])
    assert figures["n_items"] == len(items) and figures["n_identities"] == len(set(labels))


def test_missing_attribute_is_named():
    x, items, _, _ = synthetic(0.0, receipts=10)
    items[4] = {"receipt_id": items[4]["receipt_id"], "path": "img4.jpg"}
    items[6]["device"] = ""
    with pytest.raises(ValueError, match="attribute 'device' is empty or absent for 2 of 30 items, first img4.jpg"):
        audit_figures(x, items, ["device"])


def test_an_empty_or_single_valued_context_attribute_is_listed_as_not_tested():
    """Issue 16 item 6: a context column that is empty (for every item, or for some: context is
    never flagged) or single-valued is not tested and says why; the audit itself runs."""
    x, items, _, _ = synthetic(0.0, receipts=10)
    for i, item in enumerate(items):
        item["merchant"], item["shop"], item["note"] = "", "ONE", "" if i == 3 else f"n{i % 3}"
    figures = audit_figures(x, items, ["device"], context=("merchant", "shop", "note"))
    assert figures["untestable"] == {
        "merchant": "it is empty for every item",
        "shop": "it has a single value ('ONE')",
        "note": "it is empty or absent for 1 of 30 items, first item 3",
    }
    assert set(figures["shortcuts"]) == {"device"}
    with pytest.raises(ValueError, match="attribute 'note' is empty or absent for 1 of 30 items"):
        audit_figures(x, items, ["device", "note"])  # an audited attribute is never silently partial
    assert audit_figures(x, items, ["merchant"])["untestable"] == {"merchant": "it is empty for every item"}


@pytest.fixture(scope="module")
def indexes(tmp_path_factory):
    """An index from a trained checkpoint and one from raw pixels, both of data_samples/."""
    from conftest import run_cli

    from receipt_embed.data.dataset_dir import load_dataset_dir
    from receipt_embed.images import load_resized

    base = tmp_path_factory.mktemp("audit")
    train_tiny(base)
    result = run_cli(
        "index",
        "--checkpoint",
        base / "run" / "checkpoints" / "best.pt",
        "--data",
        base / "dataset",
        "--out",
        base / "trained",
        "-q",
    )
    assert result.returncode == 0, result.stderr
    rows = load_dataset_dir(base / "dataset")
    pixels = np.stack([load_resized(row["path"], (48, 24)).mean(axis=2).ravel() for row in rows]).astype(np.float32)
    np.save(base / "pixels.npy", pixels - pixels.mean(axis=1, keepdims=True))
    result = run_cli(
        "index", "--embeddings", base / "pixels.npy", "--manifest", base / "dataset", "--out", base / "pixels", "-q"
    )
    assert result.returncode == 0, result.stderr
    return base


def test_audit_end_to_end_from_a_checkpoint(cli, indexes):
    out = indexes / "report"
    result = cli(
        "audit-shortcuts", indexes / "trained", "--attribute", "device", "--context-attribute", "merchant", "--out", out
    )
    assert result.returncode == 0, result.stderr
    audit = json.loads((out / "audit.json").read_text())
    assert audit["n_items"] == 180 and audit["n_identities"] == 60
    assert {"recall_at_1", "recall_at_5", "recall_at_10", "map", "cross_attribute"} <= set(audit["retrieval"])
    assert set(audit["retrieval"]["cross_attribute"]) == {"device", "merchant"}
    # merchant never varies within a receipt, so no query has a cross-merchant positive
    assert audit["retrieval"]["cross_attribute"]["merchant"] == {"recall_at_1": None, "n_queries": 0}
    for attribute in ("device", "merchant"):
        assert {
            "knn_agreement",
            "base_rate",
            "lift",
            "lift_z",
            "probe_accuracy",
            "probe_chance",
            "probe_gain",
            "flagged",
            "status",
        } <= set(audit["shortcuts"][attribute])
    assert audit["shortcuts"]["merchant"]["status"] == "context" and not audit["shortcuts"]["merchant"]["flagged"]
    assert "merchant (context, never flagged)" in result.stdout
    assert "NaN" not in (out / "audit.json").read_text()
    assert {"positive_mean", "negative_mean", "same_attr_negative_mean", "cross_attr_negative_mean"} <= set(
        audit["similarity"]
    )
    assert {"alignment", "uniformity", "effective_rank", "min_dim_std"} <= set(audit["diagnostics"])
    assert result.stdout.splitlines()[0].startswith(("No shortcut flagged", "SHORTCUT:"))
    assert "cross-device recall@1" in result.stdout and "audit.html" in result.stdout
    assert "no receipt has captures with different merchant values" in result.stdout

    html = (out / "audit.html").read_text()
    assert 'id="verdict"' in html and "Worst retrieval failures" in html
    assert not re.search(r'src="(?!data:)', html)  # self-contained: every image inlined
    images = re.findall(r'src="data:image/(png|jpeg);base64,([^"]+)"', html)
    assert len(images) >= 6  # agreement bars, 2 histograms, 3 projections, plus thumbnails
    for _, data in images:
        with Image.open(io.BytesIO(base64.b64decode(data))) as image:
            image.load()
            assert image.width > 20 and image.height > 20


def test_raw_pixels_come_out_shortcut_heavy(cli, indexes):
    result = cli("audit-shortcuts", indexes / "pixels", "--out", indexes / "pixels_report", "--fail-on-shortcut")
    assert result.returncode == 1, result.stdout + result.stderr
    audit = json.loads((indexes / "pixels_report" / "audit.json").read_text())
    device = audit["shortcuts"]["device"]
    assert device["flagged"] and device["lift"] > 1.5 and audit["flagged"] == ["device"]
    assert result.stdout.startswith("SHORTCUT: device")
    assert "external embeddings" in (indexes / "pixels_report" / "audit.html").read_text()


def test_audit_input_errors(cli, indexes, tmp_path):
    result = cli("audit-shortcuts", indexes / "trained", "--attribute", "devcie", "--out", tmp_path / "r")
    assert result.returncode == 2 and "'devcie' is not a column" in result.stderr and "device" in result.stderr
    assert "did you mean 'device'" in result.stderr
    result = cli("audit-shortcuts", tmp_path / "nothing")
    assert result.returncode == 2 and "does not exist" in result.stderr
    result = cli("audit-shortcuts", indexes / "trained", "--attribute", "receipt_id", "--out", tmp_path / "r")
    assert result.returncode == 2 and "receipt_id is the identity" in result.stderr
    result = cli(
        "audit-shortcuts",
        indexes / "trained",
        "--attribute",
        "height",
        "--attribute",
        "format",
        "--out",
        tmp_path / "r",
        "-q",
    )
    assert result.returncode == 0, result.stderr
    assert (
        "not tested: height (it has" in result.stdout and "not tested: format (it has a single value" in result.stdout
    )
    (tmp_path / "file").write_text("x")
    result = cli("audit-shortcuts", indexes / "trained", "--out", tmp_path / "file")
    assert result.returncode == 2 and "is a file" in result.stderr


def test_a_column_given_as_attribute_and_as_context_is_refused(cli, tmp_path):
    """Attack round 16 (F14): `--attribute device --context-attribute device` dropped the context
    request without a word and flagged device (exit 0). A column cannot be both: one line, exit 2."""
    from receipt_embed.audit.run import run_audit
    from receipt_embed.errors import BadInput
    from receipt_embed.indexing.build import index_embeddings

    x, items, _, _ = synthetic(1.6, receipts=20)
    np.save(tmp_path / "x.npy", x.astype(np.float32))
    (tmp_path / "manifest.jsonl").write_text("".join(json.dumps({**item, "path": "none.jpg"}) + "\n" for item in items))
    index_embeddings(tmp_path / "x.npy", tmp_path / "manifest.jsonl", tmp_path / "index")
    result = cli(
        "audit-shortcuts", tmp_path / "index", "--attribute", "device", "--context-attribute", "device",
        "--out", tmp_path / "r", "-q",
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr == (
        "Error: --attribute 'device' and --context-attribute 'device': a column cannot be both audited (and "
        "flagged) and used as context (never flagged); give it to one of them\n"
    )
    assert not (tmp_path / "r").exists()
    with pytest.raises(BadInput, match="'device' is given both as an attribute to audit and as a context attribute"):
        run_audit(tmp_path / "index", ["device"], tmp_path / "r", context=("device",))


def test_report_renders_in_a_headless_browser(cli, indexes):
    """The report opened by Chromium (Qt WebEngine): verdict shown, every image decoded."""
    report = indexes / "browser"
    assert cli("audit-shortcuts", indexes / "pixels", "--out", report, "-q").returncode == 0
    page = browser_page(report / "audit.html")
    assert page["verdict"].startswith("SHORTCUT: device")
    assert {"Retrieval", "Shortcuts", "Similarity distributions", "Projection", "Diagnostics"} <= set(page["headings"])
    assert len(page["images"]) >= 6
    assert all(image["complete"] and image["width"] > 20 for image in page["images"]), page["images"]


def test_degenerate_spaces_and_tiny_sets():
    from receipt_embed.fileio import json_safe

    x, items, _, _ = synthetic(0.0, receipts=10)
    collapsed = audit_figures(np.ones_like(x), items, ["device"])
    assert collapsed["collapsed"] and collapsed["diagnostics"]["effective_rank"] < 2
    json.dumps(json_safe(collapsed), allow_nan=False)  # strict JSON even for a degenerate space
    with pytest.raises(ValueError, match="at least 2 receipts"):
        audit_figures(x[:3], items[:3], ["device"])
    capped = audit_figures(x, items, ["device"], k=500)
    assert capped["k"] == len(items) - 3 and capped["k_requested"] == 500


def test_too_few_items_is_inconclusive_not_clear():
    # a strong device component on 8 receipts: the lift is high but the evidence thin
    x, items, _, _ = synthetic(3.0, receipts=8, devices=2)
    device = audit_figures(x, items, ["device"], rule=FlagRule(min_z=50.0))["shortcuts"]["device"]
    assert device["lift"] > 1.3 and device["status"] == "inconclusive" and not device["flagged"]
    assert any("standard errors" in reason for reason in device["reasons"])


def test_an_untestable_attribute_is_named_once_escaped_without_numpy_reprs():
    """Attack round 4: the reason read ``np.str_('a\\\\b')``: numpy's repr, then escaped twice."""
    from receipt_embed.audit.figures import testable
    from receipt_embed.audit.run import verdict_lines

    reason = testable(np.array(["a\\b", "a\\b", "a\\b"]))
    assert reason == "it has a single value ('a\\b')"
    figures = {"flagged": [], "collapsed": False, "shortcuts": {}, "inconclusive": [], "untestable": {"x\\y": reason}}
    assert verdict_lines(figures)[-1] == "not tested: x\\\\y (it has a single value ('a\\\\b'))"


def test_attack_round_27_f5_a_one_dimensional_index_is_audited_on_a_line(tmp_path):
    """Attack round 27 F5: `index --embeddings` takes a 1-D array, and its audit died in the PCA
    plot (n_components=2 of 1 feature) with an internal error; the projection is drawn on a line."""
    from conftest import run_cli
    from test_overwrite import write_embeddings

    x, manifest = write_embeddings(tmp_path, "e", 36, dim=1)
    assert run_cli("index", "--embeddings", x, "--manifest", manifest, "--out", tmp_path / "ix", "-q").returncode == 0
    result = run_cli("audit-shortcuts", tmp_path / "ix", "--gallery", "0", "-q")
    assert result.returncode in (0, 1) and "internal error" not in result.stderr, result.stderr
    assert "effective rank 1.00" in result.stdout
    figures = json.loads((tmp_path / "ix" / "audit" / "audit.json").read_text())
    assert figures["n_items"] == 36
