"""Input validation and the base class shared by every loss in this package.

Errors say what was wrong and what was expected, because a contrastive loss fed a batch in the
wrong layout does not crash: it silently learns the wrong thing.
"""

from __future__ import annotations

import functools
import math
import numbers
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from receipt_embed.config import MAX_TEMPERATURE
from receipt_embed.errors import BadInput
from receipt_embed.losses.engine import DEFAULT_TILE, EngineInfo, autocast_off, masked_logsumexp

LOW_TEMPERATURE = 0.05
_EPS = 1e-12


def check_temperature(temperature) -> float:
    """Return ``temperature`` as a float; error unless > 0 and at most MAX_TEMPERATURE, warn below 0.05."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise BadInput(f"temperature must be a number > 0, got {temperature!r}")
    value = float(temperature)
    if not math.isfinite(value) or value <= 0:
        raise BadInput(f"temperature must be > 0, got {value}")
    if value > MAX_TEMPERATURE:  # the logits (similarity / temperature) vanish in float32: the loss is NaN
        raise BadInput(f"temperature must be at most {MAX_TEMPERATURE}, got {value:g}")
    if value < LOW_TEMPERATURE:
        warnings.warn(
            f"temperature {value:g} is below {LOW_TEMPERATURE}: logits span +-{1 / value:.3g}, so "
            "training is fragile (the loss is computed in a stable way, but the gradients grow as "
            "1 / temperature); choose the temperature on validation retrieval",
            UserWarning,
            stacklevel=3,
        )
    return value


def check_embeddings(embeddings, name: str = "embeddings") -> torch.Tensor:
    """A 2-D floating tensor of finite values, at least one row."""
    if not torch.is_tensor(embeddings):
        raise TypeError(f"{name} must be a torch.Tensor of shape (N, d), got {type(embeddings).__name__}")
    if embeddings.dim() != 2:
        raise BadInput(f"{name} must have shape (N, d), got shape {tuple(embeddings.shape)}")
    if not embeddings.is_floating_point():
        raise BadInput(f"{name} must be floating point, got {embeddings.dtype}")
    if embeddings.shape[0] == 0 or embeddings.shape[1] == 0:
        raise BadInput(f"{name} is empty: shape {tuple(embeddings.shape)}")
    finite = torch.isfinite(embeddings.detach())
    if not bool(finite.all()):
        bad_rows = torch.nonzero(~finite.all(dim=1)).flatten()
        kind = "NaN" if bool(torch.isnan(embeddings.detach()).any()) else "infinite values"
        raise BadInput(
            f"{name} contain {kind} in {bad_rows.numel()} of {embeddings.shape[0]} rows "
            f"(first rows: {bad_rows[:5].tolist()}); check the encoder for divergence"
        )
    return embeddings


def check_labels(labels, n: int, device, name: str = "labels") -> torch.Tensor:
    """Integer identity labels of length ``n``, returned as int64 on ``device``."""
    if not torch.is_tensor(labels):
        raise TypeError(f"{name} must be a torch.Tensor of integer identities, got {type(labels).__name__}")
    if labels.dim() != 1:
        raise BadInput(f"{name} must have shape (N,), got shape {tuple(labels.shape)}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise BadInput(f"{name} must be integer identities, got dtype {labels.dtype}")
    if labels.shape[0] != n:
        raise BadInput(
            f"{name} has length {labels.shape[0]} but the embeddings have {n} rows; one identity label per row"
        )
    return labels.to(device=device, dtype=torch.long)


def check_two_view(labels: torch.Tensor, loss_name: str) -> int:
    """Check rows are [first views of B identities; second views]; return B."""
    n = labels.shape[0]
    if n % 2 or n < 2:
        raise BadInput(
            f"{loss_name} is a two-view loss: it needs 2B rows laid out as [first views of B "
            f"identities; second views], got {n} rows"
        )
    b = n // 2
    differ = torch.nonzero(labels[:b] != labels[b:]).flatten()
    if differ.numel():
        i = int(differ[0])
        raise BadInput(
            f"{loss_name} is a two-view loss: row i and row i + B must be two views of one "
            f"identity, but labels differ at {differ.numel()} of {b} rows (first: row {i} has "
            f"label {int(labels[i])}, row {i + b} has {int(labels[i + b])}); for P x K batches "
            "use 'supcon'"
        )
    return b


def identity_counts(labels: torch.Tensor) -> torch.Tensor:
    """For each row, how many rows of the batch share its label (itself included)."""
    _, inverse, counts = torch.unique(labels, return_inverse=True, return_counts=True)
    return counts[inverse]


def float32_logits(forward):
    """Decorator for ``forward(self, embeddings, ...)``: run the whole loss with autocast off,
    so normalisation, positive logits and the engine all stay float32 under bf16/fp16."""

    @functools.wraps(forward)
    def wrapper(self, embeddings, *args, **kwargs):
        device_type = embeddings.device.type if torch.is_tensor(embeddings) else "cpu"
        with autocast_off(device_type):
            return forward(self, embeddings, *args, **kwargs)

    return wrapper


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def normalize(x: torch.Tensor) -> torch.Tensor:
    """L2-normalise rows in float32 (float64 stays float64)."""
    return F.normalize(x.to(compute_dtype(x)), dim=1, eps=_EPS)


class ContrastiveLoss(nn.Module):
    """Base of the losses here: temperature, engine settings and ``last_stats``.

    ``last_stats`` is replaced after every call with plain numbers (anchors, masked pairs,
    engine path) so a training loop can log them. ``batch_layout`` is the layout of rows the loss
    needs (see ``receipt_embed.batch_layout``); ``sampler.name: auto`` picks a sampler by it.
    """

    batch_layout = "two_view"

    def __init__(self, temperature: float = 0.1, tile_size: int = DEFAULT_TILE, path: str = "auto"):
        super().__init__()
        self.temperature = check_temperature(temperature)
        if not isinstance(tile_size, int) or isinstance(tile_size, bool) or tile_size < 1:
            raise BadInput(f"tile_size must be a positive integer, got {tile_size!r}")
        if path not in ("auto", "dense", "tiled", "tiled-general"):
            raise BadInput(f"path must be one of auto, dense, tiled, tiled-general; got {path!r}")
        self.tile_size = tile_size
        self.path = path
        self.last_stats: dict = {}

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}, tile_size={self.tile_size}, path={self.path!r}"

    def _lse(self, queries, keys, query_labels, key_labels, scales) -> tuple[torch.Tensor, EngineInfo]:
        return masked_logsumexp(
            queries, keys, query_labels, key_labels, scales, tile_size=self.tile_size, path=self.path
        )


class TwoViewLoss(ContrastiveLoss):
    """Shared set-up of the two-view losses (ntxent, debiased, hard_negative)."""

    name = "two-view"

    def __init__(self, temperature=0.1, duplicates: str = "mask", tile_size=DEFAULT_TILE, path="auto"):
        super().__init__(temperature, tile_size, path)
        if duplicates not in ("mask", "error"):
            raise BadInput(f"duplicates must be 'mask' or 'error', got {duplicates!r}")
        self.duplicates = duplicates

    def extra_repr(self) -> str:
        return super().extra_repr() + f", duplicates={self.duplicates!r}"

    def _two_view_batch(self, embeddings, labels):
        """Validate; return (z, labels, B, same-identity count per row, base stats)."""
        check_embeddings(embeddings)
        n = embeddings.shape[0]
        if labels is None:
            if n % 2:
                check_two_view(torch.zeros(n, dtype=torch.long), self.name)
            labels = torch.arange(n // 2, device=embeddings.device).repeat(2)
        labels = check_labels(labels, n, embeddings.device)
        b = check_two_view(labels, self.name)
        same = identity_counts(labels)
        repeated = torch.unique(labels[same > 2])
        if repeated.numel() and self.duplicates == "error":
            raise BadInput(
                f"{self.name}: {repeated.numel()} identities appear in more than one two-view slot "
                f"of this batch (labels {repeated[:10].tolist()}); their extra captures would be "
                "negatives. Use a sampler with unique identities per batch, duplicates='mask', "
                "or the multi-positive 'supcon' loss"
            )
        z = normalize(embeddings)
        n_negatives = n - same
        stats = {
            "anchors": n,
            "duplicate_identities": int(repeated.numel()),
            # ordered (anchor, item) pairs of one identity that are neither self nor the positive
            "masked_duplicates": int((same - 2).sum()),
            "anchors_without_negatives": int((n_negatives == 0).sum()),
        }
        return z, labels, b, n_negatives, stats

    @staticmethod
    def _positive_logits(z, b, temperature):
        """s_{i, (i + B) mod 2B}: each row against its other view."""
        return (z * z.roll(b, dims=0)).sum(dim=1) / temperature
