"""The bundled sample set and the demo command, end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli

REPO = Path(__file__).resolve().parents[1]


def test_ingest_data_samples(cli, tmp_path):
    result = cli("ingest", REPO / "data_samples" / "manifest.csv", "--out", tmp_path / "ds", "-q")
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "ds" / "ingest_report.json").read_text())
    assert report["counts"]["accepted"] == 180 and report["counts"]["rejected"] == 0
    assert report["counts"]["identities"] == 60
    assert report["captures_per_identity"] == {"3": 60}
    assert {k: v["identities"] for k, v in report["per_split"].items()} == {"train": 48, "val": 6, "heldout": 6}
    rows = [json.loads(l) for l in (tmp_path / "ds" / "manifest.jsonl").read_text().splitlines()]
    assert {row["merchant"] for row in rows} and all(Path(row["path"]).is_file() for row in rows)


def test_demo_pipeline_wiring(cli, tmp_path):
    """The demo's steps with two epochs: outputs in place, figures reported, missing steps named."""
    result = cli("demo", "--out", tmp_path / "demo", "-q", "--set", "train.epochs=2", cwd=REPO)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "demo"
    assert (out / "dataset" / "manifest.jsonl").is_file()
    assert (out / "run" / "checkpoints" / "best.pt").is_file() and (out / "run" / "metrics.jsonl").is_file()
    figures = json.loads((out / "heldout_retrieval.json").read_text())
    assert figures["backbone"]["n_queries"] == 18 and 0 <= figures["backbone"]["recall_at_1"] <= 1
    assert "accepted 180" in result.stdout and "held-out (18 captures) backbone features: recall@1" in result.stdout
    index = json.loads((out / "index" / "index.json").read_text())
    assert (index["count"], index["features"], index["source"]["split"]) == (18, "head", "heldout")
    assert "receipt-embed search" in result.stdout and "[4/4] audit-shortcuts" in result.stdout
    audit = json.loads((out / "audit" / "audit.json").read_text())
    assert audit["n_items"] == 18 and set(audit["shortcuts"]) == {"device", "merchant"}
    assert (out / "audit" / "audit.html").is_file()
    # the dataset's own captures are inside its capture folder: thumbnails, nothing refused
    assert "data:image/jpeg" in (out / "audit" / "audit.html").read_text() and audit["gallery_refused"] == 0
    # run from the repository root, the demo loads plugins/ like any command: the epoch hook
    # wrote metrics.csv and the hubness check is in the audit
    assert (out / "run" / "metrics.csv").is_file() and "hubness" in audit["checks"]
    again = cli("demo", "--out", out, "-q", cwd=REPO)
    assert again.returncode == 2 and "already holds a demo run" in again.stderr


@pytest.mark.slow
def test_full_demo_learns(cli, tmp_path):
    """The README's demo as a newcomer runs it: held-out recall@1 of at least 0.9."""
    result = cli("demo", "--out", tmp_path / "demo", "-q", cwd=REPO, timeout=900)
    assert result.returncode == 0, result.stderr
    figures = json.loads((tmp_path / "demo" / "heldout_retrieval.json").read_text())
    assert figures["head"]["recall_at_1"] >= 0.9, figures  # train.select_on: head


def test_a_demo_stopped_in_training_exits_143_saying_how_to_go_on(tmp_path):
    """New-user trial: SIGTERM while the demo trained came out as an internal error, exit 1, with a
    `--resume` hint that `demo` does not take."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import TINY_TRAINING

    out = tmp_path / "demo"
    settings = [arg for setting in [*TINY_TRAINING, "train.epochs=500"] for arg in ("--set", setting)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECEIPT_EMBED_")}
    child = subprocess.Popen(
        [sys.executable, "-m", "receipt_embed", "demo", "--out", str(out), "-q", *settings],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 240
    while not (out / "run" / "checkpoints" / "last.pt").exists():  # in training, past its first epoch
        assert child.poll() is None and time.monotonic() < deadline, child.communicate()
        time.sleep(0.2)
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=120)
    assert child.returncode == 143, err  # 128 + SIGTERM, as a shell reports it
    assert "internal error" not in err and "Traceback" not in err, err
    assert (
        f"the demo's index and audit were not made: run it again with `receipt-embed demo --out {out} --force`" in err
    )
    assert f"`receipt-embed train --out {out / 'run'} --resume`" in err


def test_a_set_too_small_to_audit_is_refused_before_any_training(tmp_path):
    """Attack round 12: a 12-receipt set (1 held-out receipt) was ingested, trained and indexed, then
    refused at the audit; the held-out count is known right after ingest."""
    from receipt_embed.samples import make_samples

    make_samples(tmp_path / "small", receipts=12, devices=3, seed=0)
    result = run_cli("demo", "--out", tmp_path / "out", "--samples", tmp_path / "small", timeout=120)
    assert result.returncode == 2, result.stderr
    assert "gives 1 held-out receipt(s) of 12; the demo indexes and audits the held-out receipts" in result.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["dataset"]


def test_a_demo_stopped_after_some_steps_says_which_parts_are_new(tmp_path, monkeypatch, capsys):
    """Attack round 12: a SIGTERM between the training and the index steps printed "OUT left as it
    was", though OUT's run was already the new one; the line now names the new and the old parts."""
    from receipt_embed.cli import demo
    from receipt_embed.stops import StoppedBySignal

    def stopped(*args, **kwargs):
        raise StoppedBySignal(143)

    monkeypatch.setattr(demo, "_ingest_step", lambda *args: None)
    monkeypatch.setattr(demo, "_train_step", lambda *args: None)
    monkeypatch.setattr(demo, "_index_step", stopped)
    with pytest.raises(StoppedBySignal) as info:
        demo._run_demo(None, None, tmp_path / "out", tmp_path, quiet=True)
    assert info.value.reported
    assert capsys.readouterr().err == (
        f"stopped by SIGTERM: the demo in {tmp_path / 'out'} replaced dataset, run; index, audit are the previous "
        f"run's: run it again with `receipt-embed demo --out {tmp_path / 'out'} --force`\n"
    )
    monkeypatch.setattr(demo, "_ingest_step", stopped)  # before any step ended: the lock's own line says it
    with pytest.raises(StoppedBySignal) as info:
        demo._run_demo(None, None, tmp_path / "out", tmp_path, quiet=True)
    assert not info.value.reported and capsys.readouterr().err == ""
