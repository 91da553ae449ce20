"""Generation: write a sample set that ``ingest`` reads as it is.

A set is ``out_dir/images/<receipt_id>_<device>.jpg`` (every receipt captured once by
each device) plus ``out_dir/manifest.csv`` with the columns :data:`MANIFEST_COLUMNS`,
paths relative to ``out_dir``. The receipts are either rendered (:func:`make_samples`) or
existing scans (:func:`capture_scans`). Each capture's seed comes from the set's seed and
the receipt and device *names*, so a set with more receipts or devices contains the
captures of a smaller one unchanged, and one seed always gives the same bytes.
"""

from __future__ import annotations

import csv
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from receipt_embed.errors import BadInput
from receipt_embed.samples.capture import capture_jpeg
from receipt_embed.samples.devices import DeviceProfile, select_devices
from receipt_embed.samples.receipts import make_receipt
from receipt_embed.samples.render import render_receipt

MANIFEST_COLUMNS = ("path", "receipt_id", "device", "merchant")
SCAN_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".tif", ".tiff", ".bmp", ".webp"})

Progress = Callable[[int], object]


def capture_seed(seed: int, receipt_id: str, device: str) -> int:
    """The seed of one capture, derived from the set's seed and the two names."""
    key = [seed, zlib.crc32(receipt_id.encode()), zlib.crc32(device.encode())]
    return int(np.random.SeedSequence(key).generate_state(1, dtype=np.uint64)[0])


def make_samples(
    out_dir: str | Path, receipts: int, devices: int, seed: int = 0, progress: Progress | None = None
) -> Path:
    """Render ``receipts`` synthetic receipts, capture each with the first ``devices`` profiles.

    ``progress`` is called with 1 after each capture written. Returns the manifest path.
    """
    if receipts < 1:
        raise BadInput(f"receipts must be at least 1, got {receipts}")
    profiles = select_devices(devices)

    def sources() -> Iterator[tuple[str, str, Image.Image]]:
        for index in range(receipts):
            receipt = make_receipt(seed, index)
            yield receipt.receipt_id, receipt.shop.name, render_receipt(receipt)

    return _write_set(Path(out_dir), sources(), profiles, seed, progress)


def capture_scans(
    scan_paths: Iterable[str | Path], out_dir: str | Path, devices: int, seed: int = 0, progress: Progress | None = None
) -> Path:
    """Capture existing receipt scans with the first ``devices`` profiles.

    The receipt id is each file's stem, so stems must be unique; ``merchant`` is left
    empty. Returns the manifest path.
    """
    paths = [Path(p) for p in scan_paths]
    if not paths:
        raise BadInput("no scans given")
    repeated = sorted(stem for stem, n in Counter(p.stem for p in paths).items() if n > 1)
    if repeated:
        raise BadInput(f"scan file names must have unique stems (they become receipt ids): {repeated}")
    profiles = select_devices(devices)
    sources = ((path.stem, "", _load_scan(path)) for path in paths)
    return _write_set(Path(out_dir), sources, profiles, seed, progress)


def find_scans(folder: str | Path) -> list[Path]:
    """The image files directly in ``folder`` (by suffix, see :data:`SCAN_SUFFIXES`), sorted."""
    return sorted(p for p in Path(folder).iterdir() if p.is_file() and p.suffix.lower() in SCAN_SUFFIXES)


def _load_scan(path: Path) -> Image.Image:
    try:
        with Image.open(path) as image:
            return ImageOps.exif_transpose(image)  # a loaded copy, upright
    except (OSError, Image.DecompressionBombError) as err:
        raise BadInput(f"cannot read scan {path}: {err}") from err


def _write_set(
    out_dir: Path,
    sources: Iterable[tuple[str, str, Image.Image]],
    profiles: tuple[DeviceProfile, ...],
    seed: int,
    progress: Progress | None,
) -> Path:
    """Write every capture, then the manifest (last, so a failed run leaves none)."""
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for receipt_id, merchant, image in sources:
        for device in profiles:
            relative = f"images/{receipt_id}_{device.name}.jpg"
            data = capture_jpeg(image, device, capture_seed(seed, receipt_id, device.name))
            (out_dir / relative).write_bytes(data)
            rows.append((relative, receipt_id, device.name, merchant))
            if progress is not None:
                progress(1)
    manifest = out_dir / "manifest.csv"
    with manifest.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(MANIFEST_COLUMNS)
        writer.writerows(rows)
    return manifest
