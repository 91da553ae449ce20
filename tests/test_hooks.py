"""The call hooks: ``on_epoch_end`` during training and ``register_audit_checks`` in
audit-shortcuts, each through real folder discovery, with their failure rules."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, TINY_TRAINING

from receipt_embed.plugin_manager import PluginHookWarning, PluginLoader, PluginLoadError

RECORDER = """
import json
from receipt_embed.hookspecs import hookimpl

@hookimpl
def on_epoch_end(run_dir, epoch, metrics, model, config):
    with open(run_dir / "hook_calls.jsonl", "a") as handle:
        handle.write(json.dumps({"epoch": epoch, "metrics": metrics, "training": model.training,
                                 "last_saved": (run_dir / "checkpoints" / "last.pt").exists(),
                                 "loss": config.loss.name, "run_dir": str(run_dir)}) + "\\n")
"""

ONLY_EPOCH = """
from receipt_embed.hookspecs import hookimpl
CALLS = []

@hookimpl
def on_epoch_end(epoch):  # pluggy passes only the arguments an implementation names
    CALLS.append(epoch)
"""

BROKEN_TRACKER = """
from receipt_embed.hookspecs import hookimpl

@hookimpl
def on_epoch_end(epoch):
    raise ConnectionError("tracker offline")
"""


def _registry(folder: Path, strict: bool = False, **plugins: str):
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in plugins.items():
        (folder / f"{name}.py").write_text(textwrap.dedent(text))
    loader = PluginLoader(strict=strict)
    loader.load_builtins()
    loader.load_folder(folder, required=True)
    loader.collect_components()
    return loader.registry


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from receipt_embed.config import load_config
    from receipt_embed.ingest import ingest

    out = tmp_path_factory.mktemp("hooks") / "ds"
    ingest(REPO / "data_samples", out, load_config().ingest)
    return out


def _train(registry, dataset, run_dir, epochs=2):
    from receipt_embed.config import load_config
    from receipt_embed.training.trainer import train

    config = load_config(overrides=[*TINY_TRAINING, f"train.epochs={epochs}"])
    return train(config, dataset, run_dir, registry, progress=False, log=lambda m: None)


@pytest.mark.hook("on_epoch_end")
def test_on_epoch_end_sees_each_epoch_after_its_checkpoint(tmp_path, dataset):
    registry = _registry(tmp_path / "plugins", recorder=RECORDER, only_epoch=ONLY_EPOCH, broken_tracker=BROKEN_TRACKER)
    run = tmp_path / "run"
    with pytest.warns(
        PluginHookWarning, match="'broken_tracker' failed in on_epoch_end \\(epoch \\d\\).*tracker offline"
    ) as caught:
        result = _train(registry, dataset, run)
    assert len([w for w in caught if issubclass(w.category, PluginHookWarning)]) == 2  # once per epoch
    calls = [json.loads(line) for line in (run / "hook_calls.jsonl").read_text().splitlines()]
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [c["epoch"] for c in calls] == [1, 2]
    assert [c["metrics"] for c in calls] == logged  # the same line metrics.jsonl received
    assert all(c["last_saved"] and not c["training"] and c["loss"] == "supcon" for c in calls)
    assert calls[0]["run_dir"] == str(run)
    assert registry.plugin_manager.get_plugin("only_epoch").CALLS == [1, 2]
    # the failing tracker did not stop training
    assert result.best_epoch is not None and (run / "checkpoints" / "best.pt").exists()


@pytest.mark.hook("on_epoch_end")
def test_on_epoch_end_failure_is_fatal_when_strict(tmp_path, dataset):
    registry = _registry(tmp_path / "plugins", strict=True, broken_tracker=BROKEN_TRACKER)
    with pytest.raises(PluginLoadError, match="'broken_tracker' failed in on_epoch_end.*tracker offline"):
        _train(registry, dataset, tmp_path / "run")
    # the epoch's checkpoint was written before the hook ran: the run can be resumed
    assert (tmp_path / "run" / "checkpoints" / "last.pt").exists()


@pytest.mark.hook("on_epoch_end")
def test_on_epoch_end_strict_failure_on_the_command_line(cli, tmp_path, dataset):
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "broken_tracker.py").write_text(BROKEN_TRACKER)
    sets = [arg for item in TINY_TRAINING for arg in ("--set", item)]
    result = cli("--strict-plugins", "train", "--data", dataset, "--out", tmp_path / "run", "-q", *sets, cwd=tmp_path)
    assert result.returncode == 2
    assert (
        "Error: plugin 'broken_tracker' failed in on_epoch_end (epoch 1) (--strict-plugins): ConnectionError: tracker offline"
        in result.stderr
    )
    assert "Traceback" not in result.stderr


NEIGHBOUR_CHECK = """
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from receipt_embed.hookspecs import hookimpl

SEEN = {}

def make():
    def check(context):
        similarities, indices = context.neighbours(3)
        SEEN.update(similarities=similarities, indices=indices, labels=context.labels, k=context.k,
                    attributes=context.attributes, devices=context.values("device"))
        same = float((context.labels[indices[:, 0]] == context.labels).mean())
        figure, axis = plt.subplots()
        axis.hist(similarities[:, 0])
        return {"figures": {"top1_same_receipt": same, "items": len(indices)},
                "summary": f"top-1 neighbour is the same receipt for {same:.0%}", "flagged": same < 0.99,
                "plot": figure}
    return check

@hookimpl
def register_audit_checks(register):
    register("top1", make, description="share of items whose nearest neighbour is their receipt")
"""

MALFORMED_CHECK = """
from receipt_embed.hookspecs import hookimpl

@hookimpl
def register_audit_checks(register):
    register("malformed", lambda: (lambda context: [1, 2, 3]))
    register("check_itself", lambda context: {"figures": {}})  # the check registered instead of its factory
"""


EXITING_CHECKS = """
from receipt_embed.hookspecs import hookimpl

def exits(context):
    raise SystemExit(0)

def interrupts(context):
    raise KeyboardInterrupt

@hookimpl
def register_audit_checks(register):
    register("exits", lambda: exits, description="calls sys.exit(0)")
    register("interrupts", lambda: interrupts, description="raises KeyboardInterrupt, no signal sent")
"""


def _index(tmp_path, alpha=1.6):
    from test_audit import synthetic

    from receipt_embed.indexing.build import index_embeddings

    x, items, labels, devices = synthetic(alpha, receipts=40)
    np.save(tmp_path / "x.npy", x.astype(np.float32))
    with open(tmp_path / "manifest.jsonl", "w") as handle:
        for item in items:
            handle.write(json.dumps({**item, "path": "none.jpg"}) + "\n")
    index_embeddings(tmp_path / "x.npy", tmp_path / "manifest.jsonl", tmp_path / "index")
    return tmp_path / "index", x, labels


@pytest.mark.hook("register_audit_checks")
def test_audit_check_reads_exact_neighbours_and_lands_in_the_report(tmp_path):
    from receipt_embed.audit.run import run_audit, verdict_lines

    registry = _registry(tmp_path / "plugins", neighbour_check=NEIGHBOUR_CHECK)
    index, x, labels = _index(tmp_path)
    figures = run_audit(index, ["device"], tmp_path / "report", k=5, gallery=0, registry=registry)
    seen = registry.plugin_manager.get_plugin("neighbour_check").SEEN

    # the context's neighbours are the exact top 3 other items by inner product of the stored vectors
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    similarity = xn @ xn.T
    np.fill_diagonal(similarity, -np.inf)
    expected = np.argsort(-similarity, axis=1, kind="stable")[:, :3]
    assert np.array_equal(np.sort(seen["indices"], axis=1), np.sort(expected, axis=1))
    assert np.allclose(seen["similarities"], np.take_along_axis(similarity, expected, axis=1), atol=1e-5)
    assert seen["k"] == 5 and seen["attributes"] == ["device"]
    # one label per receipt (numbered in receipt_id order): the same partition as the truth
    assert len(set(zip(seen["labels"].tolist(), labels.tolist()))) == len(set(labels.tolist())) == 40
    assert seen["devices"][:3].tolist() == ["d0", "d1", "d2"]

    top1 = float((labels[expected[:, 0]] == labels).mean())
    result = figures["checks"]["top1"]
    assert result["figures"] == {"top1_same_receipt": pytest.approx(top1), "items": 120}
    assert result["plugin"] == "neighbour_check" and result["flagged"] == (top1 < 0.99)
    saved = json.loads((tmp_path / "report" / "audit.json").read_text())
    assert saved["checks"]["top1"]["summary"] == result["summary"]
    if result["flagged"]:
        assert saved["flagged_checks"] == ["top1"]
        assert any(line.startswith("CHECK top1 (neighbour_check): top-1") for line in verdict_lines(figures))
    html = (tmp_path / "report" / "audit.html").read_text()
    assert 'id="check-top1"' in html and 'alt="top1 plot" src="data:image/png;base64,' in html


@pytest.mark.hook("register_audit_checks")
def test_flagged_check_fails_the_ci_gate_and_a_malformed_one_is_reported(cli, tmp_path):
    index, _, _ = _index(tmp_path, alpha=0.0)
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "neighbour_check.py").write_text(NEIGHBOUR_CHECK.replace("same < 0.99", "True"))
    (plugins / "malformed_check.py").write_text(MALFORMED_CHECK)
    result = cli(
        "--plugins-dir",
        plugins,
        "audit-shortcuts",
        index,
        "--out",
        tmp_path / "r",
        "--fail-on-shortcut",
        "--gallery",
        "0",
        "-q",
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stderr
    assert "CHECK top1 (neighbour_check): top-1 neighbour is the same receipt" in result.stdout
    assert "audit check 'malformed' (plugin 'malformed_check') failed" in result.stderr
    assert "returned list, not a dict with a 'figures' dict" in result.stderr
    assert "register the factory that returns check(context), not the check itself" in result.stderr
    saved = json.loads((tmp_path / "r" / "audit.json").read_text())
    assert saved["checks"]["malformed"]["error"].startswith("returned list")
    assert "missing 1 required positional argument: 'context'" in saved["checks"]["check_itself"]["error"]
    assert saved["flagged_checks"] == ["top1"] and saved["flagged"] == []
    # the same gate without the plugins folder passes: the flag came from the check
    clean = cli(
        "--plugins-dir",
        tmp_path / "none",
        "audit-shortcuts",
        index,
        "--out",
        tmp_path / "r2",
        "--fail-on-shortcut",
        "--gallery",
        "0",
        "-q",
        cwd=tmp_path,
    )
    assert clean.returncode == 0, clean.stdout + clean.stderr
    # strict: the malformed check stops the audit with a one-line error
    strict = cli(
        "--strict-plugins",
        "--plugins-dir",
        plugins,
        "audit-shortcuts",
        index,
        "--out",
        tmp_path / "r3",
        "--gallery",
        "0",
        "-q",
        cwd=tmp_path,
    )
    assert strict.returncode == 2 and "(--strict-plugins)" in strict.stderr and "Traceback" not in strict.stderr


@pytest.mark.hook("register_audit_checks")
def test_a_check_that_exits_or_raises_keyboard_interrupt_is_a_failed_check_and_the_gate_still_decides(cli, tmp_path):
    """Attack round 16 (F4): a check raising SystemExit(0) ended `audit-shortcuts --fail-on-shortcut`
    silently with exit 0 and no report, so a CI gate passed while nothing was audited; one raising
    KeyboardInterrupt (no signal sent) printed click's "Aborted!" (exit 1) and wrote no report."""
    index, _, _ = _index(tmp_path)
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "exiting_checks.py").write_text(EXITING_CHECKS)
    result = cli(
        "--plugins-dir", plugins, "audit-shortcuts", index, "--out", tmp_path / "r", "--fail-on-shortcut", "-q",
        cwd=tmp_path,
    )  # fmt: skip
    assert "audit check 'exits' (plugin 'exiting_checks') failed: SystemExit: 0; the audit goes on" in result.stderr
    assert "audit check 'interrupts' (plugin 'exiting_checks') failed: KeyboardInterrupt" in result.stderr
    assert "Aborted" not in result.stderr
    saved = json.loads((tmp_path / "r" / "audit.json").read_text())
    assert saved["checks"]["exits"]["error"] == "SystemExit: 0"
    assert saved["checks"]["interrupts"]["error"] == "KeyboardInterrupt"
    assert saved["flagged"] == ["device"] and "SHORTCUT: device" in result.stdout
    assert result.returncode == 1, result.stdout + result.stderr  # the shortcut the audit found fails the gate


@pytest.mark.hook("register_audit_checks")
def test_audit_checks_can_be_skipped_and_given_parameters(cli, tmp_path):
    index, _, _ = _index(tmp_path, alpha=0.0)

    def audit(*extra, out):
        # the repository's plugins/ folder holds the hubness check
        return cli(
            "--plugins-dir",
            REPO / "plugins",
            "audit-shortcuts",
            index,
            "--out",
            tmp_path / out,
            "--gallery",
            "0",
            "-q",
            *extra,
            cwd=tmp_path,
        )

    default = audit(out="a")
    assert default.returncode == 0, default.stderr
    hubness = json.loads((tmp_path / "a" / "audit.json").read_text())["checks"]["hubness"]
    assert not hubness["flagged"] and hubness["figures"]["k"] == 10
    # a threshold below the measured skewness flags it (120 items >= min_items 50)
    strict = audit(
        "--check-set", f"hubness.max_skewness={hubness['figures']['skewness'] - 0.01}", "--fail-on-shortcut", out="b"
    )
    assert strict.returncode == 1 and "CHECK hubness (hubness): k-occurrence skewness" in strict.stdout
    skipped = audit("--skip-check", "hubness", out="c")
    assert skipped.returncode == 0, skipped.stderr
    assert "hubness" not in json.loads((tmp_path / "c" / "audit.json").read_text())["checks"]
    typo = audit("--skip-check", "hubnes", out="d")  # not installed here: skipped already, so only a warning
    assert typo.returncode == 0 and "--skip-check 'hubnes': no such audit check here; checks: hubness" in typo.stderr
    typo = audit("--check-set", "hubnes.min_items=3", out="d2")
    assert typo.returncode == 2 and "--check-set: no audit check 'hubnes' (did you mean 'hubness'?)" in typo.stderr
    bad_param = audit("--check-set", "hubness.max_skew=3", out="e")
    assert bad_param.returncode == 2
    assert (
        "its --check-set may set max_skewness, min_items (did you mean 'max_skewness' for 'max_skew'?)"
        in bad_param.stderr
    )
    assert audit("--check-set", "hubness=3", out="f").returncode == 2
    # attack round 7: `nan` (text, as --set reads it) reached the check, which then failed mid-audit
    not_a_number = audit("--check-set", "hubness.max_skewness=nan", out="f2")
    assert not_a_number.returncode == 2
    assert (
        "audit_check 'hubness' (from plugin 'hubness'): parameter 'max_skewness' takes a number (float), got 'nan'"
        in not_a_number.stderr
    )
    for value in (".inf", "1e400"):  # attack round 8: infinity was taken, and audit.json then was not JSON
        infinite = audit("--check-set", f"hubness.max_skewness={value}", out="f3")
        assert infinite.returncode == 2 and "takes a finite number (float), got inf" in infinite.stderr
    # values read like --set values, and recorded with the results
    audit("--check-set", "hubness.max_skewness=1e1", "--check-set", "hubness.min_items=50", out="g")
    recorded = json.loads((tmp_path / "g" / "audit.json").read_text())["checks"]["hubness"]["params"]
    assert recorded == {"max_skewness": 10.0, "min_items": 50}


def test_audit_context_refuses_a_column_no_item_has(tmp_path):
    from receipt_embed.audit.checks import AuditContext

    items = [{"receipt_id": "r0", "device": "a", "merchant": "m"}, {"receipt_id": "r1", "device": "b"}]
    context = AuditContext(np.eye(2, dtype=np.float32), items, np.array([0, 1]), ["device"], 1, tmp_path)
    assert context.values("merchant").tolist() == ["m", ""]
    with pytest.raises(KeyError, match="no item has a column 'merchnt' \\(did you mean 'merchant'\\?\\)"):
        context.values("merchnt")


def test_attack_round_22_mb10_an_audit_check_summary_is_one_readable_line():
    """A check's 1,000,000-character summary was printed whole in the terminal and the report."""
    from receipt_embed.audit.checks import MAX_SUMMARY_CHARACTERS, AuditCheckError, _result

    fine = _result("c", "p", {"figures": {}, "summary": "x" * MAX_SUMMARY_CHARACTERS})
    assert len(fine["summary"]) == MAX_SUMMARY_CHARACTERS
    with pytest.raises(AuditCheckError) as info:
        _result("c", "p", {"figures": {}, "summary": "x" * 1_000_000})
    assert str(info.value) == (
        "'summary' is 1,000,000 characters; a summary is one line of at most 2,000 (put data in 'figures')"
    )
