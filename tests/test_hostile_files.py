"""Files that are not regular files, never end, are too large, or changed since ingest.

Every place that reads a user-named file refuses a FIFO, a device or a directory by name
(never opening it, so nothing hangs), caps the bytes it reads and the pixels it decodes,
and refuses captures replaced after ingest. Where a regression would hang, the CLI runs in
a subprocess with a timeout, or the call runs under a real SIGALRM deadline.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import signal
import struct
import time
import zlib
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, TINY_TRAINING, builtin_registry, run_cli, train_tiny
from PIL import Image

from receipt_embed.config import ConfigError, load_config
from receipt_embed.data.cache import CaptureChanged, ImageCache
from receipt_embed.data.dataset_dir import load_dataset_dir, verify_captures
from receipt_embed.images import ImageRejected, load_resized
from receipt_embed.indexing import IndexDirError, load_index_dir
from receipt_embed.ingest import ManifestError, ingest
from receipt_embed.userfiles import UnusableFile

HANG = 60  # seconds a CLI run may take before it counts as hung


@contextmanager
def deadline(seconds: float = 5.0):
    """Fail (instead of hanging the suite) when the body blocks, e.g. on opening a FIFO."""

    def expire(signum, frame):
        raise TimeoutError(f"blocked for more than {seconds}s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _jpeg(seed: int, size=(40, 80), pad: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=90)
    return buffer.getvalue() + b"\0" * pad  # decoders ignore bytes after the end marker


def _png_bomb(width: int = 100_000, height: int = 100_000) -> bytes:
    """A PNG whose header declares 10^10 pixels but holds almost no data."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def _settings(**overrides):
    return load_config(overrides=[f"ingest.{k}={v}" for k, v in overrides.items()]).ingest


@pytest.fixture
def small_dataset(tmp_path):
    """10 receipts x 2 captures of synthetic JPEGs, ingested into tmp/dataset."""
    caps = tmp_path / "caps"
    caps.mkdir()
    lines = ["path,receipt_id,device"]
    for i in range(20):
        (caps / f"c{i}.jpg").write_bytes(_jpeg(i))
        lines.append(f"c{i}.jpg,r{i // 2},{'phone' if i % 2 else 'scanner'}")
    (caps / "manifest.csv").write_text("\n".join(lines) + "\n")
    ingest(caps, tmp_path / "dataset", _settings())
    return tmp_path / "dataset"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("hostile"))


# --- ingest: capture rows ---------------------------------------------------------------


def test_hostile_rows_are_rejected_with_reasons_and_never_hang(tmp_path):
    caps = tmp_path / "caps"
    caps.mkdir()
    for i in range(3):
        (caps / f"good{i}.jpg").write_bytes(_jpeg(i))
    (caps / "big.jpg").write_bytes(_jpeg(9, pad=40_000))
    (caps / "bomb.png").write_bytes(_png_bomb())
    os.mkfifo(caps / "pipe.jpg")
    os.symlink("loop_b.jpg", caps / "loop_a.jpg")
    os.symlink("loop_a.jpg", caps / "loop_b.jpg")
    (caps / "folder.jpg").mkdir()
    rows = [
        ("good0.jpg", "r1"),
        ("pipe.jpg", "r2"),
        ("loop_a.jpg", "r3"),
        ("nul\0byte.jpg", "r4"),
        ("x" * 300 + ".jpg", "r5"),
        ("big.jpg", "r6"),
        ("bomb.png", "r7"),
        ("/dev/zero", "r8"),
        ("folder.jpg", "r9"),
        ("good1.jpg", "r1"),
        ("good2.jpg", "r10"),
    ]
    (caps / "manifest.jsonl").write_text(
        "".join(json.dumps({"path": p, "receipt_id": r, "device": "phone"}) + "\n" for p, r in rows)
    )
    started = time.monotonic()
    result = run_cli(
        "ingest", caps, "--out", tmp_path / "out", "--max-bytes", "30000", "--allow-absolute-paths", "-q", timeout=HANG
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and time.monotonic() - started < HANG
    report = json.loads((tmp_path / "out" / "ingest_report.json").read_text())
    reasons = {entry["line"]: entry["reason"] for entry in report["rejected"]}
    assert reasons == {
        2: "not_a_file",
        3: "unresolvable_path",
        4: "unresolvable_path",
        5: "unresolvable_path",
        6: "too_large",
        7: "too_many_pixels",
        8: "not_a_file",
        9: "not_a_file",
    }
    details = {entry["line"]: entry["detail"] for entry in report["rejected"]}
    assert "pipe.jpg" in details[2] and "FIFO" in details[2]
    assert "symbolic links" in details[3] and "NUL byte" in details[4] and "too long" in details[5]
    assert "over the limit of 30000" in details[6] and "character device" in details[8]
    accepted = [json.loads(line) for line in (tmp_path / "out" / "manifest.jsonl").read_text().splitlines()]
    assert [Path(row["path"]).name for row in accepted] == ["good0.jpg", "good1.jpg", "good2.jpg"]
    for row in accepted:
        info = os.stat(row["path"])
        assert (row["bytes"], row["mtime_ns"]) == (info.st_size, info.st_mtime_ns)
        assert list(row)[:7] == ["path", "receipt_id", "device", "split", "sha256", "width", "height"]


def test_manifest_columns_that_ingest_writes_are_refused(tmp_path):
    (tmp_path / "a.jpg").write_bytes(_jpeg(0))
    (tmp_path / "manifest.csv").write_text(
        "path,receipt_id,device,sha256,duplicate_conflict,split\na.jpg,r1,phone,abc,true,train\n"
    )
    with pytest.raises(ManifestError, match=r"column\(s\) sha256, duplicate_conflict are written by ingest") as caught:
        ingest(tmp_path, tmp_path / "out", _settings())
    assert "'sha256' -> 'sha256_given'" in str(caught.value)
    assert not (tmp_path / "out").exists()
    result = run_cli("ingest", tmp_path / "manifest.csv", "--out", tmp_path / "out", timeout=HANG)
    assert result.returncode == 2 and "sha256, duplicate_conflict" in result.stderr and "Traceback" not in result.stderr
    (tmp_path / "manifest.csv").write_text("path,receipt_id,device,split\na.jpg,r1,phone,train\n")
    assert ingest(tmp_path, tmp_path / "out", _settings()).rows[0]["split"] == "train"


def test_attack_round_22_mb4_jsonl_keys_lose_their_spaces_and_case_variants_of_own_columns_are_refused(tmp_path):
    """Attack round 22 MB4: a JSONL key " sha256" slipped past the reserved-name check (CSV
    headers were stripped, JSONL keys were not), and a `Split` column was kept as metadata, its
    splits ignored. JSONL keys are now stripped as CSV headers are, and a column that is one of
    ingest's own names in other letter case is refused, naming the rename."""
    (tmp_path / "a.jpg").write_bytes(_jpeg(0))
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text(json.dumps({"path": "a.jpg", "receipt_id": "r1", "device": "phone", " sha256": "abc"}) + "\n")
    with pytest.raises(ManifestError, match=r"column\(s\) sha256 are written by ingest"):
        ingest(manifest, tmp_path / "out", _settings())
    manifest.write_text(
        json.dumps({"path": "a.jpg", "receipt_id": "r1", "device": "phone", "split ": "train", "split": "val"}) + "\n"
    )
    with pytest.raises(ManifestError, match=r"line 1: key\(s\) 'split' given twice"):
        ingest(manifest, tmp_path / "out", _settings())
    manifest.write_text(json.dumps({" path ": "a.jpg", "receipt_id": "r1", "device": "phone", "split": "val"}) + "\n")
    assert ingest(manifest, tmp_path / "out", _settings()).rows[0]["split"] == "val"
    for name, header in (("Split", "path,receipt_id,device,Split"), ("SHA256", "path,receipt_id,device,SHA256")):
        csv_manifest = tmp_path / f"{name}.csv"
        csv_manifest.write_text(f"{header}\na.jpg,r1,phone,train\n")
        result = run_cli("ingest", csv_manifest, "--out", tmp_path / name, timeout=HANG)
        assert (
            result.returncode == 2
            and f"column(s) {name} differ from ingest's own column names only in letter case" in result.stderr
        ), result.stderr
        assert f"'{name}' -> '{name.lower()}'" in result.stderr and "Traceback" not in result.stderr
        assert not (tmp_path / name).exists()
    np.save(tmp_path / "x.npy", np.eye(1, 4, dtype=np.float32))
    result = run_cli(
        "index",
        "--embeddings",
        tmp_path / "x.npy",
        "--manifest",
        tmp_path / "Split.csv",
        "--out",
        tmp_path / "ix",
        timeout=HANG,
    )
    assert result.returncode == 2 and "'Split' -> 'split'" in result.stderr and not (tmp_path / "ix").exists(), (
        result.stderr
    )


# --- the manifest and the config ------------------------------------------------------


def test_fifo_and_device_manifests_are_refused_quickly(tmp_path):
    os.mkfifo(tmp_path / "pipe.csv")
    folder = tmp_path / "folder"
    folder.mkdir()
    os.mkfifo(folder / "manifest.csv")
    with deadline():
        for source, kind in ((tmp_path / "pipe.csv", "FIFO"), (folder, "FIFO"), ("/dev/zero", "character device")):
            with pytest.raises(ManifestError, match=kind) as caught:
                ingest(source, tmp_path / "out", _settings())
            assert "not found" not in str(caught.value)
    result = run_cli("ingest", tmp_path / "pipe.csv", "--out", tmp_path / "out", timeout=HANG)
    assert result.returncode == 2 and "pipe.csv: is a FIFO" in result.stderr


def test_oversized_manifest_is_refused_unread(tmp_path, monkeypatch):
    from receipt_embed.ingest import manifest

    (tmp_path / "manifest.csv").write_text("path,receipt_id,device\n" + "a.jpg,r1,phone\n" * 100)
    monkeypatch.setattr(manifest, "MAX_MANIFEST_BYTES", 1000)
    with pytest.raises(ManifestError, match="over the limit of 1000"):
        ingest(tmp_path, tmp_path / "out", _settings())


def test_fifo_config_file_is_refused(tmp_path):
    os.mkfifo(tmp_path / "exp.yaml")
    with deadline(), pytest.raises(ConfigError, match="exp.yaml: is a FIFO"):
        load_config(tmp_path / "exp.yaml")
    result = run_cli("config", "--config", tmp_path / "exp.yaml", timeout=HANG)
    assert result.returncode == 2 and "exp.yaml: is a FIFO" in result.stderr and "Traceback" not in result.stderr


# --- decoding for the training cache, embedding and thumbnails -------------------------


def test_bomb_in_the_image_cache_is_refused_from_its_header(tmp_path):
    (tmp_path / "ok.jpg").write_bytes(_jpeg(0))
    (tmp_path / "bomb.png").write_bytes(_png_bomb())
    started = time.monotonic()
    with pytest.raises(ImageRejected, match="bomb.png: 100000x100000") as caught:
        ImageCache([str(tmp_path / "ok.jpg"), str(tmp_path / "bomb.png")], (20, 10))
    assert caught.value.reason == "too_many_pixels" and time.monotonic() - started < 5
    with pytest.raises(ImageRejected, match="limit of 500"):
        load_resized(tmp_path / "ok.jpg", (20, 10), max_pixels=500)
    assert load_resized(tmp_path / "ok.jpg", (20, 10)).shape == (20, 10, 3)


def test_fifo_devices_and_oversized_files_never_reach_the_decoder(tmp_path):
    from receipt_embed.audit.report import thumbnail

    os.mkfifo(tmp_path / "pipe.jpg")
    (tmp_path / "big.jpg").write_bytes(_jpeg(0, pad=5000))
    with deadline():
        for path, reason in (
            (tmp_path / "pipe.jpg", "not_a_file"),
            ("/dev/zero", "not_a_file"),
            (tmp_path, "not_a_file"),
            (tmp_path / "gone.jpg", "missing_file"),
        ):
            with pytest.raises(UnusableFile) as caught:
                ImageCache([str(path)], (20, 10))
            assert caught.value.reason == reason and str(path) in str(caught.value)
            assert thumbnail(str(path)) is None  # the audit gallery shows no thumbnail instead of crashing
        with pytest.raises(UnusableFile, match="over the limit of 1000"):
            load_resized(tmp_path / "big.jpg", (20, 10), max_bytes=1000)


# --- captures replaced after ingest -----------------------------------------------------


def _a_train_capture(dataset: Path) -> dict:
    return next(row for row in load_dataset_dir(dataset) if row["split"] == "train")


def test_touched_file_passes_and_old_dataset_dirs_are_not_checked(small_dataset):
    rows = load_dataset_dir(small_dataset)
    os.utime(rows[0]["path"], ns=(1, 1))  # same bytes, another mtime: not a change
    verify_captures(rows)
    Path(rows[1]["path"]).write_bytes(_jpeg(99, size=(48, 96)))
    legacy = [{k: v for k, v in row.items() if k not in ("bytes", "mtime_ns")} for row in rows]
    verify_captures(legacy)  # written before ingest recorded size and mtime
    with pytest.raises(CaptureChanged, match=rf"{rows[1]['path']} changed since ingest: \d+ bytes, was \d+"):
        verify_captures(rows)


def test_train_refuses_a_capture_replaced_since_ingest(small_dataset, tmp_path):
    row = _a_train_capture(small_dataset)
    Path(row["path"]).write_bytes(_jpeg(123, size=(44, 88)))
    result = run_cli(
        "train",
        "--data",
        small_dataset,
        "--out",
        tmp_path / "run",
        *[arg for item in TINY_TRAINING for arg in ("--set", item)],
        timeout=HANG,
    )
    assert result.returncode == 2, result.stderr
    assert f"{row['path']} changed since ingest" in result.stderr and f"was {row['bytes']}" in result.stderr
    assert "re-run `receipt-embed ingest`" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_index_refuses_replaced_captures_by_size_and_by_content(small_dataset, trained, tmp_path):
    from receipt_embed.indexing.build import index_dataset

    _, checkpoint = trained
    row = load_dataset_dir(small_dataset)[0]
    original = Path(row["path"]).read_bytes()
    # same size and mtime, other bytes: only the sha256 of the bytes read for decoding tells
    forged = bytearray(original)
    forged[len(forged) // 2] ^= 0xFF
    Path(row["path"]).write_bytes(bytes(forged))
    os.utime(row["path"], ns=(row["mtime_ns"], row["mtime_ns"]))
    assert hashlib.sha256(forged).hexdigest() != row["sha256"]
    with pytest.raises(CaptureChanged, match="content \\(sha256\\) differs"):
        index_dataset(checkpoint, small_dataset, tmp_path / "ix", builtin_registry())
    assert not (tmp_path / "ix" / "index.json").exists()
    Path(row["path"]).write_bytes(original + b"\0")
    result = run_cli(
        "index", "--checkpoint", checkpoint, "--data", small_dataset, "--out", tmp_path / "ix2", "-q", timeout=HANG
    )
    assert result.returncode == 2 and f"{len(original) + 1} bytes, was {len(original)}" in result.stderr
    Path(row["path"]).write_bytes(original)
    os.utime(row["path"], ns=(row["mtime_ns"], row["mtime_ns"]))
    index_dataset(checkpoint, small_dataset, tmp_path / "ix3", builtin_registry())
    items = load_index_dir(tmp_path / "ix3").items
    assert items[0]["bytes"] == len(original) and "mtime_ns" not in items[0]


@pytest.mark.parametrize("replacement", ["fifo", "directory", "device_link", "symlink_loop", "deleted"])
def test_attack_round_28_index_names_what_replaced_a_capture(small_dataset, trained, tmp_path, replacement):
    """Attack round 28: a capture replaced by a FIFO, a folder, a link to /dev/zero or a symlink
    loop was "missing ... were they moved?" to `index --data`, though the file is there; it is
    named by what it is now (as `train` does), and only a deleted one is missing."""
    _, checkpoint = trained
    path = Path(load_dataset_dir(small_dataset)[3]["path"])
    path.unlink()
    said = {
        "fifo": (os.mkfifo, "is a FIFO"),
        "directory": (os.mkdir, "is a directory"),
        "device_link": (lambda p: os.symlink("/dev/zero", p), "is a character device"),
        "symlink_loop": (lambda p: os.symlink(p.name, p), "symbolic links"),
        "deleted": (lambda p: None, "1 capture listed in"),
    }
    make, expected = said[replacement]
    make(path)
    result = run_cli(
        "index", "--checkpoint", checkpoint, "--data", small_dataset, "--out", tmp_path / "ix", "-q", timeout=HANG
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert expected in result.stderr and str(path) in result.stderr, result.stderr
    assert ("missing" in result.stderr) == (replacement == "deleted"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "ix").exists(), result.stderr


# --- search queries and index dirs ------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint_index(trained, tmp_path_factory):
    from receipt_embed.indexing.build import index_dataset

    dataset, checkpoint = trained
    out = tmp_path_factory.mktemp("hostile_ix") / "heldout"
    index_dataset(checkpoint, dataset, out, builtin_registry(), split="heldout")
    return out


def test_fifo_device_and_folder_queries_are_listed_and_never_read(checkpoint_index, tmp_path):
    os.mkfifo(tmp_path / "pipe.jpg")
    good = load_index_dir(checkpoint_index).items[0]["path"]
    started = time.monotonic()
    result = run_cli("search", checkpoint_index, good, "/dev/zero", tmp_path / "pipe.jpg", timeout=HANG)
    assert result.returncode == 2 and time.monotonic() - started < HANG
    assert "2 of 3 query images cannot be used" in result.stderr
    assert "/dev/zero: is a character device" in result.stderr and "pipe.jpg: is a FIFO" in result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()  # attack round 6: one problem a line, not a literal "\n"
    assert lines[0] == "Error: 2 of 3 query images cannot be used (no search was run):", lines
    assert lines[1].startswith("  /dev/zero: ") and lines[2].startswith(f"  {tmp_path / 'pipe.jpg'}: "), lines


def test_oversized_and_folder_queries_are_refused(tmp_path):
    from receipt_embed.indexing.search import check_queries

    (tmp_path / "big.jpg").write_bytes(_jpeg(0, pad=3000))
    with pytest.raises(ValueError, match="2 of 2 query images") as caught:
        check_queries([str(tmp_path / "big.jpg"), str(tmp_path)], max_pixels=10**6, max_bytes=2000)
    assert re.search(r"big.jpg: is \d+ bytes, over the limit of 2000", str(caught.value))
    assert f"{tmp_path}: is a directory" in str(caught.value)  # the CLI's own check stops folders earlier


def _copy_index(index_dir: Path, target: Path) -> Path:
    shutil.copytree(index_dir, target)
    return target


def test_fifo_in_place_of_index_faiss_is_refused_without_hanging(checkpoint_index, tmp_path):
    broken = _copy_index(checkpoint_index, tmp_path / "ix")
    (broken / "index.faiss").unlink()
    os.mkfifo(broken / "index.faiss")
    result = run_cli("search", broken, "--all-pairs", "--threshold", "0.9", "--out", tmp_path / "p.csv", timeout=HANG)
    assert result.returncode == 2 and "index.faiss: is a FIFO" in result.stderr and "Traceback" not in result.stderr
    with deadline(), pytest.raises(IndexDirError, match="index.faiss: is a FIFO"):
        load_index_dir(broken, verify=False)  # not even the unverified path opens it


@pytest.mark.parametrize("name", ["items.jsonl", "embeddings.npy", "index.json"])
def test_non_regular_index_members_are_named(checkpoint_index, tmp_path, name):
    broken = _copy_index(checkpoint_index, tmp_path / "ix")
    (broken / name).unlink()
    os.mkfifo(broken / name)
    with deadline():
        for verify in (True, False):
            with pytest.raises(IndexDirError, match=f"{name}: is a FIFO"):
                load_index_dir(broken, verify=verify)
    (broken / name).unlink()
    (broken / name).mkdir()
    with deadline(), pytest.raises(IndexDirError, match=f"{name}: is a directory"):
        load_index_dir(broken, verify=False)


def test_fifo_shard_embeddings_and_checkpoint_are_refused(trained, tmp_path):
    from receipt_embed.indexing.build import index_dataset, load_embeddings
    from receipt_embed.indexing.shards import read_shard
    from receipt_embed.training.checkpoint import CheckpointError, load_checkpoint

    dataset, checkpoint = trained
    shard = tmp_path / "shard"
    index_dataset(checkpoint, dataset, shard, builtin_registry(), split="heldout", shard=(0, 2))
    os.mkfifo(tmp_path / "pipe")
    with deadline():
        read_shard(shard)
        (shard / "embeddings.npy").unlink()
        os.mkfifo(shard / "embeddings.npy")
        with pytest.raises(IndexDirError, match="embeddings.npy is missing, not a regular file"):
            read_shard(shard)
        (shard / "shard.json").unlink()
        os.mkfifo(shard / "shard.json")
        with pytest.raises(IndexDirError, match="shard.json: is a FIFO"):
            read_shard(shard)
        with pytest.raises(ValueError, match="pipe: is a FIFO"):
            load_embeddings(tmp_path / "pipe")
        for path, what in ((tmp_path / "pipe", "FIFO"), (tmp_path, "directory"), ("/dev/zero", "character device")):
            with pytest.raises(CheckpointError, match=f"is not a checkpoint: is a {what}"):
                load_checkpoint(path)
    result = run_cli(
        "index", "--embeddings", tmp_path / "pipe", "--manifest", dataset, "--out", tmp_path / "e", timeout=HANG
    )
    assert result.returncode == 2 and "pipe: is a FIFO" in result.stderr


# --- round 3 of the attack: plugins folders, deep nesting, huge recorded files -------------------


def test_a_fifo_or_device_in_the_plugins_folder_is_skipped_by_name_without_hanging(tmp_path):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    os.mkfifo(plugins / "evil.py")
    os.symlink("/dev/zero", plugins / "zeros.py")
    (plugins / "fine.py").write_text("VALUE = 1\n")
    result = run_cli("plugins", cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"plugin 'evil' failed to load and was skipped: {plugins / 'evil.py'}: is a FIFO" in result.stderr
    assert (
        f"plugin 'zeros' failed to load and was skipped: {plugins / 'zeros.py'}: is a character device" in result.stderr
    )
    strict = run_cli("--strict-plugins", "plugins", cwd=tmp_path, timeout=60)
    assert strict.returncode == 2 and "(--strict-plugins)" in strict.stderr and "Traceback" not in strict.stderr


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.slow  # trains: a long run, kept out of the default suite (-m slow runs it)
def test_deeply_nested_json_is_one_error_naming_the_file(small_dataset, tmp_path):
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"path": "a.jpg", "receipt_id": "r", "device": "d", "x": ' + _deep(200_000) + "}\n")
    result = run_cli("ingest", deep, "--out", tmp_path / "ds", timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"{deep}, line 1: invalid JSON (nested too deeply" in result.stderr

    # a lock file holding deep JSON is an unreadable holder record: taken over like an empty one
    target = tmp_path / "ds2"
    (tmp_path / ".ds2.lock").write_text(_deep(100_000))
    taken = run_cli("ingest", REPO / "data_samples", "--out", target, "-q", timeout=120)
    assert taken.returncode == 0 and "Traceback" not in taken.stderr, taken.stderr

    record = small_dataset / "ingest_report.json"
    record.write_text('{"source": ' + _deep(100_000) + "}")
    broken = run_cli("train", "--data", small_dataset, "--out", tmp_path / "run", "-q", timeout=120)
    assert "Traceback" not in broken.stderr and "RecursionError" not in broken.stderr, broken.stderr


def test_deeply_nested_yaml_is_refused_at_once(tmp_path):
    config = tmp_path / "deep.yaml"
    config.write_text("train:\n  epochs: " + _deep(50_000) + "\n")
    started = time.perf_counter()
    result = run_cli("config", "--config", config, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (
        result.stderr.strip()
        == f"Error: config file {config}, line 2: nested more than 32 levels deep; a config never needs that"
    )
    assert time.perf_counter() - started < 30
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  epochs: [1, 2\n")
    one_line = run_cli("config", "--config", bad)
    assert one_line.returncode == 2 and len(one_line.stderr.strip().splitlines()) == 1, one_line.stderr
    assert "is not valid YAML: expected ',' or ']'" in one_line.stderr and "(line 3, column 1)" in one_line.stderr


def test_a_huge_checkpoint_named_by_an_index_dir_is_refused_unread(checkpoint_index, tmp_path):
    from tamper import edit_meta

    huge = tmp_path / "huge.pt"
    with open(huge, "wb") as handle:
        handle.truncate(300 * 1024**3)  # sparse: 300 GB that would take minutes to hash
    index = _copy_index(checkpoint_index, tmp_path / "ix")
    edit_meta(index, lambda meta: meta["source"].update(checkpoint=str(huge)))
    query = next((REPO / "data_samples" / "images").iterdir())
    result = run_cli("search", index, query, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"{huge}: is {300 * 1024**3} bytes, over the limit of" in result.stderr


def test_over_long_names_are_one_line_not_an_internal_error(tmp_path):
    """Attack round 8: a 256-byte --plugins-dir or train --out was an internal error (ENAMETOOLONG),
    and a legal 250-byte --out could never be written (its .NAME.lock is over 255 bytes)."""
    from conftest import REPO, run_cli

    long = tmp_path / ("p" * 256)
    fits = tmp_path / ("q" * 250)
    for args in (["--plugins-dir", long, "plugins"], ["train", "--data", tmp_path, "--out", long]):
        result = run_cli(*args)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert result.stderr.strip().endswith("a name in this path is too long for the file system"), result.stderr
    result = run_cli("ingest", REPO / "data_samples", "--out", fits, "-q")
    assert result.returncode == 2, result.stderr
    assert "the name is 250 bytes; an output dir's name may have at most 200" in result.stderr
    assert not fits.exists()


def test_attack_round_22_mb12_a_csv_value_past_the_readers_limit_is_named_as_such(tmp_path):
    """A CSV value over 131,072 characters was reported as "malformed CSV"."""
    from receipt_embed.ingest.manifest import ManifestError, read_manifest

    manifest = tmp_path / "m.csv"
    manifest.write_text("path,receipt_id,note\na.jpg,r1,short\nb.jpg,r2," + "x" * 200_000 + "\n")
    with pytest.raises(ManifestError) as info:
        read_manifest(manifest)
    assert str(info.value) == (
        f"{manifest}, line 3: a value is longer than 131,072 characters, the most a manifest value may have"
    )


def test_attack_round_28_a_json_lines_value_is_held_to_the_csv_limit(tmp_path):
    """Attack round 28: a JSON-lines manifest took a 10-million-character receipt id, which then
    filled search's output (22 MB for --k 2) and a 152 MB audit report; it is held to the CSV limit."""
    from receipt_embed.ingest.manifest import ManifestError, read_manifest

    manifest = tmp_path / "m.jsonl"
    fits = {"path": "a.jpg", "receipt_id": "r" * 131_072, "device": "phone"}
    manifest.write_text(
        json.dumps(fits) + "\n" + json.dumps({**fits, "path": "b.jpg", "merchant": "M" * 131_073}) + "\n"
    )
    with pytest.raises(ManifestError) as info:
        read_manifest(manifest)
    assert (
        str(info.value)
        == f"{manifest}, line 2: the value of 'merchant' has 131,073 characters; a manifest value has at most 131,072"
    )
    manifest.write_text(json.dumps(fits) + "\n")
    assert read_manifest(manifest)[0].fields["receipt_id"] == "r" * 131_072, "the limit itself is taken"
    manifest.write_text(json.dumps({**fits, "device": "d" * 3_000_000}) + "\n")
    result = run_cli("ingest", manifest, "--out", tmp_path / "ds2", "-q", timeout=HANG)
    assert result.returncode == 2 and "'device' has 3,000,000 characters" in result.stderr, result.stderr
    assert len(result.stderr) < 1000 and not (tmp_path / "ds2").exists()


@pytest.mark.parametrize(
    "header, message",
    [
        (
            "path,receipt_id,device,",
            "a column has no name (an empty header cell or JSON key); name it, or delete the column",
        ),
        ('path,receipt_id,device,"a\nb"', "column name 'a\nb' holds control or invisible characters"),
        ("path,receipt_id,device,\x1b[31mred", "column name '\x1b[31mred' holds control or invisible characters"),
        ("path,receipt_id,device,\u202eevil", "column name '\u202eevil' holds control or invisible characters"),
        ("path,receipt_id,device,nul\x00", "column name 'nul\x00' holds control or invisible characters"),
    ],
)
def test_attack_round_22_mb5_ingest_refuses_the_column_names_make_samples_refuses(tmp_path, header, message):
    from receipt_embed.ingest import ingest
    from receipt_embed.ingest.manifest import ManifestError

    manifest = tmp_path / "m.csv"
    manifest.write_text(f"{header}\na.jpg,r1,d,x\n", newline="")
    with pytest.raises(ManifestError) as info:
        ingest(manifest, tmp_path / "ds")
    assert str(info.value).startswith(f"{manifest}: {message}")
    assert not (tmp_path / "ds").exists()
