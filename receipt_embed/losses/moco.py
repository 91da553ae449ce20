"""MoCo: InfoNCE against a queue of momentum-encoder keys, with identity-aware masking."""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from receipt_embed.errors import BadInput
from receipt_embed.losses._common import (
    ContrastiveLoss,
    check_embeddings,
    check_labels,
    check_two_view,
    float32_logits,
    normalize,
)
from receipt_embed.losses.engine import DEFAULT_TILE

NO_IDENTITY = torch.iinfo(torch.long).min  # label of the random keys a fresh queue starts with
# The queue is allocated whole when the loss is built: bound it, so a typo'd size is an error
# naming the key instead of an allocation that takes the machine's memory (MoCo uses 65,536).
MAX_QUEUE_SIZE = 1_048_576
MAX_QUEUE_FLOATS = 1 << 28  # queue_size x dim float32 keys: 1 GiB


class MoCoLoss(ContrastiveLoss):
    r"""InfoNCE of queries against their positive key and a queue of past keys (MoCo).

    He et al., "Momentum Contrast for Unsupervised Visual Representation Learning", CVPR 2020,
    https://arxiv.org/abs/1911.05722; Chen et al. 2020 (MoCo v2),
    https://arxiv.org/abs/2003.04297.

    For query ``q_i`` (online encoder), its key ``k_i`` (momentum encoder, another view of the
    same receipt) and queue entries ``u_j`` with identities ``y_j``, on unit vectors:

    .. math::
        \ell_i = -\log \frac{e^{\langle q_i, k_i\rangle / t}}
                 {e^{\langle q_i, k_i\rangle / t} + \sum_{j:\, y_j \ne y_i} e^{\langle q_i, u_j\rangle / t}}

    The queue stores the identity label of every key, and entries with the query's identity
    are masked (a receipt seen in an earlier batch is not its own negative). With
    ``in_batch_negatives=True`` the current batch's keys of other identities are negatives as
    well (MoCo v3 style; with ``queue_size=0`` this is MoCo v3's loss).

    State: ``queue`` (queue_size, dim), ``queue_labels``, ``queue_ptr`` and ``queue_count`` are
    registered buffers, so ``state_dict()`` -- and hence the training checkpoint -- carries
    them. As in the paper a fresh queue holds random unit vectors (label ``NO_IDENTITY``), so
    the first steps already have negatives; ``queue_init="empty"`` starts it empty instead
    (until it fills, anchors without any negative contribute 0 and are counted in
    ``last_stats["anchors_without_negatives"]``). The keys are enqueued *after* the loss is computed, detached, and only in training
    mode (``loss.eval()`` computes a validation loss without touching the queue).

    Call::

        loss = moco(queries, labels, keys=keys)

    with ``queries`` (N, d) from the online encoder, ``keys`` (N, d) from the momentum encoder
    (row i is the positive of query i; normally computed under ``torch.no_grad()``) and
    ``labels`` (N,) their identities. Called as ``moco(embeddings, labels)`` without keys, the
    batch must be two-view ``[view 1; view 2]``: every row is a query whose key is its other
    view, detached (stop-gradient), and the second views are enqueued.

    Args:
        temperature: 0 < ``t`` <= 100 (MoCo v2 uses 0.2). queue_size: number of stored keys
            (e.g. 65,536; 0 disables the queue; at most 1,048,576, and queue_size x dim at most
            2**28, a 1 GiB queue). dim: embedding size of the keys.
        in_batch_negatives: also use the batch's keys of other identities as negatives.
        queue_init: ``"random"`` (default, as MoCo) or ``"empty"``.
        tile_size, path: engine settings (queries x queue is streamed in blocks).

    ``last_stats``: ``queries``, ``queue_entries`` (valid keys used), ``masked_queue_entries``
    ((query, entry) pairs masked for sharing an identity), ``anchors_without_negatives``,
    ``path``.

    Example::

        >>> moco = MoCoLoss(temperature=0.2, queue_size=65536, dim=128)
        >>> key_encoder = make_momentum_encoder(encoder)
        >>> for images1, images2, ids in loader:
        ...     q = encoder(images1)
        ...     with torch.no_grad():
        ...         momentum_update(encoder, key_encoder, m=0.999)
        ...         k = key_encoder(images2)
        ...     loss = moco(q, ids, keys=k)
    """

    # the trainer keeps a momentum copy of the model and passes its keys (see train.momentum)
    wants_momentum_keys = True

    def __init__(
        self,
        temperature: float = 0.2,
        queue_size: int = 65536,
        dim: int = 128,
        in_batch_negatives: bool = False,
        queue_init: str = "random",
        tile_size: int = DEFAULT_TILE,
        path: str = "auto",
    ):
        super().__init__(temperature, tile_size, path)
        for name, value, low in (("queue_size", queue_size, 0), ("dim", dim, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise BadInput(f"{name} must be an integer >= {low}, got {value!r}")
        if queue_size > MAX_QUEUE_SIZE:
            raise BadInput(f"loss.params.queue_size must be at most {MAX_QUEUE_SIZE} keys, got {queue_size}")
        if queue_size * dim > MAX_QUEUE_FLOATS:
            raise BadInput(
                f"loss.params.queue_size x loss.params.dim must be at most {MAX_QUEUE_FLOATS} floats "
                f"(a 1 GiB queue), got {queue_size} x {dim}; lower loss.params.queue_size"
            )
        if queue_size == 0 and not in_batch_negatives:
            raise BadInput("moco needs negatives: set queue_size > 0 or in_batch_negatives=True")
        if queue_init not in ("random", "empty"):
            raise BadInput(f"queue_init must be 'random' or 'empty', got {queue_init!r}")
        self.in_batch_negatives = bool(in_batch_negatives)
        random_start = queue_init == "random"
        queue = (
            torch.nn.functional.normalize(torch.randn(queue_size, dim), dim=1)
            if random_start
            else torch.zeros(queue_size, dim)
        )
        self.register_buffer("queue", queue)
        self.register_buffer("queue_labels", torch.full((queue_size,), NO_IDENTITY, dtype=torch.long))
        self.register_buffer("queue_ptr", torch.zeros((), dtype=torch.long))
        self.register_buffer("queue_count", torch.tensor(queue_size if random_start else 0, dtype=torch.long))

    @property
    def queue_size(self) -> int:
        return self.queue.shape[0]

    def extra_repr(self) -> str:
        return (
            super().extra_repr()
            + f", queue_size={self.queue_size}, dim={self.queue.shape[1]}, in_batch_negatives={self.in_batch_negatives}"
        )

    @float32_logits
    def forward(self, queries: torch.Tensor, labels: torch.Tensor, keys: torch.Tensor | None = None) -> torch.Tensor:
        check_embeddings(queries, "queries")
        n, d = queries.shape
        labels = check_labels(labels, n, queries.device)
        if bool((labels == NO_IDENTITY).any()):
            raise BadInput(f"label {NO_IDENTITY} is reserved for the random keys of a fresh queue")
        if d != self.queue.shape[1]:
            raise BadInput(f"moco was built with dim={self.queue.shape[1]} but the queries have {d} columns")
        if keys is None:
            b = check_two_view(labels, "moco (called without keys)")
            keys = queries.roll(b, dims=0).detach()
            enqueue = slice(0, b)  # keys[:b] are the second views: one key per identity
        else:
            check_embeddings(keys, "keys")
            if keys.shape != queries.shape:
                raise BadInput(
                    f"keys must match queries row for row (key i is the positive of query i): "
                    f"queries {tuple(queries.shape)}, keys {tuple(keys.shape)}"
                )
            enqueue = slice(0, n)
        q = normalize(queries)
        k = normalize(keys).to(q.dtype)
        t = self.temperature
        pos = (q * k).sum(dim=1) / t

        count = int(self.queue_count)
        columns, column_labels = [], []
        if self.in_batch_negatives:
            columns.append(k)  # k_i itself shares the query's identity, so it is masked
            column_labels.append(labels)
        if count:
            # A copy: the enqueue below rewrites the buffer while backward still needs these keys.
            columns.append(self.queue[:count].to(dtype=q.dtype, copy=True))
            column_labels.append(self.queue_labels[:count])
        path = "none"
        if columns:
            lse, info = self._lse(q, torch.cat(columns), labels, torch.cat(column_labels), (1.0 / t,))
            lse_neg, path = lse[:, 0], info.path
        else:
            lse_neg = torch.full_like(pos, float("-inf"))
        loss = (torch.logaddexp(pos, lse_neg) - pos).mean()

        self.last_stats = {
            "queries": n,
            "queue_entries": count,
            "masked_queue_entries": _shared_identity_pairs(labels, self.queue_labels[:count]),
            "anchors_without_negatives": int(torch.isinf(lse_neg).sum()),
            "path": path,
        }
        if self.training and self.queue_size:
            self._enqueue(k[enqueue].detach(), labels[enqueue])
        return loss

    @torch.no_grad()
    def _enqueue(self, keys: torch.Tensor, labels: torch.Tensor) -> None:
        """Write keys at ``queue_ptr`` (ring buffer); the oldest entries are overwritten."""
        size = self.queue_size
        keys, labels = keys[-size:], labels[-size:]
        ptr = int(self.queue_ptr)
        index = (ptr + torch.arange(keys.shape[0], device=self.queue.device)) % size
        self.queue[index] = keys.to(device=self.queue.device, dtype=self.queue.dtype)
        self.queue_labels[index] = labels.to(self.queue_labels.device)
        self.queue_ptr.fill_((ptr + keys.shape[0]) % size)
        self.queue_count.fill_(min(size, int(self.queue_count) + keys.shape[0]))


def _shared_identity_pairs(labels: torch.Tensor, queue_labels: torch.Tensor) -> int:
    """How many (query, queue entry) pairs share an identity, without an N x M matrix."""
    if queue_labels.numel() == 0:
        return 0
    ordered = torch.sort(queue_labels.to(labels.device)).values
    hits = torch.searchsorted(ordered, labels, right=True) - torch.searchsorted(ordered, labels)
    return int(hits.sum())


@torch.no_grad()
def momentum_update(online: nn.Module, momentum_model: nn.Module, m: float) -> None:
    r"""EMA of parameters: ``theta_k <- m * theta_k + (1 - m) * theta_q`` (MoCo eq. 2).

    ``online`` is the query encoder, ``momentum_model`` the key encoder of identical
    architecture; ``m`` in [0, 1] (MoCo: 0.999; 0 copies, 1 freezes). Buffers (e.g. batch-norm
    statistics) are left alone: the key encoder updates its own in its forward pass. The key
    encoder is part of the training state, so checkpoint its ``state_dict`` with the model.
    """
    m = float(m)
    if not (0.0 <= m <= 1.0 and math.isfinite(m)):
        raise BadInput(f"momentum m must be in [0, 1], got {m}")
    online_params = list(online.parameters())
    key_params = list(momentum_model.parameters())
    if len(online_params) != len(key_params):
        raise BadInput(
            f"momentum_update: the models differ: {len(online_params)} vs {len(key_params)} parameter tensors"
        )
    for i, (p_q, p_k) in enumerate(zip(online_params, key_params)):
        if p_q.shape != p_k.shape:
            raise BadInput(f"momentum_update: parameter {i} has shape {tuple(p_q.shape)} vs {tuple(p_k.shape)}")
        p_k.mul_(m).add_(p_q.detach(), alpha=1.0 - m)


def make_momentum_encoder(online: nn.Module) -> nn.Module:
    """A frozen copy of ``online`` to serve as the key encoder (updated by momentum_update)."""
    key_encoder = copy.deepcopy(online)
    key_encoder.requires_grad_(False)
    return key_encoder
