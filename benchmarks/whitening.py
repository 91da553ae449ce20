"""Held-out figures of trained checkpoints with and without learned whitening (model.whiten).

    python benchmarks/whitening.py QUALITY_OUT RUN_DIR [RUN_DIR ...] [--shrink 0.1 ...] [--json FILE]

QUALITY_OUT is a ``benchmarks/quality.py --out`` dir (its ``dataset`` holds the split); each RUN_DIR
a run trained on it (``QUALITY_OUT/run-NAME-seedS``). For each run's ``best.pt`` the whitening is
taken off, the backbone features of the training captures are embedded, the whitening is fitted
with ``receipt_embed.models.whitening.fit_whitening`` (what `train` does at the end of a run), and
the held-out captures are scored with quality.py's figures, raw beside whitened. So the two rows
come from one checkpoint and differ only by the whitening.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--shrink", type=float, nargs="+", default=[SHRINK])
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
        rows = {"none": score(quality.embed_both(loaded, held.paths)["backbone"])}
        train_features = quality.embed_both(loaded, train.paths)["backbone"]
        for shrink in args.shrink:
            mean, projection = fit_whitening(train_features, train.labels, model.whitening.out_dim, shrink)
            model.whitening.set(mean, projection)
            rows[f"shrink {shrink:g}"] = score(quality.embed_both(loaded, held.paths)["backbone"])
            model.whitening.reset()
        for name, figures in rows.items():
            print(f"| {Path(run).name} | {name} | " + " | ".join(f"{figures[k]:.3f}" for k in KEYS) + " |", flush=True)
            results.append({"run": str(run), "whitening": name, **figures})
    if args.json:
        Path(args.json).write_text("".join(json.dumps(r) + "\n" for r in results))


if __name__ == "__main__":
    main()
