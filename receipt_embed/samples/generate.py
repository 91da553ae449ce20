"""Generation: write a sample set that ``ingest`` reads as it is.

A set is ``out_dir/images/<receipt_id>_<device>.jpg`` (every receipt captured once by
each device) plus ``out_dir/manifest.csv`` with the columns :data:`MANIFEST_COLUMNS`,
paths relative to ``out_dir``; rendered receipts add :data:`RENDERED_COLUMNS`' printed
``date``, ``total`` and ``receipt_number`` (the fields verifier's columns), scans the
metadata their listing gives. The receipts are either rendered (:func:`make_samples`) or
existing scans (:func:`capture_scans`). Each capture's seed comes from the set's seed and
the receipt and device *names*, so a set with more receipts or devices contains the
captures of a smaller one unchanged, and one seed always gives the same bytes.
"""

from __future__ import annotations

import csv
import io
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from receipt_embed.display import quoted, shortened
from receipt_embed.errors import BadInput
from receipt_embed.fileio import DiskFull, free_bytes, is_disk_full
from receipt_embed.images import DEFAULT_MAX_PIXELS, HIGH_DEPTH_MODES, SUPPORTED_FORMATS, DecodingOutOfMemory, to_rgb
from receipt_embed.samples.capture import capture_jpeg
from receipt_embed.samples.devices import DeviceProfile, select_devices
from receipt_embed.samples.receipts import make_receipt
from receipt_embed.samples.render import PRINTED_FIELDS, printed_fields, render_receipt
from receipt_embed.samples.scans import Scan, checked_scan_bytes, read_scans, scans_of_paths

MANIFEST_COLUMNS = ("path", "receipt_id", "device", "merchant")
RENDERED_COLUMNS = (*MANIFEST_COLUMNS, *PRINTED_FIELDS)  # a rendered set's: plus the printed fields

Progress = Callable[[int], object]


def capture_seed(seed: int, receipt_id: str, device: str) -> int:
    """The seed of one capture, derived from the set's seed and the two names."""
    key = [seed, zlib.crc32(receipt_id.encode()), zlib.crc32(device.encode())]
    return int(np.random.SeedSequence(key).generate_state(1, dtype=np.uint64)[0])


def make_samples(
    out_dir: str | Path, receipts: int, devices: int, seed: int = 0, progress: Progress | None = None
) -> Path:
    """Render ``receipts`` synthetic receipts, capture each with the first ``devices`` profiles.

    The manifest has :data:`RENDERED_COLUMNS`: the shop's name as ``merchant`` and the
    ``date``, ``total`` and ``receipt_number`` each receipt prints, as printed
    (:func:`~receipt_embed.samples.render.printed_fields`). ``progress`` is called with 1 after
    each capture written. Returns the manifest path.
    """
    if receipts < 1:
        raise BadInput(f"receipts must be at least 1, got {receipts}")
    profiles = select_devices(devices)

    def sources() -> Iterator[tuple[str, str, dict, Image.Image]]:
        for index in range(receipts):
            receipt = make_receipt(seed, index)
            metadata = {"merchant": receipt.shop.name, **printed_fields(receipt)}
            yield receipt.receipt_id, receipt.receipt_id, metadata, render_receipt(receipt)

    return _write_set(Path(out_dir), sources(), profiles, seed, progress)


def capture_scans(
    scans: Iterable[Scan | str | Path],
    out_dir: str | Path,
    devices: int,
    seed: int = 0,
    progress: Progress | None = None,
) -> Path:
    """Capture existing receipt scans with the first ``devices`` profiles.

    ``scans`` come from :func:`~receipt_embed.samples.scans.read_scans` (with their metadata and
    one receipt id per set of byte-identical files), or are file paths (each stem an id, names
    unique). The manifest has :data:`MANIFEST_COLUMNS` (``merchant`` empty unless listed), then
    the listing's metadata as given (``date``, ``total``, ...): nothing is read off a scan, so a
    scan without listed fields has no date, total or receipt number column. Returns the manifest path.
    """
    scans = list(scans)
    if not scans:
        raise BadInput("no scans given")
    if not all(isinstance(s, Scan) for s in scans):
        scans = scans_of_paths(scans)
    profiles = select_devices(devices)
    # one scan in memory at a time, decoded from the bytes checked against the hash read_scans took
    sources = ((s.name, s.receipt_id, {"merchant": "", **s.metadata}, _load_scan(s)) for s in scans)
    return _write_set(Path(out_dir), sources, profiles, seed, progress)


def find_scans(folder: str | Path) -> list[Path]:
    """The scan files of ``folder``: those its ``receipts.jsonl`` lists, else its images, sorted."""
    return [scan.path for scan in read_scans(folder)]


_OPENERS = sorted(SUPPORTED_FORMATS - {"MPO"})  # Pillow opens MPO files with its JPEG plugin
_FORMATS_READ = ", ".join(sorted(SUPPORTED_FORMATS)[:-1]) + " or " + sorted(SUPPORTED_FORMATS)[-1]


def _load_scan(scan: Scan) -> Image.Image:
    """The scan, upright, decoded from bytes read as a regular file and checked against the hash
    taken when it was listed (PIL opening the path would follow a link or block on a FIFO swapped
    in meanwhile); its size is checked from the header first, with ingest's pixel limit (PIL's own
    only warns below twice that: a 734 KB PNG decoded to 3.5 GB). Only the formats ingest reads are
    opened (Pillow would otherwise pick any plugin by content: GIF, or EPS through Ghostscript), and
    16-bit and float scans are scaled to 8 bits as ingest does (converting would clip the ink away)."""
    path = scan.path
    data = checked_scan_bytes(scan)
    size = None
    try:
        with Image.open(io.BytesIO(data), formats=_OPENERS) as image:
            width, height = size = image.size
            if width * height > DEFAULT_MAX_PIXELS:
                raise BadInput(
                    f"scan {path}: {width}x{height} = {width * height} pixels exceeds the limit of "
                    f"{DEFAULT_MAX_PIXELS} (possible decompression bomb); shrink the scan first"
                )
            upright = ImageOps.exif_transpose(image)  # a loaded copy
            return (
                to_rgb(upright, f"scan {quoted(shortened(str(path)))}") if upright.mode in HIGH_DEPTH_MODES else upright
            )
    except MemoryError:
        raise DecodingOutOfMemory(f"scan {path}", size) from None
    except UnidentifiedImageError:  # its message names the in-memory copy, not the file
        raise BadInput(
            f"cannot read scan {quoted(shortened(str(path)))}: not a {_FORMATS_READ} image (the formats ingest reads)"
        ) from None
    except (OSError, Image.DecompressionBombError) as err:
        raise BadInput(f"cannot read scan {quoted(shortened(str(path)))}: {err}") from err


def _write_set(
    out_dir: Path,
    sources: Iterable[tuple[str, str, dict, Image.Image]],
    profiles: tuple[DeviceProfile, ...],
    seed: int,
    progress: Progress | None,
) -> Path:
    """Write every capture of each (name, receipt id, metadata, image), then the manifest (last, so
    a failed run leaves none): :data:`MANIFEST_COLUMNS`, then any other metadata in first-seen order."""
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    rows, columns = [], list(MANIFEST_COLUMNS)
    for name, receipt_id, metadata, image in sources:
        columns += [key for key in metadata if key not in columns]
        for device in profiles:
            relative = f"images/{name}_{device.name}.jpg"
            data = capture_jpeg(image, device, capture_seed(seed, name, device.name))
            _write_naming_the_file(out_dir / relative, lambda path, data=data: path.write_bytes(data))
            rows.append({"path": relative, "receipt_id": receipt_id, "device": device.name, **metadata})
            if progress is not None:
                progress(1)
    manifest = out_dir / "manifest.csv"

    def write_manifest(path: Path) -> None:
        with path.open("w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns, restval="", lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)

    _write_naming_the_file(manifest, write_manifest)
    return manifest


def _write_naming_the_file(path: Path, write) -> None:
    """``write(path)``; a full disk names ``path`` (a failed write() carries no file name, so the
    error would name only the dir being filled)."""
    try:
        write(path)
    except OSError as exc:
        if is_disk_full(exc):
            raise DiskFull(path, free_bytes(path.parent)) from None
        raise
