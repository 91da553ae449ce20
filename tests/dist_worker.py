"""One rank of the distributed-loss test: run as torchrun would (RANK, WORLD_SIZE, MASTER_*).

    python tests/dist_worker.py OUT.pt LOSS {differentiable|detached}

Builds the test model and global batch (tests/test_distributed.py), takes this rank's slice,
computes the global loss through DDP and ``receipt_embed.distributed.global_loss``, runs
backward, and saves the loss and the parameter gradients.
"""

from __future__ import annotations

import sys

import torch
from torch.nn.parallel import DistributedDataParallel

from receipt_embed import create_loss
from receipt_embed.distributed import global_loss, identity_slice, init_from_env, shutdown


def model_and_batch(identities: int = 8, views: int = 2, dim: int = 16):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(dim, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    inputs = torch.randn(views, identities, dim)  # view v of identity i
    return model, inputs


def rows_for(inputs: torch.Tensor, ids: list[int]):
    """[view 0 of ids; view 1 of ids; ...] and their labels."""
    x = torch.cat([inputs[v, ids] for v in range(inputs.shape[0])])
    labels = torch.tensor(ids * inputs.shape[0])
    return x, labels


def make_loss(name: str):
    torch.manual_seed(1)  # the MoCo queue's random start is the same on every rank
    if name == "moco":
        return create_loss("moco", temperature=0.2, queue_size=24, dim=8)
    return create_loss(name, temperature=0.2)


@torch.no_grad()
def momentum_keys(model, x: torch.Tensor) -> torch.Tensor:
    """Keys from a frozen copy of the model: row i's key is the other view of its receipt."""
    import copy

    return copy.deepcopy(model)(x).roll(len(x) // 2, dims=0)


def main(out: str, loss_name: str, mode: str) -> None:
    context = init_from_env("gloo")
    model, inputs = model_and_batch()
    ddp = DistributedDataParallel(model)
    ids = identity_slice(list(range(inputs.shape[1])), context.rank, context.world_size)
    x, labels = rows_for(inputs, ids)
    loss_fn = make_loss(loss_name)
    keys = momentum_keys(model, x) if loss_name == "moco" else None
    loss = global_loss(
        loss_fn,
        ddp(x),
        labels,
        two_view=loss_name != "supcon",
        differentiable=mode == "differentiable",
        local_keys=keys,
    )
    loss.backward()
    torch.save(
        {
            "loss": loss.detach(),
            "grads": [p.grad.detach().clone() for p in model.parameters()],
            "state": {k: v.clone() for k, v in loss_fn.state_dict().items()},
        },
        out,
    )
    shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:4])
