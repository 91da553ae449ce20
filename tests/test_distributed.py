"""Distributed contrastive loss: 2 CPU processes (gloo) against one process on the same batch."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_worker import make_loss, model_and_batch, momentum_keys, rows_for

from receipt_embed.distributed import identity_slice, two_view_order

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(tmp_path: Path, loss: str, mode: str, world: int = 2) -> list[dict]:
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(world),
        "OMP_NUM_THREADS": "1",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "dist_worker.py"), str(tmp_path / f"r{r}.pt"), loss, mode],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
    return [torch.load(tmp_path / f"r{r}.pt", weights_only=True) for r in range(world)]


def single_process(loss: str) -> dict:
    model, inputs = model_and_batch()
    x, labels = rows_for(inputs, list(range(inputs.shape[1])))
    loss_fn = make_loss(loss)
    if loss == "moco":
        value = loss_fn(model(x), labels, keys=momentum_keys(model, x))
    else:
        value = loss_fn(model(x), labels)
    value.backward()
    return {
        "loss": value.detach(),
        "grads": [p.grad.detach().clone() for p in model.parameters()],
        "state": loss_fn.state_dict(),
    }


@pytest.mark.parametrize("loss", ["ntxent", "supcon", "moco"])
def test_two_ranks_match_one_process(tmp_path, loss):
    reference = single_process(loss)
    ranks = run_ranks(tmp_path, loss, "differentiable")
    for rank in ranks:
        assert torch.allclose(rank["loss"], reference["loss"], atol=1e-5), (rank["loss"], reference["loss"])
        for got, want in zip(rank["grads"], reference["grads"]):
            assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
        # MoCo: every rank's queue holds the global batch's keys in the single-process order
        for name, value in reference["state"].items():
            assert torch.allclose(rank["state"][name].float(), value.float(), atol=1e-5), name


def test_detached_gather_gets_the_gradients_wrong(tmp_path):
    """Same loss value, but rows from the other rank act as constants: every parameter
    gradient comes out 1/W of the true one. This is why the gather must be differentiable."""
    reference = single_process("ntxent")
    ranks = run_ranks(tmp_path, "ntxent", "detached")
    assert torch.allclose(ranks[0]["loss"], reference["loss"], atol=1e-5)
    for got, want in zip(ranks[0]["grads"], reference["grads"]):
        assert not torch.allclose(got, want, atol=1e-4)
        assert torch.allclose(got, want / 2, atol=1e-5)


def test_two_view_order_and_identity_slices():
    order = two_view_order(world_size=2, local_identities=3)
    # gathered rows: rank 0 [a0 a1 a2 a0' a1' a2'], rank 1 [b0 b1 b2 b0' b1' b2']
    assert order.tolist() == [0, 1, 2, 6, 7, 8, 3, 4, 5, 9, 10, 11]
    assert identity_slice(list(range(8)), 1, 2) == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="does not split over 3 ranks"):
        identity_slice(list(range(8)), 0, 3)


def test_train_nproc_2_end_to_end(cli, tmp_path):
    """`train --nproc 2` launches torchrun; rank 0 writes the run dir; resume needs the same count."""
    from receipt_embed.config import load_config
    from receipt_embed.ingest import ingest

    ingest(REPO / "data_samples", tmp_path / "ds", load_config().ingest)
    tiny = [
        "--set",
        "data.image_size=[64,32]",
        "--set",
        "train.batch_size=8",
        "--set",
        "model.head_hidden=64",
        "--set",
        "model.head_dim=32",
        "--set",
        "train.eval_batch_size=64",
        "--set",
        "train.bn_recalibrate=32",
    ]
    result = cli(
        "train",
        "--data",
        tmp_path / "ds",
        "--out",
        tmp_path / "run",
        "--nproc",
        "2",
        "-q",
        "--set",
        "train.epochs=1",
        *tiny,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1  # one writer
    import json

    line = json.loads(lines[0])
    assert line["world_size"] == 2 and line["loss_stats"]["anchors"] == 24  # the global batch: 8 receipts x 3 captures
    assert line["global_unique_identities_per_step"] == 8
    assert "recall_at_1" in line["val"]["head"]
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert state["world_size"] == 2
    result = cli(
        "train",
        "--data",
        tmp_path / "ds",
        "--out",
        tmp_path / "run",
        "--resume",
        "-q",
        "--set",
        "train.epochs=2",
        *tiny,
    )
    assert result.returncode == 2 and "resume it with the same number (--nproc 2), not 1" in result.stderr
    result = cli(
        "train",
        "--data",
        tmp_path / "ds",
        "--out",
        tmp_path / "run",
        "--resume",
        "--nproc",
        "2",
        "-q",
        "--set",
        "train.epochs=2",
        *tiny,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [l["epoch"] for l in lines] == [1, 2] and lines[1]["world_size"] == 2
    result = cli("train", "--out", tmp_path / "run2", "--nproc", "2", "-q")
    assert result.returncode == 2 and "needs --data" in result.stderr
    result = cli(
        "train",
        "--data",
        tmp_path / "ds",
        "--out",
        tmp_path / "run3",
        "--nproc",
        "2",
        "-q",
        "--set",
        "train.epochs=1",
        *tiny[:2],
        "--set",
        "train.batch_size=7",
        *tiny[4:],
    )
    assert result.returncode == 2 and "does not split over 2 processes" in result.stderr  # checked before launching
    assert "Traceback" not in result.stderr


def test_sigterm_to_the_launcher_stops_every_rank_and_saves(tmp_path):
    import signal
    import time

    from receipt_embed.config import load_config
    from receipt_embed.ingest import ingest

    ingest(REPO / "data_samples", tmp_path / "ds", load_config().ingest)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECEIPT_EMBED_")}
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "receipt_embed",
            "train",
            "--data",
            str(tmp_path / "ds"),
            "--out",
            str(tmp_path / "run"),
            "--nproc",
            "2",
            "-q",
            "--set",
            "train.epochs=200",
            "--set",
            "data.image_size=[64,32]",
            "--set",
            "train.batch_size=8",
            "--set",
            "model.head_hidden=64",
            "--set",
            "model.head_dim=32",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        time.sleep(0.5)
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 143, err[-2000:]
    assert "SIGTERM received: saved" in err and err.count("received: saved") == 1  # rank 0 speaks for the run
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert state["world_size"] == 2 and state["epoch"] >= 1


def test_train_nproc_2_with_moco_keeps_one_queue(cli, tmp_path):
    from receipt_embed.config import load_config
    from receipt_embed.ingest import ingest

    ingest(REPO / "data_samples", tmp_path / "ds", load_config().ingest)
    result = cli(
        "train",
        "--data",
        tmp_path / "ds",
        "--out",
        tmp_path / "run",
        "--nproc",
        "2",
        "-q",
        "--set",
        "train.epochs=1",
        "--set",
        "data.image_size=[64,32]",
        "--set",
        "train.batch_size=8",
        "--set",
        "model.head_hidden=64",
        "--set",
        "model.head_dim=32",
        "--set",
        "loss.name=moco",
        "--set",
        "loss.params={queue_size: 64, dim: 32, queue_init: empty}",
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    # 6 steps x 16 global keys, into a queue of 64 that started empty: full, every slot labelled
    assert int(state["loss"]["queue_count"]) == 64 and "momentum_model" in state
