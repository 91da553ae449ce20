"""Simulated capture: turn a flat scan of a receipt into what one device would record.

Works on any upright receipt image, rendered or real. The steps follow the physics in
order: the paper is framed and put in perspective on the device's surface, lit, blurred by
the optics, sampled and made noisy by the sensor, colour-processed, and saved as a JPEG at
the device's quality. :func:`capture_jpeg` returns the file bytes (written as they are, so
there is one compression only, like a real device); :func:`simulate_capture` decodes them.
All randomness comes from ``numpy.random.default_rng(seed)``: the same image, device and
seed give the same bytes.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageFilter

from receipt_embed.images import HIGH_DEPTH_MODES, to_rgb
from receipt_embed.samples import conditions
from receipt_embed.samples.backgrounds import make_background
from receipt_embed.samples.devices import DeviceProfile

_MIN_ASPECT = 1.25  # captures are portrait: height >= 1.25 x width
_MAX_ASPECT = 3.0  # very long receipts are shrunk to fit rather than making huge images


def capture_jpeg(image: Image.Image, device: DeviceProfile, seed: int) -> bytes:
    """The JPEG file that ``device`` would produce when capturing the receipt in ``image``."""
    return capture_with_page_box(image, device, seed)[0]


def capture_with_page_box(
    image: Image.Image, device: DeviceProfile, seed: int
) -> tuple[bytes, tuple[int, int, int, int]]:
    """:func:`capture_jpeg`'s bytes and where the paper lies in them: (top, bottom, left,
    right) of the paper's bounding box, bottom and right exclusive. The ground truth a page
    detector is measured against (``benchmarks/page_crop.py``)."""
    rng = np.random.default_rng(seed)
    paper = _flatten(image)
    width, height, corners, paper = _frame(paper, device, rng)
    paper = _wear(paper, device, rng)

    coefficients = _homography(corners, paper.size)
    warped = paper.transform(
        (width, height), Image.Transform.PERSPECTIVE, coefficients, Image.Resampling.BICUBIC, fillcolor=(0, 0, 0)
    )
    mask = Image.new("L", paper.size, 255).transform(
        (width, height), Image.Transform.PERSPECTIVE, coefficients, Image.Resampling.BILINEAR, fillcolor=0
    )
    alpha = np.asarray(mask, dtype=np.float32)[..., None] / 255
    rows, cols = np.nonzero(alpha[..., 0] > 0.5)
    box = (int(rows.min()), int(rows.max()) + 1, int(cols.min()), int(cols.max()) + 1)

    surface = make_background(device.background, device.background_rgb, (height, width), rng)
    surface *= 1 - device.drop_shadow * _shadow(mask, rng)[..., None]
    scene = surface * (1 - alpha) + np.asarray(warped, dtype=np.float32) * alpha
    scene *= _lighting(device, (height, width), rng)[..., None]
    if device.cast_shadow > 0:
        scene *= conditions.cast_shadow((height, width), device.cast_shadow, rng)[..., None]

    frame = _optics(_to_image(scene), device, rng)
    frame = _sensor(frame, device, rng)
    frame = _processing(frame, device)
    if device.binarise:
        frame = conditions.binarise(frame)
    if device.screenshot:
        frame, (left, top, scale_x, scale_y) = conditions.screenshot(frame, rng)
        box = (
            top + round(box[0] * scale_y),
            top + round(box[1] * scale_y),
            left + round(box[2] * scale_x),
            left + round(box[3] * scale_x),
        )

    buffer = io.BytesIO()
    frame.save(buffer, format="JPEG", quality=device.jpeg_quality)
    return buffer.getvalue(), box


def simulate_capture(image: Image.Image, device: DeviceProfile, seed: int) -> Image.Image:
    """Capture ``image`` with ``device``: an RGB portrait image with the device's look."""
    with Image.open(io.BytesIO(capture_jpeg(image, device, seed))) as decoded:
        return decoded.convert("RGB")


def _flatten(image: Image.Image) -> Image.Image:
    """RGB paper; transparent parts (e.g. a cut-out scan) become white; 16-bit and float scans
    are scaled to 8 bits as ingest decodes them (``convert`` clips 16-bit ink to white)."""
    if image.mode in HIGH_DEPTH_MODES:
        return to_rgb(image)
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def _frame(
    paper: Image.Image, device: DeviceProfile, rng: np.random.Generator
) -> tuple[int, int, np.ndarray, Image.Image]:
    """Choose the frame size and where the paper's four corners land in it.

    Returns the frame width and height, the corners (top-left, top-right, bottom-right,
    bottom-left) in frame pixels, and the paper resized close to its size in the frame, so
    the perspective warp samples near 1:1 instead of aliasing a large scan.
    """
    width = device.width
    paper_w = width * rng.uniform(*device.fill)
    margin = (width - paper_w) / 2 * rng.uniform(0.8, 1.3)
    paper_h = paper_w * paper.height / paper.width
    if paper_h + 2 * margin > _MAX_ASPECT * width:
        scale = (_MAX_ASPECT * width - 2 * margin) / paper_h
        paper_w, paper_h = paper_w * scale, paper_h * scale
    height = round(max(paper_h + 2 * margin, _MIN_ASPECT * width))
    paper = paper.resize((max(1, round(paper_w)), max(1, round(paper_h))), Image.Resampling.LANCZOS, reducing_gap=3.0)

    half_w, half_h = paper_w / 2, paper_h / 2
    corners = np.array([[-half_w, -half_h], [half_w, -half_h], [half_w, half_h], [-half_w, half_h]])
    keystone = device.tilt * rng.uniform(0.5, 1.5) * paper_w / 2
    corners[:2, 0] += (keystone, -keystone)
    corners += rng.normal(0, device.corner_jitter * paper_w, size=corners.shape)
    angle = np.deg2rad(rng.normal(0, device.rotation_deg))
    rotation = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
    corners = corners @ rotation.T

    # Keep the whole paper in the frame: shrink if needed, then shift within the slack.
    extent = corners.max(axis=0) - corners.min(axis=0)
    frame = np.array([width, height], dtype=float) - 4
    corners = (corners - (corners.max(axis=0) + corners.min(axis=0)) / 2) * min(1.0, *(frame / extent))
    slack = frame - (corners.max(axis=0) - corners.min(axis=0))
    corners += np.array([width, height]) / 2 + rng.uniform(-0.3, 0.3, size=2) * slack
    return width, height, corners, paper


def _wear(paper: Image.Image, device: DeviceProfile, rng: np.random.Generator) -> Image.Image:
    """Faded ink and creases, for the devices that have them (no randomness drawn otherwise)."""
    if device.fade > 0:
        paper = conditions.fade_ink(paper, device.fade, rng)
    if device.creases > 0:
        paper = conditions.crease(paper, device.creases, rng)
    return paper


def _homography(corners: np.ndarray, size: tuple[int, int]) -> tuple[float, ...]:
    """PIL perspective coefficients mapping frame pixels back to paper pixels."""
    w, h = size
    source = [(0, 0), (w, 0), (w, h), (0, h)]
    rows, values = [], []
    for (x, y), (u, v) in zip(corners, source):
        rows.append([x, y, 1, 0, 0, 0, -u * x, -u * y])
        rows.append([0, 0, 0, x, y, 1, -v * x, -v * y])
        values += [u, v]
    return tuple(np.linalg.solve(np.array(rows), np.array(values)).tolist())


def _shadow(mask: Image.Image, rng: np.random.Generator) -> np.ndarray:
    """The paper's soft shadow on the surface, offset away from the light, in 0..1."""
    dx, dy = rng.integers(2, 7, size=2)
    shifted = Image.new("L", mask.size, 0)
    shifted.paste(mask, (int(dx), int(dy)))
    return np.asarray(shifted.filter(ImageFilter.GaussianBlur(5)), dtype=np.float32) / 255


def _lighting(device: DeviceProfile, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Illumination falloff: a linear gradient from a random side, times a vignette."""
    height, width = shape
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    y, x = y / height - 0.5, x / width - 0.5
    direction = rng.uniform(0, 2 * np.pi)
    along = x * np.cos(direction) + y * np.sin(direction)
    along = (along - along.min()) / (along.max() - along.min())
    radius2 = (x * x + y * y) / 0.5
    return (1 - device.light_gradient * along) * (1 - device.vignette * radius2)


def _optics(frame: Image.Image, device: DeviceProfile, rng: np.random.Generator) -> Image.Image:
    """Defocus (Gaussian) and camera shake (averaging shifted copies along a random line)."""
    frame = frame.filter(ImageFilter.GaussianBlur(rng.uniform(*device.defocus)))
    if device.motion <= 0:
        return frame
    length = device.motion * rng.uniform(0.5, 1.0)
    direction = rng.uniform(0, np.pi)
    steps = max(2, int(np.ceil(length)) + 1)
    pad = int(np.ceil(length))
    pixels = np.pad(np.asarray(frame, dtype=np.float32), ((pad, pad), (pad, pad), (0, 0)), mode="edge")
    height, width = frame.height, frame.width
    total = np.zeros((height, width, 3), dtype=np.float32)
    for t in np.linspace(-0.5, 0.5, steps):
        dx, dy = round(t * length * np.cos(direction)), round(t * length * np.sin(direction))
        total += pixels[pad + dy : pad + dy + height, pad + dx : pad + dx + width]
    return _to_image(total / steps)


def _sensor(frame: Image.Image, device: DeviceProfile, rng: np.random.Generator) -> Image.Image:
    """Sensor resolution (sampled down, interpolated back up) and noise."""
    if device.resolution < 1:
        small = (max(1, round(frame.width * device.resolution)), max(1, round(frame.height * device.resolution)))
        frame = frame.resize(small, Image.Resampling.BOX).resize(frame.size, Image.Resampling.BILINEAR)
    pixels = np.asarray(frame, dtype=np.float32)
    shape = pixels.shape[:2]
    luma = rng.standard_normal(shape, dtype=np.float32)[..., None] * device.noise
    chroma = rng.standard_normal((*shape, 3), dtype=np.float32) * device.chroma_noise
    return _to_image(pixels + luma + chroma)


def _processing(frame: Image.Image, device: DeviceProfile) -> Image.Image:
    """The device's colour processing: white balance, exposure, contrast, sharpening."""
    pixels = np.asarray(frame, dtype=np.float32) * np.asarray(device.white_balance, dtype=np.float32)
    pixels = (pixels * device.exposure - 128) * device.contrast + 128
    frame = _to_image(pixels)
    if device.sharpen > 0:
        frame = frame.filter(ImageFilter.UnsharpMask(radius=1.5, percent=round(device.sharpen), threshold=4))
    if device.grayscale:
        frame = frame.convert("L").convert("RGB")
    return frame


def _to_image(pixels: np.ndarray) -> Image.Image:
    return Image.fromarray(np.clip(np.rint(pixels), 0, 255).astype(np.uint8))
