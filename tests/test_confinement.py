"""Reading only what the user handed over: thumbnails confined to the dataset's capture
folders (or --images-root), checkpoints loaded without model.pretrained, and no plugins
folder imported by library calls unless one is passed."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, builtin_registry, run_cli, train_tiny
from tamper import copy_index, rewrite_items

SECRET = b"root:x:0:0:secret-line-of-the-password-file\n"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """data_samples/ ingested and trained for one tiny epoch, indexed from the checkpoint."""
    from receipt_embed.indexing import index_dataset

    base = tmp_path_factory.mktemp("confine")
    dataset, checkpoint = train_tiny(base)
    index_dataset(checkpoint, dataset, base / "index", builtin_registry())
    return base


@pytest.fixture(scope="module")
def outside(trained):
    """A folder outside the dataset with a real image and a password-like file in it."""
    folder = trained / "outside"
    folder.mkdir()
    shutil.copy(REPO / "data_samples" / "images" / "r0000_phone_a.jpg", folder / "private.jpg")
    (folder / "pass\x1b[2J\nwd").write_bytes(SECRET)
    return folder


@pytest.fixture(scope="module")
def hostile_index(trained, outside, tmp_path_factory):
    """The index with every item pointing outside (half at the image, half at the text
    file), index.json's checksums recomputed as an attacker would."""
    index = copy_index(trained / "index", tmp_path_factory.mktemp("hostile") / "index")
    names = ("pass\x1b[2J\nwd", "private.jpg")
    rewrite_items(index, lambda row, item: {**item, "path": str(outside / names[row % 2])})
    return index


def _thumbnail_of(path: Path) -> str:
    from receipt_embed.audit.report import thumbnail

    return thumbnail(str(path)).split(",", 1)[1]


def test_outside_paths_are_refused_named_and_never_embedded(hostile_index, outside, tmp_path):
    result = run_cli("audit-shortcuts", hostile_index, "--out", tmp_path / "report", "--gallery", "4", "-q")
    assert result.returncode == 0, result.stderr
    warning = [line for line in result.stderr.splitlines() if "outside the dataset's capture folders" in line]
    assert len(warning) == 1 and "--images-root" in warning[0] and str(outside) in warning[0]
    assert "\x1b" not in result.stderr
    refused = json.loads((tmp_path / "report" / "audit.json").read_text())["gallery_refused"]
    assert refused > 0 and warning[0].startswith(f"Warning: {refused} gallery image(s)")
    html = (tmp_path / "report" / "audit.html").read_text()
    assert _thumbnail_of(outside / "private.jpg") not in html
    assert "data:image/jpeg" not in html and "secret-line" not in html
    assert base64.b64encode(SECRET).decode()[:24] not in html
    assert "not shown: outside the dataset's capture folders" in html


def test_images_root_allows_a_folder(trained, outside, tmp_path):
    """Every item points at the outside image (which items the gallery shows depends on the
    embedding, so a half-and-half index may show only the text file's rows)."""
    index = copy_index(trained / "index", tmp_path / "index")
    rewrite_items(index, lambda row, item: {**item, "path": str(outside / "private.jpg")})
    result = run_cli(
        "audit-shortcuts", index, "--out", tmp_path / "report", "--gallery", "4", "-q", "--images-root", outside
    )
    assert result.returncode == 0, result.stderr
    assert "outside the dataset" not in result.stderr
    html = (tmp_path / "report" / "audit.html").read_text()
    assert _thumbnail_of(outside / "private.jpg") in html
    assert json.loads((tmp_path / "report" / "audit.json").read_text())["gallery_refused"] == 0


def test_captures_of_the_dataset_still_get_thumbnails(trained, tmp_path):
    """Both kinds of index: from the checkpoint (source.dataset) and from external
    embeddings of the dataset dir (source.manifest)."""
    from receipt_embed.indexing import index_embeddings

    rng = np.random.default_rng(0)
    count = json.loads((trained / "index" / "index.json").read_text())["count"]
    np.save(tmp_path / "vectors.npy", rng.normal(size=(count, 8)).astype(np.float32))
    index_embeddings(tmp_path / "vectors.npy", trained / "dataset", tmp_path / "external")
    for index in (trained / "index", tmp_path / "external"):
        out = tmp_path / f"report-{index.name}"
        result = run_cli("audit-shortcuts", index, "--out", out, "--gallery", "2", "-q")
        assert result.returncode == 0, result.stderr
        assert "outside the dataset" not in result.stderr
        assert "data:image/jpeg" in (out / "audit.html").read_text()


def test_a_symlink_out_of_the_capture_folder_is_refused(trained, outside, tmp_path):
    from receipt_embed.audit.confine import ImageRoots, recorded_roots

    meta = json.loads((trained / "index" / "index.json").read_text())
    roots = ImageRoots.for_index(meta)
    assert roots.roots == [(REPO / "data_samples").resolve()]
    inside = REPO / "data_samples" / "images" / "r0000_phone_a.jpg"
    link = tmp_path / "link.jpg"
    link.symlink_to(outside / "private.jpg")
    captures = tmp_path / "captures"
    captures.mkdir()
    (captures / "escape.jpg").symlink_to(outside / "private.jpg")
    confined = ImageRoots([captures.resolve()])
    assert roots.check(0, str(inside)) and not roots.check(1, str(link)) and not roots.check(2, "/etc/passwd")
    assert not confined.check(3, str(captures / "escape.jpg"))
    assert not roots.check(4, str(REPO / "data_samples" / ".." / "README.md"))
    assert not roots.check(5, "a\0b") and [row for row, _ in roots.refused] == [1, 2, 4]
    assert roots.unresolvable == [(5, "a\0b")]  # attack round 26 F7: no file at all, not one "outside"
    assert recorded_roots({"source": {"kind": "checkpoint", "dataset": str(tmp_path)}}) == []  # no ingest report


def _checkpoint_with(trained: Path, tmp_path: Path, pretrained: str) -> Path:
    from receipt_embed.training.checkpoint import save_checkpoint

    state = torch.load(trained / "run" / "checkpoints" / "best.pt", map_location="cpu", weights_only=True)
    state["config"]["model"]["pretrained"] = pretrained
    state.pop("format_version")
    path = tmp_path / "pretrained.pt"
    save_checkpoint(path, state)
    return path


def test_loading_a_checkpoint_never_reads_model_pretrained(trained, tmp_path):
    """The checkpoint's weights are all a load needs: a pretrained path that does not exist
    (receipt_cnn would raise on it) and a torchvision weights name (a download, with the
    network off and an empty TORCH_HOME) both load, and embed like the original."""
    from receipt_embed.embedding import embed_paths, load_model
    from receipt_embed.models.build import build_model
    from receipt_embed.models.encoders import TorchvisionEncoder
    from receipt_embed.training.checkpoint import save_checkpoint

    missing = _checkpoint_with(trained, tmp_path, str(tmp_path / "never" / "weights.pt"))
    image = str(REPO / "data_samples" / "images" / "r0000_phone_a.jpg")
    original = load_model(trained / "run" / "checkpoints" / "best.pt", builtin_registry())
    loaded = load_model(missing, builtin_registry())
    assert np.array_equal(embed_paths(loaded, [image]), embed_paths(original, [image]))
    assert not (tmp_path / "never").exists()

    from receipt_embed.config import load_config

    config = load_config(overrides=["model.encoder=mobilenet_v3_small", "data.image_size=[64,32]"])
    model = build_model(config, builtin_registry())
    config_dict = config.model_dump(mode="json")
    config_dict["model"]["pretrained"] = "IMAGENET1K_V1"
    save_checkpoint(tmp_path / "tv.pt", {"model": model.state_dict(), "config": config_dict})
    assert isinstance(model.encoder, TorchvisionEncoder)
    code = (
        "import sys; from receipt_embed.embedding import load_model, embed_paths; "
        "from receipt_embed.plugin_manager import get_registry; "
        f"m = load_model({str(tmp_path / 'tv.pt')!r}, get_registry()); print(embed_paths(m, [{image!r}]).shape)"
    )
    env = {
        **os.environ,
        "TORCH_HOME": str(tmp_path / "torch-home"),
        "https_proxy": "http://127.0.0.1:9",
        "HTTPS_PROXY": "http://127.0.0.1:9",
    }
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith("(1, ") and not (tmp_path / "torch-home").exists()


EVIL = """from pathlib import Path
Path({marker!r}).write_text("plugin code ran")
"""


def test_library_calls_import_no_plugins_folder_unless_given(tmp_path):
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "evil.py").write_text(EVIL.format(marker=str(tmp_path / "MARKER")))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECEIPT_EMBED_")}
    code = (
        "import receipt_embed, torch; loss = receipt_embed.create_loss('ntxent'); "
        "print(float(loss(torch.randn(8, 4), torch.arange(4).repeat(2))) > 0, "
        "sorted(receipt_embed.get_registry().plugins))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("True") and "evil" not in result.stdout
    assert not (tmp_path / "MARKER").exists()

    code = (
        "import receipt_embed; "
        f"print(sorted(receipt_embed.get_registry(plugins_dir={str(tmp_path / 'plugins')!r}).plugins))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and "evil" in result.stdout and (tmp_path / "MARKER").exists()
    (tmp_path / "MARKER").unlink()

    result = run_cli("plugins", cwd=tmp_path)  # the CLI's documented default: ./plugins
    assert result.returncode == 0, result.stderr
    assert "evil" in result.stdout and (tmp_path / "MARKER").exists()


def test_an_older_report_with_the_manifest_path_as_typed_still_finds_the_captures(trained, tmp_path):
    from receipt_embed.audit.confine import recorded_roots

    dataset = tmp_path / "dataset"
    shutil.copytree(trained / "dataset", dataset)
    report = json.loads((dataset / "ingest_report.json").read_text())
    meta = {"source": {"kind": "checkpoint", "dataset": str(dataset)}}
    for typed, root in (
        ("data_samples/manifest.csv", (REPO / "data_samples").resolve()),
        ("manifest.csv", None),
        ("../x/manifest.csv", None),
        ("elsewhere/manifest.csv", None),
    ):
        (dataset / "ingest_report.json").write_text(json.dumps({**report, "source": typed}))
        assert recorded_roots(meta) == ([root] if root else []), typed


def test_a_capture_that_cannot_be_shown_says_why_in_the_report(trained, tmp_path):
    """Attack round 7: a gallery capture replaced by a FIFO (or gone) was an unexplained blank."""
    from receipt_embed.audit.report import thumbnail_or_reason

    captures = tmp_path / "captures"
    captures.mkdir()
    os.mkfifo(captures / "pipe.jpg")
    (captures / "text.jpg").write_bytes(b"not an image")
    assert thumbnail_or_reason(str(captures / "pipe.jpg")) == (None, "is a FIFO (named pipe), not a regular file")
    assert thumbnail_or_reason(str(captures / "gone.jpg")) == (None, "file not found")
    assert thumbnail_or_reason(str(captures / "text.jpg")) == (None, "not a recognised image file")
    assert thumbnail_or_reason(None) == (None, "no path")
    index = copy_index(trained / "index", tmp_path / "index")
    rewrite_items(index, lambda row, item: {**item, "path": str(captures / "pipe.jpg")})
    out = tmp_path / "report"
    result = run_cli("audit-shortcuts", index, "--out", out, "--gallery", "2", "-q", "--images-root", captures)
    assert result.returncode == 0, result.stderr
    assert "no image: is a FIFO (named pipe), not a regular file</div>" in (out / "audit.html").read_text()


def test_a_large_ingest_report_still_names_the_capture_folder(tmp_path):
    """Attack round 8: a 23 MB report (125,000 rejected rows) was over the 16 MiB cap of small JSON
    files, so the audit found no capture folder and showed no thumbnails."""
    from receipt_embed.audit.confine import _capture_folder

    rejected = [{"line": n, "path": "images/x.jpg", "reason": "repeated_row"} for n in range(300_000)]
    report = json.dumps({"source": str(tmp_path / "captures" / "manifest.csv"), "rejected": rejected})
    assert len(report) > 16 * 2**20
    (tmp_path / "ingest_report.json").write_text(report)
    assert _capture_folder(tmp_path) == tmp_path / "captures"


def test_attack_round_26_f7_a_dataset_of_absolute_paths_shows_its_own_captures(tmp_path):
    """A dataset ingested with --allow-absolute-paths, its captures in another folder than its
    manifest, had every gallery thumbnail refused as "outside the dataset's capture folders" (the
    folder allowed was the manifest's). The captures it accepted are the user's: they are shown;
    a file it never listed, beside them, is still refused."""
    from receipt_embed.audit.confine import ImageRoots

    captures, listed = tmp_path / "captures", tmp_path / "listing"
    captures.mkdir()
    listed.mkdir()
    lines = ["path,receipt_id,device"]
    for row in range(24):
        receipt, device = divmod(row, 3)
        name = f"r{receipt:04d}_{['phone_a', 'phone_b', 'scanner'][device]}.jpg"
        shutil.copy(REPO / "data_samples" / "images" / name, captures / name)
        lines.append(f"{captures / name},r{receipt},{device}")
    (listed / "manifest.csv").write_text("\n".join(lines) + "\n")
    shutil.copy(REPO / "data_samples" / "images" / "r0030_phone_a.jpg", captures / "never_listed.jpg")
    dataset = tmp_path / "dataset"
    result = run_cli("ingest", listed / "manifest.csv", "--out", dataset, "--allow-absolute-paths", "-q")
    assert result.returncode == 0, result.stderr
    np.save(tmp_path / "vectors.npy", np.random.default_rng(0).normal(size=(24, 8)).astype(np.float32))
    index = tmp_path / "index"
    result = run_cli("index", "--embeddings", tmp_path / "vectors.npy", "--manifest", dataset, "--out", index, "-q")
    assert result.returncode == 0, result.stderr
    report = tmp_path / "report"
    result = run_cli("audit-shortcuts", index, "--out", report, "--gallery", "3", "-q")
    assert result.returncode == 0, result.stderr
    assert "outside the dataset" not in result.stderr
    assert json.loads((report / "audit.json").read_text())["gallery_refused"] == 0
    assert "data:image/jpeg" in (report / "audit.html").read_text()
    roots = ImageRoots.for_index(json.loads((index / "index.json").read_text()))
    assert roots.check(0, str(captures / "r0000_phone_a.jpg"))
    assert not roots.check(1, str(captures / "never_listed.jpg")) and roots.refused == [
        (1, str(captures / "never_listed.jpg"))
    ]
