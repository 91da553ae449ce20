"""The geometric verifier: a known homography is recovered from a warped capture, a receipt's
other captures outscore other receipts, and pages without features score 0 instead of failing."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image

from receipt_embed.errors import BadInput
from receipt_embed.verification.geometric import GeometricVerifier, match_pair

SAMPLES = Path(__file__).resolve().parents[1] / "data_samples" / "images"


def _capture(name: str) -> np.ndarray:
    return np.asarray(Image.open(SAMPLES / name).convert("RGB"))


def _corners(width: int, height: int) -> np.ndarray:
    return np.array([[0, 0], [width, 0], [width, height], [0, height]], np.float64).reshape(-1, 1, 2)


def test_a_known_homography_is_recovered_from_a_warped_capture():
    verifier = GeometricVerifier()
    page = _capture("r0000_phone_a.jpg")
    height, width = page.shape[:2]
    assert max(height, width) <= verifier.long_side  # extracted at its own size: pixels are the page's
    known = np.array([[0.9, 0.05, 20.0], [-0.04, 0.95, 30.0], [1e-5, 2e-5, 1.0]])
    warped = cv2.warpPerspective(page, known, (width, height), borderValue=(255, 255, 255))
    match = match_pair(verifier.extract(page), verifier.extract(warped))
    expected = cv2.perspectiveTransform(_corners(width, height), known)
    recovered = cv2.perspectiveTransform(_corners(width, height), match.homography)
    assert np.abs(recovered - expected).max() < 2.0  # every page corner within 2 pixels
    assert match.inliers > 0.8 * match.matches and match.inliers > 200
    assert match.coverage > 0.5  # inliers over most of the page, not one band


def test_features_are_taken_at_the_documented_long_side_and_mapped_back_by_the_homography():
    verifier = GeometricVerifier(long_side=240)
    page = _capture("r0000_phone_a.jpg")  # 471 x 288: halved to 240 on its long side
    data = verifier.extract(page)
    assert tuple(data["size"]) == (240, 147)
    assert data["points"].dtype == np.float32 and data["descriptors"].shape[1] == 32
    assert data["points"][:, 1].max() < 240 and data["points"][:, 0].max() < 147


def test_a_receipts_other_captures_outscore_other_receipts():
    verifier = GeometricVerifier()
    query = verifier.extract(_capture("r0000_phone_a.jpg"))
    same = [verifier.score(query, verifier.extract(_capture(f"r0000_{d}.jpg"))) for d in ("phone_b", "scanner")]
    others = [
        verifier.score(query, verifier.extract(_capture(f"r000{r}_{d}.jpg")))
        for r in (1, 2, 3)
        for d in ("phone_a", "phone_b", "scanner")
    ]
    assert min(s["score"] for s in same) > max(s["score"] for s in others)
    assert min(s["inliers"] for s in same) > 2 * max(s["inliers"] for s in others)
    again = verifier.score(query, verifier.extract(_capture("r0000_phone_b.jpg")))
    assert again == same[0]  # MAGSAC++ is seeded: the same pair scores the same


def test_a_blank_or_tiny_capture_scores_zero_instead_of_failing():
    verifier = GeometricVerifier()
    blank = verifier.extract(np.full((400, 200, 3), 255, np.uint8))
    assert blank["points"].shape == (0, 2) and blank["descriptors"].shape == (0, 32)
    page = verifier.extract(_capture("r0000_phone_a.jpg"))
    for pair in ((blank, page), (page, blank), (blank, blank)):
        assert verifier.score(*pair) == {"score": 0.0, "matches": 0, "inliers": 0}
    tiny = verifier.extract(np.zeros((3, 2), np.uint8))
    assert verifier.score(page, tiny)["score"] == 0.0


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"long_side": 10}, "long_side must be an int in \\[64, 8192\\], got 10"),
        ({"keypoints": 0}, "keypoints must be an int in \\[16, 100000\\], got 0"),
        ({"ratio": 0.0}, "ratio must be in \\(0, 1\\], got 0.0"),
        ({"reprojection_px": -1.0}, "reprojection_px must be in \\(0, 100\\], got -1.0"),
        ({"ratio": float("nan")}, "ratio must be in \\(0, 1\\], got nan"),
    ],
)
def test_bad_parameters_are_refused_by_name(params, message):
    with pytest.raises(BadInput, match=f"verifier geometric: {message}"):
        GeometricVerifier(**params)


def test_a_capture_that_is_not_a_uint8_image_is_refused():
    with pytest.raises(BadInput, match="a capture must be a uint8 H x W or H x W x 3 array"):
        GeometricVerifier().extract(np.zeros((10, 10), np.float32))
