"""Field accuracy of the ``ocr_fields`` verifier on simulated captures of real receipts.

    OMP_NUM_THREADS=1 python benchmarks/ocr_fields.py SAMPLES_DIR [--receipts 20] [--seed 0]
        [--long-side 1024] [--min-score 0.5] [--json FILE] [--dump FILE]

SAMPLES_DIR is a samples dir of real scans (``receipt-embed make-samples --from-scans DIR``): a
``manifest.csv`` with path, receipt_id, device and the scans' labels merchant, date and total.
``--receipts`` receipts are drawn (seeded), each with every device's capture. For each capture
the verifier's OCR reads the fields and each is compared with the manifest's after the fields
verifier's normalisation: right (equal), none (OCR found no value) or wrong (another value: worse
than none, since it tells the verifier "another receipt"); shares of the captures whose label
normalises (a month-first date in the labels cannot judge a day-first reading). Per device and overall, with seconds
per capture (one onnxruntime thread, OpenCV one thread). Then the pairs of captures of one
receipt: the share the verifier would score 0 (a field both read differs), 1 (all it reads on
both agree) or abstain on, for each field alone, the verifier's default fields (date, total) and
all three.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from receipt_embed.images import decode_image  # noqa: E402
from receipt_embed.verification.ocr import (  # noqa: E402
    DEFAULT_OCR_FIELDS,
    OcrFieldsVerifier,
    parse_fields,
    read_words,
    text_rows,
)

FIELDS = ("date", "total", "merchant")
MAX_PIXELS = 89_478_485  # decode_image's default limit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("samples_dir")
    parser.add_argument("--receipts", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--long-side", type=int, default=1024)
    parser.add_argument("--min-score", type=float, default=0.5)
    parser.add_argument("--json", help="append the figures to this JSONL file")
    parser.add_argument("--dump", help="write each capture's OCR rows and fields to this JSONL file")
    args = parser.parse_args()

    import cv2

    cv2.setNumThreads(1)
    root = Path(args.samples_dir)
    with open(root / "manifest.csv", newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    receipts = sorted({row["receipt_id"] for row in rows})
    chosen = set(
        np.random.default_rng(args.seed).choice(receipts, size=min(args.receipts, len(receipts)), replace=False)
    )
    captures = [row for row in rows if row["receipt_id"] in chosen]
    verifier = OcrFieldsVerifier(fields=list(FIELDS), long_side=args.long_side, min_score=args.min_score, threads=1)
    verifier.read(np.full((64, 64, 3), 255, np.uint8))  # the engine's models load before the clock starts

    outcome = defaultdict(lambda: defaultdict(lambda: defaultdict(int)))  # device -> field -> right/none/wrong
    seconds = defaultdict(float)
    read_values = defaultdict(dict)  # receipt -> device -> {field: normalised OCR value}
    dump = open(args.dump, "w", encoding="utf-8") if args.dump else None
    for row in captures:
        image = np.asarray(decode_image((root / row["path"]).read_bytes(), MAX_PIXELS, name=row["path"]).image)
        started = time.perf_counter()
        words = read_words(image, verifier.long_side, 1, verifier.min_score)
        lines = text_rows(words)
        printed = parse_fields(lines, verifier.day_first)
        seconds[row["device"]] += time.perf_counter() - started
        values = {}
        for name in FIELDS:
            truth, found = verifier.normalise(name, row.get(name)), verifier.normalise(name, printed[name])
            values[name] = found
            kind = "none" if not found else "right" if found == truth else "wrong"
            for device in (row["device"], "all"):
                if truth:  # a label that does not normalise (a month-first date) cannot judge the OCR
                    outcome[device][name][kind] += 1
                    outcome[device][name]["labelled"] += 1
        read_values[row["receipt_id"]][row["device"]] = values
        if dump:
            dump.write(json.dumps({"path": row["path"], "words": [dataclasses.astuple(w) for w in words], "rows": lines, "printed": printed, "values": values,
                                   "truth": {n: verifier.normalise(n, row.get(n)) for n in FIELDS}}) + "\n")  # fmt: skip
    if dump:
        dump.close()
    seconds["all"] = sum(seconds.values())
    counts = defaultdict(int)
    for row in captures:
        counts[row["device"]] += 1
        counts["all"] += 1

    devices = sorted(d for d in counts if d != "all") + ["all"]
    table = []
    for device in devices:
        entry = {"device": device, "captures": counts[device], "s_per_capture": seconds[device] / counts[device]}
        for name in FIELDS:
            labelled = outcome[device][name]["labelled"]
            entry[f"{name}_labelled"] = labelled
            for kind in ("right", "none", "wrong"):
                entry[f"{name}_{kind}"] = outcome[device][name][kind] / max(1, labelled)
        table.append(entry)

    # pairs of captures of one receipt: what the verifier says about a true pair
    pairs = {}
    for fields in [(name,) for name in FIELDS] + [tuple(DEFAULT_OCR_FIELDS), FIELDS]:
        said = defaultdict(int)
        for by_device in read_values.values():
            for a, b in itertools.combinations(sorted(by_device), 2):
                shared = [(by_device[a][f], by_device[b][f]) for f in fields if by_device[a][f] and by_device[b][f]]
                said["abstain" if not shared else "differ" if any(x != y for x, y in shared) else "agree"] += 1
        total = sum(said.values())
        pairs[", ".join(fields)] = {kind: said[kind] / total for kind in ("agree", "differ", "abstain")} | {
            "pairs": total
        }

    print(f"{len(chosen)} receipts, {len(captures)} captures, long_side {args.long_side}, min_score {args.min_score}")
    everything = table[-1]
    print(
        "captures whose label normalises (the denominators): "
        + ", ".join(f"{n} {everything[n + '_labelled']}" for n in FIELDS)
    )
    print(
        "| device | captures | date right / none / wrong | total right / none / wrong | merchant right / none / wrong | s per capture |"
    )
    print("|---|---|---|---|---|---|")
    for entry in table:
        cells = [" / ".join(f"{entry[f'{name}_{kind}']:.2f}" for kind in ("right", "none", "wrong")) for name in FIELDS]
        label = f"**{entry['device']}**" if entry["device"] == "all" else entry["device"]
        print(f"| {label} | {entry['captures']} | {' | '.join(cells)} | {entry['s_per_capture']:.2f} |")
    print("| same-receipt pairs: fields | pairs | agree (1) | differ (0) | abstain |")
    print("|---|---|---|---|---|")
    for fields, said in pairs.items():
        print(f"| {fields} | {said['pairs']} | {said['agree']:.3f} | {said['differ']:.3f} | {said['abstain']:.3f} |")
    if args.json:
        with open(args.json, "a", encoding="utf-8") as handle:
            settings = {"samples_dir": args.samples_dir, "receipts": len(chosen), "seed": args.seed,
                        "long_side": args.long_side, "min_score": args.min_score}  # fmt: skip
            handle.write(json.dumps({**settings, "devices": table, "same_receipt_pairs": pairs}) + "\n")


if __name__ == "__main__":
    main()
