"""Batch-hard triplet loss (Hermans, Beyer & Leibe, "In Defense of the Triplet Loss for
Person Re-Identification", 2017) as a receipt-embed plugin.

For every anchor row: its hardest positive (the farthest row of the same receipt, never
itself) and its hardest negative (the nearest row of another receipt), on L2-normalised
embeddings:

    L = mean over anchors of  max(0, margin + d(a, p_hard) - d(a, n_hard))      (hinge)
                          or  log(1 + exp(d(a, p_hard) - d(a, n_hard)))         (soft=True)

Anchors without a positive in the batch are skipped (counted in ``last_stats``). Works with
two-view batches (``unique_identity``) and P x K batches (``pk``).

    receipt-embed train --data DATASET_DIR --set loss.name=batch_hard_triplet --set sampler.name=pk
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from receipt_embed.hookspecs import hookimpl

__version__ = "0.1.0"


class BatchHardTriplet(torch.nn.Module):
    def __init__(self, margin: float = 0.2, soft: bool = False):
        super().__init__()
        if margin < 0:
            raise ValueError(f"margin must be >= 0, got {margin}")
        self.margin, self.soft = margin, soft
        self.last_stats: dict = {}

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        z = F.normalize(embeddings, dim=1)
        # sqrt of a clamped squared distance: the gradient stays finite at d = 0
        distance = (2.0 - 2.0 * z @ z.T).clamp_min(1e-12).sqrt()
        same = labels[:, None] == labels[None, :]
        itself = torch.eye(len(labels), dtype=torch.bool, device=labels.device)
        positive = same & ~itself
        has_positive = positive.any(dim=1)
        if not has_positive.any():
            raise ValueError("batch_hard_triplet needs at least one receipt with two rows in the batch")
        hardest_positive = distance.masked_fill(~positive, float("-inf")).amax(dim=1)
        hardest_negative = distance.masked_fill(same, float("inf")).amin(dim=1)
        gap = (hardest_positive - hardest_negative)[has_positive]
        losses = F.softplus(gap) if self.soft else F.relu(self.margin + gap)
        self.last_stats = {"anchors": int(has_positive.sum()), "anchors_without_positive": int((~has_positive).sum()),
                           "active_triplets": float((losses > 0).float().mean())}
        return losses.mean()


def build(temperature: float = 0.0, margin: float = 0.2, soft: bool = False) -> BatchHardTriplet:
    """``temperature`` is accepted (train passes loss.temperature to every loss) and unused."""
    return BatchHardTriplet(margin=margin, soft=soft)


@hookimpl
def register_losses(register):
    register("batch_hard_triplet", build,
             description="batch-hard triplet loss (Hermans et al. 2017); params margin, soft")
