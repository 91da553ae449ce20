"""Decode each capture once, at a reduced size, and keep it in memory.

Augmenting from the cache is what lets data loading keep up with the model on a CPU:
decoding full-size JPEGs every epoch would cost more than the forward pass.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
from tqdm import tqdm

from receipt_embed.errors import BadInput
from receipt_embed.images import DEFAULT_MAX_PIXELS, resize_bytes
from receipt_embed.userfiles import DEFAULT_MAX_BYTES, read_regular
from receipt_embed.workers import thread_pool


class CaptureChanged(BadInput):
    """A capture file differs from what ingest recorded in manifest.jsonl (replaced or edited)."""


# what to do about a capture that no longer matches its manifest.jsonl row
REINGEST = "re-run `receipt-embed ingest` (or restore the file)"


def load_capture(
    path: str,
    size: tuple[int, int],
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
    sha256: str | None = None,
    crop_page: bool = False,
) -> np.ndarray:
    """One capture, read once: its bytes are checked against the sha256 ingest recorded
    (when given; hashing bytes already in memory is cheap), then decoded to ``size`` (cut to
    its page first with ``crop_page``: ``data.page_crop``)."""
    data = read_regular(path, max_bytes)
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise CaptureChanged(
            f"{path} changed since ingest: its content (sha256) differs from manifest.jsonl; {REINGEST}"
        )
    return resize_bytes(data, size, max_pixels, name=str(path), crop_page=crop_page)


class ImageCache:
    """RGB uint8 arrays of fixed size, one per capture path, decoded in parallel threads.

    Only regular files of at most ``max_bytes`` are read and no image over ``max_pixels``
    is decoded; ``digests`` (sha256 per path, None to skip one) refuse files replaced since
    ingest; ``crop_page`` cuts each to its page first. The first bad file stops the cache with
    one error naming it."""

    def __init__(
        self,
        paths: list[str],
        size: tuple[int, int],
        progress: bool = False,
        workers: int = 2,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        max_bytes: int | None = DEFAULT_MAX_BYTES,
        digests: Sequence[str | None] | None = None,
        crop_page: bool = False,
    ):
        self.size = size
        digests = list(digests) if digests is not None else [None] * len(paths)
        if len(digests) != len(paths):
            raise BadInput(f"{len(digests)} digests for {len(paths)} paths")
        with thread_pool(workers) as pool:  # one bad file or a stop: do not decode the rest first
            decoded = pool.map(
                lambda job: load_capture(job[0], size, max_pixels, max_bytes, job[1], crop_page), zip(paths, digests)
            )
            self.images = (
                np.stack(list(tqdm(decoded, total=len(paths), desc="decoding", unit="img", disable=not progress)))
                if paths
                else np.zeros((0, *size, 3), np.uint8)
            )

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.images[index]
