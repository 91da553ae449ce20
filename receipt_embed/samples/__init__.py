"""Deterministic synthetic receipts and simulated capture devices.

The bundled ``data_samples/`` set comes from here: shop templates shared by many receipts
(:mod:`.shops`), per-receipt content (:mod:`.receipts`), rendering to a flat scan
(:mod:`.render`), device profiles (:mod:`.devices`) with their surfaces
(:mod:`.backgrounds`), the capture simulation that works on any scan (:mod:`.capture`),
existing scans with their metadata (:mod:`.scans`), and writing a set with its manifest
(:mod:`.generate`). Same seed and arguments, same
bytes.
"""

from receipt_embed.samples.capture import capture_jpeg, capture_with_page_box, simulate_capture
from receipt_embed.samples.devices import DEVICES, DeviceProfile, select_devices
from receipt_embed.samples.generate import (
    MANIFEST_COLUMNS,
    RENDERED_COLUMNS,
    capture_scans,
    capture_seed,
    find_scans,
    make_samples,
)
from receipt_embed.samples.receipts import LineItem, Receipt, make_receipt
from receipt_embed.samples.render import PRINTED_FIELDS, printed_fields, render_receipt
from receipt_embed.samples.scans import SCAN_SUFFIXES, Scan, read_scans
from receipt_embed.samples.shops import SHOPS, ShopTemplate

__all__ = [
    "DEVICES",
    "MANIFEST_COLUMNS",
    "PRINTED_FIELDS",
    "RENDERED_COLUMNS",
    "SCAN_SUFFIXES",
    "SHOPS",
    "DeviceProfile",
    "LineItem",
    "Receipt",
    "Scan",
    "ShopTemplate",
    "capture_jpeg",
    "capture_with_page_box",
    "capture_scans",
    "capture_seed",
    "find_scans",
    "make_receipt",
    "make_samples",
    "printed_fields",
    "read_scans",
    "render_receipt",
    "select_devices",
    "simulate_capture",
]
