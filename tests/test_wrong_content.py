"""Valid files with the wrong content: checkpoints with other keys, types or shapes, index
dirs whose index.json, items.jsonl or embeddings.npy were edited (checksums recomputed),
and metadata that matplotlib would read as mathtext. Each is one error naming the file and
the key, exit code 2, never a traceback or a silently wrong result."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, builtin_registry, run_cli, train_tiny
from tamper import copy_index, edit_meta, reseal, rewrite_items

from receipt_embed.errors import BadInput
from receipt_embed.indexing import IndexDirError, index_embeddings, load_index_dir
from receipt_embed.training.checkpoint import CheckpointError, save_checkpoint


def _one_clean_error(result, *fragments) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    message = result.stderr.strip()
    assert message.startswith("Error: ") and len(message.splitlines()) == 1, message
    for fragment in fragments:
        assert fragment in message, message


# ---- index dirs -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_index(tmp_path_factory):
    """An index of 20 random vectors over a manifest of 5 receipts x 4 captures."""
    base = tmp_path_factory.mktemp("content")
    rows = [{"path": f"img{i}.jpg", "receipt_id": f"r{i // 4}", "device": f"d{i % 2}"} for i in range(20)]
    (base / "manifest.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    np.save(base / "vectors.npy", np.random.default_rng(0).normal(size=(20, 8)).astype(np.float32))
    index_embeddings(base / "vectors.npy", base / "manifest.jsonl", base / "index")
    return base / "index"


def _embeddings(array):
    def change(index):
        np.save(index / "embeddings.npy", array, allow_pickle=True)
        reseal(index, "embeddings.npy")

    return change


_GOOD = np.random.default_rng(1).normal(size=(20, 8)).astype(np.float32)
_NAN = _GOOD.copy()
_NAN[3, 2] = np.nan
_STRUCTURED = np.zeros(20, dtype=[("a", np.float32, (8,))])

TAMPERED = {
    "count as a string": (lambda d: edit_meta(d, lambda m: m.update(count="20")), "index.json: count is a str"),
    "unknown split": (  # attack round 13: it selected no dataset rows, so items went unchecked
        lambda d: edit_meta(d, lambda m: m["source"].update(split="bogus")),
        "index.json: source.split is a str ('bogus'), expected one of",
    ),
    "negative dim": (lambda d: edit_meta(d, lambda m: m.update(dim=-1)), "index.json: dim is an int"),
    "factory a number": (lambda d: edit_meta(d, lambda m: m.update(factory=5)), "index.json: factory is an int"),
    "files a list": (lambda d: edit_meta(d, lambda m: m.update(files=[])), "index.json: files is a list"),
    "file entry without sha256": (
        lambda d: edit_meta(d, lambda m: m["files"]["items.jsonl"].pop("sha256")),
        "files.items.jsonl is a dict",
    ),
    "bytes a float": (
        lambda d: edit_meta(d, lambda m: m["files"]["items.jsonl"].update(bytes=1.5)),
        "files.items.jsonl.bytes is a float",
    ),
    "source a list": (lambda d: edit_meta(d, lambda m: m.update(source=[])), "index.json: source is list"),
    "source.manifest a number": (
        lambda d: edit_meta(d, lambda m: m["source"].update(manifest=3)),
        "source.manifest is an int",
    ),
    "search_params a number": (lambda d: edit_meta(d, lambda m: m.update(search_params=7)), "search_params is an int"),
    "a key the format lacks": (  # attack round 7: was read as if it were not there
        lambda d: edit_meta(d, lambda m: m.update(exact_override=True, zz=1)),
        "index.json has keys that format version 1 does not have ('exact_override', 'zz'): it was edited",
    ),
    "unknown features": (lambda d: edit_meta(d, lambda m: m.update(features="pixels")), "features is a str"),
    # attack round 29: search read the missing key as an internal error (KeyError)
    "features missing": (lambda d: edit_meta(d, lambda m: m.pop("features")), "index.json lacks features"),
    # attack round 22 MC6: each was accepted whatever it held
    "metric not inner product": (
        lambda d: edit_meta(d, lambda m: m.update(metric="L2")),
        "index.json: metric is a str ('L2'), expected \"inner_product\"",
    ),
    "normalised false": (
        lambda d: edit_meta(d, lambda m: m.update(normalised=False)),
        "index.json: normalised is a bool (False), expected true",
    ),
    "exact a string": (lambda d: edit_meta(d, lambda m: m.update(exact="yes")), "exact is a str ('yes')"),
    "exact untrue to the factory": (
        lambda d: edit_meta(d, lambda m: m.update(exact=False)),
        "index.json: exact is a bool (False), expected true for a Flat index",
    ),
    "a files entry for another file": (
        lambda d: edit_meta(d, lambda m: m["files"].update({"extra.bin": {"sha256": "0" * 64, "bytes": 1}})),
        "expected entries for index.faiss, items.jsonl, embeddings.npy only, not 'extra.bin'",
    ),
    "an item a list": (
        lambda d: rewrite_items(d, lambda row, item: [1] if row == 4 else item),
        "items.jsonl, row 4 (0-based) is a list, not a JSON object",
    ),
    "receipt_id a number": (
        lambda d: rewrite_items(d, lambda row, item: {**item, "receipt_id": row}),
        "items.jsonl, row 0 (0-based): receipt_id is an int",
    ),
    "path missing": (
        lambda d: rewrite_items(d, lambda row, item: {k: v for k, v in item.items() if k != "path"}),
        "items.jsonl, row 0 (0-based) lacks 'path'",
    ),
    "device a list": (
        lambda d: rewrite_items(d, lambda row, item: {**item, "device": ["a"]}),
        "row 0 (0-based): device is a list",
    ),
    "NaN embedding": (_embeddings(_NAN), "embeddings.npy: row 3 (0-based) holds NaN or Inf"),
    "integer embeddings": (_embeddings(_GOOD.astype(np.int32)), "embeddings.npy holds int32 values"),
    "float64 embeddings": (_embeddings(_GOOD.astype(np.float64)), "embeddings.npy holds float64 values"),
    "complex embeddings": (_embeddings(_GOOD.astype(np.complex64)), "embeddings.npy holds complex64 values"),
    "structured embeddings": (_embeddings(_STRUCTURED), "embeddings.npy holds structured values"),
    "object embeddings": (_embeddings(np.array([None] * 20, dtype=object)), "embeddings.npy cannot be read"),
    "1-D embeddings": (_embeddings(_GOOD.ravel()), "embeddings.npy has shape (160,)"),
}


@pytest.mark.parametrize("case", TAMPERED)
def test_edited_index_dirs_are_named_not_crashed_on(small_index, tmp_path, case):
    change, message = TAMPERED[case]
    index = copy_index(small_index, tmp_path / "index")
    change(index)
    with pytest.raises(IndexDirError) as caught:
        load_index_dir(index)
    assert message in str(caught.value) and str(index) in str(caught.value)


@pytest.mark.parametrize(
    "case", ["receipt_id a number", "structured embeddings", "count as a string", "features missing"]
)
def test_search_and_audit_exit_2_on_edited_index_dirs(small_index, tmp_path, case):
    change, message = TAMPERED[case]
    index = copy_index(small_index, tmp_path / "index")
    change(index)
    _one_clean_error(
        run_cli("search", index, "--all-pairs", "--threshold", "0.5", "--out", tmp_path / "p.csv"), message
    )
    _one_clean_error(run_cli("audit-shortcuts", index, "--out", tmp_path / "report", "-q"), message)
    assert not (tmp_path / "p.csv").exists() and not (tmp_path / "report").exists()


# ---- checkpoints ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    base = tmp_path_factory.mktemp("ckpt")
    train_tiny(base)
    return base


def _tampered_checkpoint(source, target, change):
    state = torch.load(source, map_location="cpu", weights_only=True)
    state.pop("format_version")
    change(state)
    save_checkpoint(target, state)
    return target


def _first_weight(state) -> str:
    return next(name for name, tensor in state["model"].items() if tensor.ndim == 4)


def _reshape_first(state):
    name = _first_weight(state)
    shape = state["model"][name].shape
    state["model"][name] = torch.zeros(shape[0] // 2, *shape[1:])


CHECKPOINTS = {
    "no model": (lambda s: s.pop("model"), "lacks 'model'"),
    "no config": (lambda s: s.pop("config"), "lacks 'config'"),
    "config a string": (lambda s: s.update(config="resnet"), "config is a str, not a dict"),
    "config.model a list": (lambda s: s["config"].update(model=[]), "config.model is missing or not a dict"),
    "model a list": (lambda s: s.update(model=[1, 2]), "model is a list, not a dict of tensors"),
    "a weight a list": (lambda s: s["model"].update({_first_weight(s): [1.0]}), "is a list, not a tensor"),
    "a weight of another shape": (_reshape_first, "the architecture needs ("),
    "a missing weight": (lambda s: s["model"].pop(_first_weight(s)), "is missing; the checkpoint is from another"),
    "an extra weight": (
        lambda s: s["model"].update(extra=torch.zeros(1)),
        "model.extra is not part of the architecture",
    ),
    "config value of a wrong type": (lambda s: s["config"]["model"].update(head_dim="big"), "config.model.head_dim"),
    "whole-number weights": (  # attack round 11: loaded as truncated integers, index exited 0
        lambda s: s["model"].update({k: v.to(torch.int64) for k, v in s["model"].items() if v.is_floating_point()}),
        "holds int64 values, the architecture needs float32",
    ),
    "images over 2048 a side": (  # attack round 11: 4096 x 4096 made index allocate some 23 GB
        lambda s: s["config"]["data"].update(image_size=[4096, 4096]),
        "config.data.image_size.0: Input should be less than or equal to 2048",
    ),
    "a cache margin of 2000": (  # attack round 16: a 24 GB bitmap for each capture
        lambda s: s["config"]["train"].update(cache_margin=2000),
        "config.train.cache_margin: Input should be less than or equal to 4",
    ),
    "a cache over 2048 a side": (  # attack round 16: the margin times the image size was never checked
        lambda s: s["config"]["data"].update(image_size=[1024, 1024]) or s["config"]["train"].update(cache_margin=4),
        "config.train.cache_margin: 4 x data.image_size [1024, 1024] caches images of 4096 x 4096, over 2048 a side",
    ),
}


@pytest.mark.parametrize("case", CHECKPOINTS)
def test_checkpoints_with_other_keys_types_or_shapes_are_named(trained, tmp_path, case):
    from receipt_embed.embedding import load_model

    change, message = CHECKPOINTS[case]
    path = _tampered_checkpoint(trained / "run" / "checkpoints" / "best.pt", tmp_path / "bad.pt", change)
    with pytest.raises(CheckpointError) as caught:
        load_model(path, builtin_registry())
    assert message in str(caught.value) and str(path) in str(caught.value)


def test_shape_message_names_key_and_both_shapes(trained, tmp_path):
    state = torch.load(trained / "run" / "checkpoints" / "best.pt", map_location="cpu", weights_only=True)
    name, shape = _first_weight(state), tuple(state["model"][_first_weight(state)].shape)
    path = _tampered_checkpoint(trained / "run" / "checkpoints" / "best.pt", tmp_path / "bad.pt", _reshape_first)
    wanted = (
        f"model.{name} has shape ({','.join(map(str, (shape[0] // 2, *shape[1:])))}), the architecture needs "
        f"({','.join(map(str, shape))})"
    )
    result = run_cli("index", "--checkpoint", path, "--data", trained / "dataset", "--out", tmp_path / "index", "-q")
    _one_clean_error(result, str(path), wanted)
    assert not (tmp_path / "index").exists()


def test_a_checkpoint_whose_cache_margin_would_decode_without_limit_is_refused_before_embedding(trained, tmp_path):
    """Attack round 16 (F1): a checkpoint whose config held train.cache_margin=2000 was taken by
    index: every capture was decoded to a 128000 x 64000 bitmap (24 GB), ending in "out of memory"
    or the OOM killer. It is refused in one line naming the checkpoint and the key."""
    path = _tampered_checkpoint(
        trained / "run" / "checkpoints" / "best.pt",
        tmp_path / "margin.pt",
        lambda s: s["config"]["train"].update(cache_margin=2000),
    )
    result = run_cli("index", "--checkpoint", path, "--data", trained / "dataset", "--out", tmp_path / "index", "-q")
    _one_clean_error(result, str(path), "config.train.cache_margin: Input should be less than or equal to 4")
    assert not (tmp_path / "index").exists()


@pytest.mark.parametrize(
    "change,message",
    [
        (_reshape_first, "the architecture needs ("),
        (lambda s: s.update(optimizer="adam"), "optimizer is a str, --resume needs a dict"),
        (lambda s: s.pop("torch_rng"), "lacks 'torch_rng', which --resume needs"),
    ],
    ids=["shape", "optimizer type", "no rng"],
)
def test_resume_from_a_tampered_last_checkpoint_exits_2(trained, tmp_path, change, message):
    run = tmp_path / "run"
    shutil.copytree(trained / "run", run)
    last = run / "checkpoints" / "last.pt"
    _tampered_checkpoint(last, last, change)
    before = last.read_bytes()
    result = run_cli("train", "--data", trained / "dataset", "--out", run, "--resume", "-q")
    _one_clean_error(result, str(last), message)
    assert last.read_bytes() == before


def _first_running_var(state) -> str:
    return next(name for name in state["model"] if name.endswith("running_var"))


ROUND_19_CHECKPOINTS = {
    "a sparse weight": (  # J2: torch's value check crashed ("Could not run 'aten::ne.Scalar' ... 'SparseCPU'")
        lambda s: s["model"].update({_first_weight(s): s["model"][_first_weight(s)].to_sparse()}),
        "is a sparse tensor (sparse_coo), the architecture needs a dense one",
    ),
    "a weight on the meta device": (  # J2: a meta tensor loads as one and has no values to check
        lambda s: s["model"].update({_first_weight(s): torch.empty(s["model"][_first_weight(s)].shape, device="meta")}),
        "is a tensor on the meta device, which holds no values; the checkpoint is corrupt",
    ),
    "a negative running_var": (  # J8: every embedding was NaN, and the images were blamed
        lambda s: s["model"].update({_first_running_var(s): -torch.ones_like(s["model"][_first_running_var(s)])}),
        "running_var holds negative values; the checkpoint is corrupt",
    ),
}


@pytest.mark.parametrize("case", ROUND_19_CHECKPOINTS)
def test_checkpoint_tensors_that_are_not_dense_values_a_model_can_hold_are_named(trained, tmp_path, case):
    """Attack round 19 J2, J8: a sparse weight in a checkpoint was an internal error (exit 1, after torch's
    "Validating sparse tensor invariants" warning); a BatchNorm running_var of -1 made index say "the model
    produced non-finite embeddings for 180 images, first r0000_phone_a.jpg". Both are the checkpoint's fault,
    named in one line with its key; nothing is written."""
    change, message = ROUND_19_CHECKPOINTS[case]
    best = trained / "run" / "checkpoints" / "best.pt"
    path = _tampered_checkpoint(best, tmp_path / "bad.pt", change)
    state = torch.load(best, map_location="cpu", weights_only=True)
    key = _first_running_var(state) if "running_var" in message else _first_weight(state)
    result = run_cli("index", "--checkpoint", path, "--data", trained / "dataset", "--out", tmp_path / "index", "-q")
    _one_clean_error(result, f"{path}: model.{key} ", message)
    assert not (tmp_path / "index").exists()


def test_a_checkpoint_format_version_of_true_is_refused(trained, tmp_path):
    """Attack round 19 J12: ``format_version = True`` was taken, because True == 1."""
    state = torch.load(trained / "run" / "checkpoints" / "best.pt", map_location="cpu", weights_only=True)
    state["format_version"] = True
    torch.save(state, tmp_path / "bool.pt")
    result = run_cli(
        "index", "--checkpoint", tmp_path / "bool.pt", "--data", trained / "dataset", "--out", tmp_path / "ix"
    )
    _one_clean_error(result, f"{tmp_path / 'bool.pt'} is not a receipt-embed checkpoint", "its format_version is True")
    assert not (tmp_path / "ix").exists()


def test_parameters_and_cycles_in_a_checkpoint_load_quietly_and_index_the_same(trained, tmp_path):
    """Attack round 21 L3: a weight saved as an ``nn.Parameter`` made torch print "Converting a tensor with
    requires_grad=True to a scalar" (with a literal \\n) from the checkpoint checks. The weights are taken as
    plain tensors: no warning, and the index equals the one from the untampered file. A list holding
    itself (pickle allows it) is walked once, not forever."""
    best = trained / "run" / "checkpoints" / "best.pt"

    def change(state):
        state["model"][_first_weight(state)] = torch.nn.Parameter(state["model"][_first_weight(state)])
        loop = [1]
        loop.append(loop)
        state["extra"] = {"loop": loop}

    path = _tampered_checkpoint(best, tmp_path / "param.pt", change)
    results = {}
    for name, checkpoint in (("plain", best), ("param", path)):
        out = tmp_path / name
        result = run_cli("index", "--checkpoint", checkpoint, "--data", trained / "dataset", "--out", out, "-q")
        assert result.returncode == 0, result.stderr
        assert "requires_grad" not in result.stderr and "Warning" not in result.stderr, result.stderr
        results[name] = np.load(out / "embeddings.npy")
    np.testing.assert_array_equal(results["plain"], results["param"])


def _peak_memory_kb(*args) -> tuple[int, str, int]:
    """``python -m receipt_embed ARGS``: exit code, stderr and the process's own peak RSS (KB)."""
    import os
    import subprocess
    import sys
    import tempfile

    env = {k: v for k, v in os.environ.items() if not k.startswith("RECEIPT_EMBED_")}
    with tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "receipt_embed", *map(str, args)], stdout=subprocess.DEVNULL, stderr=err, env=env
        )
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        return process.returncode, err.read(), usage.ru_maxrss


def test_a_checkpoint_asking_for_a_wider_encoder_than_its_weights_is_refused_before_building_it(trained, tmp_path):
    """Attack round 19 J1: a 13 MB checkpoint whose config asked for model.params.widths [4000, 4000] made
    index build the whole 576 MB model (kaiming init touching every page) before the first shape check;
    [20000, 20000] would have taken some 29 GB. The checkpoint's tensors are now compared with the shapes
    of the model built on torch's meta device, so the refusal costs no more memory than any other one.
    (Here [4096, 4096], the widest allowed: 1.2 GB, so the test itself stays safe without the fix.)"""
    best = trained / "run" / "checkpoints" / "best.pt"
    small = _tampered_checkpoint(best, tmp_path / "small.pt", _reshape_first)
    wide = _tampered_checkpoint(
        best,
        tmp_path / "wide.pt",
        lambda s: s["config"]["model"].update(params={**s["config"]["model"]["params"], "widths": [4096, 4096]}),
    )
    state = torch.load(best, weights_only=True)
    first = _first_weight(state)
    shape = ",".join(map(str, state["model"][first].shape))  # (32, 1, stem, stem): the first stage's
    wider = ",".join(map(str, (4096, *state["model"][first].shape[1:])))
    data = ("--data", trained / "dataset", "-q")
    code, _, baseline = _peak_memory_kb("index", "--checkpoint", small, "--out", tmp_path / "ix1", *data)
    assert code == 2
    code, stderr, peak = _peak_memory_kb("index", "--checkpoint", wide, "--out", tmp_path / "ix2", *data)
    assert code == 2 and stderr.strip().splitlines() == [
        f"Error: {wide}: model.{first} has shape ({shape}), the architecture needs ({wider})"
    ], stderr
    assert peak < baseline + 400 * 1024, (peak, baseline)  # the real model would be 1.2 GB more
    assert not (tmp_path / "ix2").exists()


@pytest.mark.parametrize(
    "widths, shown",
    [
        ("[0]", "got [0]"),  # J3: an internal error from the convolution ("expected weight to be at least 1")
        ("abc", "got 'abc'"),  # J9a: "not all arguments converted during string formatting"
        ("[65536,65536]", "got [65536, 65536]"),  # J1: a 154 GB weight was allocated
    ],
    ids=["zero", "text", "huge"],
)
def test_train_refuses_receipt_cnn_widths_it_cannot_build(trained, tmp_path, widths, shown):
    """Attack round 19 J1, J3, J9a: model.params.widths is checked before anything is built: 1 to 16 whole
    numbers from 1 to 4096, the key and the bad value named in one line (exit 2)."""
    from conftest import TINY_TRAINING

    sets = [item for setting in [*TINY_TRAINING, f"model.params.widths={widths}"] for item in ("--set", setting)]
    result = run_cli("train", "--data", trained / "dataset", "--out", tmp_path / "run", *sets, "-q")
    _one_clean_error(
        result,
        "encoder 'receipt_cnn' (from plugin 'builtin.encoders'): model.params.widths must be a list of 1 to 16 "
        f"whole numbers from 1 to 4096 (channels per stage), {shown}",
    )
    assert not (tmp_path / "run" / "checkpoints").exists()


# ---- mathtext and markup in metadata ------------------------------------------------------


def test_dollar_signs_and_markup_in_metadata_are_drawn_and_shown_literally(tmp_path):
    images = sorted((REPO / "data_samples" / "images").glob("*.jpg"))[:24]
    folder = tmp_path / "captures"
    folder.mkdir()
    devices = ["$\\frac{$", "$x$", "a$b", "<script>alert(1)</script>"]
    rows = []
    for i, image in enumerate(images):
        shutil.copy(image, folder / image.name)
        rows.append(
            {
                "path": image.name,
                "receipt_id": f"r{i // 3}",
                "device": devices[i % 4],
                "merchant": "$\\sqrt{$" if i % 2 else "$$",
            }
        )
    (folder / "manifest.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    np.save(tmp_path / "vectors.npy", np.random.default_rng(0).normal(size=(len(rows), 6)).astype(np.float32))
    index_embeddings(tmp_path / "vectors.npy", folder / "manifest.jsonl", tmp_path / "index")
    result = run_cli(
        "audit-shortcuts",
        tmp_path / "index",
        "--attribute",
        "device",
        "--context-attribute",
        "merchant",
        "--out",
        tmp_path / "report",
        "--gallery",
        "3",
        "-q",
    )
    assert result.returncode == 0, result.stderr
    html = (tmp_path / "report" / "audit.html").read_text()
    assert "<script>alert(1)" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert html.count("data:image/png") >= 5 and "data:image/jpeg" in html


def test_literal_text_is_never_mathtext():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from receipt_embed.audit.report import literal

    for text in ("$\\frac{$", "$x$", "a$b", "\\$", "$$"):
        fig, ax = plt.subplots()
        label = ax.set_title(literal(text))
        fig.canvas.draw()  # bad mathtext would raise here
        assert label._preprocess_math(label.get_text()) == (text, False)
        plt.close(fig)


# ---- shards -----------------------------------------------------------------------------


def _shards(base):
    from receipt_embed.indexing.shards import write_shard

    rng = np.random.default_rng(2)
    source = {
        "kind": "checkpoint",
        "checkpoint": "/x/best.pt",
        "checkpoint_sha256": "0" * 64,
        "dataset": "/x/data",
        "dataset_sha256": None,
        "split": "all",
        "features": "backbone",
        "total": 8,
    }
    for shard in (0, 1):
        items = [
            {"path": f"/x/{shard}-{i}.jpg", "receipt_id": f"r{i}", "device": "d", "split": "train"} for i in range(4)
        ]
        write_shard(
            base / f"s{shard}",
            rng.normal(size=(4, 6)).astype(np.float32),
            items,
            {**source, "shard": shard, "shards": 2, "rows": [4 * shard, 4 * shard + 4]},
        )
    return [base / "s0", base / "s1"]


def _edit_shard(shard, change):
    meta = json.loads((shard / "shard.json").read_text())
    change(meta)
    (shard / "shard.json").write_text(json.dumps(meta))


def _shard_items(shard, change):
    from receipt_embed.indexing.index_dir import sha256_file

    (shard / "items.jsonl").write_text(change((shard / "items.jsonl").read_text()))
    _edit_shard(shard, lambda meta: meta["files"].update({"items.jsonl": sha256_file(shard / "items.jsonl")}))


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda s: _edit_shard(s, lambda m: m.update(files=["embeddings.npy"])), "shard.json: files is a list"),
        (lambda s: _edit_shard(s, lambda m: m.update(shard="1")), "shard.json: shard is a str"),
        (lambda s: _edit_shard(s, lambda m: m.pop("total")), "shard.json lacks 'total'"),
        # attack round 29: index-merge said only "Error: 'features'"
        (lambda s: _edit_shard(s, lambda m: m.pop("features")), "shard.json lacks 'features'"),
        (lambda s: _shard_items(s, lambda text: text.replace('"r1"', "1")), "items.jsonl, row 1 (0-based): receipt_id"),
    ],
    ids=["files a list", "shard a string", "no total", "no features", "receipt_id a number"],
)
def test_index_merge_names_edited_shards(tmp_path, change, message):
    shards = _shards(tmp_path)
    change(shards[1])
    result = run_cli("index-merge", *shards, "--out", tmp_path / "merged", "-q")
    _one_clean_error(result, str(shards[1]), message)
    assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize(
    "rows",
    [None, [4], {"a": 1}, "ab", [4, "x"], [1.5, 2], [4.0, 8.0], [4, 8, 5], [-4, 8], [True, 8], [0, 4], []],
    ids=repr,
)
def test_index_merge_refuses_a_shard_json_rows_other_than_its_shard_covers(tmp_path, rows):
    """Attack round 18 H1: index-merge sliced the dataset with shard.json's rows unchecked: null,
    [90] or [1.5, 2] were internal errors (TypeError, IndexError), [90, 180, 5] and [-90, 180]
    merged, [true, 180] was named as a wrong item count. rows is the [start, end] of shard i/n."""
    shards = _shards(tmp_path)
    _edit_shard(shards[1], lambda meta: meta.update(rows=rows))
    result = run_cli("index-merge", *shards, "--out", tmp_path / "merged", "-q")
    _one_clean_error(result, f"{shards[1] / 'shard.json'}: rows is {json.dumps(rows)}, expected [4, 8] (two integers")
    assert "shard 1/2 of 8 covers" in result.stderr
    assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda m: m.update(kind=None), 'kind is null, expected "checkpoint"'),
        (lambda m: m.update(kind="embeddings"), 'kind is "embeddings", expected "checkpoint"'),
        (lambda m: m.pop("kind"), "shard.json lacks 'kind'"),
        (lambda m: m.pop("rows"), "shard.json lacks 'rows'"),
        (lambda m: m.update(count=3), "shard.json: count is 3, but rows [4, 8] of shard 1/2 hold 4"),
        (lambda m: m.update(shard=2, rows=[8, 12]), "shard.json: shard is 2 of shards 2, expected 0 <= shard < shards"),
    ],
    ids=["kind null", "kind embeddings", "no kind", "no rows", "count off", "shard past shards"],
)
def test_index_merge_refuses_a_shard_json_kind_or_slice_index_shard_never_writes(tmp_path, change, message):
    """Attack round 18 H1: kind null or "embeddings" merged (exit 0) into a checkpoint index; the
    slice a shard claims (shard, count, rows) must be the one `index --shard` writes for it."""
    shards = _shards(tmp_path)
    _edit_shard(shards[1], change)
    result = run_cli("index-merge", *shards, "--out", tmp_path / "merged", "-q")
    _one_clean_error(result, str(shards[1] / "shard.json"), message)
    assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize("name", ["/etc/hostname", "../s0/items.jsonl", "notes.txt"])
def test_a_shard_json_naming_other_files_is_refused_without_opening_them(tmp_path, name):
    """Attack round 14: index-merge opened and hashed every path shard.json's files named (/etc/shadow,
    ../..), a yes/no oracle on any file's sha256 and a read of any size; only the shard's own two load."""
    import hashlib

    shards = _shards(tmp_path)
    target = Path(name) if name.startswith("/") else shards[1] / name
    digest = hashlib.sha256(target.read_bytes()).hexdigest() if target.is_file() else "0" * 64
    _edit_shard(shards[1], lambda meta: meta["files"].update({name: digest}))
    result = run_cli("index-merge", *shards, "--out", tmp_path / "merged", "-q")
    named = ", ".join(repr(n) for n in sorted([name, "embeddings.npy", "items.jsonl"]))
    _one_clean_error(result, str(shards[1] / "shard.json"), f"files names {named}")
    assert "a shard holds exactly embeddings.npy and items.jsonl" in result.stderr
    assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda s: s.update(sums={**s["sums"], "loss": "x"}), "sums.loss is a str, --resume needs a number"),
        (lambda s: s.update(sums={**s["sums"], "steps": -1}), "sums.steps is -1; --resume needs 0 or more"),
        (lambda s: s.update(epoch=-5), "epoch is -5; --resume needs a count of 0 or more"),
        (lambda s: s.update(step=10**9), "step is 1000000000, but an epoch of this run has"),
        (lambda s: s.update(step=-3), "step is -3; --resume needs a count of 0 or more"),
    ],
    ids=["sums loss a string", "negative sums", "negative epoch", "step past the epoch", "negative step"],
)
@pytest.mark.slow  # five training resumes: kept out of the default suite (-m slow runs it)
def test_resume_refuses_counters_a_run_cannot_have(trained, tmp_path, change, message):
    """Round 3 of the attack: a last.pt whose counters were edited is named, not trained on."""
    run = tmp_path / "run"
    shutil.copytree(trained / "run", run)
    last = run / "checkpoints" / "last.pt"
    _tampered_checkpoint(last, last, change)
    before = last.read_bytes()
    result = run_cli("train", "--data", trained / "dataset", "--out", run, "--resume", "-q", "--set", "train.epochs=3")
    _one_clean_error(result, str(last), message)
    assert last.read_bytes() == before


@pytest.mark.parametrize(
    "section,key,value,named",
    [
        ("data", "image_size", [16000, 8000], "config.data.image_size.0"),
        ("model", "head_hidden", 10**10, "config.model.head_hidden"),
    ],
)
def test_a_checkpoint_config_with_absurd_sizes_is_refused_before_anything_is_allocated(
    trained, tmp_path, section, key, value, named
):
    path = _tampered_checkpoint(
        trained / "run" / "checkpoints" / "best.pt",
        tmp_path / "big.pt",
        lambda s: s["config"][section].update({key: value}),
    )
    result = run_cli("index", "--checkpoint", path, "--data", trained / "dataset", "--out", tmp_path / "ix", "-q")
    _one_clean_error(result, str(path), named, "less than or equal to")


def test_idmap_factories_are_refused_in_one_line(small_index, tmp_path):
    x = small_index.parent / "vectors.npy"
    manifest = small_index.parent / "manifest.jsonl"
    for factory in ("IDMap,Flat", "IDMap2,Flat", "IDMap,HNSW32"):
        result = run_cli(
            "index", "--embeddings", x, "--manifest", manifest, "--out", tmp_path / "ix", "--factory", factory
        )
        _one_clean_error(result, "IDMap wrappers are not supported")
        assert not (tmp_path / "ix").exists()


@pytest.mark.slow  # trains: a long run, kept out of the default suite (-m slow runs it)
def test_resume_refuses_a_checkpoint_ahead_of_its_runs_log(trained, tmp_path):
    """Round 4 of the attack: epoch=10**12 in last.pt was resumed ("nothing to train")."""
    run = tmp_path / "run"
    shutil.copytree(trained / "run", run)
    last = run / "checkpoints" / "last.pt"
    _tampered_checkpoint(last, last, lambda s: s.update(epoch=10**12))
    result = run_cli("train", "--data", trained / "dataset", "--out", run, "--resume", "-q", "--set", "train.epochs=3")
    _one_clean_error(result, str(last), "epoch is 1000000000000, but", "records epochs up to 1")


def test_a_head_too_large_for_memory_is_refused_before_it_is_built(trained, tmp_path):
    """Round 4 of the attack: sizes each within bounds whose product is 137 GB of weights."""
    overrides = {"grid": [64, 64], "pooling": "grid", "head_hidden": 65536}
    path = _tampered_checkpoint(
        trained / "run" / "checkpoints" / "best.pt",
        tmp_path / "big.pt",
        lambda s: s["config"]["model"].update(overrides),
    )
    result = run_cli("index", "--checkpoint", path, "--data", trained / "dataset", "--out", tmp_path / "ix", "-q")
    _one_clean_error(result, "the projection head would have", "lower model.head_hidden or model.grid")


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda s: s.update(best={"epoch": 1, "recall_at_1": float("inf")}), "best.recall_at_1 is inf; --resume"),
        (lambda s: s.update(best={"epoch": 99, "recall_at_1": 0.5}), "best.epoch is 99; --resume needs an epoch"),
        (lambda s: s["scheduler"].update(last_epoch=-40), "scheduler.last_epoch is -40; --resume needs a step"),
        (lambda s: s["scheduler"].update(last_epoch=2.5), "scheduler.last_epoch is 2.5"),
        (lambda s: s["scheduler"].update(base_lrs=[-0.1]), "scheduler.base_lrs holds -0.1; --resume needs finite"),
        (lambda s: s["optimizer"]["param_groups"][0].update(lr=float("nan")), "optimizer.param_groups holds nan"),
    ],
    ids=["best inf", "best epoch ahead", "negative step", "fractional step", "negative rate", "nan rate"],
)
def test_resume_refuses_a_best_or_schedule_a_run_cannot_have(trained, change, message):
    """Attack round 4: an ``inf`` best would block every later selection, a negative schedule step or
    rate would train uphill; each is named before anything is restored."""
    from receipt_embed.training.checkpoint import check_resumable

    last = trained / "run" / "checkpoints" / "last.pt"
    state = torch.load(last, map_location="cpu", weights_only=True)
    check_resumable(state, last)  # the run's own checkpoint passes
    change(state)
    with pytest.raises(CheckpointError, match=re.escape(f"{last}: {message}")):
        check_resumable(state, last)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda s: s["sums"].update(loss=float("nan")), "sums.loss is nan; --resume needs a finite number"),
        (lambda s: s["sums"].update(seconds=float("inf")), "sums.seconds is inf; --resume needs a finite number"),
        (lambda s: s["sums"].update(steps=0, views=0, loss=1e300), "sums has loss 1e+300 and views 0 over 0 steps"),
    ],
    ids=["nan loss", "inf seconds", "a loss over no steps"],
)
def test_resume_refuses_running_sums_a_run_cannot_have(trained, change, message):
    """Attack round 5: NaN, infinite or impossible running sums were resumed into metrics.jsonl."""
    from receipt_embed.training.checkpoint import check_resumable

    last = trained / "run" / "checkpoints" / "last.pt"
    state = torch.load(last, map_location="cpu", weights_only=True)
    change(state)
    with pytest.raises(CheckpointError, match=re.escape(f"{last}: {message}")):
        check_resumable(state, last)


# ---- dataset dirs edited by hand -----------------------------------------------------------


def _add_a_row(rows):
    rows.append({**rows[0], "path": rows[0]["path"].replace(".jpg", "-copy.jpg")})


def _duplicate_a_row(rows):
    rows.append(dict(rows[0]))


def _delete_a_row(rows):
    del rows[-1]


def _move_a_receipt(rows):
    moved = next(row["receipt_id"] for row in rows if row["split"] == "heldout")
    for row in rows:
        if row["receipt_id"] == moved:
            row["split"] = "train"


def _split_a_receipt(rows):
    next(row for row in rows if row["split"] == "heldout")["split"] = "train"


def _relabel_a_row(rows):
    rows[0]["receipt_id"] = rows[-1]["receipt_id"]


EDITS = {"added": _add_a_row, "duplicated": _duplicate_a_row, "deleted": _delete_a_row}
EDITS |= {"moved": _move_a_receipt, "relabelled": _relabel_a_row}


def _edited_dataset(source, target, change, reseal=False):
    """A copy of dataset dir ``source`` with ``change(rows)`` applied to its manifest; ``reseal``
    records the edited manifest's sha256 in the report, as a forger would."""
    import hashlib

    shutil.copytree(source, target)
    manifest = target / "manifest.jsonl"
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    change(rows)
    manifest.write_text("".join(json.dumps(row) + "\n" for row in rows))
    if reseal:
        report = json.loads((target / "ingest_report.json").read_text())
        report["manifest_sha256"] = hashlib.sha256(manifest.read_bytes()).hexdigest()
        (target / "ingest_report.json").write_text(json.dumps(report))
    return manifest


@pytest.mark.parametrize("case", sorted(EDITS))
def test_train_and_index_refuse_a_manifest_edited_after_ingest(trained, tmp_path, case):
    """Attack round 10: a row added, duplicated, deleted, relabelled or moved to another split by hand
    was trained on and indexed as if ingest had checked it. ingest seals the manifest with its sha256
    in the report; train and index refuse a manifest that no longer matches, naming it."""
    dataset = tmp_path / "ds"
    manifest = _edited_dataset(trained / "dataset", dataset, EDITS[case])
    expected = (str(manifest), "was changed after ingest wrote it", "run `receipt-embed ingest` again")
    result = run_cli("train", "--data", dataset, "--out", tmp_path / "run", "-q", "--set", "train.epochs=1")
    _one_clean_error(result, *expected)
    assert not (tmp_path / "run").exists()
    checkpoint = trained / "run" / "checkpoints" / "best.pt"
    result = run_cli("index", "--checkpoint", checkpoint, "--data", dataset, "--out", tmp_path / "ix", "-q")
    _one_clean_error(result, *expected)
    assert not (tmp_path / "ix").exists()


UNSEALED = {  # the rules a dataset dir keeps even when its seal was recomputed over a hand-edited manifest
    "duplicated": (_duplicate_a_row, "is listed again (first on line 1)"),
    "split": (_split_a_receipt, "a receipt's captures must share one split"),
    "unknown split": (lambda rows: rows[0].update(split="test"), "line 1: unknown split 'test'"),
    "number id": (lambda rows: rows[0].update(receipt_id=7), "line 1: receipt_id must be a non-empty string, not 7"),
    "empty device": (lambda rows: rows[0].update(device=""), "line 1: device must be a non-empty string"),
}


@pytest.mark.parametrize("case", sorted(UNSEALED))
def test_a_resealed_dataset_dir_is_still_checked_row_by_row(trained, tmp_path, case):
    change, message = UNSEALED[case]
    manifest = _edited_dataset(trained / "dataset", tmp_path / "ds", change, reseal=True)
    result = run_cli("train", "--data", tmp_path / "ds", "--out", tmp_path / "run", "-q", "--set", "train.epochs=1")
    _one_clean_error(result, str(manifest), message)


SEAL_OFF = {  # attack round 13: each switched the seal off, and a hand-edited manifest was trusted
    "report deleted": (lambda report: None, "ingest_report.json is missing: a dataset dir is what"),
    "report a list": (lambda report: [], "does not record the sha256 of manifest.jsonl"),
    "seal null": (lambda report: {**report, "manifest_sha256": None}, "does not record the sha256 of manifest.jsonl"),
    "seal dropped": (lambda report: {k: v for k, v in report.items() if k != "manifest_sha256"}, "does not record"),
}


@pytest.mark.parametrize("case", sorted(SEAL_OFF))
def test_a_dataset_dir_whose_seal_is_removed_is_refused(trained, tmp_path, case):
    change, message = SEAL_OFF[case]
    dataset = tmp_path / "ds"
    _edited_dataset(trained / "dataset", dataset, _relabel_a_row)
    report = change(json.loads((dataset / "ingest_report.json").read_text()))
    (dataset / "ingest_report.json").unlink()
    if report is not None:
        (dataset / "ingest_report.json").write_text(json.dumps(report))
    result = run_cli("train", "--data", dataset, "--out", tmp_path / "run", "-q", "--set", "train.epochs=1")
    _one_clean_error(result, str(dataset / "ingest_report.json"), message, "re-run `receipt-embed ingest`")
    assert not (tmp_path / "run").exists()


def test_an_unedited_dataset_dir_loads_and_its_seal_is_the_manifests_sha256(trained):
    import hashlib

    from receipt_embed.data.dataset_dir import load_dataset_dir

    dataset = trained / "dataset"
    report = json.loads((dataset / "ingest_report.json").read_text())
    assert report["manifest_sha256"] == hashlib.sha256((dataset / "manifest.jsonl").read_bytes()).hexdigest()
    assert len(load_dataset_dir(dataset)) == report["counts"]["accepted"]


@pytest.mark.parametrize("params", ["efSearch=-1", "efSearch=2000000000", "efSearch=16,efSearch=999", "nprobe=4"])
def test_search_params_other_than_a_tuned_setting_are_refused(tmp_path, params):
    """Attack round 11: efSearch=-1 in index.json silently dropped neighbours (a query's own
    capture among them), and efSearch=2000000000 searched for 45 s in 16 GB: faiss takes any
    number. Only a setting `index` tunes over loads."""
    from test_overwrite import write_embeddings

    x, manifest = write_embeddings(tmp_path, "e", 300)
    index_embeddings(x, manifest, tmp_path / "ix", factory="HNSW32")
    tuned = json.loads((tmp_path / "ix" / "index.json").read_text())["search_params"]
    assert tuned.startswith("efSearch=") and load_index_dir(tmp_path / "ix").meta["search_params"] == tuned
    edit_meta(tmp_path / "ix", lambda meta: meta.update(search_params=params))
    with pytest.raises(IndexDirError) as info:
        load_index_dir(tmp_path / "ix")
    assert f"index.json: search_params {params!r} do not apply to a HNSW32 index" in str(info.value)
    assert "`receipt-embed index` writes one of the settings it tunes: 'efSearch=16'" in str(info.value)


def test_embedding_batches_hold_a_bounded_number_of_pixels():
    """Attack round 11: batches of 128 at a large input size were tens of GB; a batch now holds
    at most MAX_BATCH_PIXELS input pixels (128 at the defaults, one at 2048 x 2048)."""
    from receipt_embed.data.views import MAX_BATCH_PIXELS, clean_batches

    images = np.zeros((5, 40, 20, 3), np.uint8)
    sizes = [len(b) for b in clean_batches(images, (2048, 1024), True, 128)]
    assert sizes == [2, 2, 1] and 2 * 2048 * 1024 <= MAX_BATCH_PIXELS
    assert [len(b) for b in clean_batches(np.zeros((200, 40, 20, 3), np.uint8), (128, 64), True, 128)] == [128, 72]


def test_a_jsonl_manifest_row_giving_a_key_twice_is_refused(tmp_path):
    """Attack round 11: `"split": "heldout", "split": "train"` kept the last value silently (a
    repeated CSV column was already refused)."""
    from receipt_embed.ingest import ManifestError, ingest

    image = sorted((REPO / "data_samples" / "images").glob("*.jpg"))[0]
    shutil.copy(image, tmp_path / "a.jpg")
    (tmp_path / "m.jsonl").write_text(
        '{"path": "a.jpg", "receipt_id": "r1", "device": "p"}\n'
        '{"path": "a.jpg", "receipt_id": "r1", "device": "p", "split": "heldout", "split": "train"}\n'
    )
    with pytest.raises(ManifestError) as info:
        ingest(tmp_path / "m.jsonl", tmp_path / "ds")
    assert str(info.value) == f"{tmp_path / 'm.jsonl'}, line 2: invalid JSON (key 'split' is given twice in one object)"
    assert not (tmp_path / "ds").exists()


def test_items_swapped_or_shards_crossed_are_refused_against_their_dataset(trained, tmp_path):
    """Attack round 12: two rows of items.jsonl swapped (checksums recomputed) loaded fine and
    `search` named the wrong receipt at similarity 1.000; a shard holding another shard's rows
    merged into an index listing 12 captures twice. Items are checked against the rows of the
    dataset they were built from, while that dataset's manifest is unchanged."""
    from receipt_embed.indexing.index_dir import sha256_file

    dataset, checkpoint = trained / "dataset", trained / "run" / "checkpoints" / "best.pt"
    index = tmp_path / "ix"
    assert run_cli("index", "--checkpoint", checkpoint, "--data", dataset, "--out", index, "-q").returncode == 0
    lines = (index / "items.jsonl").read_text().splitlines(keepends=True)
    (index / "items.jsonl").write_text("".join([lines[1], lines[0], *lines[2:]]))
    reseal(index, "items.jsonl")
    with pytest.raises(IndexDirError) as info:
        load_index_dir(index)
    first = json.loads(lines[1])["path"]
    assert str(info.value).startswith(
        f"{index / 'items.jsonl'}, row 0 (0-based): {first!r} is not the capture its dataset"
    )

    for shard in ("0/2", "1/2"):
        result = run_cli("index", "--checkpoint", checkpoint, "--data", dataset, "--shard", shard, "-q",
                         "--out", tmp_path / f"s{shard[0]}")  # fmt: skip
        assert result.returncode == 0, result.stderr
    crossed = tmp_path / "s1" / "items.jsonl"
    crossed.write_bytes((tmp_path / "s0" / "items.jsonl").read_bytes())
    meta = json.loads((tmp_path / "s1" / "shard.json").read_text())
    meta["files"]["items.jsonl"] = sha256_file(crossed)
    (tmp_path / "s1" / "shard.json").write_text(json.dumps(meta))
    result = run_cli("index-merge", tmp_path / "s0", tmp_path / "s1", "--out", tmp_path / "merged")
    _one_clean_error(result, f"{crossed}, row 0 (0-based): ", "is not the capture its dataset lists there")
    assert not (tmp_path / "merged").exists()


def test_attack_round_22_mc5_an_item_whose_receipt_id_was_changed_names_the_field_not_the_path_twice(trained, tmp_path):
    dataset, checkpoint = trained / "dataset", trained / "run" / "checkpoints" / "best.pt"
    index = tmp_path / "ix"
    assert run_cli("index", "--checkpoint", checkpoint, "--data", dataset, "--out", index, "-q").returncode == 0
    lines = (index / "items.jsonl").read_text().splitlines(keepends=True)
    first = json.loads(lines[0])
    edited = {**first, "receipt_id": "someone-else"}
    (index / "items.jsonl").write_text("".join([json.dumps(edited) + "\n", *lines[1:]]))
    reseal(index, "items.jsonl")
    with pytest.raises(IndexDirError) as info:
        load_index_dir(index)
    assert str(info.value) == (
        f"{index / 'items.jsonl'}, row 0 (0-based, {first['path']!r}): its 'receipt_id' is 'someone-else' but its dataset "
        f"has {first['receipt_id']!r}: the index was edited; build it again"
    )
    dropped = {k: v for k, v in first.items() if k != "device"}
    (index / "items.jsonl").write_text("".join([json.dumps(dropped) + "\n", *lines[1:]]))
    reseal(index, "items.jsonl")
    with pytest.raises(IndexDirError, match=r"its 'device' is absent but its dataset has "):
        load_index_dir(index)


@pytest.mark.parametrize("key, value", [("device", [1, 2]), ("split", {"a": 1}), ("sha256", True), ("receipt_id", [])])
def test_index_embeddings_refuses_a_manifest_value_its_readers_cannot_take(tmp_path, key, value):
    """Attack round 14: `index --embeddings` wrote a list-valued device (or a non-text split or sha256)
    from a JSON-lines manifest into items.jsonl and exited 0; every reader then refused the index,
    naming items.jsonl instead of the manifest line to fix. Numbers are taken as their digits."""
    rows = [{"path": f"{i}.jpg", "receipt_id": f"r{i // 2}", "device": "d", "split": "heldout"} for i in range(6)]
    rows[3][key] = value
    rows[4]["device"] = 7
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    np.save(tmp_path / "x.npy", np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32))
    with pytest.raises(BadInput) as info:
        index_embeddings(tmp_path / "x.npy", tmp_path / "m.jsonl", tmp_path / "ix")
    assert str(info.value).startswith(f"{tmp_path / 'm.jsonl'}, line 4: {key} is {json.dumps(value)}, expected text")
    assert not (tmp_path / "ix").exists()
    rows[3][key] = "ok"
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    index_embeddings(tmp_path / "x.npy", tmp_path / "m.jsonl", tmp_path / "ix")
    assert load_index_dir(tmp_path / "ix").items[4]["device"] == "7"


def test_embeddings_of_large_finite_values_index_as_their_directions(tmp_path):
    """Attack round 15: rows of 1e20 (finite float32) overflowed their squared norm, were stored as
    all-zero vectors with exit 0, and every reader then refused the index."""
    rows = [{"path": f"{i}.jpg", "receipt_id": f"r{i // 2}", "device": "d"} for i in range(4)]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    x = np.array([[1e20, 1e20, 0], [2e20, 2e20, 1e19], [0, -1e38, 1e38], [0, -3, 3]], np.float32)
    np.save(tmp_path / "x.npy", x)
    index_embeddings(tmp_path / "x.npy", tmp_path / "m.jsonl", tmp_path / "ix")
    stored = load_index_dir(tmp_path / "ix").embeddings
    assert np.allclose(np.linalg.norm(stored, axis=1), 1, atol=1e-6)
    assert np.allclose(stored[0], [2**-0.5, 2**-0.5, 0]) and np.allclose(stored[2], stored[3])


def test_an_ivf_index_of_no_lists_is_refused_at_load(small_index, tmp_path):
    """Attack round 15: an IVF0,Flat index dir (an older release wrote one with exit 0) made search and
    audit an internal error ("cur_nprobe > 0 failed")."""
    import faiss

    from receipt_embed.indexing.index_dir import sha256_file

    index = copy_index(small_index, tmp_path / "ix")
    stored = load_index_dir(index).embeddings
    ivf = faiss.IndexIVFFlat(faiss.IndexFlatIP(stored.shape[1]), stored.shape[1], 0, faiss.METRIC_INNER_PRODUCT)
    ivf.is_trained = True
    faiss.write_index(ivf, str(index / "index.faiss"))
    reseal(index, "index.faiss")
    with pytest.raises(IndexDirError, match="index.faiss is an IVF index with no lists; build it again with IVF1"):
        load_index_dir(index)
    assert sha256_file(index / "index.faiss")


def test_near_identical_rows_swapped_in_embeddings_are_refused(tmp_path):
    """Attack round 29: two rows within a cosine of 1e-3 of each other (an under-trained model, two
    captures of one receipt) could trade places in embeddings.npy, checksums resealed, unseen by
    searching the index for them; the Flat index's stored vectors are compared instead."""
    rows = [{"path": f"img{i}.jpg", "receipt_id": f"r{i // 2}", "device": "d"} for i in range(8)]
    (tmp_path / "manifest.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    vectors = np.random.default_rng(2).normal(size=(8, 16)).astype(np.float32)
    vectors[1] = vectors[0] + 1e-3 * vectors[5]  # cosine about 0.999999 with row 0
    np.save(tmp_path / "vectors.npy", vectors)
    index_embeddings(tmp_path / "vectors.npy", tmp_path / "manifest.jsonl", tmp_path / "index")
    index = tmp_path / "index"
    stored = np.load(index / "embeddings.npy")
    assert float(stored[0] @ stored[1]) > 1 - 1e-3  # what the search-based check lets through
    load_index_dir(index)  # untouched, it loads
    _embeddings(stored[[1, 0, 2, 3, 4, 5, 6, 7]])(index)
    with pytest.raises(IndexDirError, match=r"its vector 0 differs from row 0 of embeddings.npy by up to .* \(2 of 8"):
        load_index_dir(index)
