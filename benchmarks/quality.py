"""Held-out retrieval and device lift of a trained encoder against two baselines, one run.

    python benchmarks/quality.py SAMPLES_DIR --out DIR [--split-ratios 0.6,0.1,0.3] [--plugins-dir plugins] [--set key=value ...]

SAMPLES_DIR holds a manifest.csv (e.g. from `receipt-embed make-samples`, or real scans
captured with `make-samples --from-scans`). The set is ingested, then on the held-out
receipts three embeddings are compared:
- raw pixels: the capture at 48 x 24 grayscale, each image standardised (no model);
- untrained: the configured encoder with random weights;
- trained: the same encoder after `train` with the given settings (wall time reported).
For each: leave-one-out recall@1 / mAP and the device lift (kNN agreement of other-receipt
neighbours on `device`, divided by chance). Prints one JSON object and a table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import cv2
import numpy as np
import torch

from receipt_embed.config import load_config
from receipt_embed.data.dataset_dir import load_dataset_dir, select_split
from receipt_embed.embedding import LoadedModel, embed_paths, load_model
from receipt_embed.evaluation.retrieval import retrieval_metrics
from receipt_embed.evaluation.shortcuts import attribute_lift
from receipt_embed.images import load_resized
from receipt_embed.ingest import ingest
from receipt_embed.models.build import build_model
from receipt_embed.plugin_manager import PluginLoader
from receipt_embed.training.trainer import train


def raw_pixels(paths: list[str]) -> np.ndarray:
    rows = []
    for path in paths:
        gray = cv2.cvtColor(load_resized(path, (48, 24)), cv2.COLOR_RGB2GRAY).astype(np.float32).ravel()
        rows.append((gray - gray.mean()) / (gray.std() + 1e-3))
    return np.stack(rows)


def figures(x: np.ndarray, labels, devices) -> dict:
    retrieval = retrieval_metrics(x, labels, ks=(1, 5))
    return {
        "recall_at_1": retrieval["recall_at_1"],
        "map": retrieval["map"],
        "device_lift": attribute_lift(x, labels, devices)["lift"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("samples")
    parser.add_argument("--out", required=True)
    parser.add_argument("--split-ratios", default="0.6,0.1,0.3")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument(
        "--plugins-dir",
        default=None,
        help="also load the plugins in this folder (e.g. plugins/ for --set sampler.name=same_merchant)",
    )
    args = parser.parse_args()
    out = Path(args.out)
    overrides = [f"ingest.split_ratios=[{args.split_ratios}]", *args.overrides]
    config = load_config(overrides=overrides)
    loader = PluginLoader(strict=True)
    loader.load_builtins()
    if args.plugins_dir:
        loader.load_folder(Path(args.plugins_dir), required=True)
    loader.collect_components()
    registry = loader.registry

    ingest(args.samples, out / "dataset", config.ingest)
    rows = load_dataset_dir(out / "dataset")
    held = select_split(rows, "heldout")
    devices = [row["device"] for row in held.rows]
    result = {
        "samples": args.samples,
        "heldout_receipts": len(held.identities),
        "heldout_captures": len(held),
        "train_receipts": len(select_split(rows, "train").identities),
        "overrides": args.overrides,
    }

    result["raw_pixels"] = figures(raw_pixels(held.paths), held.labels, devices)
    torch.manual_seed(config.train.seed)
    untrained = LoadedModel(build_model(config, registry).eval(), config, Path("-"))
    for features in ("backbone", "head"):
        result[f"untrained_{features}"] = figures(embed_paths(untrained, held.paths, features), held.labels, devices)

    started = time.perf_counter()
    train(config, out / "dataset", out / "run", registry, progress=False, log=lambda m: None)
    result["train_seconds"] = round(time.perf_counter() - started, 1)
    trained = load_model(out / "run" / "checkpoints" / "best.pt", registry)
    for features in ("backbone", "head"):
        result[f"trained_{features}"] = figures(embed_paths(trained, held.paths, features), held.labels, devices)

    print(json.dumps(result))
    print(f"{'embedding':<20} recall@1   mAP     device lift")
    for name in ("raw_pixels", "untrained_backbone", "untrained_head", "trained_backbone", "trained_head"):
        f = result[name]
        print(f"{name:<20} {f['recall_at_1']:.3f}      {f['map']:.3f}   {f['device_lift']:.2f}")


if __name__ == "__main__":
    main()
