"""A small plain CNN for receipt images, trained from scratch on a CPU.

ImageNet backbones spend their depth on textures and objects and train slowly from scratch
on two cores; what identifies a receipt at low resolution is its layout: where the text blocks,
rules, totals and barcode sit. Five stride-2 stages of 3x3 convolutions (BatchNorm, ReLU)
bring a portrait page down to a coarse grid whose cells are pooled and flattened, so the
features keep *where* things are. ``stem`` (default 2) is the first stage's stride: 4 takes a
page twice as tall and wide for about the cost of the default at the default size.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from receipt_embed.display import quoted, shortened
from receipt_embed.errors import BadInput
from receipt_embed.models.bundled import bundled_weights, is_bundled

# the default is 32 ... 128 channels in 5 stages; one 3x3 convolution of 4096 to 4096 channels is already
# 150 million weights, and a checkpoint asking for 20000 made index allocate tens of GB before any check
MAX_WIDTH = 4096
MAX_STAGES = 16


def _check_widths(widths) -> tuple[int, ...]:
    """``model.params.widths``: 1 to MAX_STAGES whole channel counts in 1..MAX_WIDTH, named when not."""
    fits = isinstance(widths, (list, tuple)) and 1 <= len(widths) <= MAX_STAGES
    if not fits or any(type(width) is not int or not 1 <= width <= MAX_WIDTH for width in widths):
        shown = quoted(shortened(widths)) if isinstance(widths, str) else shortened(widths)
        raise BadInput(
            f"model.params.widths must be a list of 1 to {MAX_STAGES} whole numbers from 1 to {MAX_WIDTH} "
            f"(channels per stage), got {shown}"
        )
    return tuple(widths)


MAX_STEM = 8


def _check_stem(stem) -> int:
    """``model.params.stem``: the first stage's stride, a whole number from 1 to MAX_STEM."""
    if type(stem) is not int or not 1 <= stem <= MAX_STEM:
        raise BadInput(
            f"model.params.stem must be a whole number from 1 to {MAX_STEM} (the first stride), got {stem!r}"
        )
    return stem


def _conv(cin: int, cout: int, stride: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


def _stem(cin: int, cout: int, stride: int) -> nn.Sequential:
    """The first stage: a 3x3 convolution for strides up to 2; beyond, non-overlapping
    ``stride`` x ``stride`` patches (each pixel seen once, none skipped), so a larger input costs
    the later stages no more than a smaller one with the default stem."""
    if stride <= 2:
        return _conv(cin, cout, stride)
    return nn.Sequential(nn.Conv2d(cin, cout, stride, stride, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class ReceiptCNN(nn.Module):
    """Images (N, C, H, W) -> features (N, widths[-1] * rows * cols)."""

    def __init__(
        self,
        pretrained: str | None = None,
        in_channels: int = 1,
        pooling: str = "grid",
        grid: tuple[int, int] = (4, 2),
        widths: tuple[int, ...] = (32, 48, 64, 96, 128),
        stem: int = 2,
    ):
        super().__init__()
        state = None
        widths = _check_widths(widths)
        stem = _check_stem(stem)
        if is_bundled(pretrained):
            pretrained = str(bundled_weights(in_channels, widths, stem))
        if pretrained not in (None, "", "none"):
            from receipt_embed.models.encoders import read_weights_file

            if not os.path.lexists(pretrained):
                raise FileNotFoundError(
                    "receipt_cnn has no published weights; pretrained must be 'bundled' (the weights shipped "
                    f"in the package) or a local file, got {pretrained!r}"
                )
            state = read_weights_file(Path(pretrained))  # a text file or a .npy is one line naming it
        if pooling not in ("gap", "grid"):
            raise BadInput(f"pooling must be 'gap' or 'grid', got {pooling!r}")
        layers, cin = [], in_channels
        for i, width in enumerate(widths):
            layers.append(_stem(cin, width, stem) if i == 0 else _conv(cin, width, 2))
            if i > 0:  # a second convolution per stage once the resolution is affordable
                layers.append(_conv(width, width, 1))
            cin = width
        self.trunk = nn.Sequential(*layers)
        cells = (1, 1) if pooling == "gap" else tuple(grid)
        self.pool = nn.AdaptiveAvgPool2d(cells)
        self.feature_dim = cin * cells[0] * cells[1]
        if state is not None:
            try:
                self.load_state_dict(state)
            except RuntimeError as exc:
                first = str(exc).strip().splitlines()[0]
                raise BadInput(
                    f"pretrained weights file {pretrained} does not fit receipt_cnn: {first[:200]}"
                ) from None

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.pool(self.trunk(images)), 1)
