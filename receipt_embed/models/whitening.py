"""Learned whitening of the backbone features (Radenović et al., TPAMI 2018).

Two captures of one receipt differ by their device: lighting, blur, fading, framing. Those
differences take the largest directions of the space between a receipt's captures, and a
cosine weighs them as much as what tells receipts apart. Learned whitening measures that
within-receipt spread on the training captures (labels known), divides it out (the directions
where captures of one receipt vary most count least), then rotates to the principal axes of
what is left. It is one linear map fitted after training, stored in the checkpoint as buffers,
and applied wherever the backbone features are used (val, index, search, audit).

On the real-scan benchmark it lifts held-out recall@1 of the trained backbone by about 0.03 (two seeds) and
lowers the device lift (benchmarks/README.md, "Learned whitening").
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

# the within-receipt scatter is estimated from a few thousand captures: its small eigenvalues are
# noise, so a share of the mean eigenvalue is added before dividing (0: plain inverse square root)
SHRINK = 0.1
# the map is features x dims floats: at most 1,024 dims out keeps it 4 MB for receipt_cnn (1,024
# features) and 19 MB for a 4,608-feature mobilenet grid
MAX_DIMS = 1024


class Whitening(nn.Module):
    """``(l2(x) - mean) @ projection``, L2-normalised; the identity until :meth:`set` fits it, so a
    model in training (and a checkpoint whose fit never ran) gives its features unchanged."""

    def __init__(self, feature_dim: int, dims: int | None = None):
        super().__init__()
        dims = min(feature_dim, MAX_DIMS) if dims is None else dims
        self.register_buffer("mean", torch.zeros(feature_dim))
        self.register_buffer("projection", torch.zeros(feature_dim, dims))
        self.register_buffer("fitted", torch.tensor(False))
        self.out_dim = dims

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if not bool(self.fitted):
            return features
        x = nn.functional.normalize(features.float(), dim=1)
        return nn.functional.normalize((x - self.mean) @ self.projection, dim=1)

    def dim_for(self, feature_dim: int) -> int:
        """The length of the features this gives for ``feature_dim`` inputs."""
        return self.out_dim if bool(self.fitted) else feature_dim

    @torch.no_grad()
    def set(self, mean: np.ndarray, projection: np.ndarray) -> None:
        self.mean.copy_(torch.from_numpy(mean.astype(np.float32)))
        self.projection.copy_(torch.from_numpy(projection.astype(np.float32)))
        self.fitted.fill_(True)

    @torch.no_grad()
    def reset(self) -> None:
        """Back to the identity: training changes the features the fit was made for."""
        self.mean.zero_()
        self.projection.zero_()
        self.fitted.fill_(False)


class CannotWhiten(ValueError):
    """The training captures do not show how captures of one receipt vary."""


def fit_whitening(features: np.ndarray, labels, dims: int, shrink: float = SHRINK) -> tuple[np.ndarray, np.ndarray]:
    """(mean, projection) of learned whitening for ``features`` (N, d) with receipt ``labels``:
    whiten the within-receipt scatter (deviations of each capture from its receipt's mean, over
    receipts with two or more captures), then take the ``dims`` principal axes of all captures in
    that whitened space."""
    x = np.asarray(features, dtype=np.float64)
    x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    labels = np.asarray(labels)
    mean = x.mean(axis=0)
    centred = x - mean
    # each capture's deviation from its receipt's mean, in one pass (a loop over receipts that masks all
    # captures each time is quadratic: minutes for 100,000 captures)
    _, receipt, counts = np.unique(labels, return_inverse=True, return_counts=True)
    sums = np.zeros((len(counts), centred.shape[1]))
    np.add.at(sums, receipt, centred)
    shared = counts[receipt] >= 2
    if not shared.any():
        raise CannotWhiten("no training receipt has two captures")
    deviations = (centred - (sums / counts[:, None])[receipt])[shared]
    scatter = deviations.T @ deviations / len(deviations)
    values, vectors = np.linalg.eigh(scatter)
    values = np.maximum(values, 0.0)
    if values.mean() <= 1e-12:
        raise CannotWhiten("every receipt's captures have the same features")
    whiten = vectors / np.sqrt(values + shrink * values.mean())
    z = centred @ whiten
    spread, axes = np.linalg.eigh(z.T @ z / len(z))
    order = np.argsort(spread)[::-1][:dims]
    return mean, whiten @ axes[:, order]
