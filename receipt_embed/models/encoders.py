"""torchvision backbones as receipt encoders.

Receipts are identified mostly by page layout, so besides global average pooling the
encoder can keep a coarse spatial grid (adaptive average pooling to rows x cols cells,
flattened): on this CPU, global pooling alone stayed at chance (see the project's notes).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from receipt_embed.errors import BadInput
from receipt_embed.models.bundled import is_bundled, refuse_for

# architecture -> (torchvision builder name, attribute path of the feature trunk)
ARCHITECTURES: dict[str, str] = {
    "resnet18": "resnet",
    "resnet50": "resnet",
    "mobilenet_v3_small": "features",
    "mobilenet_v3_large": "features",
    "efficientnet_b0": "features",
    "convnext_tiny": "features",
}


def _trunk(model: nn.Module, family: str) -> nn.Module:
    """The convolutional part of a torchvision classifier, without pooling and head."""
    if family == "resnet":
        return nn.Sequential(
            model.conv1,
            model.bn1,
            model.relu,
            model.maxpool,
            model.layer1,
            model.layer2,
            model.layer3,
            model.layer4,
        )
    return model.features


def _first_conv(trunk: nn.Module) -> tuple[nn.Module, str, nn.Conv2d]:
    for name, module in trunk.named_modules():
        if isinstance(module, nn.Conv2d):
            parent_name, _, attr = name.rpartition(".")
            return trunk.get_submodule(parent_name) if parent_name else trunk, attr, module
    raise BadInput("backbone has no convolution")


def _to_grayscale_input(trunk: nn.Module) -> None:
    """Replace the first convolution by a 1-channel one (summing pretrained RGB filters)."""
    parent, attr, conv = _first_conv(trunk)
    gray = nn.Conv2d(
        1,
        conv.out_channels,
        conv.kernel_size,
        conv.stride,
        conv.padding,
        conv.dilation,
        conv.groups,
        conv.bias is not None,
    )
    with torch.no_grad():
        gray.weight.copy_(conv.weight.sum(dim=1, keepdim=True))
        if conv.bias is not None:
            gray.bias.copy_(conv.bias)
    setattr(parent, attr, gray)


MAX_PRETRAINED_BYTES = 2 * 1024**3  # the largest torchvision backbone here is a few hundred MB


def read_weights_file(path: Path) -> dict:
    """A state dict from a local weights file; a text file, a .npy or a device is one line naming
    it (not torch's IndexError or its multi-line weights_only advice)."""
    import io
    import pickle

    from receipt_embed.userfiles import UnusableFile, read_regular

    try:
        data = read_regular(path, MAX_PRETRAINED_BYTES)  # read whole: capped, so a huge file is named, not loaded
    except UnusableFile as exc:
        if exc.reason == "missing_file":
            raise FileNotFoundError(f"pretrained weights file not found: {path}") from None
        raise BadInput(f"pretrained weights file {exc}") from None
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except (
        RuntimeError,
        ValueError,
        IndexError,
        KeyError,
        TypeError,
        AttributeError,
        EOFError,
        pickle.UnpicklingError,
    ) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if first.startswith("Weights only load failed"):
            first = "it holds objects other than tensors, which a safe load refuses"
        raise BadInput(
            f"pretrained weights file {path} is not a torch state dict saved with torch.save ({first[:160]})"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise BadInput(f"pretrained weights file {path} holds {type(state).__name__}, not a state dict of tensors")
    return state


def _load_weights(model: nn.Module, arch: str, pretrained: str | None) -> None:
    """``pretrained``: None/"none", a torchvision weights name (downloads), or a local file."""
    if pretrained in (None, "", "none"):
        return
    if is_bundled(pretrained):
        refuse_for(arch)
    path = Path(pretrained)
    if path.suffix in {".pt", ".pth"} or path.exists():
        state = read_weights_file(path)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or len(missing) == len(model.state_dict()):
            raise BadInput(
                f"weights file {path} does not fit {arch}: {len(missing)} missing and {len(unexpected)} unexpected keys"
            )
        return
    from torchvision.models import get_weight

    weights = get_weight(pretrained if "." in pretrained else f"{_weights_enum(arch)}.{pretrained}")
    model.load_state_dict(weights.get_state_dict(progress=True))


def _weights_enum(arch: str) -> str:
    from torchvision.models import get_model_weights

    return get_model_weights(arch).__name__


class TorchvisionEncoder(nn.Module):
    """A torchvision backbone mapping images (N, C, H, W) to features (N, feature_dim)."""

    def __init__(
        self,
        arch: str,
        pretrained: str | None = None,
        in_channels: int = 1,
        pooling: str = "grid",
        grid: tuple[int, int] = (4, 2),
    ):
        super().__init__()
        if arch not in ARCHITECTURES:
            raise BadInput(f"unknown torchvision architecture {arch!r}; known: {', '.join(ARCHITECTURES)}")
        if in_channels not in (1, 3):
            raise BadInput(f"in_channels must be 1 (grayscale) or 3 (RGB), got {in_channels}")
        if pooling not in ("gap", "grid"):
            raise BadInput(f"pooling must be 'gap' or 'grid', got {pooling!r}")
        import torchvision

        model = torchvision.models.get_model(arch, weights=None)
        _load_weights(model, arch, pretrained)
        self.arch, self.in_channels, self.pooling = arch, in_channels, pooling
        self.trunk = _trunk(model, ARCHITECTURES[arch])
        if in_channels == 1:
            _to_grayscale_input(self.trunk)
        cells = (1, 1) if pooling == "gap" else tuple(grid)
        self.pool = nn.AdaptiveAvgPool2d(cells)
        with torch.no_grad():
            channels = self.trunk.eval()(torch.zeros(1, in_channels, 64, 32)).shape[1]
        self.trunk.train()
        self.feature_dim = channels * cells[0] * cells[1]

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.pool(self.trunk(images)), 1)
