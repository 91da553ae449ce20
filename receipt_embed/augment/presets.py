"""Augmentation presets built with albumentations.

``capture`` imitates what differs between two photos or scans of one paper receipt:
framing and perspective, lighting, white balance, focus, sensor noise and JPEG. Crops keep
most of the page (scale >= 0.8): the layout is what identifies a receipt. With
``min_page_scale`` below 1 the page may also come out smaller in the frame, on a plain
background (a photo from further away, a screenshot of a photo): crops only ever zoom in.
"""

from __future__ import annotations

import albumentations as A
import cv2
import numpy as np

from receipt_embed.errors import BadInput


def _portrait_ratio(image_size: tuple[int, int]) -> tuple[float, float]:
    height, width = image_size
    ratio = width / height
    return ratio * 0.9, ratio * 1.1


class ShrinkOntoBackground(A.ImageOnlyTransform):
    """The whole frame shrunk by a factor in ``scale_range`` and placed at a random spot on a
    plain background of a random grey level (with a little noise), the frame size unchanged."""

    def __init__(self, scale_range: tuple[float, float] = (0.6, 1.0), p: float = 0.5):
        super().__init__(p=p)
        low, high = scale_range
        if not 0.1 <= low <= high <= 1.0:
            raise BadInput(f"page scale range must lie in [0.1, 1] with low <= high, got {scale_range}")
        self.scale_range = (float(low), float(high))

    def get_params(self) -> dict:
        return {
            "scale": self.py_random.uniform(*self.scale_range),
            "left": self.py_random.random(),
            "top": self.py_random.random(),
            "level": self.py_random.uniform(0, 255),
            "noise_seed": self.py_random.randrange(2**31),
        }

    def apply(self, img: np.ndarray, scale: float, left: float, top: float, level: float, noise_seed: int, **_):
        height, width = img.shape[:2]
        small_h, small_w = max(1, round(height * scale)), max(1, round(width * scale))
        shrunk = cv2.resize(img, (small_w, small_h), interpolation=cv2.INTER_AREA)
        noise = np.random.default_rng(noise_seed).normal(0.0, 4.0, size=img.shape)
        canvas = np.clip(level + noise, 0, 255).astype(img.dtype)
        y, x = round(top * (height - small_h)), round(left * (width - small_w))
        canvas[y : y + small_h, x : x + small_w] = shrunk.reshape(small_h, small_w, *img.shape[2:])
        return canvas

    def get_transform_init_args_names(self) -> tuple[str, ...]:
        return ("scale_range",)


class UnevenFade(A.ImageOnlyTransform):
    """Ink paled towards the paper by a smooth random field: each pixel's darkness below the
    page's paper level is scaled by a factor in ``keep_range`` that varies across the page
    (a 3 x 2 grid of draws, interpolated), as heat and light fade a thermal receipt."""

    def __init__(self, keep_range: tuple[float, float] = (0.3, 1.0), p: float = 0.5):
        super().__init__(p=p)
        low, high = keep_range
        if not 0.0 <= low <= high <= 1.0:
            raise BadInput(f"fade keep range must lie in [0, 1] with low <= high, got {keep_range}")
        self.keep_range = (float(low), float(high))

    def get_params(self) -> dict:
        return {"grid": [self.py_random.uniform(*self.keep_range) for _ in range(6)]}

    def apply(self, img: np.ndarray, grid: list[float], **_):
        height, width = img.shape[:2]
        keep = cv2.resize(np.asarray(grid, np.float32).reshape(3, 2), (width, height), interpolation=cv2.INTER_LINEAR)
        pixels = img.astype(np.float32)
        paper = np.percentile(pixels[::4, ::4], 95)  # the paper level; a sparse sample suffices
        ink = np.maximum(paper - pixels, 0)
        keep = keep.reshape(height, width, *([1] * (img.ndim - 2)))
        return np.clip(pixels + ink * (1 - keep), 0, 255).astype(img.dtype)

    def get_transform_init_args_names(self) -> tuple[str, ...]:
        return ("keep_range",)


def build_none(image_size: tuple[int, int]) -> A.Compose:
    """Resize only: for evaluation and for raw-pixel baselines."""
    height, width = image_size
    return A.Compose([A.Resize(height, width)])


def build_capture(
    image_size: tuple[int, int],
    strength: float = 1.0,
    min_crop_scale: float = 1.0,
    min_page_scale: float = 1.0,
    max_perspective: float = 0.06,
    harsh: float = 0.0,
) -> A.Compose:
    """Phone- and scanner-like capture variation; ``strength`` scales every probability.
    ``min_crop_scale``: the least share of the page a view keeps (1.0, the default: the whole page,
    so no view loses the small print that tells same-shop receipts apart; held-out recall@1 on
    real scans 0.874 / 0.887 against 0.837 / 0.846 at 0.8, benchmarks/README.md).
    ``min_page_scale`` < 1 shrinks the frame onto a background in half the views (down to that
    factor); ``max_perspective`` is the largest corner shift of the perspective step (a share
    of the side). ``harsh`` > 0 is the probability of each of four harsher looks no default
    step gives: uneven contrast (ink faded in patches), a light falling off across the page,
    a low-resolution capture, and a curled page."""
    if not 0.0 <= strength <= 1.0:
        raise BadInput(f"augment strength must be in [0, 1], got {strength}")
    # the share of the page a crop keeps at least; albumentations' own check names it `scale`
    if not 0.0 < min_crop_scale <= 1.0:
        raise BadInput(f"augment.params.min_crop_scale must be in (0, 1], got {min_crop_scale}")
    if not 0.1 <= min_page_scale <= 1.0:
        raise BadInput(f"augment min_page_scale must be in [0.1, 1], got {min_page_scale}")
    if not 0.02 <= max_perspective <= 0.3:
        raise BadInput(f"augment max_perspective must be in [0.02, 0.3], got {max_perspective}")
    if not 0.0 <= harsh <= 1.0:
        raise BadInput(f"augment harsh must be in [0, 1], got {harsh}")
    height, width = image_size
    p = lambda base: min(1.0, base * strength)  # noqa: E731 - a readable local shorthand
    shrink = [ShrinkOntoBackground((min_page_scale, 1.0), p=p(0.5))] if min_page_scale < 1.0 else []
    curl, looks = [], []
    if harsh > 0:
        curl = [A.GridDistortion(num_steps=4, distort_limit=(-0.1, 0.1), border_mode=cv2.BORDER_REPLICATE, p=p(harsh))]
        looks = [
            UnevenFade((0.3, 1.0), p=p(harsh)),
            A.Illumination(mode="linear", intensity_range=(0.05, 0.2), effect_type="darken", p=p(harsh)),
            A.Downscale(scale_range=(0.4, 0.8), p=p(harsh)),
        ]
    return A.Compose(
        [
            *curl,
            A.Perspective(scale=(0.02, max_perspective), fit_output=True, p=p(0.5)),
            A.Affine(rotate=(-4, 4), shear=(-3, 3), fill=255, p=p(0.5)),
            A.RandomResizedCrop(
                size=(height, width), scale=(min_crop_scale, 1.0), ratio=_portrait_ratio(image_size), p=1.0
            ),
            *shrink,
            A.RandomBrightnessContrast(brightness_limit=0.25, contrast_limit=0.25, p=p(0.8)),
            A.RandomGamma(gamma_limit=(70, 140), p=p(0.3)),
            A.ColorJitter(brightness=0.0, contrast=0.0, saturation=0.4, hue=0.05, p=p(0.5)),
            A.ToGray(p=p(0.2)),
            A.OneOf([A.GaussianBlur(blur_limit=(3, 5)), A.MotionBlur(blur_limit=(3, 7))], p=p(0.4)),
            A.GaussNoise(std_range=(0.01, 0.05), p=p(0.4)),
            A.RandomShadow(shadow_roi=(0, 0, 1, 1), num_shadows_limit=(1, 2), p=p(0.2)),
            *looks,
            A.ImageCompression(quality_range=(40, 95), p=p(0.5)),
        ]
    )
