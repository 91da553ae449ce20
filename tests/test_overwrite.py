"""Overwriting what the user has: replacing an output dir needs --force, only a dir of the same
kind is ever replaced, and no command writes over its own input."""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, run_cli


def tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (by relative path): the state to compare before and after."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def write_embeddings(base: Path, name: str, rows: int, dim: int = 16, seed: int = 0) -> tuple[Path, Path]:
    """``NAME.npy`` (rows x dim) and ``NAME.csv``, a manifest whose row i belongs to embedding row i."""
    x = np.random.default_rng(seed).normal(size=(rows, dim)).astype(np.float32)
    np.save(base / f"{name}.npy", x)
    with open(base / f"{name}.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["path", "receipt_id", "device"])
        writer.writerows([f"img{i}.png", f"r{i // 2}", f"d{i % 3}"] for i in range(rows))
    return base / f"{name}.npy", base / f"{name}.csv"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from receipt_embed.ingest import ingest

    out = tmp_path_factory.mktemp("ow") / "dataset"
    ingest(REPO / "data_samples", out)
    return out


def test_ingest_needs_force_and_never_replaces_a_foreign_or_source_folder(cli, tmp_path, dataset):
    out = tmp_path / "ds"
    assert cli("ingest", REPO / "data_samples", "--out", out, "-q").returncode == 0
    before = tree_digest(out)
    again = cli("ingest", REPO / "data_samples", "--out", out, "-q", "--seed", "7")
    assert again.returncode == 2 and f"{out} already holds a dataset dir" in again.stderr and "--force" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1 and tree_digest(out) == before
    forced = cli("ingest", REPO / "data_samples", "--out", out, "-q", "--seed", "7", "--force")
    assert forced.returncode == 0, forced.stderr
    after = tree_digest(out)
    assert after != before and set(after) == {"manifest.jsonl", "ingest_report.json"}
    report = json.loads((out / "ingest_report.json").read_text())
    assert report["settings"]["seed"] == 7  # the pair is one run's: report and manifest together
    assert not list(tmp_path.glob(".ds.*")), "no staging or lock leftovers beside the dir"

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my own files")
    refused = cli("ingest", REPO / "data_samples", "--out", mine, "-q", "--force")
    assert refused.returncode == 2 and "did not write" in refused.stderr and "not even with --force" in refused.stderr
    assert (mine / "notes.txt").read_text() == "my own files"


def test_ingest_refuses_to_write_over_its_source(cli, tmp_path):
    source = tmp_path / "captures"
    source.mkdir()
    for row in list(csv.DictReader(open(REPO / "data_samples" / "manifest.csv")))[:6]:
        (source / Path(row["path"]).name).write_bytes((REPO / "data_samples" / row["path"]).read_bytes())
    with open(source / "manifest.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["path", "receipt_id", "device"])
        writer.writerows([p.name, p.stem[:6], "d"] for p in sorted(source.glob("*.png")))
    before = tree_digest(source)
    for out in (source, tmp_path):  # the source folder itself, and a folder holding it
        result = cli("ingest", source, "--out", out, "-q", "--force")
        assert result.returncode == 2 and "destroy its own input" in result.stderr and str(source) in result.stderr
    assert tree_digest(source) == before


def test_index_needs_force_refuses_other_kinds_and_its_inputs(cli, tmp_path, dataset):
    small = write_embeddings(tmp_path, "small", 12)
    other = write_embeddings(tmp_path, "other", 12, seed=1)
    out = tmp_path / "ix"
    assert cli("index", "--embeddings", small[0], "--manifest", small[1], "--out", out, "-q").returncode == 0
    before = tree_digest(out)
    again = cli("index", "--embeddings", other[0], "--manifest", other[1], "--out", out, "-q")
    assert again.returncode == 2 and "already holds an index dir" in again.stderr and "--force" in again.stderr
    assert tree_digest(out) == before
    assert cli("index", "--embeddings", other[0], "--manifest", other[1], "--out", out, "-q", "--force").returncode == 0
    assert tree_digest(out) != before

    for target, words in ((dataset, "is the manifest"), (tmp_path, "holds the embeddings file")):
        state = tree_digest(target) if target == dataset else None
        result = cli("index", "--embeddings", small[0], "--manifest", dataset, "--out", target, "-q", "--force")
        assert result.returncode == 2 and words in result.stderr, result.stderr
        if state is not None:
            assert tree_digest(dataset) == state
    # the checkpoint's own run dir
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "best.pt").write_bytes(b"PK not really")
    result = cli("index", "--checkpoint", run / "checkpoints" / "best.pt", "--data", dataset, "--out", run, "--force")
    assert result.returncode == 2 and "holds the checkpoint" in result.stderr
    assert (run / "checkpoints" / "best.pt").read_bytes() == b"PK not really"


@pytest.mark.slow  # long end-to-end run (tens of seconds): `pytest -m slow` runs it
def test_audit_report_needs_force_and_is_never_the_index_dir(cli, tmp_path):
    x, manifest = write_embeddings(tmp_path, "e", 40)
    index = tmp_path / "ix"
    assert cli("index", "--embeddings", x, "--manifest", manifest, "--out", index, "-q").returncode == 0
    report = tmp_path / "report"
    first = cli("audit-shortcuts", index, "--out", report, "-q", "--gallery", "0")
    assert first.returncode == 0, first.stderr
    before = tree_digest(report)
    again = cli("audit-shortcuts", index, "--out", report, "-q", "--gallery", "0")
    assert again.returncode == 2 and "already holds an audit report dir" in again.stderr and "--force" in again.stderr
    assert tree_digest(report) == before
    index_state = tree_digest(index)
    own = cli("audit-shortcuts", index, "--out", index, "-q", "--force")
    assert own.returncode == 2 and "is the index dir" in own.stderr and tree_digest(index) == index_state
    assert cli("audit-shortcuts", index, "--out", report, "-q", "--gallery", "0", "--force").returncode == 0


def test_dir_kinds_tell_ours_from_the_users(tmp_path):
    from receipt_embed.outdir import check_replaceable, dir_kind

    assert dir_kind(tmp_path / "absent") is None
    (tmp_path / "empty").mkdir()
    assert dir_kind(tmp_path / "empty") is None
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "index.faiss").write_bytes(b"x")  # an index interrupted by an older version: still ours
    assert dir_kind(partial) == "index"
    (partial / "holiday.jpg").write_bytes(b"x")
    assert dir_kind(partial) == "other"
    with pytest.raises(ValueError, match="never replaced"):
        check_replaceable(partial, "index", force=True)
    website = tmp_path / "website"
    website.mkdir()
    (website / "index.json").write_text("{}")  # a marker file alone does not make a folder ours
    (website / "index.html").write_text("<html>")
    assert dir_kind(website) == "other"


def test_train_never_writes_into_a_folder_it_did_not_write(cli, tmp_path, dataset):
    """F1 + F2: `train --out` (fresh, --force, --resume) refuses a user's folder, even one holding files
    named like a run's (config.yaml, metrics.jsonl) but no checkpoint; nothing in it changes."""
    thesis = tmp_path / "thesis"
    thesis.mkdir()
    (thesis / "thesis.tex").write_text("draft")
    lookalike = tmp_path / "lookalike"
    lookalike.mkdir()
    (lookalike / "config.yaml").write_text("keep: 1\n")
    (lookalike / "metrics.jsonl").write_text("my metrics\n")
    for folder in (thesis, lookalike):
        before = tree_digest(folder)
        for flags in ((), ("--force",), ("--resume",)):
            result = cli("train", "--data", dataset, "--out", folder, "-q", "--set", "train.epochs=1", *flags)
            assert result.returncode == 2, result.stderr
            assert f"{folder} holds files that receipt-embed did not write" in result.stderr, result.stderr
            assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
        assert tree_digest(folder) == before


def test_train_refuses_an_out_holding_its_dataset_or_captures(tmp_path):
    """F1: a --out that is, or holds, the dataset dir, its ingest source folder or its captures is refused
    (also when --out is a run dir, which may hold anything its plugins wrote)."""
    import shutil

    from receipt_embed.config import load_config
    from receipt_embed.ingest import ingest
    from receipt_embed.training.rundir import check_run_out, is_run_dir, refuse_dataset_inside

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.pt").write_bytes(b"")
    shutil.copytree(REPO / "data_samples", run / "captures")
    ingest(run / "captures", tmp_path / "ds", load_config().ingest)
    assert is_run_dir(run)
    check_run_out(run)
    with pytest.raises(ValueError, match=r"holds .*captures.*read by the dataset"):
        refuse_dataset_inside(run, tmp_path / "ds")
    with pytest.raises(ValueError, match="is the dataset"):
        refuse_dataset_inside(tmp_path / "ds", tmp_path / "ds")
    refuse_dataset_inside(run, run / "dataset")  # the run's own copy of the samples
    refuse_dataset_inside(tmp_path / "elsewhere", tmp_path / "ds")


def test_run_dir_kinds(tmp_path):
    """F1 + F2: which folders `train` may write into: ours (a checkpoint, or a run stopped before one)
    or empty; a folder without a run's marker files that holds anything else is the user's."""
    from receipt_embed.training.rundir import is_run_dir, is_sweep_dir

    assert is_run_dir(tmp_path / "absent") and is_run_dir(tmp_path)
    plugin = tmp_path / "plugin_run"
    (plugin / "checkpoints").mkdir(parents=True)
    (plugin / "checkpoints" / "last.pt").write_bytes(b"")
    (plugin / "my_plugin_plot.png").write_bytes(b"x")
    assert is_run_dir(plugin)
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    (stopped / "config.yaml").write_text("a: 1\n")
    (stopped / "data.json").write_text(json.dumps({"data_dir": "/x", "manifest_sha256": None}))
    assert is_run_dir(stopped)
    (stopped / "notes.txt").write_text("mine")
    assert not is_run_dir(stopped)
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "data.json").write_text(json.dumps({"mine": 1}))
    assert not is_run_dir(fake)
    sweep = tmp_path / "sweep"
    (sweep / "loss.temperature=0.1").mkdir(parents=True)
    (sweep / "sweep.json").write_text("{}")
    assert is_sweep_dir(sweep)
    (sweep / "thesis.tex").write_text("x")
    assert not is_sweep_dir(sweep)


def test_demo_never_replaces_a_folder_it_did_not_write(cli, tmp_path):
    """F1: `demo --force` refuses an OUT (or a part of it, e.g. OUT/run) holding files it did not write,
    and an OUT holding its --samples; nothing changes."""
    import shutil

    nested = tmp_path / "nested"
    (nested / "run").mkdir(parents=True)
    (nested / "run" / "precious.txt").write_text("precious")
    top = tmp_path / "top"
    top.mkdir()
    (top / "p.txt").write_text("precious")
    own = tmp_path / "own"
    shutil.copytree(REPO / "data_samples", own / "mine")
    for out, samples, expected in (
        (nested, REPO / "data_samples", "did not write (in"),
        (top, REPO / "data_samples", "did not write (p.txt)"),
        (own, own / "mine", "did not write (mine)"),
    ):
        before = tree_digest(out)
        result = cli("demo", "--out", out, "--samples", samples, "--force", "-q", "--set", "train.epochs=1")
        assert result.returncode == 2 and expected in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
        assert tree_digest(out) == before


def test_nothing_is_written_inside_a_dir_that_is_replaced_whole(cli, tmp_path, dataset):
    """A run, index or dataset inside a dataset or index dir would make that dir unreplaceable
    (or be lost with it): refused by name; an index dir's own audit/ report dir is the exception."""
    import shutil

    ds = tmp_path / "ds"
    shutil.copytree(dataset, ds)
    x, manifest = write_embeddings(tmp_path, "e", 12)
    index = tmp_path / "ix"
    assert cli("index", "--embeddings", x, "--manifest", manifest, "--out", index, "-q").returncode == 0
    before = {ds: tree_digest(ds), index: tree_digest(index)}
    attempts = [
        (ds, ("train", "--data", dataset, "--out", ds / "run", "-q", "--set", "train.epochs=1")),
        (ds, ("index", "--embeddings", x, "--manifest", manifest, "--out", ds / "idx", "-q")),
        (index, ("ingest", REPO / "data_samples", "--out", index / "nested" / "ds", "-q")),
        (index, ("index", "--embeddings", x, "--manifest", manifest, "--out", index / "audit" / "idx", "-q")),
    ]
    for parent, args in attempts:
        result = cli(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert f"is inside {'a dataset dir' if parent == ds else 'an index dir'} ({parent})" in result.stderr
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert {ds: tree_digest(ds), index: tree_digest(index)} == before
    assert sorted(p.name for p in ds.iterdir()) == ["ingest_report.json", "manifest.jsonl"]
    assert cli("ingest", REPO / "data_samples", "--out", ds, "-q", "--force").returncode == 0, "still replaceable"
    report = cli("audit-shortcuts", index, "--out", index / "audit", "-q")
    assert report.returncode == 0, report.stderr


def _dead_pid() -> int:
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_only_our_own_leftovers_of_a_dead_writer_are_removed(tmp_path, recwarn):
    """Folders that merely carry a staging or set-aside name (a user's, a link, a live writer's)
    are never deleted, and nothing is reported for them on every later write."""
    import os

    from receipt_embed.staging import clean_leftovers
    from receipt_embed.training.replacement import leftovers_of, settle_leftovers

    dead = _dead_pid()
    out = tmp_path / "ix"
    mine = tmp_path / f".ix.staging-{dead}"
    mine.mkdir()
    (mine / "thesis.tex").write_text("a user's own file")
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / f".ix.old-{dead + 1}")
    live = tmp_path / f".ix.staging-{os.getppid()}"
    live.mkdir()
    (live / "index.faiss").write_bytes(b"being written")
    ours = tmp_path / f".ix.old-{dead}"
    ours.mkdir()
    (ours / "index.faiss").write_bytes(b"half")
    for _ in range(2):
        clean_leftovers(out)
    messages = [str(w.message) for w in recwarn]
    assert messages == [f"restored {out} from {ours.name}, set aside by an interrupted write"], messages
    assert (out / "index.faiss").read_bytes() == b"half"
    assert (mine / "thesis.tex").read_text() == "a user's own file" and (tmp_path / "elsewhere").is_dir()
    assert (tmp_path / f".ix.old-{dead + 1}").is_symlink() and (live / "index.faiss").exists()

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.pt").write_bytes(b"new")
    users = tmp_path / f".run.old-{dead}"
    users.mkdir()
    (users / "photos").mkdir()
    assert leftovers_of(run) == []
    settle_leftovers(run)
    assert (users / "photos").is_dir() and len(recwarn) == 1


@pytest.mark.slow  # long end-to-end run (tens of seconds): `pytest -m slow` runs it
def test_all_pairs_out_never_goes_inside_our_dirs_nor_over_a_file_it_did_not_write(cli, tmp_path, dataset):
    """Round 3 of the attack: --out inside a dataset or another index dir, and --force over a
    checkpoint or a manifest, were accepted."""
    import shutil

    x, manifest = write_embeddings(tmp_path, "e", 12)
    index = tmp_path / "ix"
    other = tmp_path / "other_ix"
    for target in (index, other):
        assert cli("index", "--embeddings", x, "--manifest", manifest, "--out", target, "-q").returncode == 0
    ds = tmp_path / "ds"
    shutil.copytree(dataset, ds)
    before = {ds: tree_digest(ds), other: tree_digest(other)}
    pairs = ("search", index, "--all-pairs", "--threshold", "-1")
    for out, words in ((ds / "pairs.csv", "is inside a dataset dir"), (other / "pairs.csv", "is inside an index dir")):
        result = cli(*pairs, "--out", out)
        assert result.returncode == 2 and words in result.stderr, result.stderr
    checkpoint = tmp_path / "run" / "checkpoints" / "last.pt"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_bytes(b"PK a checkpoint")
    for victim in (checkpoint, ds / "manifest.jsonl"):
        content = victim.read_bytes()
        result = cli(*pairs, "--out", victim, "--force")
        assert result.returncode == 2, result.stderr
        assert any(words in result.stderr for words in ("is inside a run dir", "is inside a dataset dir"))
        assert victim.read_bytes() == content
    assert {ds: tree_digest(ds), other: tree_digest(other)} == before
    mine = tmp_path / "pairs.csv"
    assert cli(*pairs, "--out", mine).returncode == 0
    assert cli(*pairs, "--out", mine, "--force").returncode == 0, "a pairs CSV of ours is replaced with --force"
    assert not list(tmp_path.glob(".pairs.csv.*")), "no lock or temporary file left"


def test_nothing_is_written_inside_a_samples_dir_that_make_samples_force_replaces_whole(cli, tmp_path):
    """Attack round 16 (F8): `search --all-pairs --out SAMPLES/pairs.csv` and `demo --out SAMPLES/demo`
    were accepted inside a samples dir, and the next `make-samples --force` of it was then refused,
    saying the dir held "files that receipt-embed did not write"."""
    x, manifest = write_embeddings(tmp_path, "e", 12)
    index = tmp_path / "ix"
    assert cli("index", "--embeddings", x, "--manifest", manifest, "--out", index, "-q").returncode == 0
    samples = tmp_path / "samples"
    small = ("make-samples", "--receipts", "2", "--devices", "1", "-q", "--out", samples)
    assert cli(*small).returncode == 0
    before = tree_digest(samples)
    for args, out in [
        (("search", index, "--all-pairs", "--threshold", "-1"), samples / "pairs.csv"),
        (("demo", "--samples", samples, "-q"), samples / "demo"),
        (("ingest", samples, "-q"), samples / "dataset"),
        (("make-samples", "--receipts", "1", "--devices", "1", "-q"), samples / "images" / "more"),
    ]:
        result = cli(*args, "--out", out)
        assert result.returncode == 2, (args, result.stderr)
        assert f"--out {out} is inside a samples dir ({samples}); that dir is replaced whole" in result.stderr
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert tree_digest(samples) == before and sorted(p.name for p in samples.iterdir()) == [
        "images",
        "manifest.csv",
        "samples.json",
    ]
    assert cli(*small, "--seed", "1", "--force").returncode == 0, "still replaceable"


def test_make_samples_writes_only_its_own_samples_dirs(cli, tmp_path, dataset):
    import shutil

    mine = tmp_path / "mine"
    (mine / "images").mkdir(parents=True)
    (mine / "images" / "r0000_phone_a.jpg").write_text("precious")
    (mine / "manifest.csv").write_text("my notes")
    ds = tmp_path / "ds"
    shutil.copytree(dataset, ds)
    before = {mine: tree_digest(mine), ds: tree_digest(ds)}
    small = ("make-samples", "--receipts", "1", "--devices", "1", "-q")
    for out, words in ((mine, "holds files that receipt-embed did not write"), (ds / "s", "is inside a dataset dir")):
        result = cli(*small, "--out", out, "--force")
        assert result.returncode == 2 and words in result.stderr, result.stderr
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert {mine: tree_digest(mine), ds: tree_digest(ds)} == before

    samples = tmp_path / "samples"
    assert cli(*small, "--out", samples).returncode == 0
    first = tree_digest(samples)
    assert set(first) == {"manifest.csv", "samples.json", "images/r0000_phone_a.jpg"}
    again = cli(*small, "--out", samples, "--seed", "1")
    assert again.returncode == 2 and "already holds a samples dir; pass --force" in again.stderr
    assert cli(*small, "--out", samples, "--seed", "1", "--force").returncode == 0
    assert tree_digest(samples) != first and json.loads((samples / "samples.json").read_text())["seed"] == 1
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".samples")) == []


def test_an_out_given_as_a_symlink_is_refused_not_swapped_away(cli, tmp_path, dataset):
    import os
    import shutil

    real = tmp_path / "real"
    shutil.copytree(dataset, real)
    os.symlink(real, tmp_path / "link")
    before = tree_digest(real)
    result = cli("ingest", REPO / "data_samples", "--out", tmp_path / "link", "--force", "-q")
    assert result.returncode == 2 and f"{tmp_path / 'link'} is a symbolic link (to {real})" in result.stderr
    assert (tmp_path / "link").is_symlink() and tree_digest(real) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]


def test_partial_staging_copies_of_killed_writers_are_removed(tmp_path):
    """Round 4 of the attack: a samples or dataset staging copy killed before its marker file was
    written was never removed."""
    from receipt_embed.staging import clean_leftovers

    dead = _dead_pid()
    samples = tmp_path / f".ms.staging-{dead}"
    (samples / "images").mkdir(parents=True)
    (samples / "images" / "r0000_phone_a.jpg").write_bytes(b"half")
    dataset = tmp_path / f".ds.staging-{dead}"
    dataset.mkdir()
    (dataset / "manifest.jsonl").write_text("{}\n")
    for name in ("ms", "ds"):
        with pytest.warns(UserWarning, match=rf"removed 1 leftover\(s\) .*\.{name}\.staging-{dead}"):
            clean_leftovers(tmp_path / name)
    assert not samples.exists() and not dataset.exists()


@pytest.mark.slow  # trains: a long run, kept out of the default suite (-m slow runs it)
def test_a_run_dir_whose_files_are_links_is_never_written_through(cli, tmp_path, dataset):
    """Round 4 of the attack: a metrics.jsonl or checkpoints/ link planted in a run dir made
    `train --resume` append or write outside it."""
    import os

    from conftest import train_tiny

    _, _ = train_tiny(tmp_path / "t")
    run = tmp_path / "t" / "run"
    outside = tmp_path / "outside.txt"
    outside.write_text("a file elsewhere\n")
    os.rename(run / "metrics.jsonl", tmp_path / "metrics.bak")
    os.symlink(outside, run / "metrics.jsonl")
    result = cli("train", "--out", run, "--resume", "-q", "--set", "train.epochs=2")
    assert result.returncode == 2 and f"{run / 'metrics.jsonl'} is a symbolic link" in result.stderr, result.stderr
    assert outside.read_text() == "a file elsewhere\n"


def test_a_users_file_below_the_top_level_makes_the_dir_theirs(tmp_path):
    """Attack round 5: `--force` deleted INDEX/audit/notes.txt, RUN/checkpoints/notes.txt and a folder
    named audit.html; each now makes the dir the user's, refused even with --force."""
    from receipt_embed.outdir import check_replaceable, dir_kind
    from receipt_embed.training.rundir import is_run_dir

    index = tmp_path / "idx"
    (index / "audit").mkdir(parents=True)
    (index / "index.json").write_text("{}")
    (index / "audit" / "audit.json").write_text("{}")
    assert dir_kind(index) == "index"  # an index with its own report: ours
    (index / "audit" / "notes.txt").write_text("mine")
    assert dir_kind(index) == "other"
    with pytest.raises(ValueError, match="never replaced"):
        check_replaceable(index, "index", force=True)
    assert (index / "audit" / "notes.txt").read_text() == "mine"

    report = tmp_path / "report"
    (report / "audit.html").mkdir(parents=True)
    (report / "audit.json").write_text("{}")
    (report / "audit.html" / "draft.txt").write_text("mine")
    assert dir_kind(report) == "other"

    samples = tmp_path / "samples"
    (samples / "images").mkdir(parents=True)
    (samples / "manifest.csv").write_text("path\n")
    (samples / "samples.json").write_text("{}")
    (samples / "images" / "r0000_scanner.jpg").write_bytes(b"x")
    assert dir_kind(samples) == "samples"
    (samples / "images" / "notes.txt").write_text("mine")
    assert dir_kind(samples) == "other"

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.pt").write_bytes(b"")
    (run / "checkpoints" / "best.pt").write_bytes(b"")
    assert is_run_dir(run)
    (run / "checkpoints" / "notes.txt").write_text("mine")
    assert not is_run_dir(run)


def test_sweep_values_name_one_run_dir_inside_out_each(tmp_path):
    """Attack round 5: a sweep value holding `/` or `..` named a run dir outside --out (and replaced
    another run there with --force); values that would share a dir, or repeat, are refused up front."""
    from receipt_embed.config import ConfigError
    from receipt_embed.training.sweep import parse_sweep, run_name

    assert run_name("loss.temperature", "0.05") == "loss.temperature=0.05"
    for value in ("../../../runV", "a/b", "/etc", "..", "x\ny"):
        name = run_name("model.encoder", value)
        assert "/" not in name and "\n" not in name and (tmp_path / name).parent == tmp_path, name
    assert run_name("..x", "1").startswith("_")
    with pytest.raises(ConfigError, match="would share the run dir model.encoder=a_b"):
        parse_sweep("model.encoder=a/b,a_b")
    with pytest.raises(ConfigError, match="gives the value '0.1' more than once"):
        parse_sweep("loss.temperature=0.1,0.2,0.1")


def test_a_mount_point_inside_a_dir_makes_it_never_ours(tmp_path):
    """Attack round 6: `index --force` over INDEX whose audit/ was another folder bind-mounted there
    deleted that folder's files; a mount point inside a dir means it is never replaced."""
    import subprocess

    from receipt_embed.outdir import dir_kind

    index = tmp_path / "idx"
    (index / "audit").mkdir(parents=True)
    (index / "index.json").write_text("{}")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "audit.json").write_text("{}")
    if subprocess.run(["mount", "--bind", str(outside), str(index / "audit")], capture_output=True).returncode:
        pytest.skip("bind mounts need root (CAP_SYS_ADMIN)")
    try:
        assert dir_kind(index) == "other"
    finally:
        subprocess.run(["umount", str(index / "audit")], check=True)
    assert dir_kind(index) == "index" and (outside / "audit.json").exists()


def test_an_out_dir_that_is_a_mount_point_is_one_clear_line(tmp_path):
    """Attack round 7: `ingest --out MOUNT` failed at the swap with "[Errno 16] ... busy"."""
    import subprocess

    mount = tmp_path / "mnt"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("mounting needs root (CAP_SYS_ADMIN)")
    try:
        result = run_cli("ingest", REPO / "data_samples", "--out", mount, "-q")
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip() == (
            f"Error: {mount} is a mount point, and a new dataset dir cannot be swapped in for it; "
            f"write into a folder inside it instead (e.g. --out {mount / 'dataset'})"
        )
        assert list(mount.iterdir()) == [] and not list(tmp_path.glob(".mnt.*"))
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize("kind", ["dataset", "index", "shard", "audit", "samples", "pairs", "run"])
def test_nothing_is_written_inside_a_run_dir_that_train_force_replaces_whole(tmp_path, kind):
    """Attack round 14: `index`, `ingest`, `make-samples`, `audit-shortcuts` and `search --all-pairs`
    accepted an --out inside a run dir, and the next `train --force` deleted them without a word.
    Only RUN/dataset (the samples `train` ingests itself, which a replacement keeps) is allowed."""
    from receipt_embed.errors import BadInput
    from receipt_embed.outdir import refuse_nested

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.pt").write_bytes(b"")
    for out in (run / "out", run / "checkpoints" / "out"):
        with pytest.raises(BadInput) as info:
            refuse_nested(out, kind)
        assert str(info.value).startswith(f"--out {out} is inside a run dir ({run}); that dir is replaced whole")
    if kind == "dataset":
        refuse_nested(run / "dataset", kind)  # allowed
        with pytest.raises(BadInput):
            refuse_nested(run / "dataset" / "x", kind)


def test_ingest_into_a_run_dir_is_refused_and_the_run_is_untouched(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.pt").write_bytes(b"weights")
    result = run_cli("ingest", REPO / "data_samples", "--out", run / "ds")
    assert result.returncode == 2 and f"--out {run / 'ds'} is inside a run dir ({run})" in result.stderr
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints"]


def test_train_force_refuses_a_current_directory_inside_the_run_it_replaces(tmp_path, monkeypatch):
    """Attack round 17 G11: `cd RUN/checkpoints && receipt-embed train --out .. --force` moved the old
    run's files aside and deleted them, leaving the shell in a deleted directory. It is refused in
    one line, like the other commands' --out holding the current directory, and the run is untouched."""
    import os

    from conftest import TINY_TRAINING, train_tiny

    from receipt_embed.errors import BadInput
    from receipt_embed.training.resume import open_run

    dataset, _ = train_tiny(tmp_path)
    run = tmp_path / "run"
    (run / "plots").mkdir()  # a plugin's folder in the run dir goes with the old run too
    before = tree_digest(run)
    sets = [arg for setting in TINY_TRAINING for arg in ("--set", setting)]
    for here in (run / "checkpoints", run / "plots"):
        result = run_cli("train", "--data", dataset, "--out", "..", "--force", "-q", *sets, cwd=here)
        assert (result.returncode, result.stdout) == (2, ""), result
        assert result.stderr == (
            f"Error: --out .. holds the current directory ({os.path.realpath(here)}), and --force replaces "
            f"../{here.name} whole: give a path to another output dir, or cd out of it first\n"
        )
        assert tree_digest(run) == before and not list(tmp_path.glob(".run.old-*"))
    monkeypatch.chdir(run / "checkpoints")  # the library (and each run of a sweep) refuses it too
    with pytest.raises(BadInput, match="holds the current directory"):
        open_run(run, resume=False, force=True, world_size=1)
    monkeypatch.chdir(run)  # the run dir itself stays: training from there is fine
    assert open_run(run, resume=False, force=True, world_size=1) is None
    monkeypatch.chdir(run / "checkpoints")
    assert open_run(run, resume=True, force=False, world_size=1) is not None  # --resume replaces nothing


def test_an_out_that_is_or_holds_the_current_directory_is_refused(cli, tmp_path, monkeypatch):
    """Attack round 16 (F5): `--out .` (or an --out above the current directory) was swapped whole like
    any output dir, so the command wrote its output there and left the user's shell in a deleted
    directory, where the next command failed."""

    small = write_embeddings(tmp_path, "small", 12)
    here = tmp_path / "here"
    here.mkdir()
    for args in (
        ["ingest", REPO / "data_samples", "--out", "."],
        ["index", "--embeddings", small[0], "--manifest", small[1], "--out", here],
        ["make-samples", "--receipts", "1", "--devices", "1", "--out", "."],
    ):
        result = cli(*args, "-q", cwd=here)
        assert result.returncode == 2 and "is the current directory; give a path to a new or existing output dir" in (
            result.stderr
        ), result.stderr
        assert len(result.stderr.splitlines()) == 1 and here.is_dir() and list(here.iterdir()) == []
    # from inside a samples dir, replacing it with --force would delete the shell's directory too
    samples = tmp_path / "samples"
    assert cli("make-samples", "--receipts", "1", "--devices", "1", "--out", samples, "-q").returncode == 0
    before = tree_digest(samples)
    result = cli("make-samples", "--receipts", "1", "--out", "..", "--force", "-q", cwd=samples / "images")
    assert result.returncode == 2 and f"--out {samples} holds the current directory ({samples / 'images'})" in (
        result.stderr
    ), result.stderr
    assert tree_digest(samples) == before
    # the library refuses it too
    from receipt_embed.errors import BadInput
    from receipt_embed.outdir import check_replaceable

    monkeypatch.chdir(here)
    with pytest.raises(BadInput, match="is the current directory"):
        check_replaceable(".", "index", force=True)
    check_replaceable(here / "index", "index", force=False)
