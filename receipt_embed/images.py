"""Image decoding shared by ingest, training and search: one place decides what a capture
looks like once decoded.

Pillow does the decoding. EXIF orientation is applied; CMYK, palette, 16-bit and alpha
images are converted to 8-bit RGB (transparent areas become white paper) rather than
rejected. What cannot be decoded raises :class:`ImageRejected` with a short reason code.
"""

from __future__ import annotations

import io
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from receipt_embed.errors import BadInput
from receipt_embed.userfiles import DEFAULT_MAX_BYTES, read_regular

# Pillow's own decompression-bomb threshold: the default where no config is at hand
DEFAULT_MAX_PIXELS = 89_478_485
SUPPORTED_FORMATS = frozenset({"JPEG", "MPO", "PNG", "WEBP", "TIFF", "BMP"})
# a capture whose every channel spans at most this many levels once decoded has no content: the
# model's per-image normalisation maps every such image to one input, so all embed alike. Sensor
# noise, paper texture and even the palest thermal print span far more
BLANK_SPREAD = 2
_PIL_LIMIT_LOCK = threading.Lock()


class ImageRejected(BadInput):
    """A file that is not a usable capture; ``reason`` is a stable code for reports (a
    ValueError, so the CLI reports it as bad input)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class DecodedImage:
    image: Image.Image  # 8-bit RGB, orientation applied
    format: str
    source_mode: str


def _to_rgb(image: Image.Image) -> Image.Image:
    mode = image.mode
    if mode == "RGB":
        return image
    if mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        pixels = np.asarray(image, dtype=np.float64)
        top = 65535.0 if mode != "F" and pixels.max(initial=0) > 255 else 255.0
        if mode == "F":
            top = max(float(pixels.max(initial=0)), 1.0)
        gray = np.clip(np.round(pixels * (255.0 / top)), 0, 255).astype(np.uint8)
        return Image.fromarray(gray, mode="L").convert("RGB")
    if mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if mode in ("RGBA", "LA", "PA") or image.mode == "RGBA":
        rgba = image.convert("RGBA")
        paper = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(paper, rgba).convert("RGB")
    return image.convert("RGB")


def _open_header(data: bytes) -> Image.Image:
    """Pillow image from bytes with only the header read (its own bomb limit off: callers check)."""
    with _PIL_LIMIT_LOCK:  # Pillow's own bomb check reads a module global at open time
        default_limit, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
        try:
            return Image.open(io.BytesIO(data))
        finally:
            Image.MAX_IMAGE_PIXELS = default_limit


def blank_spread(image: Image.Image) -> int | None:
    """The widest range of levels over an 8-bit RGB image's channels when it is at most
    ``BLANK_SPREAD`` (a blank capture: one colour), else None."""
    spread = max(high - low for low, high in image.getextrema())
    return spread if spread <= BLANK_SPREAD else None


def decode_image(
    data: bytes, max_pixels: int, name: str = "<bytes>", max_pixels_key: str = "ingest.max_pixels"
) -> DecodedImage:
    """Decode fully (so truncation is caught), check size, format and content (a blank image
    is rejected), return 8-bit RGB; ``max_pixels_key`` is the setting a too-large image's
    error says to raise."""
    if not data:
        raise ImageRejected("empty_file", f"{name}: file is empty (0 bytes)")
    try:
        image = _open_header(data)  # the pixel count is checked below, before decoding
        fmt = image.format or "unknown"
        if fmt not in SUPPORTED_FORMATS:
            raise ImageRejected(
                "unsupported_format",
                f"{name}: unsupported image format {fmt} (supported: {', '.join(sorted(SUPPORTED_FORMATS))})",
            )
        width, height = image.size
        if width * height > max_pixels:
            raise ImageRejected(
                "too_many_pixels",
                f"{name}: {width}x{height} = {width * height} pixels exceeds the limit of {max_pixels} "
                f"(possible decompression bomb; raise {max_pixels_key} if it is genuine)",
            )
        source_mode = image.mode
        image.load()
        image = ImageOps.exif_transpose(image)
    except ImageRejected:
        raise
    except UnidentifiedImageError:
        raise ImageRejected("not_an_image", f"{name}: not a recognised image file") from None
    except (OSError, SyntaxError, ValueError) as exc:
        text = str(exc)
        lowered = text.lower()
        reason = "truncated" if "truncated" in lowered or "broken data stream" in lowered else "decode_error"
        raise ImageRejected(reason, f"{name}: cannot decode ({text})") from None
    rgb = _to_rgb(image)
    if (spread := blank_spread(rgb)) is not None:
        colour = "one colour" if spread == 0 else f"one colour (within {spread} levels)"
        raise ImageRejected(
            "blank", f"{name}: blank, all pixels are {colour}: no receipt to embed ({width}x{height}, {source_mode})"
        )
    return DecodedImage(rgb, fmt, source_mode)


def resize_bytes(
    data: bytes,
    size: tuple[int, int],
    max_pixels: int = DEFAULT_MAX_PIXELS,
    name: str = "<bytes>",
    crop_page: bool = False,
) -> np.ndarray:
    """Decode an encoded capture straight to (height, width) RGB uint8; with ``crop_page``,
    cut to the paper first (:mod:`receipt_embed.page_crop`).

    The pixel count is checked from the header before anything is decoded, so a
    decompression bomb is refused without allocating it. JPEG's DCT scaling (Pillow draft
    mode) decodes at 1/2, 1/4 or 1/8 resolution when the target is small, which is several
    times faster than a full decode followed by a resize (at twice the size when a crop
    will enlarge part of the frame)."""
    height, width = size
    if not data:
        raise ImageRejected("empty_file", f"{name}: file is empty (0 bytes)")
    try:
        with _open_header(data) as image:
            pixels = image.size[0] * image.size[1]
            if pixels > max_pixels:
                raise ImageRejected(
                    "too_many_pixels",
                    f"{name}: {image.size[0]}x{image.size[1]} = {pixels} pixels exceeds the limit "
                    f"of {max_pixels} (possible decompression bomb; raise ingest.max_pixels if it is genuine)",
                )
            side = max(height, width) * (2 if crop_page else 1)
            image.draft("RGB", (side, side))
            image = _to_rgb(ImageOps.exif_transpose(image))
            if crop_page:
                from receipt_embed.page_crop import page_box, with_margin

                top, bottom, left, right = with_margin(page_box(np.asarray(image)), image.height, image.width)
                image = image.crop((left, top, right, bottom))
            resized = image.resize((width, height), Image.Resampling.BILINEAR, reducing_gap=2.0)
    except ImageRejected:
        raise
    except UnidentifiedImageError:
        raise ImageRejected("not_an_image", f"{name}: not a recognised image file") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageRejected("decode_error", f"{name}: cannot decode ({exc})") from None
    return np.asarray(resized, dtype=np.uint8)


def load_resized(
    path: str | Path,
    size: tuple[int, int],
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
) -> np.ndarray:
    """A capture file decoded to (height, width) RGB uint8 (see :func:`resize_bytes`).

    Only a regular file of at most ``max_bytes`` is read (a FIFO or device raises
    :class:`~receipt_embed.userfiles.UnusableFile`); what cannot be decoded raises
    :class:`ImageRejected`. Both are ValueErrors naming the path."""
    return resize_bytes(read_regular(path, max_bytes), size, max_pixels, name=str(path))
