"""Surfaces the paper lies on: part of a device's look, since each device sits in one place.

Each texture is a float32 ``(height, width, 3)`` array in 0..255 drawn from a seeded
generator: the same kind of surface for every capture of a device, a fresh patch of it each
time.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from receipt_embed.errors import BadInput


def smooth_noise(shape: tuple[int, int], cells: int, rng: np.random.Generator) -> np.ndarray:
    """Low-frequency noise in -1..1: a coarse random grid upsampled bilinearly to ``shape``."""
    height, width = shape
    grid = rng.uniform(0, 255, size=(cells, max(2, cells * width // height))).astype(np.uint8)
    upsampled = Image.fromarray(grid).resize((width, height), Image.Resampling.BILINEAR)
    return np.asarray(upsampled, dtype=np.float32) / 127.5 - 1


def make_background(
    style: str, rgb: tuple[int, int, int], shape: tuple[int, int], rng: np.random.Generator
) -> np.ndarray:
    """A ``style`` surface (``wood``, ``slate``, ``lid``, ``fabric``, ``laminate``, ``platen``)."""
    height, width = shape
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    grain = rng.standard_normal(shape, dtype=np.float32)
    if style == "wood":
        warp = 6 * smooth_noise(shape, 4, rng)
        rings = np.sin((x + warp * 4) / rng.uniform(5, 8) + 2 * smooth_noise(shape, 3, rng))
        shade = 1 + 0.12 * rings + 0.08 * smooth_noise(shape, 3, rng) + 0.03 * grain
    elif style == "slate":
        shade = 1 + 0.1 * smooth_noise(shape, 6, rng) + 0.05 * grain
    elif style == "lid":
        shade = 1 + 0.004 * grain
    elif style == "fabric":
        weave = np.sin(x * 1.9) * np.sin(y * 1.9)
        shade = 1 + 0.06 * weave + 0.05 * smooth_noise(shape, 5, rng) + 0.03 * grain
    elif style == "laminate":
        specks = (rng.random(shape) < 0.01).astype(np.float32)
        shade = 1 + 0.04 * smooth_noise(shape, 4, rng) - 0.25 * specks + 0.015 * grain
    elif style == "platen":
        shade = 1 + 0.05 * smooth_noise(shape, 3, rng) + 0.03 * grain
    else:
        raise BadInput(f"unknown background style {style!r}")
    return np.clip(shade[..., None] * np.asarray(rgb, dtype=np.float32), 0, 255)
