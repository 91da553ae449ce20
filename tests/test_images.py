"""Decoding captures (receipt_embed.images): how 16-bit and float images become 8-bit RGB."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tracemalloc
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from receipt_embed.images import ImageRejected, decode_image, resize_bytes, to_rgb

REPO = Path(__file__).resolve().parents[1]


def _tiff(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "TIFF")
    return buffer.getvalue()


def _float_receipt(bad: float | None = None) -> np.ndarray:
    """A 0..1 float scan: paper 0.94, a dark bar 0.08, and optionally one bad pixel."""
    pixels = np.full((120, 80), 0.94, dtype=np.float32)
    pixels[50:70] = 0.08
    if bad is not None:
        pixels[5, 5] = bad
    return pixels


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_one_non_finite_pixel_does_not_blank_a_float_image(bad):
    """Attack round 20 K2: a float TIFF with one NaN or Inf pixel decoded all black (the maximum
    used for scaling was NaN or Inf), with bare numpy warnings naming no file."""
    data = _tiff(_float_receipt(bad))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "invalid value encountered in cast" was printed bare
        decoded = np.asarray(decode_image(data, 10**6, name="f.tif").image)
        resized = resize_bytes(data, (60, 40), name="f.tif")
    assert decoded[0, 0, 0] == 240 and decoded[60, 0, 0] == 20  # 0.94 and 0.08 of white
    assert decoded[5, 5, 0] == (255 if bad == np.inf else 0)  # +inf white, NaN and -inf black
    assert resized.max() >= 235 and resized.min() <= 25


def test_a_float_image_with_no_finite_pixel_is_rejected_naming_it():
    """Attack round 20 K2: with nothing finite left to scale by, the file is refused by name."""
    data = _tiff(np.full((12, 10), np.nan, dtype=np.float32))
    for decode in (lambda: decode_image(data, 10**6, name="line 2: nan.tif"),
                   lambda: resize_bytes(data, (6, 4), name="line 2: nan.tif")):  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(ImageRejected) as caught:
                decode()
        assert caught.value.reason == "decode_error"
        assert str(caught.value) == (
            "line 2: nan.tif: cannot decode (no finite pixel values: every pixel is NaN or infinite)"
        )


def _old_to_gray(pixels: np.ndarray, is_float: bool) -> np.ndarray:
    """The float64 conversion this module used before round 20, for finite images."""
    pixels = pixels.astype(np.float64)
    top = 65535.0 if not is_float and pixels.max(initial=0) > 255 else 255.0
    if is_float:
        top = max(float(pixels.max(initial=0)), 1.0)
    return np.clip(np.round(pixels * (255.0 / top)), 0, 255).astype(np.uint8)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.float32])
def test_high_depth_conversion_gives_the_same_pixels_as_before(dtype):
    """Attack round 20 K3: converting in strips changes memory use, not a single pixel value."""
    rng = np.random.default_rng(0)
    if dtype == np.float32:
        pixels = rng.uniform(-0.5, 3.0, size=(1100, 1000)).astype(np.float32)
    else:
        pixels = rng.integers(0, 65536 if dtype == np.uint16 else 300, size=(1100, 1000)).astype(dtype)
    image = Image.fromarray(pixels)
    gray = np.asarray(to_rgb(image))[..., 0]
    assert np.array_equal(gray, _old_to_gray(pixels, dtype == np.float32))


@pytest.mark.parametrize("dtype", [np.uint16, np.float32])
def test_converting_a_large_16_bit_or_float_image_takes_a_few_bytes_a_pixel(dtype):
    """Attack round 20 K3: the conversion made float64 copies of the whole image (np.asarray,
    then round, clip and cast), about 32 bytes a pixel: a 89-Mpixel TIFF needed 2.8 GB per decode,
    times ingest's decode threads. Now it works a strip at a time into one 8-bit array."""
    image = Image.fromarray(np.full((2000, 3000), 60000 if dtype == np.uint16 else 0.5, dtype=dtype))
    image.load()
    tracemalloc.start()
    try:
        converted = to_rgb(image)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert converted.mode == "RGB" and converted.getpixel((0, 0)) in ((233, 233, 233), (128, 128, 128))
    assert peak < 3 * image.width * image.height, peak  # the 8-bit result and one strip


def test_out_of_memory_while_decoding_names_the_file_and_advice_ingest_can_follow(tmp_path):
    """Attack round 20 K3: ingest out of memory said only "use a smaller data.image_size,
    --batch-size or dataset", settings ingest does not have, and not which file it was decoding."""
    Image.new("RGB", (10, 12), "white").save(tmp_path / "a.png")
    (tmp_path / "manifest.csv").write_text("path,receipt_id,device\na.png,r1,phone\n")
    script = (
        "import sys\n"
        "from PIL import ImageFile\n"
        "from receipt_embed import cli\n"
        "def no_memory(image):\n"
        "    raise MemoryError()\n"
        "ImageFile.ImageFile.load = no_memory\n"
        f"sys.argv = ['receipt-embed', 'ingest', {str(tmp_path)!r}, '--out', {str(tmp_path / 'ds')!r}, '-q']\n"
        "cli.run()\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        "Error: out of memory (a memory limit such as `ulimit -v`, or too little RAM for this job) decoding "
        "line 2: a.png (10x12 pixels); raise the limit, or shrink the largest images (a lower --max-pixels "
        "rejects them; ingest decodes up to 4 at once)\n"
    )
    assert not (tmp_path / "ds").exists()


def test_attack_round_27_f9_a_damaged_exif_block_prints_no_line_naming_no_file(tmp_path):
    """Attack round 27 F9: the first 10 bytes of a TIFF made Pillow print `Warning: Corrupt EXIF
    data. ...` (no file named) before the file's own one-line rejection; only the rejection is said."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (120, 200), "white").save(buffer, format="TIFF")
    (tmp_path / "t.tif").write_bytes(buffer.getvalue()[:10])
    program = (
        "import sys\nfrom receipt_embed.images import ImageRejected, decode_image\n"
        "try:\n    decode_image(open(sys.argv[1], 'rb').read(), 10**8, name=sys.argv[1])\n"
        "except ImageRejected as exc:\n    print(exc.reason, exc)\n"
    )
    result = subprocess.run(
        [sys.executable, "-W", "default", "-c", program, str(tmp_path / "t.tif")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.stdout == f"not_an_image {tmp_path / 't.tif'}: not a recognised image file\n"
    assert "EXIF" not in result.stderr, result.stderr
