"""Distributed contrastive loss: 2 CPU processes (gloo) against one process on the same batch."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_worker import model_and_batch, rows_for
from receipt_embed import create_loss
from receipt_embed.distributed import identity_slice, two_view_order

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(tmp_path: Path, loss: str, mode: str, world: int = 2) -> list[dict]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(world),
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(REPO / "tests" / "dist_worker.py"), str(tmp_path / f"r{r}.pt"), loss, mode],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
    return [torch.load(tmp_path / f"r{r}.pt", weights_only=True) for r in range(world)]


def single_process(loss: str) -> dict:
    model, inputs = model_and_batch()
    x, labels = rows_for(inputs, list(range(inputs.shape[1])))
    value = create_loss(loss, temperature=0.2)(model(x), labels)
    value.backward()
    return {"loss": value.detach(), "grads": [p.grad.detach().clone() for p in model.parameters()]}


@pytest.mark.parametrize("loss", ["ntxent", "supcon"])
def test_two_ranks_match_one_process(tmp_path, loss):
    reference = single_process(loss)
    ranks = run_ranks(tmp_path, loss, "differentiable")
    for rank in ranks:
        assert torch.allclose(rank["loss"], reference["loss"], atol=1e-5), (rank["loss"], reference["loss"])
        for got, want in zip(rank["grads"], reference["grads"]):
            assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


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
