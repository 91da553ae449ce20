"""Built-in augmentation presets."""

from __future__ import annotations

from receipt_embed.builtins import lazy_target
from receipt_embed.hookspecs import hookimpl


def build_none(image_size, **params):
    from receipt_embed.augment.presets import build_none as build

    return build(tuple(image_size), **params)


def build_capture(image_size, **params):
    from receipt_embed.augment.presets import build_capture as build

    return build(tuple(image_size), **params)


# the presets' annotations, for the registry's checks (`strength: abc` is named, not a TypeError deep inside)
build_none.signature_target = lazy_target("receipt_embed.augment.presets", "build_none")
build_capture.signature_target = lazy_target("receipt_embed.augment.presets", "build_capture")


@hookimpl
def register_augmentations(register):
    register("none", build_none, description="resize only (evaluation, baselines)")
    register(
        "capture", build_capture, description="phone/scanner capture variation: perspective, light, blur, noise, JPEG"
    )
