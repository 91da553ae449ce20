"""How well ``data.page_crop`` finds the paper, per capture style, against the true page box.

Captures real receipt scans with every simulated device (``capture_with_page_box`` returns
where the paper landed in the frame), runs the page detector on the decoded JPEG and scores
the box it finds against the true one:

    python benchmarks/page_crop.py [--scans ../shared/datasets/sroie] [--skip 40] [--count 100] [--json F]

Per device: the IoU of the found box with the true box (median, 5th percentile, share at
least 0.8) for the detector and for brightness alone (Otsu's threshold, the detector before
GrabCut), the IoU of the whole frame (what no crop gives), and milliseconds per capture.
The detector's thresholds were chosen on the first 40 scans: ``--skip 40`` leaves them out.
"""

from __future__ import annotations

import argparse
import io
import json
import time
from pathlib import Path

import numpy as np
from PIL import Image

from receipt_embed.page_crop import _otsu_box, page_box
from receipt_embed.samples import DEVICES, capture_with_page_box
from receipt_embed.samples.generate import capture_seed

DEFAULT_SCANS = Path(__file__).resolve().parents[1].parent / "shared" / "datasets" / "sroie"


def iou(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> float:
    """Intersection over union of two (top, bottom, left, right) boxes."""
    height = max(0, min(a[1], b[1]) - max(a[0], b[0]))
    width = max(0, min(a[3], b[3]) - max(a[2], b[2]))
    inter = height * width
    area = (a[1] - a[0]) * (a[3] - a[2]) + (b[1] - b[0]) * (b[3] - b[2]) - inter
    return inter / area if area else 0.0


def _summary(values: list[float]) -> dict:
    array = np.array(values)
    return {
        "iou_median": round(float(np.median(array)), 3),
        "iou_p5": round(float(np.percentile(array, 5)), 3),
        "share_iou_0_8": round(float(np.mean(array >= 0.8)), 3),
    }


def measure(scans: list[Path], devices=DEVICES) -> list[dict]:
    rows = []
    for device in devices:
        found, otsu, whole, seconds = [], [], [], 0.0
        for scan in scans:
            with Image.open(scan) as opened:
                image = opened.convert("RGB")
            data, truth = capture_with_page_box(image, device, capture_seed(0, scan.stem, device.name))
            with Image.open(io.BytesIO(data)) as decoded:
                rgb = np.asarray(decoded.convert("RGB"))
            started = time.perf_counter()
            box = page_box(rgb)
            seconds += time.perf_counter() - started
            found.append(iou(box, truth))
            otsu.append(iou(_otsu_box(rgb), truth))
            whole.append(iou((0, rgb.shape[0], 0, rgb.shape[1]), truth))
        rows.append(
            {
                "device": device.name,
                "captures": len(found),
                **_summary(found),
                "otsu": _summary(otsu),
                "whole_frame_iou_median": round(float(np.median(whole)), 3),
                "ms_per_capture": round(1000 * seconds / len(found), 2),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scans", type=Path, default=DEFAULT_SCANS, help="a folder with images/*.jpg")
    parser.add_argument("--skip", type=int, default=0, help="leave out the first N scans by name")
    parser.add_argument("--count", type=int, default=100, help="how many scans (by name, after --skip)")
    parser.add_argument("--json", type=Path, help="also write one JSON line per device here")
    args = parser.parse_args()
    scans = sorted((args.scans / "images").glob("*.jpg"))[args.skip : args.skip + args.count]
    if not scans:
        raise SystemExit(f"no scans in {args.scans / 'images'}")
    rows = measure(scans)
    print(
        "| device | IoU median | IoU p5 | share IoU >= 0.8 | Otsu alone: median / p5 / share | whole frame IoU | ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        otsu = row["otsu"]
        print(
            f"| {row['device']} | {row['iou_median']} | {row['iou_p5']} | {row['share_iou_0_8']} | "
            f"{otsu['iou_median']} / {otsu['iou_p5']} / {otsu['share_iou_0_8']} | "
            f"{row['whole_frame_iou_median']} | {row['ms_per_capture']} |"
        )
    mean = np.mean([row["share_iou_0_8"] for row in rows])
    mean_otsu = np.mean([row["otsu"]["share_iou_0_8"] for row in rows])
    print(f"mean share IoU >= 0.8 over {len(rows)} styles: {mean:.3f} (Otsu alone {mean_otsu:.3f}), {len(scans)} scans")
    if args.json:
        args.json.write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    main()
