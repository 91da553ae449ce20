"""How the verified score fuses the verifiers: a plain mean against a mean with the fields veto.

    python benchmarks/fusion.py INDEX_DIR [INDEX_DIR ...] [--shortlist 10] [--json FILE]

On a labelled index dir built with ``index --verify geometric --verify fields``, every capture is a
query against the others (leave-one-out, as ``calibrate`` does). Each pair of its embedding shortlist
is scored once by every stored verifier; then two fusions are read from the same scores:

- ``mean``: the mean of the verifiers that had evidence (no veto);
- ``veto``: the same, but 0 where the fields verifier found a differing printed field (the default).

Per fusion: recall@1 of the re-ranked shortlist, the calibrated point at precision 0.99 (threshold,
recall), and at loose thresholds the share of shortlisted pairs at or above it that are the same
receipt (the precision of ``search --all-pairs --verify --threshold T`` on those pairs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from receipt_embed.indexing import load_index_dir  # noqa: E402
from receipt_embed.indexing.calibration import best_verified, choose, kind_checks, pr_curve  # noqa: E402
from receipt_embed.indexing.verification import fused, shortlist_scores  # noqa: E402
from receipt_embed.plugin_manager import get_registry  # noqa: E402

THRESHOLDS = (0.2, 0.3, 0.4, 0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("index_dirs", nargs="+")
    parser.add_argument("--shortlist", type=int, default=10)
    parser.add_argument("--target-precision", type=float, default=0.99)
    parser.add_argument("--json")
    args = parser.parse_args()
    registry = get_registry()
    print(
        "| index | fusion | R@1 | calibrated threshold | recall | "
        + " | ".join(f"pairs >= {t}" for t in THRESHOLDS)
        + " |"
    )
    print("|---|---|---|---|---|" + "---|" * len(THRESHOLDS))
    for path in args.index_dirs:
        index = load_index_dir(path)
        checks = kind_checks(index, registry).get("verified", {})
        if "fields" not in checks:
            sys.exit(f"{path}: build it with `index --verify geometric --verify fields` first")
        rows, per = shortlist_scores(index, checks, args.shortlist, registry)
        labels = np.unique(np.array([item["receipt_id"] for item in index.items]), return_inverse=True)[1]
        positives = int(np.sum(np.bincount(labels)[labels] >= 2))
        same = (rows >= 0) & (labels[np.maximum(rows, 0)] == labels[:, None])
        no_veto = {
            name: (scores, abstained, np.zeros_like(vetoes)) for name, (scores, abstained, vetoes) in per.items()
        }
        for fusion, figures in (("mean", no_veto), ("veto", per)):
            verified = fused(rows, figures, list(checks))
            scores, best = best_verified(rows, verified)
            right = labels[best] == labels
            chosen = choose(pr_curve(scores, right, positives), args.target_precision) or {}
            above = {t: verified >= t for t in THRESHOLDS}
            result = {
                "index_dir": path,
                "fusion": fusion,
                "recall_at_1": float(np.mean(right)),
                "threshold": chosen.get("threshold"),
                "recall": chosen.get("recall"),
                "pairs": {
                    str(t): [int(mask.sum()), float((mask & same).sum() / max(1, mask.sum()))]
                    for t, mask in above.items()
                },
            }
            cells = " | ".join(f"{n} ({p:.1%} same)" for n, p in result["pairs"].values())
            print(
                f"| {path} | {fusion} | {result['recall_at_1']:.3f} | {result['threshold']} | "
                f"{(result['recall'] or 0):.3f} | {cells} |",
                flush=True,
            )
            if args.json:
                with open(args.json, "a", encoding="utf-8") as handle:
                    handle.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
