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
    # the dataset's own captures are inside its capture folder: thumbnails, nothing refused (the bundled
    # starting model finds every held-out capture, so the gallery of failures is empty unless one is missed)
    html = (out / "audit" / "audit.html").read_text()
    missed = audit["retrieval"]["recall_at_1"] < 1
    assert ("data:image/jpeg" in html) == missed and audit["gallery_refused"] == 0
    assert missed or "No query's nearest neighbour is another receipt." in html
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
        f"; the demo in {out} replaced dataset, run (the new one, unfinished); index, audit were not made: run it "
        f"again with `receipt-embed demo --out {out} --force`, or finish the training with "
        f"`receipt-embed train --out {out / 'run'} --resume`\n"
    ) in err
    assert len(err.strip().splitlines()) == 1, err


def test_a_set_too_small_to_audit_is_refused_before_any_training(tmp_path):
    """Attack round 12: a 12-receipt set (1 held-out receipt) was ingested, trained and indexed, then
    refused at the audit; the held-out count is known right after ingest."""
    from receipt_embed.samples import make_samples

    make_samples(tmp_path / "small", receipts=12, devices=3, seed=0)
    result = run_cli("demo", "--out", tmp_path / "out", "--samples", tmp_path / "small", timeout=120)
    assert result.returncode == 2, result.stderr
    assert "gives 1 held-out receipt(s) of 12; the demo indexes and audits the held-out receipts" in result.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["dataset"]
    # attack round 27 F8: a second demo without --force replaced the dataset the failed one left
    digest = (tmp_path / "out" / "dataset" / "manifest.jsonl").read_bytes()
    again = run_cli("demo", "--out", tmp_path / "out", "--samples", tmp_path / "small", "--set", "ingest.seed=7")
    assert again.returncode == 2 and (
        f"{tmp_path / 'out'} already holds a demo's dataset; pass --force to replace it" in again.stderr
    ), again.stderr
    assert (tmp_path / "out" / "dataset" / "manifest.jsonl").read_bytes() == digest


def _demo_stopped(monkeypatch, capsys, out: Path, tmp_path: Path, stop: type | None = None, **steps):
    """The stop (``StoppedBySignal`` unless ``stop`` says which) and the stderr of a demo into ``out``
    whose steps are replaced by ``steps`` (e.g. ``index=...``; the others do nothing)."""
    from receipt_embed.cli import demo
    from receipt_embed.stops import StoppedBySignal

    for step in ("ingest", "train", "index", "audit"):
        monkeypatch.setattr(demo, f"_{step}_step", steps.get(step, lambda *args: None))
    with pytest.raises(stop or StoppedBySignal) as info:
        demo._run_demo(None, None, out, tmp_path, quiet=True)
    return info.value, capsys.readouterr().err


def _stopped(*args, **kwargs):
    from receipt_embed.stops import StoppedBySignal

    raise StoppedBySignal(143)


def test_a_demo_stopped_after_some_steps_says_which_parts_are_new(tmp_path, monkeypatch, capsys):
    """Attack round 12: a SIGTERM between the training and the index steps printed "OUT left as it
    was", though OUT's run was already the new one; the line now names the new and the old parts."""
    stop, said = _demo_stopped(monkeypatch, capsys, tmp_path / "out", tmp_path, index=_stopped)
    assert stop.reported
    assert said == (
        f"stopped by SIGTERM: the demo in {tmp_path / 'out'} replaced dataset, run; index, audit were not "
        f"made: run it again with `receipt-embed demo --out {tmp_path / 'out'} --force`\n"
    )
    # before any step ended: the lock's own line says it
    stop, said = _demo_stopped(monkeypatch, capsys, tmp_path / "out", tmp_path, ingest=_stopped)
    assert not stop.reported and said == ""


def test_a_demo_stopped_inside_a_step_says_one_line(tmp_path, monkeypatch, capsys):
    """Issue 13 N6: a stop inside the index step printed the index lock's "OUT/index left as it
    was" and then the demo's own line, which says the previous index was removed: two accounts of
    one stop that read as contradicting each other. The demo's line alone tells it now."""
    from receipt_embed.locking import write_lock
    from receipt_embed.stops import StoppedBySignal

    out = tmp_path / "out"

    def stopped_while_writing(*args):
        with write_lock(out / "index"):
            raise StoppedBySignal(143)

    _old_demo_parts(out)
    _, said = _demo_stopped(monkeypatch, capsys, out, tmp_path, index=stopped_while_writing)
    assert said == (
        f"stopped by SIGTERM: the demo in {out} replaced dataset, run; removed the previous index and audit (built "
        f"from the replaced run): run it again with `receipt-embed demo --out {out} --force`\n"
    )
    with pytest.raises(StoppedBySignal), write_lock(out / "index"):  # outside a demo the writer's lock tells it
        raise StoppedBySignal(143)
    assert capsys.readouterr().err == f"stopped by SIGTERM: {out / 'index'} left as it was\n"


def test_a_demo_stopped_in_training_says_truly_what_out_holds(tmp_path, monkeypatch, capsys):
    """Attack round 24 P3, P8: `demo --force` stopped before the new run's first checkpoint said the
    index and audit "were not made" (the previous ones were there) and advised `train --resume` of the
    old, finished run; one stopped after training, in the held-out figures, called the run unfinished."""
    from receipt_embed.cli import demo
    from receipt_embed.stops import StopAlreadySaid, StoppedBySignal

    out = tmp_path / "out"
    _old_demo_parts(out)
    (out / "run" / "checkpoints").mkdir(parents=True)
    (out / "run" / "checkpoints" / "last.pt").write_bytes(b"the previous run")

    def stopped_before_a_checkpoint(*args):
        raise demo._TrainingStopped("SIGTERM received: stopped; no checkpoint had been saved yet", 143)

    def stopped_after_training(config, registry, out_dir, progress, quiet, trained):
        (out / "run" / "checkpoints" / "last.pt").unlink()
        (out / "run" / "checkpoints" / "last.pt").write_bytes(b"the new run")
        trained.append(True)
        raise StoppedBySignal(143)

    _, said = _demo_stopped(monkeypatch, capsys, out, tmp_path, StopAlreadySaid, train=stopped_before_a_checkpoint)
    assert said == (
        f"SIGTERM received: stopped; no checkpoint had been saved yet; the demo in {out} replaced dataset; run, "
        f"index, audit are the previous run's: run it again with `receipt-embed demo --out {out} --force`\n"
    )
    _, said = _demo_stopped(monkeypatch, capsys, out, tmp_path, train=stopped_after_training)
    assert said == (
        f"stopped by SIGTERM: the demo in {out} replaced dataset, run; removed the previous index and audit (built "
        f"from the replaced run): run it again with `receipt-embed demo --out {out} --force`\n"
    )
    assert not (out / "heldout_retrieval.json").exists()  # the old run's figures went with it


def _old_demo_parts(out: Path) -> None:
    """An index and an audit report of a previous demo (their marker files only)."""
    (out / "index").mkdir(parents=True)
    (out / "index" / "index.json").write_text('{"old": true}')
    (out / "audit").mkdir()
    (out / "audit" / "audit.json").write_text('{"old": true}')
    (out / "heldout_retrieval.json").write_text('{"old": true}')


def _demo_error(monkeypatch, out: Path, tmp_path: Path, **steps) -> str:
    """The one-line error of a demo into ``out`` whose steps are replaced by ``steps`` (e.g.
    ``train=...``; the others do nothing)."""
    from receipt_embed.cli import demo
    from receipt_embed.cli.app import InputError

    for step in ("ingest", "train", "index", "audit"):
        monkeypatch.setattr(demo, f"_{step}_step", steps.get(step, lambda *args: None))
    with pytest.raises(InputError) as info:
        demo._run_demo(None, None, out, tmp_path, quiet=True)
    return info.value.format_message()


def test_a_full_disk_at_the_audit_leaves_no_old_audit_beside_the_new_run(tmp_path, monkeypatch):
    """Attack round 17 G4: ENOSPC at the audit step of `demo --force` left the new dataset, run and
    index beside the previous audit, and said nothing of it. The old index and audit describe the
    replaced run, so they are removed once the new run is trained, and the error says what OUT holds."""
    import errno

    out = tmp_path / "out"
    _old_demo_parts(out)

    def new_index(*args):
        assert not (out / "index").exists() and not (out / "audit").exists()  # gone before the new index
        (out / "index").mkdir()
        (out / "index" / "index.json").write_text('{"new": true}')

    def disk_full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    assert _demo_error(monkeypatch, out, tmp_path, index=new_index, audit=disk_full) == (
        f"No space left on device; the demo in {out} replaced dataset, run, index; removed the previous audit "
        f"(built from the replaced run): run it again with `receipt-embed demo --out {out} --force`"
    )
    assert sorted(p.name for p in out.iterdir()) == ["heldout_retrieval.json", "index"]
    assert (out / "index" / "index.json").read_text() == '{"new": true}'


def test_a_demo_failing_in_its_index_step_says_the_old_index_and_audit_were_removed(tmp_path, monkeypatch):
    """Attack round 17 G4: an index step that failed (a full disk, a second writer) left the previous
    index and audit beside the new run; the one-line error now says they were removed."""
    from receipt_embed.errors import BadInput

    out = tmp_path / "out"
    _old_demo_parts(out)

    def refused(*args):
        raise BadInput("disk full writing index.faiss")

    assert _demo_error(monkeypatch, out, tmp_path, index=refused) == (
        f"disk full writing index.faiss; the demo in {out} replaced dataset, run; removed the previous index and "
        f"audit (built from the replaced run): run it again with `receipt-embed demo --out {out} --force`"
    )
    assert not (out / "index").exists() and not (out / "audit").exists()


def test_a_demo_failing_in_training_after_a_checkpoint_removes_what_was_built_from_the_old_run(tmp_path, monkeypatch):
    """Attack round 17 G4: training that failed after its first checkpoint (the old run is then
    discarded) left the previous index, audit and held-out figures beside a new, unfinished run;
    before a checkpoint the old run is kept, and the error says the index and audit are its own."""
    from receipt_embed.errors import BadInput

    out = tmp_path / "out"
    _old_demo_parts(out)

    def fails_before_a_checkpoint(*args):
        raise BadInput("No space left on device")

    assert _demo_error(monkeypatch, out, tmp_path, train=fails_before_a_checkpoint) == (
        f"No space left on device; the demo in {out} replaced dataset; index, audit are the previous run's; run was "
        f"not made: run it again with `receipt-embed demo --out {out} --force`"
    )
    assert (out / "index" / "index.json").read_text() == '{"old": true}'

    def fails_after_a_checkpoint(*args):
        (out / "run" / "checkpoints").mkdir(parents=True)
        (out / "run" / "checkpoints" / "last.pt").write_bytes(b"new")
        raise BadInput("No space left on device")

    assert _demo_error(monkeypatch, out, tmp_path, train=fails_after_a_checkpoint) == (
        f"No space left on device; the demo in {out} replaced dataset, run (the new one, unfinished); removed the "
        f"previous index and audit (built from the replaced run): run it again with `receipt-embed demo --out {out} "
        "--force`"
    )
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["run"]


@pytest.mark.parametrize("part", ["index", "audit", "dataset", "run/checkpoints"])
def test_demo_refuses_a_current_directory_inside_a_part_it_replaces(tmp_path, part):
    """Attack round 17 G4/G11: `demo --out OUT --force` run from inside OUT/audit (or OUT/index, ...)
    replaced the dataset and run, then was refused at the step that replaces the shell's directory,
    leaving OUT mixed (or deleted the directory under the shell). It is refused before any step."""
    import os
    import shutil

    out = tmp_path / "out"
    here = out / part
    here.mkdir(parents=True)
    if part == "run/checkpoints":
        (here / "last.pt").write_bytes(b"old")
    samples = tmp_path / "samples"
    shutil.copytree(REPO / "data_samples", samples)
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    result = run_cli("demo", "--out", out, "--samples", samples, "--force", "-q", cwd=here, timeout=120)
    assert (result.returncode, result.stdout) == (2, ""), result
    assert result.stderr == (
        f"Error: --out {out} holds the current directory ({os.path.realpath(here)}), and the demo replaces "
        f"{here} whole: give a path to another output dir, or cd out of it first\n"
    )
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if not p.name.endswith(".lock")) == before


FILLER_PLUGIN = """
import os

from receipt_embed.hookspecs import hookimpl


def make_check(**params):
    def check(context):  # fills the small file system OUT is on, so the audit's own writes meet ENOSPC
        target = os.environ.get("FILL_DISK")
        if not target or not os.path.ismount(os.path.dirname(target)):  # never any other disk
            return {"figures": {}, "summary": "disk left as it is", "flagged": False, "plot": None}
        with open(target, "wb") as handle:
            try:
                while True:
                    handle.write(bytes(1 << 16))
            except OSError:
                pass
        return {"figures": {}, "summary": "disk filled", "flagged": False, "plot": None}

    return check


@hookimpl
def register_audit_checks(register):
    register("filler", make_check, description="fills the disk")
"""


@pytest.mark.slow  # long end-to-end run (tens of seconds): `pytest -m slow` runs it
def test_demo_force_meeting_a_full_disk_at_the_audit_says_what_out_holds(tmp_path):
    """Attack round 17 G4, end to end: `demo --force` on a small file system that fills up during the
    audit left the new dataset, run and index beside the previous audit; now the old audit is gone
    and the error names the new parts and the removed one."""
    import subprocess

    from conftest import TINY_TRAINING

    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=60m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        (tmp_path / "plugins").mkdir()
        (tmp_path / "plugins" / "filler.py").write_text(FILLER_PLUGIN)
        out = disk / "out"
        sets = [arg for setting in TINY_TRAINING for arg in ("--set", setting)]
        args = ("demo", "--out", out, "--samples", REPO / "data_samples", "-q", *sets)
        first = run_cli(*args, cwd=tmp_path, timeout=300)
        assert first.returncode == 0, first.stderr
        result = run_cli(*args, "--force", cwd=tmp_path, env={"FILL_DISK": str(disk / "filler")}, timeout=300)
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith(f"Error: no space left on device writing {out / 'audit'}"), result.stderr
        assert result.stderr.endswith(
            f"; the demo in {out} replaced dataset, run, index; removed the previous audit (built from the replaced "
            f"run): run it again with `receipt-embed demo --out {out} --force`\n"
        )
        assert sorted(p.name for p in out.iterdir()) == ["dataset", "heldout_retrieval.json", "index", "run"]
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
