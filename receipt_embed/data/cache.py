"""Decode each capture once, at a reduced size, and keep it in memory.

Augmenting from the cache is what lets data loading keep up with the model on a CPU:
decoding full-size JPEGs every epoch would cost more than the forward pass.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
from tqdm import tqdm

from receipt_embed.images import load_resized


def cache_size(image_size: tuple[int, int], margin: float = 1.25) -> tuple[int, int]:
    """Cached resolution: a margin above the model input so crops keep detail."""
    height, width = image_size
    return round(height * margin), round(width * margin)


class ImageCache:
    """RGB uint8 arrays of fixed size, one per capture path, decoded in parallel threads."""

    def __init__(self, paths: list[str], size: tuple[int, int], progress: bool = False, workers: int = 2):
        self.size = size
        with ThreadPoolExecutor(max_workers=workers) as pool:
            decoded = pool.map(lambda p: load_resized(p, size), paths)
            self.images = np.stack(
                list(tqdm(decoded, total=len(paths), desc="decoding", unit="img", disable=not progress))
            ) if paths else np.zeros((0, *size, 3), np.uint8)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.images[index]
