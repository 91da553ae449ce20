"""The package's own tests: receipt-embed's contract checks plus an independent reference."""

import numpy as np
import pytest
import torch
from receipt_embed_triplet import build
from receipt_embed_triplet.loss import BatchHardTriplet

from receipt_embed.testing import check_loss


def reference(z: np.ndarray, labels: np.ndarray, margin: float) -> float:
    """Plain loops in float64: hardest positive and negative per anchor."""
    z = z / np.linalg.norm(z, axis=1, keepdims=True)
    losses = []
    for a in range(len(z)):
        d = np.linalg.norm(z - z[a], axis=1)
        positives = [d[j] for j in range(len(z)) if j != a and labels[j] == labels[a]]
        negatives = [d[j] for j in range(len(z)) if labels[j] != labels[a]]
        if positives:
            losses.append(max(0.0, margin + max(positives) - min(negatives)))
    return float(np.mean(losses))


def test_keeps_the_receipt_embed_loss_contract():
    check_loss(build(margin=0.2))
    check_loss(build(soft=True))


def test_matches_a_reference_on_uneven_groups():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(11, 6))
    labels = np.array([0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 4])  # receipt 2 and 4 have no positive
    loss = BatchHardTriplet(margin=0.5)(torch.tensor(z), torch.tensor(labels))
    assert loss.item() == pytest.approx(reference(z, labels, 0.5), rel=1e-9)


def test_a_batch_without_positives_is_an_error():
    with pytest.raises(ValueError, match="two rows"):
        BatchHardTriplet()(torch.randn(4, 3), torch.arange(4))
