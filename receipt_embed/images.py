"""Image decoding shared by ingest, training and search: one place decides what a capture
looks like once decoded.

Pillow does the decoding. EXIF orientation is applied; CMYK, palette, 16-bit and alpha
images are converted to 8-bit RGB (transparent areas become white paper) rather than
rejected. What cannot be decoded raises :class:`ImageRejected` with a short reason code.
"""

from __future__ import annotations

import io
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from receipt_embed.errors import BadInput
from receipt_embed.userfiles import DEFAULT_MAX_BYTES, read_regular

# Pillow warns of a damaged EXIF block without naming the file (decoding goes on without it, or the
# file is rejected by name for its real fault); a line naming no file is noise to whoever reads it.
# A filter, not catch_warnings: ingest decodes in threads, and catch_warnings is not thread-safe.
warnings.filterwarnings("ignore", message=r"(Possibly )?[Cc]orrupt EXIF data", module=r"PIL\.")

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


class DecodingOutOfMemory(MemoryError):
    """Memory ran out while decoding one file; ``what`` names it for the command's message."""

    def __init__(self, name: str, size: tuple[int, int] | None):
        self.what = f"decoding {name}" + (f" ({size[0]}x{size[1]} pixels)" if size else "")
        super().__init__(self.what)


@dataclass(frozen=True)
class DecodedImage:
    image: Image.Image  # 8-bit RGB, orientation applied
    format: str
    source_mode: str


HIGH_DEPTH_MODES = frozenset({"I;16", "I;16B", "I;16L", "I;16N", "I", "F"})  # scaled to 8 bits, not clipped
_STRIP_PIXELS = 1 << 18  # a high-depth image is converted this many pixels at a time


def to_rgb(image: Image.Image, name: str = "<image>") -> Image.Image:
    """``image`` as 8-bit RGB, as ingest decodes captures: 16-bit and 32-bit values are scaled
    to 8 bits (not clipped), float values by their finite maximum, transparent areas become
    white paper. A float image with no finite pixel raises :class:`ImageRejected` naming ``name``."""
    mode = image.mode
    if mode == "RGB":
        return image
    if mode in HIGH_DEPTH_MODES:
        return _high_depth_to_gray(image, name).convert("RGB")
    if mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if mode in ("RGBA", "LA", "PA") or image.mode == "RGBA":
        rgba = image.convert("RGBA")
        paper = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(paper, rgba).convert("RGB")
    return image.convert("RGB")


def _strips(image: Image.Image):
    """(first row, pixels as a numpy array) of ``image`` in strips of rows, so converting a
    large image copies one strip at a time (``np.asarray`` of a whole image copies all of it)."""
    width, height = image.size
    rows = max(1, _STRIP_PIXELS // max(1, width))
    for top in range(0, height, rows):
        yield top, np.asarray(image.crop((0, top, width, min(height, top + rows))))


def _high_depth_to_gray(image: Image.Image, name: str) -> Image.Image:
    """An 8-bit greyscale copy of a 16-bit, 32-bit or float image, a strip at a time (a few bytes
    a pixel, not float64 copies of the whole image). Integers above 255 mean a 0..65535 range;
    floats are scaled so the largest finite value is white (0..1 and 0..255 data both read).
    A NaN or -inf pixel is black, +inf white: one bad pixel does not blank the receipt."""
    is_float = image.mode == "F"
    top, any_finite = 0.0, False
    for _, strip in _strips(image):
        if not is_float:
            top = max(top, float(strip.max(initial=0)))
        elif (finite := np.isfinite(strip)).any():
            top, any_finite = max(top, float(strip.max(where=finite, initial=-np.inf))), True
    if is_float and not any_finite and image.width * image.height:
        raise ImageRejected(
            "decode_error", f"{name}: cannot decode (no finite pixel values: every pixel is NaN or infinite)"
        )
    top = max(top, 1.0) if is_float else (65535.0 if top > 255 else 255.0)
    gray = np.empty((image.height, image.width), dtype=np.uint8)
    for first, strip in _strips(image):
        values = strip.astype(np.float64)
        if is_float:
            values[np.isnan(values) | (values == -np.inf)] = 0.0
            values[values == np.inf] = top
        values *= 255.0 / top
        np.rint(values, out=values)
        np.clip(values, 0, 255, out=values)
        gray[first : first + len(values)] = values
    return Image.fromarray(gray, mode="L")


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
    size = None
    try:
        image = _open_header(data)  # the pixel count is checked below, before decoding
        fmt = image.format or "unknown"
        if fmt not in SUPPORTED_FORMATS:
            raise ImageRejected(
                "unsupported_format",
                f"{name}: unsupported image format {fmt} (supported: {', '.join(sorted(SUPPORTED_FORMATS))})",
            )
        width, height = size = image.size
        if width * height > max_pixels:
            raise ImageRejected(
                "too_many_pixels",
                f"{name}: {width}x{height} = {width * height} pixels exceeds the limit of {max_pixels} "
                f"(possible decompression bomb; raise {max_pixels_key} if it is genuine)",
            )
        source_mode = image.mode
        image.load()
        ImageOps.exif_transpose(image, in_place=True)  # a copy would be 4 more bytes a pixel
        decoded = DecodedImage(to_rgb(image, name), fmt, source_mode)
    except ImageRejected:
        raise
    except MemoryError:
        raise DecodingOutOfMemory(name, size) from None
    except UnidentifiedImageError:
        raise ImageRejected("not_an_image", f"{name}: not a recognised image file") from None
    except (OSError, SyntaxError, ValueError) as exc:
        text = str(exc)
        lowered = text.lower()
        reason = "truncated" if "truncated" in lowered or "broken data stream" in lowered else "decode_error"
        raise ImageRejected(reason, f"{name}: cannot decode ({text})") from None
    if (spread := blank_spread(decoded.image)) is not None:
        colour = "one colour" if spread == 0 else f"one colour (within {spread} levels)"
        raise ImageRejected(
            "blank", f"{name}: blank, all pixels are {colour}: no receipt to embed ({width}x{height}, {source_mode})"
        )
    return decoded


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
    frame_size = None
    try:
        with _open_header(data) as image:
            frame_size = image.size
            pixels = image.size[0] * image.size[1]
            if pixels > max_pixels:
                raise ImageRejected(
                    "too_many_pixels",
                    f"{name}: {image.size[0]}x{image.size[1]} = {pixels} pixels exceeds the limit "
                    f"of {max_pixels} (possible decompression bomb; raise ingest.max_pixels if it is genuine)",
                )
            side = max(height, width) * (2 if crop_page else 1)
            image.draft("RGB", (side, side))
            ImageOps.exif_transpose(image, in_place=True)  # a copy would be 4 more bytes a pixel
            image = to_rgb(image, name)
            if crop_page:
                from receipt_embed.page_crop import page_box, with_margin

                top, bottom, left, right = with_margin(page_box(np.asarray(image)), image.height, image.width)
                image = image.crop((left, top, right, bottom))
            resized = image.resize((width, height), Image.Resampling.BILINEAR, reducing_gap=2.0)
    except ImageRejected:
        raise
    except MemoryError:
        raise DecodingOutOfMemory(name, frame_size) from None
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
