"""Held-out figures of trained checkpoints with and without learned whitening (model.whiten).

    python benchmarks/whitening.py QUALITY_OUT RUN_DIR [RUN_DIR ...] [--shrink 0.1 ...] [--dims 160 ...]
        [--fit-receipts 50 ...] [--json FILE]

QUALITY_OUT is a ``benchmarks/quality.py --out`` dir (its ``dataset`` holds the split); each RUN_DIR
a run trained on it (``QUALITY_OUT/run-NAME-seedS``). For each run's ``best.pt`` the whitening is
taken off, the backbone features of the training captures are embedded, the whitening is fitted
with ``receipt_embed.models.whitening.fit_whitening`` (what `train` does at the end of a run), and
the held-out captures are scored with quality.py's figures, raw beside whitened. So the two rows
come from one checkpoint and differ only by the whitening. ``--dims`` also scores the first D axes
only (the fit orders them by spread); ``--fit-receipts`` fits on that many training receipts only
(drawn with seed 0), to see how the fit fares on a smaller set.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import quality  # noqa: E402

from receipt_embed.data.dataset_dir import load_dataset_dir, select_split  # noqa: E402
from receipt_embed.embedding import load_model  # noqa: E402
from receipt_embed.models.whitening import SHRINK, Whitening, fit_whitening  # noqa: E402

KEYS = (
    "recall_at_1",
    "map",
    "cross_device_recall_at_1",
    "device_lift",
    "sibling_above_true",
    "recall_at_1_seen_devices",
    "recall_at_1_unseen_devices",
)


def _whitened(features: np.ndarray, mean: np.ndarray, projection: np.ndarray) -> np.ndarray:
    """What ``Whitening.forward`` computes, in float64 (any number of axes)."""
    x = features.astype(np.float64)
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    y = (x - mean) @ projection
    return y / np.linalg.norm(y, axis=1, keepdims=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--shrink", type=float, nargs="+", default=[SHRINK])
    parser.add_argument("--dims", type=int, nargs="+", default=[], help="also score the first D axes")
    parser.add_argument("--fit-receipts", type=int, nargs="+", default=[], help="also fit on N training receipts")
    parser.add_argument("--json")
    args = parser.parse_args()
    out = Path(args.out)
    dataset = load_dataset_dir(out / "dataset")
    held, train = select_split(dataset, "heldout"), select_split(dataset, "train")
    unseen = {row["device"] for row in held.rows} - {row["device"] for row in train.rows}
    score = quality.Scorer(
        held, [r["device"] for r in held.rows], [r.get("merchant", "") for r in held.rows], unseen, 0
    )
    registry = quality._registry(None)
    print("| run | whitening | " + " | ".join(KEYS) + " |")
    print("|---|---|" + "---|" * len(KEYS))
    results = []
    for run in args.runs:
        loaded = load_model(Path(run) / "checkpoints" / "best.pt", registry)
        model = loaded.model
        if model.whitening is None:  # trained before model.whiten: add the (identity) module to fit
            model.whitening = Whitening(model.encoder.feature_dim)
        model.whitening.reset()
        held_raw = quality.embed_both(loaded, held.paths)["backbone"]
        rows = {"none": score(held_raw)}
        train_features = quality.embed_both(loaded, train.paths)["backbone"]
        labels = np.asarray(train.labels)
        fits = [(f"shrink {shrink:g}", np.ones(len(labels), bool), shrink) for shrink in args.shrink]
        rng = np.random.default_rng(0)
        for n in args.fit_receipts:
            chosen = rng.choice(np.unique(labels), size=min(n, len(np.unique(labels))), replace=False)
            fits.append((f"{n} receipts", np.isin(labels, chosen), SHRINK))
        for name, rows_used, shrink in fits:
            mean, projection = fit_whitening(
                train_features[rows_used], labels[rows_used], model.whitening.out_dim, shrink
            )
            for dims in [None, *args.dims]:
                label = name if dims is None else f"{name}, {dims} dims"
                rows[label] = score(_whitened(held_raw, mean, projection[:, :dims]))
        for name, figures in rows.items():
            print(f"| {Path(run).name} | {name} | " + " | ".join(f"{figures[k]:.3f}" for k in KEYS) + " |", flush=True)
            results.append({"run": str(run), "whitening": name, **figures})
    if args.json:
        Path(args.json).write_text("".join(json.dumps(r) + "\n" for r in results))


if __name__ == "__main__":
    main()
