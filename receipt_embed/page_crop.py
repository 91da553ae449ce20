"""Find the paper in a capture and crop to it, so every capture of a receipt is framed alike.

A phone photo shows the receipt small on a table, a scan shows it filling the page, a
screenshot shows a photo of it inside a dark screen. The embedding pools a coarse grid of
the frame, so where the page sits in the frame changes every feature; cropping to the page
first takes that difference away before the model sees the capture (in training and when
indexing or searching alike: it is part of decoding, set by ``data.page_crop``).

The page is the object in the middle of the frame: OpenCV's GrabCut, started from the frame
less a thin border as background, separates it by colour, which a shadow across the page or
light falling off towards one end does not split (a brightness threshold does). Its largest
region is taken when it is large, fills its box, and is on average no darker than the rest
(else the brightest large region by Otsu's threshold is used, as for a scan that is all
page). Inside a GrabCut box, a brighter region framed by darker surround on all four sides
is a page inside a photo inside a screenshot. ``benchmarks/page_crop.py`` scores it per
capture style against the true page box.
"""

from __future__ import annotations

import numpy as np

GRABCUT_SIDE = 128  # the long side of the small copy GrabCut runs on
GRABCUT_BORDER = 0.03  # the share of each side GrabCut starts from as background
GRABCUT_ITERATIONS = 2
MIN_FILL = 0.7  # the page (a tilted quadrilateral) fills at least this share of its box
SEARCH_SIDE = 160  # the long side of the small copy Otsu's threshold runs on
MIN_AREA = 0.15  # a region smaller than this share of the frame is not the page
WHOLE = 0.96  # a region spanning this share of both sides is the frame itself
RING = 0.02  # an inner page leaves at least this share of the shorter side free on each side
MARGIN = 0.02  # kept around the page's box, a share of its sides
ROUNDS = 2

Box = tuple[int, int, int, int]


def page_box(rgb: np.ndarray) -> Box:
    """(top, bottom, left, right) of the page in ``rgb`` (H x W x 3 uint8), bottom and right
    exclusive; the whole frame when no page stands out. Deterministic: the same pixels give
    the same box whatever ran before."""
    height, width = rgb.shape[:2]
    found = _grabcut_box(rgb)
    if found is None:
        return _otsu_box(rgb)
    top, bottom, left, right = found
    inner = _otsu_box(rgb[top:bottom, left:right], rounds=1, ring=RING)
    if inner == (0, bottom - top, 0, right - left):
        return found
    return top + inner[0], top + inner[1], left + inner[2], left + inner[3]


def _small(image: np.ndarray, side: int) -> tuple[np.ndarray, float]:
    import cv2

    height, width = image.shape[:2]
    scale = min(1.0, side / max(height, width))
    size = (max(1, round(width * scale)), max(1, round(height * scale)))
    return cv2.resize(np.ascontiguousarray(image), size, interpolation=cv2.INTER_AREA), scale


def _to_frame(box: Box, scale: float, height: int, width: int) -> Box:
    """A box found in a copy scaled by ``scale``, in the frame's pixels."""
    if scale == 1.0:
        return box
    top, bottom, left, right = box
    return (
        int(np.floor(top / scale)),
        min(height, int(np.ceil(bottom / scale))),
        int(np.floor(left / scale)),
        min(width, int(np.ceil(right / scale))),
    )


def _grabcut_box(rgb: np.ndarray) -> Box | None:
    """The page's box by GrabCut, or None where it finds no convincing page."""
    import cv2

    height, width = rgb.shape[:2]
    small, scale = _small(rgb, GRABCUT_SIDE)
    rows, cols = small.shape[:2]
    gray = cv2.cvtColor(small, cv2.COLOR_RGB2GRAY)
    if rows < 16 or cols < 8 or int(gray.max()) - int(gray.min()) < 16:  # too small or flat to tell
        return None
    border_x, border_y = max(1, round(GRABCUT_BORDER * cols)), max(1, round(GRABCUT_BORDER * rows))
    mask = np.zeros((rows, cols), np.uint8)
    models = np.zeros((1, 65), np.float64), np.zeros((1, 65), np.float64)
    cv2.setRNGSeed(0)  # GrabCut seeds its colour models from OpenCV's global generator
    try:
        cv2.grabCut(
            cv2.cvtColor(small, cv2.COLOR_RGB2BGR),
            mask,
            (border_x, border_y, cols - 2 * border_x, rows - 2 * border_y),
            *models,
            GRABCUT_ITERATIONS,
            cv2.GC_INIT_WITH_RECT,
        )
    except cv2.error:  # a frame it cannot model (too few distinct colours)
        return None
    page = ((mask == cv2.GC_FGD) | (mask == cv2.GC_PR_FGD)).astype(np.uint8)
    page = cv2.morphologyEx(page, cv2.MORPH_CLOSE, np.ones((3, 3), np.uint8))
    count, labels, stats, _ = cv2.connectedComponentsWithStats(page, connectivity=4)
    if count < 2:
        return None
    best = 1 + int(np.argmax(stats[1:, cv2.CC_STAT_AREA]))
    x, y, w, h, area = (int(v) for v in stats[best])
    region = labels == best
    if area < MIN_AREA * rows * cols or area < MIN_FILL * w * h or region.all():
        return None
    if gray[region].mean() < gray[~region].mean():  # a dark object on light paper, not the paper
        return None
    return _to_frame((y, y + h, x, x + w), scale, height, width)


def _otsu_box(rgb: np.ndarray, rounds: int = ROUNDS, ring: float = 0.0) -> Box:
    """The brightest large region by Otsu's threshold on a blurred small greyscale copy, in up
    to ``rounds`` rounds (each inside the last); with ``ring``, a region is taken only when it
    leaves that share of the shorter side free on every side. The whole frame when none."""
    import cv2

    height, width = rgb.shape[:2]
    gray = cv2.cvtColor(np.ascontiguousarray(rgb), cv2.COLOR_RGB2GRAY)
    small, scale = _small(gray, SEARCH_SIDE)
    small = cv2.GaussianBlur(small, (5, 5), 0)
    top, bottom, left, right = 0, small.shape[0], 0, small.shape[1]
    for _ in range(rounds):
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
        if ring and min(x, y, cols - x - w, rows - y - h) < ring * min(rows, cols):
            break
        top, bottom, left, right = top + y, top + y + h, left + x, left + x + w
    return _to_frame((top, bottom, left, right), scale, height, width)


def with_margin(box: tuple[int, int, int, int], height: int, width: int) -> tuple[int, int, int, int]:
    """``box`` widened by MARGIN on each side, within the frame."""
    top, bottom, left, right = box
    dy, dx = round(MARGIN * (bottom - top)), round(MARGIN * (right - left))
    return max(0, top - dy), min(height, bottom + dy), max(0, left - dx), min(width, right + dx)


def crop_to_page(rgb: np.ndarray) -> np.ndarray:
    """``rgb`` cut to its page's box and a small margin (a view, not a copy)."""
    top, bottom, left, right = with_margin(page_box(rgb), *rgb.shape[:2])
    return rgb[top:bottom, left:right]
