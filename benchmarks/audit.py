"""Wall time of `audit-shortcuts` on a large index (figures in chunks and through FAISS).

    python benchmarks/audit.py [--items 100000] [--dim 512] [--devices 4] [--alpha 0.5]

Builds an index dir of synthetic embeddings (3 captures per receipt; identity component +
alpha x device component + capture noise, so the truth is known), then times the whole
audit (load and verify the index dir, figures, plots, gallery, report). Items have no image
files, so the failure gallery shows placeholders (thumbnails are not what scales).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from receipt_embed.audit.run import run_audit
from receipt_embed.indexing import build_index
from receipt_embed.indexing.index_dir import write_index_dir


def synthetic(items: int, dim: int, devices: int, alpha: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    receipts = items // 3
    labels = np.repeat(np.arange(receipts), 3)
    device = rng.integers(devices, size=len(labels))
    device_dirs = rng.normal(size=(devices, dim)).astype(np.float32)
    x = np.empty((len(labels), dim), np.float32)
    for start in range(0, receipts, 10_000):  # identity directions made a block at a time
        block = np.arange(start, min(receipts, start + 10_000))
        identity = rng.normal(size=(len(block), dim)).astype(np.float32)
        rows = np.arange(3 * block[0], 3 * (block[-1] + 1))
        x[rows] = identity[labels[rows] - block[0]] + alpha * device_dirs[device[rows]]
    x += 0.6 * rng.normal(size=x.shape).astype(np.float32)
    meta = [
        {"path": f"missing/{i}.jpg", "receipt_id": f"r{l}", "device": f"d{d}"}
        for i, (l, d) in enumerate(zip(labels, device))
    ]
    return x, meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--alpha", type=float, default=0.5)
    args = parser.parse_args()
    x, items = synthetic(args.items, args.dim, args.devices, args.alpha)
    with tempfile.TemporaryDirectory() as tmp:
        built = build_index(x, "Flat")
        write_index_dir(
            Path(tmp) / "index",
            built,
            x / np.linalg.norm(x, axis=1, keepdims=True),
            items,
            {"kind": "embeddings", "embeddings": "synthetic", "embeddings_sha256": "-"},
            None,
        )
        started = time.perf_counter()
        figures = run_audit(Path(tmp) / "index", ["device"], Path(tmp) / "audit")
        full_s = time.perf_counter() - started
        html_mb = (Path(tmp) / "audit" / "audit.html").stat().st_size / 2**20
    device = figures["shortcuts"]["device"]
    print(
        json.dumps(
            {
                "items": len(items),
                "dim": args.dim,
                "alpha": args.alpha,
                "audit_s": round(full_s, 1),
                "html_mb": round(html_mb, 2),
                "recall_at_1": figures["retrieval"]["recall_at_1"],
                "lift": device["lift"],
                "probe_accuracy": device["probe_accuracy"],
                "flagged": device["flagged"],
            }
        )
    )


if __name__ == "__main__":
    main()
