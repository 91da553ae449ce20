"""Training over torch.distributed ranks: the global loss, and which rows each rank takes.

Every rank embeds its slice of the global batch; the projections are gathered with the
*differentiable* all_gather of ``torch.distributed.nn``, so each rank's anchors meet every
rank's rows as negatives and the gradient of every row flows back to the rank that produced
it. Each rank then evaluates the same global loss on the same gathered matrix (the tiled
engine keeps that O(N d) in memory). The gather's backward sums the W identical gradients a
row receives and DDP averages parameter gradients over the W ranks, so the parameters get
exactly the single-process gradient of the global loss.

A plain (detached) ``all_gather`` would be wrong: rows from other ranks would be constants,
so a rank's rows would only receive the gradient of its own copy of the loss, and after
DDP's averaging every parameter gradient would be 1/W of the true one (other variants that
splice the local rows back in have the same flaw). ``tests/test_distributed.py`` shows both.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from receipt_embed.errors import BadInput


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_from_env(backend: str | None = None) -> DistContext:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, ...).

    gloo on CPU, nccl when CUDA is available; a single process without torchrun's variables
    is world size 1 and initialises nothing."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return DistContext()
    if not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if torch.cuda.is_available() else "gloo"))
    return DistContext(dist.get_rank(), dist.get_world_size())


def shutdown() -> None:
    """Leave the process group cleanly: wait for every rank, then destroy it (letting it be
    torn down at interpreter exit can abort a rank while gloo threads still run)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


PEER_GONE_EXIT = 3  # a rank's exit code when it stopped because another rank failed or was killed
_PEER_GONE_SIGNS = (
    "connection reset by peer",
    "connection closed by peer",
    "broken pipe",
    "/gloo/transport/",
    "nccl communicator was aborted",
    "remote process exited",
)


def lost_a_peer(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it wraps) is a collective failing because another rank is gone
    (killed, out of memory, or failed with its own error): gloo's "Connection reset by peer" and kin."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, getattr(dist, "DistNetworkError", ())):
            return True
        if isinstance(exc, RuntimeError) and any(sign in str(exc).lower() for sign in _PEER_GONE_SIGNS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def gather_rows(local: torch.Tensor, differentiable: bool = True) -> torch.Tensor:
    """Rows of every rank, in rank order, (W * n, ...); all ranks must pass n rows."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    if differentiable:
        import warnings

        from torch.distributed.nn.functional import all_gather

        with warnings.catch_warnings():  # its suggested successor is a private API
            warnings.filterwarnings("ignore", message=".*all_gather is deprecated")
            return torch.cat(all_gather(local), dim=0)
    # the common shortcut: a plain gather with this rank's own rows spliced back in, so only
    # they carry gradients (kept to show why it is wrong, see the module docstring)
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local.detach().contiguous())
    parts[dist.get_rank()] = local
    return torch.cat(parts, dim=0)


def two_view_order(world_size: int, local_identities: int) -> torch.Tensor:
    """Index that turns gathered per-rank blocks ``[v1_r; v2_r]`` into ``[v1 of all; v2 of all]``,
    the layout two-view losses expect (row i's positive at i + B)."""
    b = local_identities
    first = [r * 2 * b + i for r in range(world_size) for i in range(b)]
    second = [r * 2 * b + b + i for r in range(world_size) for i in range(b)]
    return torch.tensor(first + second, dtype=torch.long)


def global_loss(
    loss_fn,
    local_embeddings: torch.Tensor,
    local_labels: torch.Tensor,
    *,
    two_view: bool,
    differentiable: bool = True,
    local_keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """The loss of the whole global batch, from this rank's rows.

    ``local_embeddings`` (n, d) and ``local_labels`` (n,) hold this rank's rows; for two-view
    losses they are ``[first views; second views]`` of this rank's n/2 identities. Labels must be
    global identity ids (unique across ranks for different receipts). ``local_keys``: momentum
    keys for MoCo, gathered (without gradients) into the same global order on every rank, so
    every rank's queue receives the same keys in the same order and the queues stay identical."""
    embeddings = gather_rows(local_embeddings, differentiable)
    labels = gather_rows(local_labels, differentiable=False)
    keys = None if local_keys is None else gather_rows(local_keys.detach(), differentiable=False)
    if two_view and dist.is_initialized() and dist.get_world_size() > 1:
        order = two_view_order(dist.get_world_size(), local_embeddings.shape[0] // 2).to(embeddings.device)
        embeddings, labels = embeddings[order], labels[order]
        keys = None if keys is None else keys[order]
    return loss_fn(embeddings, labels) if keys is None else loss_fn(embeddings, labels, keys=keys)


def identity_slice(identities: list, rank: int, world_size: int) -> list:
    """This rank's share of a global batch of identities (contiguous, equal sizes).

    Every rank draws the same global batch from the same seeded sampler, so identities are
    unique across the whole global batch; its size must divide by the world size."""
    if len(identities) % world_size:
        raise BadInput(
            f"a global batch of {len(identities)} identities does not split over {world_size} ranks; "
            "use a batch size divisible by the world size"
        )
    share = len(identities) // world_size
    return identities[rank * share : (rank + 1) * share]


class RankBatches:
    """This rank's rows of each global batch (views keep the seeds of their global slots).

    A batch of a sampler declaring the two-view layout ``[first captures of B; second captures
    of B]`` gives each rank B/W identities with both captures, in the same layout; any other
    batch gives each rank a contiguous 1/W of its rows (multi-positive losses read labels, not
    positions)."""

    def __init__(self, batches, labels: list[int], rank: int, world_size: int, two_view: bool):
        self.batches, self.labels, self.rank, self.world_size = batches, labels, rank, world_size
        self.two_view = two_view
        self.unique_identities = 0  # summed over the global batches handed out so far

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        for batch in self.batches:
            self.unique_identities += len({self.labels[index] for index, _ in batch})
            half = len(batch) // 2
            if self.two_view:
                firsts = identity_slice(list(range(half)), self.rank, self.world_size)
                yield [batch[i] for i in firsts] + [batch[half + i] for i in firsts]
            else:
                yield identity_slice(batch, self.rank, self.world_size)


def agree_after_step(ctx: DistContext, received: list, budget_spent: float) -> tuple[bool, float]:
    """(whether any rank got a stop signal, the largest share of the time budget any rank has
    spent), in one tiny all-reduce per step when distributed: every rank stops after the same
    step and sets the same learning rate, though their clocks differ a little."""
    if not ctx.distributed:
        return bool(received), budget_spent
    flags = torch.tensor([1.0 if received else 0.0, budget_spent], dtype=torch.float64)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return bool(flags[0].item() > 0), float(flags[1].item())


def any_rank(ctx: DistContext, received: list) -> bool:
    """Whether any rank got a stop signal (one tiny all-reduce per step when distributed),
    so that every rank stops after the same step instead of waiting on a gone peer."""
    if not ctx.distributed:
        return bool(received)
    flag = torch.tensor([1 if received else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
