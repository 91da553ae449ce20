"""Verified search against embedding search, on a labelled index dir built with ``index --verify``.

    python benchmarks/verification.py INDEX_DIR [--shortlist 10] [--queries N] [--json FILE]

With the ``fields`` verifier in the index too (``index --verify geometric --verify fields``), its
score alone and the verified score search uses (the mean of coverage and fields, an abstaining
fields verifier left out as search leaves it out) are rows as well; the fields come from the
manifest's columns, so they are as good as the team's OCR output is. The same two rows for the
``ocr_fields`` verifier when the index stores it (the fields read from the pixels by OCR).

Every indexed capture is a query (leave-one-out) against the others: its embedding shortlist is
the exact ``--shortlist`` nearest other captures (from embeddings.npy), and each variant of the
geometric verifier's score re-ranks it, from the per-capture data the index stores (so a query's
own data is its stored row, as if it had been extracted at search time). Figures per variant:
recall@1 (the top of the re-ranked shortlist is another capture of the query's receipt),
"sibling above true" (a capture of another receipt of the same ``merchant`` outranks every true
capture in the shortlist), and the share of queries whose true capture is in the shortlist at
all (the ceiling of any re-ranking). Then the inlier counts of true, sibling and other pairs
(median, 99th percentile), and the cost: milliseconds per pair on this machine and the index's
recorded extraction time and bytes per capture.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from receipt_embed.indexing import load_index_dir  # noqa: E402
from receipt_embed.indexing.verification import verified_score  # noqa: E402
from receipt_embed.verification.geometric import match_pair  # noqa: E402

# score variants: from a pair's (inliers, coverage), higher = more likely the same receipt
VARIANTS = {
    "embedding": None,
    "inliers": lambda inliers, coverage: inliers,
    "coverage": lambda inliers, coverage: coverage,
    "inliers x coverage": lambda inliers, coverage: inliers * coverage,
    "coverage, ties by inliers": lambda inliers, coverage: coverage + 0.01 * inliers / (inliers + 40),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("index_dir")
    parser.add_argument("--shortlist", type=int, default=10)
    parser.add_argument("--queries", type=int, default=None, help="only the first N captures as queries")
    parser.add_argument("--json")
    args = parser.parse_args()

    index = load_index_dir(args.index_dir)
    record = index.meta["verifiers"]["geometric"]
    params = record["params"]
    data = index.verifiers["geometric"]
    receipts = np.array([item["receipt_id"] for item in index.items])
    merchants = np.array([item.get("merchant", "") for item in index.items])
    vectors = index.embeddings
    queries = range(len(receipts) if args.queries is None else min(args.queries, len(receipts)))
    ratio, reprojection = params.get("ratio", 0.8), params.get("reprojection_px", 4.0)

    # verifiers of printed fields the index stores: from manifest columns (fields), read by OCR (ocr_fields)
    field_checks = {}
    for kind in ("fields", "ocr_fields"):
        if kind in index.verifiers:
            from receipt_embed.plugin_manager import get_registry

            params = index.meta["verifiers"][kind]["params"]
            field_checks[kind] = (get_registry().create("verifier", kind, **params), index.verifiers[kind])
    names = [*VARIANTS]
    for kind in field_checks:
        names += [kind, f"verified: mean of coverage and {kind}"]
    hits = {name: 0 for name in names}
    sibling_above = {name: 0 for name in names}
    in_shortlist, pairs, pair_seconds = 0, 0, 0.0
    inliers_by = {"true": [], "sibling": [], "other": []}
    for query in queries:
        sims = vectors @ vectors[query]
        sims[query] = -np.inf
        shortlist = np.argsort(-sims, kind="stable")[: args.shortlist]
        true = receipts[shortlist] == receipts[query]
        sibling = ~true & (merchants[shortlist] == merchants[query]) & (merchants[query] != "")
        in_shortlist += bool(true.any())
        found = []
        for row in shortlist:
            started = time.perf_counter()
            match = match_pair(data.item(query), data.item(int(row)), ratio, reprojection)
            pair_seconds += time.perf_counter() - started
            pairs += 1
            found.append((match.inliers, match.coverage))
        for (inliers, _), is_true, is_sibling in zip(found, true, sibling):
            inliers_by["true" if is_true else "sibling" if is_sibling else "other"].append(inliers)
        agreement = {
            kind: [verifier.score(data.item(query), data.item(int(r))) for r in shortlist]
            for kind, (verifier, data) in field_checks.items()
        }
        for name in names:
            variant = VARIANTS.get(name)
            if name in field_checks:
                score = np.array([result["score"] for result in agreement[name]])
            elif name.startswith("verified"):
                kind = name.rsplit(" ", 1)[1]
                # as search --verify: the mean of the verifiers that have evidence (an abstaining one is left out)
                score = np.array(
                    [
                        verified_score([{"score": coverage}, result])
                        for (_, coverage), result in zip(found, agreement[kind])
                    ]
                )
            elif variant is None:
                score = sims[shortlist]
            else:
                score = np.array([variant(*pair) for pair in found], dtype=float)
            order = np.argsort(-score, kind="stable")  # ties keep the embedding's order
            hits[name] += bool(true[order[0]])
            if true.any() and sibling.any():
                best_true = score[true].max()
                sibling_above[name] += bool(score[sibling].max() > best_true)
    count = len(queries)
    results = [
        {
            "variant": name,
            "queries": count,
            "shortlist": args.shortlist,
            "recall_at_1": hits[name] / count,
            "sibling_above_true": sibling_above[name] / count,
            "true_in_shortlist": in_shortlist / count,
        }
        for name in names
    ]
    distribution = {
        kind: {
            "pairs": len(values),
            "median": float(np.median(values)) if values else None,
            "p99": float(np.percentile(values, 99)) if values else None,
        }
        for kind, values in inliers_by.items()
    }
    cost = {
        "ms_per_pair": 1000 * pair_seconds / max(1, pairs),
        "ms_per_query": 1000 * pair_seconds / max(1, count),
        "extract_ms_per_capture": 1000 * record["extract_seconds"] / index.count,
        "kib_per_capture": record["bytes_per_item"] / 1024,
        "params": params,
    }
    print(f"{count} queries, shortlist {args.shortlist}; true capture in the shortlist: {in_shortlist / count:.3f}")
    print("| score | R@1 | sibling above true |")
    print("|---|---|---|")
    for row in results:
        print(f"| {row['variant']} | {row['recall_at_1']:.3f} | {row['sibling_above_true']:.3f} |")
    print("inliers by pair kind:", json.dumps(distribution))
    print("cost:", json.dumps(cost))
    if args.json:
        with open(args.json, "a", encoding="utf-8") as handle:
            for row in results:
                handle.write(json.dumps({**row, "index_dir": args.index_dir}) + "\n")
            handle.write(json.dumps({"inliers": distribution, "cost": cost, "index_dir": args.index_dir}) + "\n")


if __name__ == "__main__":
    main()
