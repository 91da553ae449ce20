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


def build_receipt_cnn(**params):
    from receipt_embed.models.receipt_cnn import ReceiptCNN

    return ReceiptCNN(**params)


@hookimpl
def register_encoders(register):
    register(
        "receipt_cnn",
        build_receipt_cnn,
        description="small plain CNN for page layout; fast to train from scratch on a CPU",
    )
    for arch in BACKBONES:
        register(
            arch,
            functools.partial(build_torchvision_encoder, arch),
            description=f"torchvision {arch}; grayscale or RGB input, global or grid pooling",
        )
