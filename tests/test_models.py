"""Encoder + head: per-image input normalisation makes exposure and contrast irrelevant."""

from __future__ import annotations

import pytest
import torch
from conftest import builtin_registry

from receipt_embed.models.embedder import Embedder, standardize_per_image


def _embedder(input_norm):
    torch.manual_seed(0)
    encoder = builtin_registry().create("encoder", "receipt_cnn", in_channels=1, grid=(2, 1))
    return Embedder(encoder, head_hidden=16, head_dim=8, input_norm=input_norm).eval()


def test_per_image_norm_is_invariant_to_gain_and_offset():
    images = torch.rand(3, 1, 64, 32)
    brighter = images * 1.7 + 0.4
    per_image, fixed = _embedder("per_image"), _embedder("fixed")
    with torch.no_grad():
        a, b = per_image(images), per_image(brighter)
        c, d = fixed(images), fixed(brighter)
    assert torch.allclose(a[0], b[0], atol=1e-4) and torch.allclose(a[1], b[1], atol=1e-4)
    assert (c[0] - d[0]).norm() > 0.1 * c[0].norm()  # without it the features move


def test_standardize_per_image_statistics():
    x = standardize_per_image(torch.rand(4, 1, 10, 6) * 5 + 2)
    assert torch.allclose(x.mean(dim=(1, 2, 3)), torch.zeros(4), atol=1e-5)
    assert torch.allclose(x.std(dim=(1, 2, 3)), torch.ones(4), atol=1e-3)


def test_bad_input_norm():
    with pytest.raises(ValueError, match="input_norm must be 'fixed' or 'per_image'"):
        _embedder("global")
