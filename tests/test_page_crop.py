"""Cutting a capture to its page (`data.page_crop`): the box found, and decoding with it."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from receipt_embed.data.cache import ImageCache
from receipt_embed.images import resize_bytes
from receipt_embed.page_crop import _otsu_box, crop_to_page, page_box


def _page(height: int, width: int) -> np.ndarray:
    """A bright receipt page with rows of dark print."""
    page = np.full((height, width, 3), 238, np.uint8)
    for row in range(8, height - 8, 9):
        page[row : row + 3, 6 : width - 6 - (row % 5) * 4] = 30
    return page


def _on(background: int, frame: tuple[int, int], page: np.ndarray, at: tuple[int, int]) -> np.ndarray:
    image = np.full((*frame, 3), background, np.uint8)
    image[at[0] : at[0] + page.shape[0], at[1] : at[1] + page.shape[1]] = page
    return image


def _close(box, expected, tolerance: int) -> bool:
    return all(abs(a - b) <= tolerance for a, b in zip(box, expected))


def test_the_page_is_found_on_a_table_inside_a_screenshot_and_not_in_a_full_scan():
    """A page on a darker table is boxed; a screenshot (dark screen around a photo of the page on
    a mid-grey table) is boxed to the page in two rounds; a frame that is all page, or flat, stays whole."""
    photo = _on(90, (400, 200), _page(240, 110), (70, 40))
    assert _close(page_box(photo), (70, 310, 40, 150), 3)
    table = _on(140, (260, 130), _page(200, 90), (30, 20))
    screenshot = _on(18, (480, 240), table, (110, 55))
    assert _close(page_box(screenshot), (140, 340, 75, 165), 3)
    scan = _page(300, 150)
    assert page_box(scan) == (0, 300, 0, 150)
    flat = np.full((100, 50, 3), 200, np.uint8)
    assert page_box(flat) == (0, 100, 0, 50)
    assert crop_to_page(photo).shape[:2] == pytest.approx((250, 114), abs=6)  # the box and a 2% margin


def _shadowed(frame: np.ndarray, share: float, strength: float) -> np.ndarray:
    """``frame`` with a soft-edged shadow over its lower ``share`` (a hand or a phone)."""
    rows = np.arange(frame.shape[0], dtype=np.float32)
    edge = frame.shape[0] * (1 - share)
    darken = 1 - strength / (1 + np.exp(-(rows - edge) / 3))
    return np.clip(frame * darken[:, None, None], 0, 255).astype(np.uint8)


def test_a_shadow_across_the_page_does_not_split_it():
    """A hard shadow over the lower 45% of a photo darkens paper and table alike: brightness
    alone (Otsu's threshold) boxes the lit part only; the page is found whole."""
    photo = _shadowed(_on(120, (400, 200), _page(300, 130), (50, 35)), 0.45, 0.55)
    assert _close(page_box(photo), (50, 350, 35, 165), 4)
    top, bottom, _, _ = _otsu_box(photo)
    assert bottom - top < 200, "brightness alone splits the page at the shadow"


def test_the_page_box_does_not_depend_on_what_ran_before():
    """GrabCut seeds its colour models from OpenCV's global random generator; the box must be
    the same for the same pixels in any order, or training and indexing would crop apart."""
    rng = np.random.default_rng(3)
    frames = [
        _shadowed(_on(int(rng.integers(60, 160)), (360, 180), _page(260, 120), (40, 30)), 0.4, 0.5)
        + rng.integers(0, 12, (360, 180, 3)).astype(np.uint8)
        for _ in range(6)
    ]
    forward = [page_box(frame) for frame in frames]
    backward = [page_box(frame) for frame in reversed(frames)][::-1]
    assert forward == backward


def test_decoding_with_page_crop_gives_the_page_alone_resized():
    """resize_bytes(crop_page=True) and the cache built with it: the page fills the frame, so two
    captures of one page framed differently decode alike; without it they do not."""
    page = _page(240, 120)
    near = _on(80, (300, 150), page, (30, 15))
    far = _on(110, (600, 300), page, (300, 160))  # small in a large frame, in a corner
    encoded = []
    for image in (near, far):
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="PNG")
        encoded.append(buffer.getvalue())
    cropped = [resize_bytes(data, (64, 32), crop_page=True).astype(float) for data in encoded]
    whole = [resize_bytes(data, (64, 32)).astype(float) for data in encoded]

    def layout(image):  # 8 x 4 cells: the box is found to about 1/160 of the frame, not to the print's pitch
        return image.mean(axis=2).reshape(8, 8, 4, 8).mean(axis=(1, 3))

    assert np.abs(layout(cropped[0]) - layout(cropped[1])).max() < 12
    assert np.abs(layout(whole[0]) - layout(whole[1])).max() > 40
    assert cropped[0].mean() > whole[0].mean() + 10  # the dark table is cut away
    assert resize_bytes(encoded[0], (64, 32)).shape == resize_bytes(encoded[0], (64, 32), crop_page=True).shape


def test_the_cache_crops_only_when_asked(tmp_path):
    path = tmp_path / "capture.png"
    Image.fromarray(_on(80, (300, 150), _page(240, 120), (30, 15))).save(path)
    plain = ImageCache([str(path)], (64, 32)).images[0]
    cropped = ImageCache([str(path)], (64, 32), crop_page=True).images[0]
    assert cropped.shape == plain.shape == (64, 32, 3)
    assert plain[3:6].mean() < 100 and cropped[3:6].mean() > 180  # the table above the page is gone
