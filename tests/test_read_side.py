"""Reads of run, dataset and index dir files a hostile copy could have replaced.

Each test names the finding it covers (F4: non-regular run files, F5: YAML alias bombs,
F6: too wide a thumbnail root, F7: a substituted index.faiss, F8: lying .npy headers,
F12: misleading messages, F14: non-string manifest values). Where a regression would
hang, the CLI runs in a subprocess with a timeout.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import run_cli, train_tiny

HANG = 60

BOMB = """a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("readside"))


def _copy_run(trained, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(trained[1].parents[1], run)
    return run


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_non_regular_metrics_file_stops_resume_at_once(trained, tmp_path, kind):
    """F4: a FIFO (hang) or a /dev/zero symlink (memory exhaustion) as metrics.jsonl is named, exit 2."""
    run = _copy_run(trained, tmp_path)
    (run / "metrics.jsonl").unlink()
    if kind == "fifo":
        os.mkfifo(run / "metrics.jsonl")
    else:
        os.symlink("/dev/zero", run / "metrics.jsonl")
    result = run_cli("train", "--out", run, "--resume", "--set", "train.epochs=2", "-q", timeout=HANG)
    assert result.returncode == 2, result.stderr
    assert "metrics.jsonl" in result.stderr and "not a regular file" in result.stderr
    assert "Traceback" not in result.stderr


def test_non_regular_data_record_is_named(trained, tmp_path):
    """F4: data.json as a FIFO is refused by name, not skipped or read."""
    from receipt_embed.training.resume import recorded_data_dir
    from receipt_embed.userfiles import UnusableFile

    run = _copy_run(trained, tmp_path)
    (run / "data.json").unlink()
    os.mkfifo(run / "data.json")
    with pytest.raises(UnusableFile, match="data.json.*FIFO"):
        recorded_data_dir(run)


def test_read_jsonl_refuses_devices():
    """F4: the shared JSON-lines reader never opens a device."""
    from receipt_embed.fileio import read_jsonl, read_jsonl_tail_tolerant
    from receipt_embed.userfiles import UnusableFile

    with pytest.raises(UnusableFile, match="character device"):
        read_jsonl("/dev/zero")
    with pytest.raises(UnusableFile, match="character device"):
        read_jsonl_tail_tolerant("/dev/zero")


def test_alias_bomb_config_fails_fast_naming_the_file(tmp_path):
    """F5: a billion-laughs --config is refused with its name, exit 2, in well under the timeout."""
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BOMB)
    result = run_cli("config", "--config", bomb, timeout=HANG)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert str(bomb) in result.stderr and "alias" in result.stderr
    assert "Traceback" not in result.stderr


def test_alias_bomb_in_a_run_config_fails_resume(trained, tmp_path):
    """F5: the same bomb as a run's config.yaml stops --resume, naming the file."""
    run = _copy_run(trained, tmp_path)
    (run / "config.yaml").write_text(BOMB)
    result = run_cli("train", "--out", run, "--resume", "-q", timeout=HANG)
    assert result.returncode == 2, result.stderr
    assert "config.yaml" in result.stderr and "alias" in result.stderr


@pytest.fixture(scope="module")
def embeddings_index(trained, tmp_path_factory):
    """An exact index dir of random external embeddings for the dataset's captures."""
    import numpy as np

    from receipt_embed.data.dataset_dir import load_dataset_dir
    from receipt_embed.indexing.build import index_embeddings

    base = tmp_path_factory.mktemp("embidx")
    count = len(load_dataset_dir(trained[0]))
    vectors = np.random.default_rng(0).normal(size=(count, 8)).astype(np.float32)
    np.save(base / "vectors.npy", vectors)
    index_embeddings(base / "vectors.npy", trained[0], base / "index")
    return base / "index", vectors


def _substitute_faiss(index_dir: Path, vectors, factory: str) -> None:
    import faiss
    from tamper import reseal

    substitute = faiss.index_factory(vectors.shape[1], factory, faiss.METRIC_INNER_PRODUCT)
    substitute.train(vectors)
    substitute.add(vectors)  # the raw, unnormalised vectors
    faiss.write_index(substitute, str(index_dir / "index.faiss"))
    reseal(index_dir, "index.faiss")


@pytest.mark.parametrize("factory, message", [("IVF4,Flat", "IndexIVFFlat"), ("Flat", "scores")])
def test_substituted_index_faiss_is_refused(embeddings_index, tmp_path, factory, message):
    """F7: another type of index, or one of unnormalised vectors, with checksums recomputed, is refused."""
    from tamper import copy_index

    from receipt_embed.indexing import IndexDirError, load_index_dir

    index_dir = copy_index(embeddings_index[0], tmp_path / "index")
    _substitute_faiss(index_dir, embeddings_index[1] * 10, factory)
    with pytest.raises(IndexDirError, match=f"index.faiss.*{message}"):
        load_index_dir(index_dir)
    result = run_cli("search", index_dir, "--all-pairs", "--threshold", "0.99", "--out", "-", timeout=HANG)
    assert result.returncode == 2 and "index.faiss" in result.stderr, result.stderr


@pytest.mark.parametrize("factory", ["Flat", "HNSW8"])
def test_attack_round_22_mc1_an_index_holding_the_rows_in_another_order_is_refused(
    trained, embeddings_index, tmp_path, factory
):
    """Attack round 22 MC1: index.faiss rebuilt from the stored (normalised) vectors in reverse
    order, checksums resealed, scored every row at ~1 and so loaded, and search then named the
    wrong receipt as the duplicate. The load-time sample now checks which rows come back."""
    import faiss
    import numpy as np
    from tamper import copy_index, reseal

    from receipt_embed.indexing import IndexDirError, load_index_dir
    from receipt_embed.indexing.build import index_embeddings

    index_dir = tmp_path / "index"
    if factory == "Flat":
        copy_index(embeddings_index[0], index_dir)
    else:
        index_embeddings(embeddings_index[0] / "embeddings.npy", trained[0], index_dir, factory=factory)
    assert load_index_dir(index_dir).index.ntotal == len(embeddings_index[1])  # as built, it loads
    stored = np.load(index_dir / "embeddings.npy")
    reversed_index = faiss.index_factory(stored.shape[1], factory, faiss.METRIC_INNER_PRODUCT)
    reversed_index.add(np.ascontiguousarray(stored[::-1]))
    faiss.write_index(reversed_index, str(index_dir / "index.faiss"))
    reseal(index_dir, "index.faiss")
    with pytest.raises(IndexDirError, match="index.faiss.*the index's rows are not the items' rows"):
        load_index_dir(index_dir)
    result = run_cli("search", index_dir, "--all-pairs", "--threshold", "0.99", "--out", "-", timeout=HANG)
    assert result.returncode == 2 and "rows are not the items' rows" in result.stderr, result.stderr


def test_untouched_index_still_loads(embeddings_index):
    """F7: the load-time check passes an index dir `index` wrote."""
    from receipt_embed.indexing import load_index_dir

    assert load_index_dir(embeddings_index[0]).index.ntotal == len(embeddings_index[1])


def _lying_npy(path: Path) -> Path:
    """A 1 KB .npy whose header claims (9999999999, 8) float32 (298 GiB)."""
    import numpy as np
    from numpy.lib import format as npy_format

    with open(path, "wb") as handle:
        npy_format.write_array_header_1_0(handle, {"descr": "<f4", "fortran_order": False, "shape": (9999999999, 8)})
        handle.write(b"\0" * 1024)
    assert np.lib.format.read_magic(open(path, "rb"))
    return path


def test_lying_npy_header_is_refused_for_embeddings(trained, tmp_path):
    """F8: `index --embeddings` with a header lying about its shape exits 2 naming the file."""
    lying = _lying_npy(tmp_path / "lying.npy")
    result = run_cli("index", "--embeddings", lying, "--manifest", trained[0], "--out", tmp_path / "idx", timeout=HANG)
    assert result.returncode == 2, result.stderr
    assert "lying.npy" in result.stderr and "header" in result.stderr and "Traceback" not in result.stderr


def test_lying_npy_header_is_refused_in_an_index_dir(embeddings_index, tmp_path):
    """F8: INDEX/embeddings.npy with a lying header (checksums recomputed) is an IndexDirError, not a MemoryError."""
    from tamper import copy_index, reseal

    from receipt_embed.indexing import IndexDirError, load_index_dir

    index_dir = copy_index(embeddings_index[0], tmp_path / "index")
    _lying_npy(index_dir / "embeddings.npy")
    reseal(index_dir, "embeddings.npy")
    with pytest.raises(IndexDirError, match="embeddings.npy.*header says shape"):
        load_index_dir(index_dir)


def test_lying_npy_header_is_refused_in_a_shard(tmp_path):
    """F8: the shared loader refuses a shape x itemsize that does not match the file (shards use it too)."""
    from receipt_embed.npyfile import BadNpyFile, load_npy

    with pytest.raises(BadNpyFile, match="lying.npy.*9999999999"):
        load_npy(_lying_npy(tmp_path / "lying.npy"))


def test_non_string_manifest_values_are_rejected_as_invalid(tmp_path):
    """F14: objects, lists, booleans, 1e400 and control characters in required JSONL columns are
    `invalid_value` rejections naming the column; object metadata is kept as JSON text."""
    import json

    from test_ingest import _jpeg

    from receipt_embed.config import load_config
    from receipt_embed.ingest import ingest

    rows = [
        {"path": "ok.jpg", "receipt_id": 7, "device": "phone", "meta": {"a": 1}},
        {"path": "1.jpg", "receipt_id": {"a": 1}, "device": "phone"},
        {"path": "2.jpg", "receipt_id": "r2", "device": ["a"]},
        {"path": "3.jpg", "receipt_id": True, "device": "phone"},
        {"path": "5.jpg", "receipt_id": "r\x00id", "device": "phone"},
        {"path": "6\x1b[2J.jpg", "receipt_id": "r6", "device": "phone"},
    ]
    for row in rows:
        (tmp_path / row["path"].replace("\x1b[2J", "")).write_bytes(_jpeg(len(row["path"])))
    text = "".join(json.dumps(row) + "\n" for row in rows)
    text += '{"path": "4.jpg", "receipt_id": 1e400, "device": "phone"}\n'  # json.dumps would write Infinity
    (tmp_path / "m.jsonl").write_text(text)
    result = ingest(tmp_path / "m.jsonl", tmp_path / "out", load_config().ingest)
    rejected = {entry["line"]: entry for entry in result.rejected}
    assert {line: entry["reason"] for line, entry in rejected.items()} == {n: "invalid_value" for n in range(2, 8)}
    for line, column in (
        (2, "receipt_id"),
        (3, "device"),
        (4, "receipt_id"),
        (5, "receipt_id"),
        (6, "path"),
        (7, "receipt_id"),
    ):
        assert column in rejected[line]["detail"], rejected[line]
    assert [(row["receipt_id"], row["meta"]) for row in result.rows] == [("7", '{"a":1}')]


def test_empty_receipt_id_in_items_is_refused(embeddings_index, tmp_path):
    """F14: items.jsonl with an empty receipt_id (checksums recomputed) is refused by index loading."""
    from tamper import copy_index, rewrite_items

    from receipt_embed.indexing import IndexDirError, load_index_dir

    index_dir = copy_index(embeddings_index[0], tmp_path / "index")
    rewrite_items(index_dir, lambda row, item: {**item, "receipt_id": ""} if row == 3 else item)
    with pytest.raises(IndexDirError, match=r"items.jsonl, row 3 .*receipt_id is empty"):
        load_index_dir(index_dir)


def test_too_wide_roots():
    """F6: /, a top-level folder and the home folder (or above) are too wide; a project folder is not."""
    from receipt_embed.audit.confine import too_wide_root

    home = Path.home().resolve()
    assert all(too_wide_root(Path(p)) for p in ("/", "/tmp", "/home", home, home.parent))
    assert not too_wide_root(home / "receipts" / "captures") and not too_wide_root(Path("/srv/data/captures"))


def test_forged_dataset_report_naming_root_gets_no_thumbnails(embeddings_index, tmp_path):
    """F6: index.json -> a fake dataset dir whose ingest_report.json source is /manifest.csv makes
    the root "/"; it is refused with one warning, and --images-root still allows a folder."""
    import json

    from conftest import REPO
    from tamper import copy_index, edit_meta

    fake = tmp_path / "fake_dataset"
    fake.mkdir()
    (fake / "ingest_report.json").write_text(json.dumps({"source": "/manifest.csv"}))
    index_dir = copy_index(embeddings_index[0], tmp_path / "index")
    edit_meta(index_dir, lambda meta: meta["source"].update(manifest=str(fake / "manifest.jsonl")))
    report = tmp_path / "report"
    result = run_cli("audit-shortcuts", index_dir, "--out", report, "--gallery", "2", "-q", timeout=HANG)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "too wide" in line]
    assert len(warnings) == 1 and "--images-root" in warnings[0] and "(/)" in warnings[0], result.stderr
    assert "data:image/jpeg" not in (report / "audit.html").read_text()
    allowed = run_cli(
        "audit-shortcuts",
        index_dir,
        "--out",
        tmp_path / "report2",
        "--gallery",
        "2",
        "-q",
        "--images-root",
        REPO / "data_samples",
        timeout=HANG,
    )
    assert allowed.returncode == 0, allowed.stderr
    assert "data:image/jpeg" in (tmp_path / "report2" / "audit.html").read_text()


def test_fifo_dataset_manifest_is_named_not_missing(trained, tmp_path):
    """F12: a FIFO as a dataset dir's manifest.jsonl is named as a FIFO, not reported "not found"."""
    from receipt_embed.data.dataset_dir import load_dataset_dir
    from receipt_embed.userfiles import UnusableFile

    (tmp_path / "ds").mkdir()
    os.mkfifo(tmp_path / "ds" / "manifest.jsonl")
    with pytest.raises(UnusableFile, match="manifest.jsonl: is a FIFO"):
        load_dataset_dir(tmp_path / "ds")


def test_device_as_recorded_checkpoint_is_named(embeddings_index):
    """F12: index.json's source.checkpoint of /dev/zero is named as not a regular file."""
    from receipt_embed.indexing import IndexDirError, load_index_dir
    from receipt_embed.indexing.search import resolve_checkpoint

    loaded = load_index_dir(embeddings_index[0])
    loaded.meta["source"] = {"kind": "checkpoint", "checkpoint": "/dev/zero", "checkpoint_sha256": "0" * 64}
    with pytest.raises(IndexDirError, match="/dev/zero: is a character device, not a regular file"):
        resolve_checkpoint(loaded)


def test_symlink_loop_source_and_config_are_named(tmp_path):
    """F12: a symlink loop as ingest SOURCE or --config says so (click alone says "does not exist")."""
    os.symlink(tmp_path / "b", tmp_path / "a")
    os.symlink(tmp_path / "a", tmp_path / "b")
    for args in (("ingest", tmp_path / "a", "--out", tmp_path / "ds"), ("config", "--config", tmp_path / "a")):
        result = run_cli(*args, timeout=HANG)
        assert result.returncode == 2 and "symlink loop" in result.stderr, result.stderr


@pytest.mark.parametrize("content", ["text", "npy", "device"])
def test_bad_pretrained_file_is_one_line_naming_it(tmp_path, content):
    """F12: model.pretrained naming /etc/passwd-like text, a .npy or a device is one ValueError naming the file."""
    import numpy as np

    from receipt_embed.models.receipt_cnn import ReceiptCNN

    path = {"text": tmp_path / "passwd", "npy": tmp_path / "w.npy", "device": Path("/dev/zero")}[content]
    if content == "text":
        path.write_text("root:x:0:0:root:/root:/bin/bash\n")
    elif content == "npy":
        np.save(path, np.zeros(3))
    with pytest.raises(ValueError) as info:
        ReceiptCNN(pretrained=str(path))
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_checkpoint_with_non_finite_weights_is_named(trained, tmp_path):
    """F12: a checkpoint whose weights load but hold NaN/Inf (a flipped exponent bit) names the tensor."""
    import torch

    from receipt_embed.training.checkpoint import CheckpointError, load_checkpoint

    state = torch.load(trained[1], map_location="cpu", weights_only=True)
    name = next(k for k, v in state["model"].items() if v.is_floating_point() and v.numel() > 1)
    state["model"][name].view(-1)[0] = float("inf")
    torch.save(state, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError, match=f"bad.pt: model.{name} holds NaN or Inf"):
        load_checkpoint(tmp_path / "bad.pt")


def test_non_regular_data_record_on_resume_is_one_line(trained, tmp_path):
    """F4: `train --resume` without --data on a run whose data.json is a FIFO exits 2 naming it (no traceback)."""
    run = _copy_run(trained, tmp_path)
    (run / "data.json").unlink()
    os.mkfifo(run / "data.json")
    result = run_cli("train", "--out", run, "--resume", "--set", "train.epochs=2", "-q", timeout=HANG)
    assert result.returncode == 2, result.stderr
    assert "data.json" in result.stderr and "FIFO" in result.stderr and "Traceback" not in result.stderr


def test_train_on_a_dataset_with_a_fifo_file_does_not_hang(trained, tmp_path):
    """F12/N1: `train --data D` whose manifest.jsonl is a FIFO exits at once naming it, and the
    own-input check reads a FIFO ingest_report.json as nothing rather than blocking on it."""
    from receipt_embed.training.rundir import dataset_sources

    data = tmp_path / "ds"
    shutil.copytree(trained[0], data)
    (data / "ingest_report.json").unlink()
    os.mkfifo(data / "ingest_report.json")
    assert len(dataset_sources(data)) > 1  # the captures still count; the FIFO was not opened
    (data / "manifest.jsonl").unlink()
    os.mkfifo(data / "manifest.jsonl")
    result = run_cli("train", "--data", data, "--out", tmp_path / "run", "--set", "train.epochs=1", "-q", timeout=HANG)
    assert result.returncode == 2, result.stderr
    assert "manifest.jsonl" in result.stderr and "FIFO" in result.stderr and "Traceback" not in result.stderr


def test_a_last_checkpoint_that_is_a_symlink_is_not_resumed_from(trained, tmp_path):
    """Attack round 7: `--resume` read through a `checkpoints/last.pt` link to another run's file,
    and then continued that run here as if it were this one."""
    run = _copy_run(trained, tmp_path)
    last = run / "checkpoints" / "last.pt"
    elsewhere = tmp_path / "other.pt"
    last.rename(elsewhere)
    last.symlink_to(elsewhere)
    result = run_cli("train", "--out", run, "--resume", "--set", "train.epochs=2", "-q", timeout=HANG)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        f"Error: cannot resume from {last}: it is a symbolic link (to {elsewhere}), not a checkpoint this run "
        "wrote; copy the file in its place if it is the one to continue from"
    )
    assert last.is_symlink() and elsewhere.stat().st_size > 0, "nothing is replaced"


def test_the_own_input_check_reads_a_large_ingest_report(trained, tmp_path):
    """Attack round 8: the report lists every rejected row (150 MB for a million), but this check
    read it only up to 16 MB, so a dataset with a large report lost its source folder from the
    inputs an `--out` must not be inside."""
    from receipt_embed.training.rundir import dataset_sources

    data = tmp_path / "ds"
    shutil.copytree(trained[0], data)
    report = json.loads((data / "ingest_report.json").read_text())
    report["rejected"] = [{"line": n, "reason": "repeated_row", "detail": "x" * 200} for n in range(100_000)]
    (data / "ingest_report.json").write_text(json.dumps(report))
    assert (data / "ingest_report.json").stat().st_size > 20 * 1024 * 1024
    source = Path(report["source"])
    assert (source.parent if source.suffix in (".csv", ".jsonl") else source) in dataset_sources(data)
