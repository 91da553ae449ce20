"""Held-out retrieval of receipt captures: baselines, peers and training recipes in one table.

    python benchmarks/quality.py SAMPLES_DIR --out DIR [--heldout-share 0.4] [--leave-out-devices D,...]
        [--distractors SAMPLES_DIR2] [--seeds 0 1] [--recipe NAME [KEY=VALUE ...]] ... [--set KEY=VALUE ...]
        [--json FILE]

SAMPLES_DIR holds a manifest.csv (from `receipt-embed make-samples`, or real scans captured
with `make-samples --from-scans`). Receipts are split at random (the benchmark's own seed 0,
not a training seed) into held-out receipts (``--heldout-share``), 10% of the rest for val
and the rest for training; no receipt is in two splits. With ``--leave-out-devices``, no
training or val capture comes from those devices, while the held-out receipts keep every
capture: the figures of queries from those devices ("unseen devices") beside those of the
other devices show whether the embedding generalises to a capture style it never saw.

Every embedding is scored on all held-out captures (leave-one-out): recall@1/5/10, mAP,
cross-device recall@1 (gallery cut to other devices than the query's), device lift (kNN
agreement on device over chance; 1 = no device shortcut), the share of queries where a
same-merchant sibling outranks every true capture, the share of top-1 misses that are such
siblings, and with ``--distractors`` recall@1 with every capture of that other set added to
the gallery (never as a query). Rows: raw pixels (48 x 24 grayscale, standardised), a
perceptual hash (imagehash's pHash, when installed: see benchmarks/README.md), each recipe's
encoder untrained (or as loaded, "before training", when the recipe sets ``model.pretrained``:
the zero-shot figures of a starting model), then trained per seed (wall seconds and training
views/s).

A recipe is a name and config overrides (``--set`` ones apply to every recipe); ``defaults``
with none is what `receipt-embed train` does with no options. Each is embedded with the features `receipt-embed index` uses
(``--features``, backbone by default) and also with the other ones.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

from receipt_embed.config import cache_size, load_config
from receipt_embed.data.cache import ImageCache
from receipt_embed.data.dataset_dir import load_dataset_dir, select_split
from receipt_embed.data.views import clean_batches
from receipt_embed.embedding import LoadedModel, load_model
from receipt_embed.evaluation.breakdown import cross_device_recall_at_1, recall_at_1_of, sibling_figures
from receipt_embed.evaluation.retrieval import retrieval_metrics
from receipt_embed.evaluation.shortcuts import attribute_lift
from receipt_embed.fileio import read_jsonl
from receipt_embed.images import load_resized
from receipt_embed.ingest import ingest
from receipt_embed.models.build import build_model
from receipt_embed.plugin_manager import PluginLoader
from receipt_embed.training.trainer import train

FEATURES = ("backbone", "head")


def split_manifest(samples: Path, out: Path, heldout_share: float, leave_out: set[str]) -> dict:
    """OUT/manifest.csv: SAMPLES/manifest.csv with absolute paths and a ``split`` column;
    train and val rows of the left-out devices dropped."""
    with open(samples / "manifest.csv", newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    receipts = sorted({row["receipt_id"] for row in rows})
    random.Random(0).shuffle(receipts)
    held = set(receipts[: round(heldout_share * len(receipts))])
    rest = receipts[len(held) :]
    val = set(rest[: max(1, round(0.1 * len(rest)))])
    kept = []
    for row in rows:
        split = "heldout" if row["receipt_id"] in held else "val" if row["receipt_id"] in val else "train"
        if split != "heldout" and row["device"] in leave_out:
            continue
        kept.append({**row, "path": str((samples / row["path"]).resolve()), "split": split})
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "manifest.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(kept[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(kept)
    return {"receipts": len(receipts), "heldout_receipts": len(held), "val_receipts": len(val)}


def distractor_paths(samples: Path | None) -> list[str]:
    if samples is None:
        return []
    with open(samples / "manifest.csv", newline="", encoding="utf-8") as handle:
        return [str((samples / row["path"]).resolve()) for row in csv.DictReader(handle)]


def raw_pixels(paths: list[str]) -> np.ndarray:
    import cv2

    rows = []
    for path in paths:
        gray = cv2.cvtColor(load_resized(path, (48, 24)), cv2.COLOR_RGB2GRAY).astype(np.float32).ravel()
        rows.append((gray - gray.mean()) / (gray.std() + 1e-3))
    return np.stack(rows)


def perceptual_hashes(paths: list[str]) -> np.ndarray | None:
    """pHash bits as +-1 vectors (inner product ranks exactly as Hamming distance does), or None
    when imagehash is not installed in the running environment."""
    try:
        import imagehash
        from PIL import Image
    except ImportError:
        return None
    rows = []
    for path in paths:
        with Image.open(path) as image:
            rows.append(imagehash.phash(image).hash.ravel())
    return np.where(np.stack(rows), 1.0, -1.0).astype(np.float32)


class Scorer:
    """The figures of one embedding of the held-out captures (plus distractors)."""

    def __init__(self, held, devices: list[str], merchants: list[str], unseen: set[str], distractors: int):
        self.labels = np.asarray(held.labels)
        self.devices, self.merchants = devices, merchants
        self.unseen = np.array([device in unseen for device in devices])
        self.distractors = distractors

    def __call__(self, x: np.ndarray) -> dict:
        gallery, extra = x[: len(self.labels)], x[len(self.labels) :]
        retrieval = retrieval_metrics(gallery, self.labels, ks=(1, 5, 10))
        figures = {k: retrieval[k] for k in ("recall_at_1", "recall_at_5", "recall_at_10", "map")}
        figures["cross_device_recall_at_1"] = cross_device_recall_at_1(gallery, self.labels, self.devices)
        figures["device_lift"] = attribute_lift(gallery, self.labels, self.devices)["lift"]
        siblings = sibling_figures(gallery, self.labels, self.merchants)
        figures["sibling_above_true"] = siblings["sibling_above_true"]
        figures["sibling_share_of_misses"] = siblings["sibling_share_of_misses"]
        if self.unseen.any():
            figures["recall_at_1_seen_devices"] = recall_at_1_of(gallery, self.labels, ~self.unseen)
            figures["recall_at_1_unseen_devices"] = recall_at_1_of(gallery, self.labels, self.unseen)
        if len(extra):
            padded = np.concatenate([self.labels, self.labels.max() + 1 + np.arange(len(extra))])
            figures["recall_at_1_with_distractors"] = recall_at_1_of(x, padded, np.arange(len(x)) < len(gallery))
        return figures


def _registry(plugins_dir: str | None):
    loader = PluginLoader(strict=True)
    loader.load_builtins()
    if plugins_dir:
        loader.load_folder(Path(plugins_dir), required=True)
    loader.collect_components()
    return loader.registry


def _train_recipe(name: str, overrides: list[str], seed: int, out: Path, registry) -> tuple[LoadedModel, dict]:
    config = load_config(overrides=[*overrides, f"train.seed={seed}"])
    run = out / f"run-{name}-seed{seed}"
    started = time.perf_counter()
    train(config, out / "dataset", run, registry, progress=False, log=lambda message: None, force=True)
    seconds = time.perf_counter() - started
    epochs = list(read_jsonl(run / "metrics.jsonl"))
    views = sum(e["views_per_s"] * e["train_seconds"] for e in epochs)
    spent = sum(e["train_seconds"] for e in epochs)
    facts = {"train_seconds": round(seconds, 1), "views_per_s": round(views / spent, 1) if spent else None}
    facts["epochs"] = len(epochs)
    return load_model(run / "checkpoints" / "best.pt", registry), facts


_DECODED: dict = {}


def _decoded(paths: list[str], config) -> np.ndarray:
    """The captures decoded (and page-cropped) once per data setting: every recipe with the same
    ``data`` section embeds the same pixels, as ``embed_paths`` would decode them."""
    size = cache_size(tuple(config.data.image_size), config.train.cache_margin)
    key = (size, config.data.page_crop, len(paths))
    if key not in _DECODED:
        _DECODED[key] = ImageCache(paths, size, crop_page=config.data.page_crop).images
    return _DECODED[key]


@torch.no_grad()
def embed_both(loaded: LoadedModel, paths: list[str]) -> dict[str, np.ndarray]:
    """Backbone and head embeddings of ``paths`` in one pass, from pixels decoded once."""
    config, out = loaded.config, {features: [] for features in FEATURES}
    loaded.model.eval()
    for images in clean_batches(_decoded(paths, config), tuple(config.data.image_size), config.data.grayscale, 128):
        backbone, head = loaded.model(images)
        out["backbone"].append(backbone.float().numpy())
        out["head"].append(head.float().numpy())
    return {features: np.concatenate(parts) for features, parts in out.items()}


def _untrained(overrides: list[str], registry) -> LoadedModel:
    config = load_config(overrides=overrides)
    torch.manual_seed(config.train.seed)
    return LoadedModel(build_model(config, registry).eval(), config, Path("-"))


def run(args) -> list[dict]:
    out = Path(args.out)
    leave_out = set(filter(None, args.leave_out_devices.split(",")))
    split = split_manifest(Path(args.samples), out, args.heldout_share, leave_out)
    ingest(out / "manifest.csv", out / "dataset", load_config(overrides=["ingest.allow_absolute_paths=true"]).ingest)
    held = select_split(load_dataset_dir(out / "dataset"), "heldout")
    devices = [row["device"] for row in held.rows]
    merchants = [row.get("merchant", "") for row in held.rows]
    extra = distractor_paths(Path(args.distractors) if args.distractors else None)
    score = Scorer(held, devices, merchants, leave_out, len(extra))
    paths = held.paths + extra
    base = {"samples": args.samples, **split, "heldout_captures": len(held), "distractors": len(extra)}
    base["leave_out_devices"] = sorted(leave_out)
    results = []

    def record(row: dict, x: np.ndarray) -> None:
        results.append({**base, **row, **score(x)})
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)

    record({"embedding": "raw pixels"}, raw_pixels(paths))
    hashes = perceptual_hashes(paths)
    if hashes is not None:
        record({"embedding": "pHash (imagehash)"}, hashes)
    registry = _registry(args.plugins_dir)
    recipes = args.recipe or [["defaults"]]
    for name, *own in recipes:
        overrides = [*args.common, *own]
        untrained = _untrained(overrides, registry)
        start = "before training" if untrained.config.model.pretrained not in (None, "", "none") else "untrained"
        embedded = embed_both(untrained, paths)
        for features in FEATURES:
            record({"embedding": f"{name} {start}", "features": features}, embedded[features])
        for seed in args.seeds:
            model, facts = _train_recipe(name, overrides, seed, out, registry)
            embedded = embed_both(model, paths)
            for features in FEATURES:
                row = {"embedding": name, "overrides": overrides, "seed": seed, "features": features, **facts}
                record(row, embedded[features])
    return results


def table(results: list[dict]) -> str:
    """The results as a Markdown table, one row per embedding (and seed, features)."""
    columns = [
        ("recall_at_1", "R@1"), ("recall_at_5", "R@5"), ("recall_at_10", "R@10"), ("map", "mAP"),
        ("cross_device_recall_at_1", "cross-device R@1"), ("device_lift", "device lift"),
        ("sibling_above_true", "sibling above true"), ("sibling_share_of_misses", "siblings / misses"),
        ("recall_at_1_seen_devices", "R@1 seen devices"), ("recall_at_1_unseen_devices", "R@1 unseen devices"),
        ("recall_at_1_with_distractors", "R@1 + distractors"), ("train_seconds", "train s"),
        ("views_per_s", "views/s"),
    ]  # fmt: skip
    present = [(key, title) for key, title in columns if any(key in row for row in results)]
    lines = ["| embedding | seed | features | " + " | ".join(title for _, title in present) + " |"]
    lines.append("|" + "---|" * (3 + len(present)))
    for row in results:
        cells = [row["embedding"], str(row.get("seed", "")), row.get("features", "")]
        for key, _ in present:
            value = row.get(key)
            cells.append("" if value is None else f"{value:.3f}" if isinstance(value, float) and key not in (
                "train_seconds", "views_per_s") else str(value))  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("samples")
    parser.add_argument("--out", required=True)
    parser.add_argument("--heldout-share", type=float, default=0.4)
    parser.add_argument("--leave-out-devices", default="", help="comma-separated device names no training capture uses")
    parser.add_argument("--distractors", default=None, help="a samples dir whose captures pad the gallery")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--recipe", nargs="+", action="append", metavar=("NAME", "KEY=VALUE"))
    parser.add_argument("--set", dest="common", action="append", default=[], help="an override for every recipe")
    parser.add_argument("--plugins-dir", default=None, help="also load this plugins folder (e.g. plugins/)")
    parser.add_argument("--json", default=None, help="append one JSON line per row to this file")
    args = parser.parse_args()
    results = run(args)
    if args.json:
        with open(args.json, "a", encoding="utf-8") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in results)
    print(table(results))


if __name__ == "__main__":
    main()
