"""The loss itself; imported only when a run builds it (see __init__.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
        self.last_stats = {
            "anchors": int(has_positive.sum()),
            "anchors_without_positive": int((~has_positive).sum()),
            "active_triplets": float((losses > 0).float().mean()),
        }
        return losses.mean()
