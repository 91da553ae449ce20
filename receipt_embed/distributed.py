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

from receipt_embed.display import quoted, shortened
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


RENDEZVOUS_TIMEOUT_ENV = "RECEIPT_EMBED_RENDEZVOUS_TIMEOUT"
RENDEZVOUS_TIMEOUT_S = 300.0  # how long ranks started without torchrun wait for each other
_START_RANKS = (
    "start every rank (torchrun, or `receipt-embed train --nproc N`), or unset WORLD_SIZE, RANK, MASTER_ADDR "
    "and MASTER_PORT to train in one process"
)


def _whole_number(name: str, minimum: int, maximum: int | None = None) -> int | None:
    """The environment variable ``name`` as a whole number in [minimum, maximum], None when unset;
    anything else is refused naming the variable (``int()`` would be a traceback, or take " 2")."""
    raw = os.environ.get(name)
    if raw is None:
        return None
    number = int(raw) if raw.isascii() and raw.isdigit() else None
    if number is None or number < minimum or (maximum is not None and number > maximum):
        bound = f"from {minimum} to {maximum}" if maximum is not None else f"of {minimum} or more"
        raise BadInput(
            f"{name}={quoted(shortened(raw, 60))} in the environment is not a whole number {bound}; {_START_RANKS}"
        )
    return number


def env_context() -> DistContext:
    """This process's rank and the world size the environment gives (torch.distributed's RANK,
    WORLD_SIZE, MASTER_ADDR and MASTER_PORT), checked up front: a bad value is one line naming
    the variable, not a traceback from torch, and unset they mean a single process."""
    world = _whole_number("WORLD_SIZE", 1)
    world = 1 if world is None else world
    rank = _whole_number("RANK", 0, world - 1)
    if world > 1:
        if rank is None:
            raise BadInput(f"WORLD_SIZE={world} is set in the environment but RANK is not; {_START_RANKS}")
        if not os.environ.get("MASTER_ADDR", "").strip():
            raise BadInput(f"WORLD_SIZE={world} is set in the environment but MASTER_ADDR is not; {_START_RANKS}")
        if _whole_number("MASTER_PORT", 1, 65535) is None:
            raise BadInput(f"WORLD_SIZE={world} is set in the environment but MASTER_PORT is not; {_START_RANKS}")
    return DistContext(rank or 0, world)


def rendezvous_timeout() -> float:
    """Seconds ranks started without torchrun wait for each other (``RECEIPT_EMBED_RENDEZVOUS_TIMEOUT``)."""
    raw = os.environ.get(RENDEZVOUS_TIMEOUT_ENV)
    if raw is None:
        return RENDEZVOUS_TIMEOUT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise BadInput(
            f"{RENDEZVOUS_TIMEOUT_ENV}={quoted(shortened(raw, 60))} in the environment is not a positive number of seconds"
        )
    return seconds


def init_from_env(backend: str | None = None) -> DistContext:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, ...).

    gloo on CPU, nccl when CUDA is available; a single process without torchrun's variables
    is world size 1 and initialises nothing. Ranks started without torchrun (the variables set
    by hand, or left over in a shell) meet in :func:`_rendezvous`: it says on stderr whom it
    waits for, gives up after :func:`rendezvous_timeout`, and a stop signal ends the wait."""
    ctx = env_context()
    if not ctx.distributed:
        return DistContext()
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if os.environ.get("TORCHELASTIC_RUN_ID") is not None:  # torchrun started the ranks together
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=_rendezvous(ctx), rank=ctx.rank, world_size=ctx.world_size)
    return DistContext(dist.get_rank(), dist.get_world_size())


_JOINED = "receipt_embed/joined"
_POLL_S = 0.1
_SAY_AFTER_S = 1.0  # ranks started together meet at once; a longer wait is said on stderr


def _rendezvous(ctx: DistContext):
    """The store of ranks started without torchrun, once all of them have joined it. torch's own
    rendezvous blocks inside C++ (a SIGTERM waits for it) and, with a rank missing, waits half an
    hour in silence; here the waiting is short steps in Python, so a stop signal ends it."""
    import socket
    import sys
    import time
    from datetime import timedelta

    from torch.distributed.constants import default_pg_timeout

    address, port = os.environ["MASTER_ADDR"].strip(), int(os.environ["MASTER_PORT"])
    where = f"{address}:{port} (WORLD_SIZE={ctx.world_size} from the environment)"
    limit = rendezvous_timeout()
    started, said = time.monotonic(), False

    def waited(what: str) -> None:
        nonlocal said
        elapsed = time.monotonic() - started
        if elapsed > limit:
            raise BadInput(f"no {what} joined at {where} within {limit:g} s; {_START_RANKS}")
        if not said and elapsed > _SAY_AFTER_S:
            print(
                f"waiting for {what} at {where}, for up to {limit:g} s ({RENDEZVOUS_TIMEOUT_ENV}) ...",
                file=sys.stderr,
                flush=True,
            )
            said = True
        time.sleep(_POLL_S)

    if ctx.is_main:
        try:
            store = dist.TCPStore(address, port, ctx.world_size, True, default_pg_timeout, wait_for_workers=False)
        except (RuntimeError, OSError) as exc:  # the port is taken, or the address is not this machine's
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise BadInput(f"rank 0 cannot listen at {where}: {shortened(first, 200)}; {_START_RANKS}") from None
    else:
        while True:  # a plain connect first: torch's client retries inside C++ and logs each failure
            try:
                with socket.create_connection((address, port), timeout=1):
                    break
            except OSError:
                waited("the process of rank 0")
        store = dist.TCPStore(address, port, ctx.world_size, False, timedelta(seconds=limit))
        store.set_timeout(default_pg_timeout)
    store.add(_JOINED, 1)
    while (joined := store.add(_JOINED, 0)) < ctx.world_size:
        missing = ctx.world_size - joined
        waited(f"{missing} more process{'es' if missing > 1 else ''}")
    return store


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
