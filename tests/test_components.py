"""Contract tests parametrised over every built-in encoder and augmentation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision
from conftest import builtin_registry

REGISTRY = builtin_registry()


@pytest.mark.parametrize("name", REGISTRY.names("encoder"))
def test_encoder_contract(name):
    torch.manual_seed(0)
    encoder = REGISTRY.create("encoder", name, in_channels=1, pooling="grid", grid=(2, 1))
    images = torch.randn(2, 1, 64, 32, requires_grad=True)
    features = encoder(images)
    assert features.shape == (2, encoder.feature_dim)
    features.sum().backward()
    assert images.grad is not None and images.grad.abs().sum() > 0
    gap = REGISTRY.create("encoder", name, in_channels=3, pooling="gap")
    assert gap.feature_dim * 2 == encoder.feature_dim
    assert gap(torch.randn(1, 3, 64, 32)).shape == (1, gap.feature_dim)


def test_encoder_loads_local_weights_file(tmp_path):
    source = torchvision.models.resnet18(weights=None)
    torch.save(source.state_dict(), tmp_path / "r18.pt")
    encoder = REGISTRY.create("encoder", "resnet18", pretrained=str(tmp_path / "r18.pt"), in_channels=3)
    assert torch.equal(encoder.trunk[4][0].conv1.weight, source.layer1[0].conv1.weight)
    gray = REGISTRY.create("encoder", "resnet18", pretrained=str(tmp_path / "r18.pt"), in_channels=1)
    assert torch.allclose(gray.trunk[0].weight, source.conv1.weight.sum(dim=1, keepdim=True))


def test_encoder_rejects_wrong_weights_file(tmp_path):
    torch.save(torchvision.models.mobilenet_v3_small(weights=None).state_dict(), tmp_path / "mnv3.pt")
    with pytest.raises(ValueError, match="does not fit resnet18"):
        REGISTRY.create("encoder", "resnet18", pretrained=str(tmp_path / "mnv3.pt"))
    with pytest.raises(FileNotFoundError, match="pretrained weights file not found"):
        REGISTRY.create("encoder", "resnet18", pretrained=str(tmp_path / "nope.pt"))


@pytest.mark.parametrize("name", REGISTRY.names("augmentation"))
def test_augmentation_contract(name):
    rng = np.random.default_rng(0)
    page = np.full((300, 140, 3), 250, np.uint8)
    page[20:280:12, 10:130] = rng.integers(0, 80, (22, 120, 3), dtype=np.uint8)
    transform = REGISTRY.create("augmentation", name, image_size=(64, 32))
    outputs = []
    for _ in range(2):
        transform.set_random_seed(7)
        outputs.append(transform(image=page)["image"])
    assert outputs[0].shape == (64, 32, 3) and outputs[0].dtype == np.uint8
    assert np.array_equal(outputs[0], outputs[1]), "same seed must give the same view"


def test_capture_views_differ_between_draws():
    transform = REGISTRY.create("augmentation", "capture", image_size=(64, 32))
    transform.set_random_seed(1)
    page = np.full((300, 140, 3), 250, np.uint8)
    page[40:260:10, 10:130] = 0
    first, second = (transform(image=page)["image"] for _ in range(2))
    assert not np.array_equal(first, second)
