"""Encoder + projection head.

The loss sees the head's output; indexing uses the encoder's features (before the head),
which keep information the contrastive objective does not need but downstream use might.
"""

from __future__ import annotations

import torch
from torch import nn

from receipt_embed.errors import BadInput
from receipt_embed.models.whitening import Whitening


class ProjectionHead(nn.Module):
    """Two-layer MLP (Linear-BN-ReLU-Linear), as in SimCLR."""

    def __init__(self, in_dim: int, hidden_dim: int, out_dim: int):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(in_dim, hidden_dim, bias=False),
            nn.BatchNorm1d(hidden_dim),
            nn.ReLU(inplace=True),
            nn.Linear(hidden_dim, out_dim),
        )
        self.out_dim = out_dim

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.layers(features)


def standardize_per_image(images: torch.Tensor, eps: float = 1e-3) -> torch.Tensor:
    """Zero mean, unit variance per image: exposure and contrast of a device cancel out."""
    mean = images.mean(dim=(1, 2, 3), keepdim=True)
    std = images.std(dim=(1, 2, 3), keepdim=True)
    return (images - mean) / (std + eps)


class Embedder(nn.Module):
    """``forward(images)`` -> (features, projections)."""

    def __init__(
        self, encoder: nn.Module, head_hidden: int, head_dim: int, input_norm: str = "fixed", whiten: bool = False
    ):
        super().__init__()
        if not hasattr(encoder, "feature_dim"):
            raise TypeError(f"encoder {type(encoder).__name__} must expose feature_dim")
        if input_norm not in ("fixed", "per_image"):
            raise BadInput(f"input_norm must be 'fixed' or 'per_image', got {input_norm!r}")
        self.encoder = encoder
        self.head = ProjectionHead(encoder.feature_dim, head_hidden, head_dim)
        self.input_norm = input_norm
        # learned whitening of the features (model.whiten), fitted after training; the identity until then
        self.whitening = Whitening(encoder.feature_dim) if whiten else None

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.input_norm == "per_image":
            images = standardize_per_image(images)
        features = self.encoder(images)
        projections = self.head(features)
        return (features if self.whitening is None else self.whitening(features)), projections

    @property
    def feature_dim(self) -> int:
        """The length of the backbone features ``forward`` gives (whitening may change it)."""
        dim = self.encoder.feature_dim
        return dim if self.whitening is None else self.whitening.dim_for(dim)


def set_batchnorm_momentum(model: nn.Module, momentum: float) -> None:
    """torchvision's mobilenets use 0.01, too slow to track statistics in short runs."""
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.momentum = momentum
