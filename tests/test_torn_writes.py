"""Writes cut short: a torn metrics line, a full disk, SIGTERM mid-ingest and a swap cut in half
all leave the previous complete state (checksums before and after)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import REPO, TINY_TRAINING, builtin_registry, run_cli, train_tiny
from test_overwrite import tree_digest, write_embeddings


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(dataset dir, run dir) of one tiny epoch; tests copy the run dir before changing it."""
    base = tmp_path_factory.mktemp("trained")
    dataset, _ = train_tiny(base)
    return dataset, base / "run"


def test_a_torn_last_metrics_line_is_dropped_on_resume_not_a_refusal(tmp_path, trained):
    from receipt_embed.config import load_config
    from receipt_embed.fileio import read_jsonl
    from receipt_embed.training.checkpoint import load_checkpoint
    from receipt_embed.training.trainer import train

    dataset = trained[0]
    shutil.copytree(trained[1], tmp_path / "run")
    metrics = tmp_path / "run" / "metrics.jsonl"
    with open(metrics, "a") as handle:
        handle.write('{"epoch": 2, "steps": 7, "lo')  # a crash in the middle of the next append
    config = load_config(overrides=[*TINY_TRAINING, "train.epochs=2"])
    with pytest.warns(UserWarning, match=rf"{metrics}, line 2: dropped a torn last line"):
        train(config, dataset, tmp_path / "run", builtin_registry(), resume=True, progress=False, log=lambda m: None)
    assert [row["epoch"] for row in read_jsonl(metrics)] == [1, 2]
    assert load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")["epoch"] == 2


def test_complete_metrics_lines_past_the_checkpoint_are_dropped_with_a_warning(tmp_path):
    """Attack round 18 H7: a whole metrics line of an epoch past last.pt (a crash between the line and
    the checkpoint) was dropped on resume without a word; it is still dropped, and said."""
    from receipt_embed.fileio import append_line, read_jsonl
    from receipt_embed.training.state import drop_unconfirmed_metrics

    metrics = tmp_path / "metrics.jsonl"
    for epoch in (1, 2, 7):
        append_line(metrics, json.dumps({"epoch": epoch}))
    with pytest.warns(UserWarning) as caught:
        assert drop_unconfirmed_metrics(tmp_path, 1) == [{"epoch": 1}]
    assert [str(w.message) for w in caught] == [
        f"dropped 2 metrics line(s) past the checkpoint's epoch 1 from {metrics} (no checkpoint holds their "
        "epochs; they are trained again)"
    ]
    assert read_jsonl(metrics) == [{"epoch": 1}, {"epoch": 2}, {"epoch": 7}], "written by the resumed run's epoch"


@pytest.mark.parametrize(
    ("epochs", "line", "message"), [((1, 1), 2, "epoch 1 after epoch 1"), ((1, 3, 2), 3, "epoch 2 after epoch 3")]
)
def test_attack_round_27_f10_a_repeated_or_backward_epoch_line_is_refused_on_resume(tmp_path, epochs, line, message):
    """Attack round 27 F10: a metrics.jsonl holding epoch 1 twice was resumed and kept (epochs 1, 1,
    2); damage before the last line is an error naming the line, and the file is left as it was."""
    from receipt_embed.fileio import append_line
    from receipt_embed.training.checkpoint import CheckpointError
    from receipt_embed.training.state import drop_unconfirmed_metrics

    metrics = tmp_path / "metrics.jsonl"
    for epoch in epochs:
        append_line(metrics, json.dumps({"epoch": epoch}))
    before = metrics.read_bytes()
    with pytest.raises(CheckpointError) as info:
        drop_unconfirmed_metrics(tmp_path, 1)
    assert str(info.value).startswith(f"{metrics}, line {line}: {message} on line {line - 1}; a run logs each")
    assert str(info.value).endswith("move the file aside to resume") and metrics.read_bytes() == before


def test_attack_round_25_m3_a_refused_resume_leaves_the_metrics_as_they_were(tmp_path, trained):
    """A --resume refused after its torn metrics line was dropped had already rewritten the file, and
    said nothing of what to do; a resume stopped before its first epoch ended did the same."""
    dataset = trained[0]
    run = tmp_path / "run"
    shutil.copytree(trained[1], run)
    metrics = run / "metrics.jsonl"
    metrics.write_bytes(metrics.read_bytes()[:-9])  # epoch 1's own line torn, yet last.pt holds epoch 1
    before = metrics.read_bytes()
    result = run_cli(
        "train", "--data", dataset, "--out", run, "-q", "--resume", *sum((["--set", s] for s in TINY_TRAINING), [])
    )
    assert result.returncode == 2
    assert f"{metrics}, line 1: dropped a torn last line" in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"Error: {run / 'checkpoints' / 'last.pt'}: epoch is 1, but {metrics} records epochs up to 0 (its torn last "
        "line dropped); the checkpoint does not belong to this run's log: train afresh with --force, or into "
        "another --out"
    )
    assert metrics.read_bytes() == before


def test_the_tolerant_reader_drops_only_a_torn_tail(tmp_path):
    from receipt_embed.fileio import append_line, read_jsonl_tail_tolerant

    path = tmp_path / "m.jsonl"
    for epoch in (1, 2):
        append_line(path, json.dumps({"epoch": epoch}))
    assert read_jsonl_tail_tolerant(path) == ([{"epoch": 1}, {"epoch": 2}], False)
    path.write_text('{"epoch": 1}\n{"epoch": 2, "x\n')  # invalid last line, even with its newline
    with pytest.warns(UserWarning, match="line 2: dropped"):
        assert read_jsonl_tail_tolerant(path) == ([{"epoch": 1}], True)
    path.write_text('{"epoch": 1}\nnot json\n{"epoch": 3}\n')  # damage before the end is not a torn append
    with pytest.raises(ValueError, match="m.jsonl, line 2: invalid JSON"):
        read_jsonl_tail_tolerant(path)


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs mounted for the test (skipped where mounting is not allowed)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_is_one_line_and_the_old_index_survives(tmp_path, small_disk):
    from receipt_embed.indexing import load_index_dir

    small = write_embeddings(tmp_path, "small", 20)
    big = write_embeddings(tmp_path, "big", 20000, dim=64)  # 5 MiB of vectors: cannot fit
    index = small_disk / "ix"
    assert run_cli("index", "--embeddings", small[0], "--manifest", small[1], "--out", index, "-q").returncode == 0
    before = tree_digest(index)
    result = run_cli("index", "--embeddings", big[0], "--manifest", big[1], "--out", index, "-q", "--force")
    assert result.returncode == 2
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line, result.stderr
    assert (
        line.startswith(f"Error: no space left on device writing {index}/") and "MiB free on that file system" in line
    )
    assert tree_digest(index) == before and load_index_dir(index).count == 20
    assert sorted(p.name for p in small_disk.iterdir()) == ["ix"], "the staging dir is removed"


def test_make_samples_on_a_full_disk_names_the_file(small_disk):
    """Attack round 7: the line named the staging dir (a failed write() has no file name)."""
    out = small_disk / "samples"
    result = run_cli("make-samples", "--out", out, "--receipts", "400", "--devices", "3", "-q")
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip()
    assert line.startswith(f"Error: no space left on device writing {out}/images/r"), line
    assert line.endswith("MiB free on that file system)") and len(line.splitlines()) == 1, line
    assert list(small_disk.iterdir()) == [], "the staging dir and the lock are removed"


def test_no_inodes_left_is_named_as_such_not_as_free_megabytes(tmp_path):
    """Attack round 7: with every inode used the line said "2.9 MiB free", which reads as a bug."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m,nr_inodes=16", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        for number in range(100):
            try:
                (disk / f"f{number}").touch()
            except OSError:
                break
        small = write_embeddings(tmp_path, "small", 20)
        result = run_cli("index", "--embeddings", small[0], "--manifest", small[1], "--out", disk / "ix", "-q")
        assert result.returncode == 2, result.stderr
        line = result.stderr.strip()
        assert line.startswith(f"Error: no space left on device writing {disk}/"), line
        assert "(no free inodes (file entries) left on that file system, though " in line and "MiB free)" in line
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def slow_source(base: Path, copies: int) -> Path:
    """data_samples/ listed ``copies`` times over hard links, so ingest takes long enough to interrupt."""
    import csv

    source = base / "source"
    source.mkdir()
    rows = list(csv.DictReader(open(REPO / "data_samples" / "manifest.csv")))
    with open(source / "manifest.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["path", "receipt_id", "device"])
        for copy in range(copies):
            for row in rows:
                name = f"{copy}_{Path(row['path']).name}"
                os.link(REPO / "data_samples" / row["path"], source / name)
                writer.writerow([name, f"{copy}_{row['receipt_id']}", row["device"]])
    return source


def _lock_named(path: Path) -> bool:
    try:
        return bool(path.read_text().strip())
    except OSError:
        return False


@pytest.mark.parametrize("times", [1, 2])
def test_sigterm_during_ingest_leaves_the_old_pair(tmp_path, times):
    """SIGTERM mid-ingest exits 143 with the old dataset pair intact, and (F13) says so in one line.
    Attack round 8: `timeout` sends it twice (to the command, then to its group), which printed two
    lines and could cut the cleanup short; a repeat within a second is the same stop."""
    from receipt_embed.ingest import ingest

    source = slow_source(tmp_path, 6)
    out = tmp_path / "ds"
    ingest(REPO / "data_samples", out)
    before = tree_digest(out)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECEIPT_EMBED_")}
    command = [sys.executable, "-m", "receipt_embed", "ingest", str(source), "--out", str(out), "-q", "--force"]
    interrupted = 0
    for delay in (0.0, 0.15, 0.4):  # after ingest took its lock, i.e. while it checks files or writes
        child = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not _lock_named(tmp_path / ".ds.lock") and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(delay)
        for repeat in range(times):
            time.sleep(0.05 * repeat)  # the repeat lands while the first stop unwinds
            child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=60)
        if child.returncode == 0:  # finished before the signal: the new pair, complete
            report = json.loads((out / "ingest_report.json").read_text())
            assert report["source"].startswith(str(source)) and report["counts"]["rows"] == 6 * 180
            break
        interrupted += 1
        assert child.returncode == 143 and "Traceback" not in err, err
        assert err.strip() == f"stopped by SIGTERM: {out} left as it was", err  # F13: one line, not silence
        assert tree_digest(out) == before, f"SIGTERM after {delay}s changed the dataset dir"
        assert not list(tmp_path.glob(".ds.*")), "the staging dir and the lock go on SIGTERM"
    assert interrupted, "no SIGTERM landed while ingest was running; make the source slower"


def test_a_swap_cut_in_half_is_repaired_by_the_next_writer(tmp_path):
    from receipt_embed.indexing import load_index_dir
    from receipt_embed.staging import replace_dir

    x, manifest = write_embeddings(tmp_path, "e", 12)
    index = tmp_path / "ix"
    assert run_cli("index", "--embeddings", x, "--manifest", manifest, "--out", index, "-q").returncode == 0
    before = tree_digest(index)
    # the fallback swap (no renameat2) killed between its two renames: old copy aside, no new one in place
    os.rename(index, tmp_path / ".ix.old-99999")
    (tmp_path / ".ix.staging-99998").mkdir()
    (tmp_path / ".ix.staging-99998" / "index.faiss").write_bytes(b"half")
    with pytest.warns(
        UserWarning, match=r"restored .* from \.ix\.old-99999.*removed 1 leftover\(s\) .*\.ix\.staging-99998"
    ):
        with pytest.raises(RuntimeError, match="stop"), replace_dir(index, "index", force=True) as staging:
            (staging / "index.json").write_text("{}")
            raise RuntimeError("stop")  # the new writer fails too: the restored old copy stays
    assert tree_digest(index) == before and load_index_dir(index).count == 12
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".ix")) == []


def test_the_fallback_swap_without_renameat2_replaces_the_dir(tmp_path, monkeypatch):
    import receipt_embed.staging as outdir

    out = tmp_path / "audit"
    for text in ("old", "new"):
        monkeypatch.setattr(outdir, "_renameat2", None if text == "new" else outdir._renameat2)
        with outdir.replace_dir(out, "audit", force=True) as staging:
            (staging / "audit.json").write_text(text)
            marker = uuid.uuid4().hex
            (staging / "audit.html").write_text(marker)
        assert (out / "audit.json").read_text() == text and (out / "audit.html").read_text() == marker
    assert sorted(p.name for p in tmp_path.iterdir()) == ["audit"]
    shutil.rmtree(out)


def test_train_force_keeps_the_old_run_until_the_new_one_has_a_checkpoint(tmp_path, trained):
    from test_training import nan_loss_plugins

    from receipt_embed.config import load_config
    from receipt_embed.training.replacement import set_aside, settle_leftovers
    from receipt_embed.training.trainer import TrainingDiverged, train

    dataset, run = trained[0], tmp_path / "run"
    shutil.copytree(trained[1], run)
    before = tree_digest(run)
    loader = nan_loss_plugins(tmp_path)
    failing = load_config(overrides=[*TINY_TRAINING, "loss.name=nan_after", "loss.params={after: 0}"])
    logged: list[str] = []
    with pytest.raises(TrainingDiverged, match="no checkpoint was written yet"):
        train(failing, dataset, run, loader.registry, progress=False, log=logged.append, force=True)
    assert tree_digest(run) == before, "a --force run that fails before its first checkpoint gives the old run back"
    assert f"the new run stopped before its first checkpoint: the previous run in {run} is kept" in logged
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plugins", "run"]
    # issue 13 N14: --force into a dir without a run said "the previous run ... is kept" of a run that never was
    logged.clear()
    with pytest.raises(TrainingDiverged, match="no checkpoint was written yet"):
        train(failing, dataset, tmp_path / "fresh", loader.registry, progress=False, log=logged.append, force=True)
    assert not [line for line in logged if "previous run" in line], logged
    shutil.rmtree(tmp_path / "fresh")

    # a --force run killed before its first checkpoint leaves the old run aside: the next writer restores it
    from test_overwrite import _dead_pid

    os.rename(set_aside(run), tmp_path / f".run.old-{_dead_pid()}")  # as a killed writer's would be
    (run / "config.yaml").write_text("the killed run's config")
    with pytest.warns(UserWarning, match=r"restored the run in .* from \.run\.old-"):
        settle_leftovers(run)
    assert tree_digest(run) == before

    train(
        load_config(overrides=TINY_TRAINING),
        dataset,
        run,
        builtin_registry(),
        progress=False,
        log=lambda m: None,
        force=True,
    )
    after = tree_digest(run)
    assert after != before and "checkpoints/last.pt" in after and len(after) == len(before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plugins", "run"], "the old run is gone once replaced"


def test_a_full_disk_while_writing_the_lock_record_names_the_lock_file(small_disk):
    """F11: ENOSPC writing the holder's record into the lock file is a DiskFull naming the lock file."""
    from receipt_embed.fileio import DiskFull
    from receipt_embed.locking import write_lock

    with open(small_disk / "filler", "wb") as handle:
        try:
            while True:
                handle.write(b"\0" * 65536)
                handle.flush()
        except OSError:
            pass
    with pytest.raises(DiskFull, match=rf"no space left on device writing {small_disk}/\.ds\.lock "):
        with write_lock(small_disk / "ds"):
            pass


@pytest.mark.slow  # long end-to-end run (tens of seconds): `pytest -m slow` runs it
def test_a_full_disk_in_any_index_file_names_that_file(tmp_path, small_disk):
    """F11: however little space is left, `index --force` on a full disk is the DiskFull line naming the
    file (index.faiss, items.jsonl or embeddings.npy), never numpy's or FAISS's bare "7680 requested and
    992 written"; the old index survives."""
    small = write_embeddings(tmp_path, "small", 120, dim=64)
    index = small_disk / "ix"
    assert run_cli("index", "--embeddings", small[0], "--manifest", small[1], "--out", index, "-q").returncode == 0
    before = tree_digest(index)
    named = set()
    for room_kb in (10, 30, 45, 50, 55, 60):
        filler = small_disk / "filler"
        filler.unlink(missing_ok=True)
        info = os.statvfs(small_disk)
        filler.write_bytes(b"\0" * max(0, info.f_bavail * info.f_frsize - room_kb * 1024))
        result = run_cli("index", "--embeddings", small[0], "--manifest", small[1], "--out", index, "-q", "--force")
        if result.returncode == 0:
            break
        assert result.returncode == 2 and "requested and" not in result.stderr, result.stderr
        line = result.stderr.strip()
        assert line.startswith(f"Error: no space left on device writing {index}/"), line
        named.add(line.split(f"{index}/")[1].split(" ")[0])
        assert tree_digest(index) == before
    assert "embeddings.npy" in named, named


def test_resume_after_a_killed_force_run_uses_the_restored_runs_data(tmp_path, trained):
    """F12: a `train --force` killed before its first checkpoint left the old run aside and its own
    data.json/config.yaml in place; the first `--resume` (no --data) restores the old run first and
    resumes it on the old run's dataset, not the aborted run's."""
    from receipt_embed.training.replacement import set_aside

    dataset, run = trained[0], tmp_path / "run"
    shutil.copytree(trained[1], run)
    old_record = (run / "data.json").read_text()
    from test_overwrite import _dead_pid

    os.rename(set_aside(run), tmp_path / f".run.old-{_dead_pid()}")  # as a killed writer's would be
    other = tmp_path / "other_ds"
    shutil.copytree(dataset, other)
    with open(other / "manifest.jsonl", "a") as handle:
        handle.write("\n")
    (run / "data.json").write_text(json.dumps({"data_dir": str(other), "manifest_sha256": "0" * 64}))
    shutil.copy(trained[1] / "config.yaml", run / "config.yaml")
    result = run_cli("train", "--out", run, "--resume", "-q", "--set", "train.epochs=2")
    assert result.returncode == 0, result.stderr
    assert "restored the run in" in result.stderr and "manifest differs" not in result.stderr
    assert (run / "data.json").read_text() == old_record
    assert not list(tmp_path.glob(".run.old-*"))


@pytest.mark.slow  # long end-to-end run (tens of seconds): `pytest -m slow` runs it
def test_a_checkpoint_set_aside_by_a_killed_force_run_is_named_with_how_to_put_it_back(tmp_path, trained):
    """Attack round 19 J7: after `demo --force` was killed between setting the old run aside and the
    new run's first checkpoint, `search OUT/index` said "pass --checkpoint PATH if it moved" (nothing
    moved it) and `index --checkpoint` said only "does not exist"; both name the set-aside run and how
    to put it back, and that advice works."""
    from test_overwrite import _dead_pid

    from receipt_embed.indexing import index_dataset
    from receipt_embed.training.checkpoint import CheckpointError, load_checkpoint
    from receipt_embed.training.replacement import set_aside

    out = tmp_path / "demo"
    run, index, best = out / "run", out / "index", out / "run" / "checkpoints" / "best.pt"
    shutil.copytree(trained[0], out / "dataset")
    shutil.copytree(trained[1], run)
    index_dataset(best, out / "dataset", index, builtin_registry())
    before = tree_digest(run)
    aside = out / f".run.old-{_dead_pid()}"
    os.rename(set_aside(run), aside)  # as a killed writer's would be, with the new run's first files
    shutil.copy(aside / "config.yaml", run / "config.yaml")
    shutil.copy(aside / "data.json", run / "data.json")
    advice = (
        f"the run in {run} was set aside in {aside} by a `--force` run that was stopped before its first "
        f"checkpoint: put it back with `receipt-embed train --out {run} --resume` (a finished run trains no "
        f"further), or rerun the demo with `receipt-embed demo --out {out} --force`"
    )
    query = REPO / "data_samples" / "images" / "r0000_phone_a.jpg"
    searched = run_cli("search", index, query, "--k", "1")
    assert searched.returncode == 2 and searched.stderr == f"Error: checkpoint {best} not found: {advice}\n"
    indexed = run_cli("index", "--checkpoint", best, "--data", out / "dataset", "--out", tmp_path / "ix2", "-q")
    assert indexed.returncode == 2 and indexed.stderr == f"Error: --checkpoint: checkpoint {best} not found: {advice}\n"
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(best)
    assert str(caught.value) == f"checkpoint not found: {best}: {advice}"

    resumed = run_cli("train", "--out", run, "--resume", "-q")
    assert resumed.returncode == 0 and "nothing to train" in resumed.stdout + resumed.stderr, resumed.stderr
    assert "resuming" not in resumed.stdout + resumed.stderr, "issue 13 U8: a finished run is not resumed"
    assert "Trained" not in resumed.stdout, "attack round 24 P10: nothing was trained"
    kept = {name: digest for name, digest in tree_digest(run).items() if name.startswith("checkpoints")}
    assert kept == {name: digest for name, digest in before.items() if name.startswith("checkpoints")}
    assert not aside.exists()
    searched = run_cli("search", index, query, "--k", "1")
    assert searched.returncode == 0 and "[same file]" in searched.stdout, searched.stderr


def test_a_killed_all_pairs_writer_leaves_a_temporary_file_the_next_one_removes(tmp_path):
    """Round 3 of the attack: the partial pairs file of a killed `search --all-pairs --out` stayed."""
    x, manifest = write_embeddings(tmp_path, "e", 12)
    index = tmp_path / "ix"
    assert run_cli("index", "--embeddings", x, "--manifest", manifest, "--out", index, "-q").returncode == 0
    leftover = tmp_path / ".pairs.csv.k3ll3d.tmp"
    leftover.write_text("path_a,path_b,similarity,same_receipt\n" * 1000)
    mine = tmp_path / ".pairs.csv.notes"  # not a temporary file of ours: kept
    mine.write_text("my notes")
    result = run_cli("search", index, "--all-pairs", "--threshold", "0.5", "--out", tmp_path / "pairs.csv")
    assert result.returncode == 0, result.stderr
    assert f"removed 1 temporary file(s) of an interrupted write of {tmp_path / 'pairs.csv'} ({leftover.name})" in (
        result.stderr
    )
    assert not leftover.exists() and mine.read_text() == "my notes" and (tmp_path / "pairs.csv").is_file()


def test_a_stop_does_not_wait_for_a_worker_blocked_in_a_read():
    """Attack round 6 (N-F2): the pool's own exit joined its threads, so a stop while one of them
    waited on a read that never returns left the command waiting forever."""
    import threading

    from receipt_embed.workers import thread_pool

    release = threading.Event()
    try:
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            with thread_pool(2) as pool:
                pool.submit(release.wait)
                queued = [pool.submit(release.wait) for _ in range(3)]
                raise KeyboardInterrupt
        assert time.monotonic() - started < 5
        assert all(job.cancelled() for job in queued[1:]), "work not yet started is cancelled"
    finally:
        release.set()  # let the abandoned thread end, or the test process would wait for it at exit


BLOCKED_INGEST = """
import os, sys
import receipt_embed.ingest.captures as captures
from receipt_embed.cli import run
fifo, real = sys.argv[1], captures._read_capture
def read(candidate, max_bytes):
    if candidate["line"] == 3:  # a file on a mount that stopped answering: read() never returns
        os.read(os.open(fifo, os.O_RDWR), 1)
    return real(candidate, max_bytes)
captures._read_capture = read
sys.argv = ["receipt-embed", *sys.argv[2:]]
run()
"""


def test_sigterm_while_ingest_waits_on_a_read_that_never_returns(tmp_path):
    fifo = tmp_path / "stuck"
    os.mkfifo(fifo)
    out = tmp_path / "ds"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECEIPT_EMBED_")}
    command = [sys.executable, "-c", BLOCKED_INGEST, str(fifo), "ingest", str(REPO / "data_samples"), "--out", str(out)]
    child = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not _lock_named(tmp_path / ".ds.lock") and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(1.0)  # the worker is now blocked on line 3
    child.send_signal(signal.SIGTERM)
    try:
        _, err = child.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        child.kill()
        pytest.fail("ingest waited for the blocked read after SIGTERM")
    assert child.returncode == 143, err
    assert err.splitlines()[-1] == f"stopped by SIGTERM: {out} left as it was", err
    assert not out.exists() and not list(tmp_path.glob(".ds.*"))


def test_a_file_size_limit_is_one_line_naming_the_file_and_the_old_dir_stays(tmp_path):
    """Attack round 11: under `ulimit -f` ingest and index said only "Error: File too large" and
    train was an internal error (exit 1); the limit stops a write as a full disk does, and says so."""
    import resource

    assert run_cli("ingest", REPO / "data_samples", "--out", tmp_path / "ds", "-q").returncode == 0
    before = tree_digest(tmp_path / "ds")

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (20 * 1024, resource.RLIM_INFINITY))

    env = {k: v for k, v in os.environ.items() if not k.startswith("RECEIPT_EMBED_")}
    result = subprocess.run(
        [sys.executable, "-m", "receipt_embed", "ingest", REPO / "data_samples", "--out", tmp_path / "ds"]
        + ["--seed", "1", "--force", "-q"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        preexec_fn=limited,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(
        f"Error: the file-size limit was reached writing {tmp_path / 'ds' / 'manifest.jsonl'}: this process may "
        "write files of at most 20 KiB (ulimit -f), with "
    ), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert tree_digest(tmp_path / "ds") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


def test_attack_round_23_n5_a_stop_after_the_swap_says_the_dir_was_replaced(tmp_path, monkeypatch, capsys):
    """A SIGTERM landing after the new copy was swapped in said the dir was "left as it was"."""
    from receipt_embed import staging
    from receipt_embed.stops import StoppedBySignal

    out = tmp_path / "report"
    out.mkdir()
    (out / "audit.json").write_text("{}")
    real_swap = staging.swap_in

    def swap_then_stop(new, target):
        real_swap(new, target)
        raise StoppedBySignal(143)

    monkeypatch.setattr(staging, "swap_in", swap_then_stop)
    with pytest.raises(StoppedBySignal):
        with staging.replace_dir(out, "audit", force=True) as new:
            (new / "audit.json").write_text('{"new": 1}')
    assert (out / "audit.json").read_text() == '{"new": 1}'
    assert f"stopped by SIGTERM: {out} already replaced by its new copy" in capsys.readouterr().err
    monkeypatch.setattr(staging, "swap_in", real_swap)
    with pytest.raises(StoppedBySignal):  # the next write of the same dir, stopped before its swap
        with staging.replace_dir(out, "audit", force=True) as new:
            raise StoppedBySignal(143)
    assert f"stopped by SIGTERM: {out} left as it was" in capsys.readouterr().err
