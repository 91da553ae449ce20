"""Find the paper in a capture and crop to it, so every capture of a receipt is framed alike.

A phone photo shows the receipt small on a table, a scan shows it filling the page, a
screenshot shows a photo of it inside a dark screen. The embedding pools a coarse grid of
the frame, so where the page sits in the frame changes every feature; cropping to the page
first takes that difference away before the model sees the capture (in training and when
indexing or searching alike: it is part of decoding, set by ``data.page_crop``).

The paper is the brightest large region: Otsu's threshold on a blurred small greyscale copy,
the largest bright connected region, its bounding box. A second round inside that box finds
a page inside a photo inside a screenshot. Where no region stands out (a scan that is all
page, a page darker than its background), the capture is kept whole.
"""

from __future__ import annotations

import numpy as np

SEARCH_SIDE = 160  # the long side of the small copy the page is looked for in
MIN_AREA = 0.15  # a bright region smaller than this share of the frame is not the page
WHOLE = 0.96  # a region spanning this share of both sides is the frame itself
MARGIN = 0.02  # kept around the page's box, a share of its sides
ROUNDS = 2


def page_box(rgb: np.ndarray) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) of the page in ``rgb`` (H x W x 3 uint8), bottom and right
    exclusive; the whole frame when no page stands out."""
    import cv2

    height, width = rgb.shape[:2]
    scale = min(1.0, SEARCH_SIDE / max(height, width))
    small = cv2.resize(
        cv2.cvtColor(np.ascontiguousarray(rgb), cv2.COLOR_RGB2GRAY),
        (max(1, round(width * scale)), max(1, round(height * scale))),
        interpolation=cv2.INTER_AREA,
    )
    small = cv2.GaussianBlur(small, (5, 5), 0)
    top, bottom, left, right = 0, small.shape[0], 0, small.shape[1]
    for _ in range(ROUNDS):
        region = small[top:bottom, left:right]
        if region.size < 64 or int(region.max()) - int(region.min()) < 16:  # too small or flat to tell
            break
        _, mask = cv2.threshold(region, 0, 255, cv2.THRESH_BINARY + cv2.THRESH_OTSU)
        mask = cv2.morphologyEx(mask, cv2.MORPH_CLOSE, np.ones((5, 5), np.uint8))  # bridge the print
        count, _, stats, _ = cv2.connectedComponentsWithStats(mask, connectivity=4)
        if count < 2:
            break
        best = 1 + int(np.argmax(stats[1:, cv2.CC_STAT_AREA]))
        x, y, w, h, area = (int(v) for v in stats[best])
        rows, cols = region.shape
        if area < MIN_AREA * rows * cols or (w > WHOLE * cols and h > WHOLE * rows):
            break
        top, bottom, left, right = top + y, top + y + h, left + x, left + x + w
    if scale == 1.0:
        return top, bottom, left, right
    return (
        int(np.floor(top / scale)),
        min(height, int(np.ceil(bottom / scale))),
        int(np.floor(left / scale)),
        min(width, int(np.ceil(right / scale))),
    )


def with_margin(box: tuple[int, int, int, int], height: int, width: int) -> tuple[int, int, int, int]:
    """``box`` widened by MARGIN on each side, within the frame."""
    top, bottom, left, right = box
    dy, dx = round(MARGIN * (bottom - top)), round(MARGIN * (right - left))
    return max(0, top - dy), min(height, bottom + dy), max(0, left - dx), min(width, right + dx)


def crop_to_page(rgb: np.ndarray) -> np.ndarray:
    """``rgb`` cut to its page's box and a small margin (a view, not a copy)."""
    top, bottom, left, right = with_margin(page_box(rgb), *rgb.shape[:2])
    return rgb[top:bottom, left:right]
