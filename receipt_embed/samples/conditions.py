"""Harsher capture conditions than the default devices have: worn paper and awkward captures.

A model tuned on the default devices can fit their looks; these are the cases it must also
survive, each one a step of :func:`receipt_embed.samples.capture.capture_jpeg` that runs only
when a device asks for it (so the default devices' captures stay byte for byte the same):

- thermal fading: the ink of a thermal receipt pales unevenly (heat, light, age), and the
  paper yellows;
- creases: fold lines across the paper, each a thin dark line with a bright and a shaded side;
- a cast shadow: the phone or the hand between the lamp and the receipt darkens part of it
  with a soft-edged shadow;
- a screenshot: the photo is shown on a phone screen (a chat app) and screenshotted, so it
  is small, framed by status and navigation bars;
- binarisation: a kiosk or fax scanner thresholds the page to pure black and white.
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageFilter

from receipt_embed.samples.backgrounds import smooth_noise

_YELLOWED = np.array([1.0, 0.97, 0.86], dtype=np.float32)  # aged thermal paper


def fade_ink(paper: Image.Image, strength: float, rng: np.random.Generator) -> Image.Image:
    """Thermal fading: ink darkness scaled by ``1 - strength * f`` with ``f`` a smooth field in
    0.4..1 (stronger towards one end of the paper), and the paper tinted yellow."""
    pixels = np.asarray(paper, dtype=np.float32)
    shape = pixels.shape[:2]
    field = 0.7 + 0.3 * smooth_noise(shape, 3, rng)
    ramp = np.linspace(0, 1, shape[0], dtype=np.float32)[:, None]
    field = np.clip(field * (0.6 + 0.4 * (ramp if rng.random() < 0.5 else 1 - ramp)), 0, 1)
    ink = 255 - pixels
    faded = 255 - ink * (1 - strength * field)[..., None]
    tint = 1 - rng.uniform(0.3, 1.0) * (1 - _YELLOWED)
    return _image(faded * tint)


def crease(paper: Image.Image, count: int, rng: np.random.Generator) -> Image.Image:
    """``count`` fold lines across the paper, each at a random height and slant."""
    pixels = np.asarray(paper, dtype=np.float32)
    height, width = pixels.shape[:2]
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    shade = np.ones((height, width), dtype=np.float32)
    for _ in range(count):
        row, slant = rng.uniform(0.15, 0.85) * height, rng.normal(0, 0.08)
        distance = (y - row - slant * (x - width / 2)) / np.sqrt(1 + slant * slant)
        line = np.exp(-(distance**2) / 2.0)  # the fold itself, about 2 px wide
        side = np.tanh(distance / (0.03 * height)) * np.exp(-np.abs(distance) / (0.08 * height))
        shade *= 1 - 0.35 * line - rng.uniform(0.04, 0.1) * side
    return _image(pixels * shade[..., None])


def cast_shadow(shape: tuple[int, int], strength: float, rng: np.random.Generator) -> np.ndarray:
    """A multiplier in ``1 - strength``..1: a soft-edged shadow over a random part of the frame
    (a half-plane whose edge crosses the frame, wavy like a hand's outline)."""
    height, width = shape
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    angle = rng.uniform(0, 2 * np.pi)
    centre = np.array([width, height]) * rng.uniform(0.3, 0.7, size=2)
    along = (x - centre[0]) * np.cos(angle) + (y - centre[1]) * np.sin(angle)
    along += 0.05 * width * smooth_noise(shape, 4, rng)
    softness = rng.uniform(0.01, 0.04) * width
    inside = 1 / (1 + np.exp(-along / softness))
    return 1 - strength * inside


def screenshot(frame: Image.Image, rng: np.random.Generator) -> tuple[Image.Image, tuple[int, int, float, float]]:
    """``frame`` as a phone screenshot of it: the same size, the photo shrunk onto a dark
    screen between a status bar and a navigation bar. Also returns where the photo went:
    (left, top, x scale, y scale)."""
    width, height = frame.size
    screen = Image.new("RGB", (width, height), (18, 18, 20))
    top, bottom = round(0.06 * height), round(0.08 * height)
    scale = min(width / frame.width, (height - top - bottom) / frame.height) * rng.uniform(0.8, 0.95)
    shown = frame.resize((max(1, round(frame.width * scale)), max(1, round(frame.height * scale))), Image.BILINEAR)
    left, shown_top = (width - shown.width) // 2, top + (height - top - bottom - shown.height) // 2
    screen.paste(shown, (left, shown_top))
    pixels = np.asarray(screen, dtype=np.float32).copy()
    pixels[:top] = 40
    pixels[height - bottom :] = 30
    for share in (0.05, 0.8, 0.86, 0.92):  # the clock and the status icons
        x0 = round(share * width)
        pixels[top // 3 : 2 * top // 3, x0 : x0 + max(2, width // 25)] = 220
    return _image(pixels), (left, shown_top, shown.width / frame.width, shown.height / frame.height)


def binarise(frame: Image.Image) -> Image.Image:
    """Black and white by a local threshold, as a kiosk or fax scanner does."""
    gray = frame.convert("L")
    local = np.asarray(gray.filter(ImageFilter.BoxBlur(8)), dtype=np.float32)
    ink = np.asarray(gray, dtype=np.float32) < local - 12
    return Image.fromarray(np.where(ink, 0, 255).astype(np.uint8)).convert("RGB")


def _image(pixels: np.ndarray) -> Image.Image:
    return Image.fromarray(np.clip(np.rint(pixels), 0, 255).astype(np.uint8))
