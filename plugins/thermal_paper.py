"""Augmentation preset ``thermal_paper``: what time does to till receipts.

Thermal paper fades (print loses contrast and darkens unevenly toward grey), yellows, and
gets crumpled in wallets (smooth local warps and creases with shading). This preset applies
those on top of ordinary capture variation, so an encoder learns to match a fresh capture
with one of the same receipt months later.

    receipt-embed train --set augment.preset=thermal_paper --set "augment.params={fade: 0.5}"
"""

from __future__ import annotations

from receipt_embed.hookspecs import hookimpl


def build(image_size, fade: float = 0.5, crumple: float = 0.5):
    """``fade`` and ``crumple`` in [0, 1] scale how strong and how likely each effect is."""
    import albumentations as A

    for name, value in (("fade", fade), ("crumple", crumple)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"thermal_paper {name} must be in [0, 1], got {value}")
    height, width = tuple(image_size)
    return A.Compose(
        [
            A.RandomResizedCrop(
                size=(height, width), scale=(0.8, 1.0), ratio=(0.9 * width / height, 1.1 * width / height)
            ),
            # fading: the print loses contrast and the paper greys, not uniformly
            A.RandomBrightnessContrast(brightness_limit=(0.0, 0.2 * fade), contrast_limit=(-0.45 * fade, 0.0), p=fade),
            A.RandomToneCurve(scale=0.1 + 0.2 * fade, p=fade),
            A.RandomGamma(gamma_limit=(60, 100), p=0.5 * fade),
            # yellowing: less blue, a little less green
            A.RGBShift(
                r_shift_limit=(0, 0),
                g_shift_limit=(-int(8 * fade), 0),
                b_shift_limit=(-int(40 * fade) - 1, -1),
                p=0.5 * fade,
            ),
            # crumpling: smooth warps, creases that catch the light
            A.ElasticTransform(alpha=20 * crumple + 1, sigma=8, border_mode=0, fill=(255, 255, 255), p=crumple),
            A.GridDistortion(
                num_steps=5, distort_limit=0.15 * crumple + 0.01, border_mode=0, fill=(255, 255, 255), p=crumple
            ),
            A.RandomShadow(
                shadow_roi=(0, 0, 1, 1),
                num_shadows_limit=(1, 3),
                shadow_dimension=4,
                shadow_intensity_range=(0.1, 0.3),
                p=0.5 * crumple,
            ),
            A.GaussNoise(std_range=(0.01, 0.04), p=0.3),
            A.ImageCompression(quality_range=(50, 95), p=0.4),
            A.Resize(height, width),
        ]
    )


@hookimpl
def register_augmentations(register):
    register("thermal_paper", build, description="faded, yellowed, crumpled thermal receipts (params: fade, crumple)")
