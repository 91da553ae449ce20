"""Augmentation presets built with albumentations.

``capture`` imitates what differs between two photos or scans of one paper receipt:
framing and perspective, lighting, white balance, focus, sensor noise and JPEG. Crops keep
most of the page (scale >= 0.8): the layout is what identifies a receipt.
"""

from __future__ import annotations

import albumentations as A

from receipt_embed.errors import BadInput


def _portrait_ratio(image_size: tuple[int, int]) -> tuple[float, float]:
    height, width = image_size
    ratio = width / height
    return ratio * 0.9, ratio * 1.1


def build_none(image_size: tuple[int, int]) -> A.Compose:
    """Resize only: for evaluation and for raw-pixel baselines."""
    height, width = image_size
    return A.Compose([A.Resize(height, width)])


def build_capture(image_size: tuple[int, int], strength: float = 1.0, min_crop_scale: float = 0.8) -> A.Compose:
    """Phone- and scanner-like capture variation; ``strength`` scales every probability."""
    if not 0.0 <= strength <= 1.0:
        raise BadInput(f"augment strength must be in [0, 1], got {strength}")
    height, width = image_size
    p = lambda base: min(1.0, base * strength)  # noqa: E731 - a readable local shorthand
    return A.Compose(
        [
            A.Perspective(scale=(0.02, 0.06), fit_output=True, p=p(0.5)),
            A.Affine(rotate=(-4, 4), shear=(-3, 3), fill=255, p=p(0.5)),
            A.RandomResizedCrop(
                size=(height, width), scale=(min_crop_scale, 1.0), ratio=_portrait_ratio(image_size), p=1.0
            ),
            A.RandomBrightnessContrast(brightness_limit=0.25, contrast_limit=0.25, p=p(0.8)),
            A.RandomGamma(gamma_limit=(70, 140), p=p(0.3)),
            A.ColorJitter(brightness=0.0, contrast=0.0, saturation=0.4, hue=0.05, p=p(0.5)),
            A.ToGray(p=p(0.2)),
            A.OneOf([A.GaussianBlur(blur_limit=(3, 5)), A.MotionBlur(blur_limit=(3, 7))], p=p(0.4)),
            A.GaussNoise(std_range=(0.01, 0.05), p=p(0.4)),
            A.RandomShadow(shadow_roi=(0, 0, 1, 1), num_shadows_limit=(1, 2), p=p(0.2)),
            A.ImageCompression(quality_range=(40, 95), p=p(0.5)),
        ]
    )
