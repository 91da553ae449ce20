"""Built-in encoders: torchvision backbones (imported only when one is built)."""

from __future__ import annotations

import functools

from receipt_embed.hookspecs import hookimpl

BACKBONES = (
    "resnet18",
    "resnet50",
    "mobilenet_v3_small",
    "mobilenet_v3_large",
    "efficientnet_b0",
    "convnext_tiny",
)


def build_torchvision_encoder(arch: str, **params):
    from receipt_embed.models.encoders import TorchvisionEncoder

    return TorchvisionEncoder(arch, **params)


@hookimpl
def register_encoders(register):
    for arch in BACKBONES:
        register(
            arch,
            functools.partial(build_torchvision_encoder, arch),
            description=f"torchvision {arch}; grayscale or RGB input, global or grid pooling",
        )
