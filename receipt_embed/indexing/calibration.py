"""Calibrated duplicate thresholds: what similarity (or verified score) a reviewer can trust.

On a labelled index every capture is a query against the others (leave-one-out), as a new
submission is checked against past ones. The question each answers is "is my nearest other
capture the same receipt?": a query is *flagged* when its best score reaches the threshold, a
flag is *right* when that nearest capture is another capture of its receipt, and recall counts
the right flags among the queries whose receipt has another capture in the index. Sweeping the
threshold gives the precision-recall curve; the calibrated threshold is the lowest one whose
precision reaches the target, so recall is the highest the target allows. It is stored in
``index.json`` under ``calibration``, where ``search --threshold auto`` reads it, per score:

- ``embedding``: the cosine similarity;
- ``verified``: the verified score with every stored verifier, each capture with its own data (as
  ``search --all-pairs --verify`` scores indexed pairs, and a search given the query's fields);
- ``verified_image``: the verified score with only the verifiers that read the image, as a search
  of a bare image scores it (only when the index also stores verifiers of manifest rows).
"""

from __future__ import annotations

import time

import numpy as np

from receipt_embed.errors import BadInput
from receipt_embed.indexing.index_dir import IndexDir

CURVE_POINTS = 101  # the curve kept in index.json, for the audit's plot


KINDS = ("embedding", "verified", "verified_image")


def best_neighbours(index_dir: IndexDir, checks: dict | None = None, shortlist: int = 10, registry=None):
    """Per item: the score and row of its best other capture, by embedding similarity or (``checks``:
    :func:`receipt_embed.indexing.verification.verifiers_of`) by the verified score of the
    embedding's ``shortlist``, from the stored data of both captures."""
    from receipt_embed.indexing.verification import fused, shortlist_scores

    if checks is None:
        from receipt_embed.evaluation.retrieval import knn

        sims, ids = knn(index_dir.embeddings, 1)  # the query itself dropped (a byte-identical copy is kept)
        return sims[:, 0].astype(np.float64), ids[:, 0]
    rows, per = shortlist_scores(index_dir, checks, shortlist, registry)
    return best_verified(rows, fused(rows, per, list(checks)))


def best_verified(rows: np.ndarray, verified: np.ndarray):
    """Per item: the best verified score of its shortlist and the row holding it (ties: the
    embedding's order)."""
    best = np.argmax(verified, axis=1)
    picked = np.arange(len(rows))
    return verified[picked, best], rows[picked, best]


def kind_checks(index_dir: IndexDir, registry) -> dict:
    """The verifiers each verified kind is calibrated on: ``verified`` every stored one;
    ``verified_image`` those that read the capture's pixels, when some do and some do not (a
    query image has no manifest row, so a verifier of rows abstains on it)."""
    from receipt_embed.indexing.verification import verifiers_of

    if not index_dir.meta.get("verifiers"):
        return {}
    every = verifiers_of(index_dir, [], registry)
    image = {name: check for name, check in every.items() if getattr(check[0], "needs_image", True) is not False}
    return {"verified": every, **({"verified_image": image} if image and len(image) < len(every) else {})}


def pr_curve(scores: np.ndarray, right: np.ndarray, positives: int) -> list[dict]:
    """Precision and recall when flagging every query whose score is >= each distinct score; a
    query without a score (-inf: every verifier abstained on its shortlist) is never flagged."""
    finite = np.isfinite(scores)
    scores, right = scores[finite], right[finite]
    order = np.argsort(-scores, kind="stable")
    ordered, hits = scores[order], right[order].astype(np.int64)
    true, flagged = np.cumsum(hits), np.arange(1, len(hits) + 1)
    last_of_value = np.flatnonzero(np.r_[ordered[1:] != ordered[:-1], True])  # a threshold flags whole ties
    return [
        {
            "threshold": float(ordered[i]),
            "flagged": int(flagged[i]),
            "precision": float(true[i] / flagged[i]),
            "recall": float(true[i] / positives) if positives else 0.0,
        }
        for i in last_of_value
    ]


def choose(curve: list[dict], target: float) -> dict | None:
    """The point of highest recall whose precision reaches ``target`` (None when none does)."""
    reaching = [point for point in curve if point["precision"] >= target]
    return max(reaching, key=lambda point: (point["recall"], point["threshold"])) if reaching else None


def calibrate(index_dir: IndexDir, registry=None, target_precision: float = 0.99, shortlist: int = 10) -> dict:
    """The ``calibration`` record for ``index_dir``: per score kind, the chosen threshold with its
    precision and recall, and the curve (at most CURVE_POINTS points)."""
    if not 0 < target_precision <= 1:
        raise BadInput(f"--target-precision must be in (0, 1], got {target_precision}")
    receipts = [item.get("receipt_id") for item in index_dir.items]
    if any(r in (None, "") for r in receipts):
        raise BadInput(f"{index_dir.path} has unlabelled items (no receipt_id): calibration needs a labelled index")
    if index_dir.count < 3:
        raise BadInput(f"{index_dir.path} holds {index_dir.count} items: calibration needs at least 3")
    labels = np.unique(np.array(receipts), return_inverse=True)[1]
    captures = np.bincount(labels)
    positives = int(np.sum(captures[labels] >= 2))
    if len(captures) == 1:
        raise BadInput(
            f"{index_dir.path}: every capture is of one receipt, so no flag could be a false alarm and precision "
            "would be 1 at any threshold: calibrate on captures of many receipts"
        )
    if positives == 0:
        raise BadInput(
            f"{index_dir.path}: no receipt has two captures, so no duplicate can be found: "
            "calibrate on an index where receipts were captured more than once"
        )
    checks = kind_checks(index_dir, registry)
    record = {
        "target_precision": target_precision,
        "queries": index_dir.count,
        "duplicates_findable": positives,
        "receipts": int(len(captures)),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if checks:  # each pair is scored once, by every verifier; each kind fuses its own
        from receipt_embed.indexing.verification import fused, shortlist_scores

        short_rows, per = shortlist_scores(index_dir, checks["verified"], shortlist, registry)
    for kind in ("embedding", *checks):
        if kind == "embedding":
            scores, rows = best_neighbours(index_dir)
        else:
            scores, rows = best_verified(short_rows, fused(short_rows, per, list(checks[kind])))
        right = labels[rows] == labels
        curve = pr_curve(scores, right, positives)
        chosen = choose(curve, target_precision)
        record[kind] = {
            "threshold": None if chosen is None else chosen["threshold"],
            "precision": None if chosen is None else chosen["precision"],
            "recall": None if chosen is None else chosen["recall"],
            "flagged": None if chosen is None else chosen["flagged"],
            **({"shortlist": shortlist, "verifiers": list(checks[kind])} if kind in checks else {}),
            "curve": thinned(curve),
        }
    return record


def thinned(curve: list[dict]) -> list[dict]:
    if len(curve) <= CURVE_POINTS:
        return curve
    picks = np.unique(np.linspace(0, len(curve) - 1, CURVE_POINTS).round().astype(int))
    return [curve[i] for i in picks]


def in_words(kind: str, chosen: dict, target: float) -> str:
    """A reviewer's reading of one calibrated threshold."""
    if chosen.get("verifiers"):
        alone = ": a search of an image without its fields" if kind == "verified_image" else ""
        kind = f"{kind} ({', '.join(chosen['verifiers'])}{alone})"
    if chosen["threshold"] is None:
        best = max(chosen["curve"], key=lambda point: point["precision"]) if chosen["curve"] else None
        reached = f" (the best is {best['precision']:.1%} at {best['threshold']:g})" if best else ""
        return f"{kind}: no threshold reaches {target:.1%} precision{reached}"
    false_alarms = (1 - chosen["precision"]) * 100
    return (
        f"{kind}: at threshold {chosen['threshold']:g}, {chosen['recall']:.1%} of duplicates caught, "
        f"{false_alarms:.1f} false alarms per 100 flagged ({chosen['flagged']} flagged)"
    )


def few_flags(record: dict, target: float) -> list[str]:
    """Warnings for thresholds chosen on too few flags to show the target: at precision 0.99 one
    false alarm per 100 is the question, so fewer than 100 flags cannot answer it."""
    import math

    if target >= 1:
        return []
    needed = math.ceil(1 / (1 - target) - 1e-9)
    warnings = []
    for kind in KINDS:
        chosen = record.get(kind) or {}
        flagged = chosen.get("flagged")
        if flagged is not None and flagged < needed:
            warnings.append(
                f"the {kind} threshold rests on {flagged} flagged quer{'y' if flagged == 1 else 'ies'}; {needed} are "
                f"needed before precision {target:g} can show one false alarm in {needed}: calibrate on more labelled "
                "captures"
                + (
                    f", or accept that this score reaches {target:g} only at a recall of {chosen['recall']:.1%} "
                    "(a lower --target-precision; for verified_image, searches given the query's --field values)"
                    if chosen.get("recall") is not None and chosen["recall"] < 0.1
                    else ""
                )
            )
    return warnings


def calibration_warnings(record: dict, target: float) -> list[str]:
    """What a reviewer should know before trusting the stored thresholds: too few flags to show the
    target (:func:`few_flags`), a target below 0.5 (more false alarms than duplicates), and a target
    of 1 (no false alarm among these captures is not none among the next)."""
    warnings = []
    if target < 0.5:
        warnings.append(
            f"--target-precision {target:g} accepts more false alarms than duplicates among the flags: a "
            "reviewer's threshold is usually 0.95 or more"
        )
    elif target >= 1:
        warnings.append(
            "--target-precision 1 picks the lowest threshold with no false alarm among these captures; the "
            "next capture may be one: a target such as 0.99 on enough captures says what to expect"
        )
    return warnings + few_flags(record, target)


# the searches each calibrated score judges, for calibrate to say which threshold a search will use
SEARCHES = {
    "embedding": "search IMAGE (without --verify), and --all-pairs: the embedding threshold",
    "verified": "search IMAGE --verify --field KEY=VALUE, and --all-pairs --verify: the verified threshold",
    "verified_image": "search IMAGE --verify (a bare image): the verified_image threshold",
}


def searches_using(record: dict) -> list[str]:
    """One line per stored threshold that auto can use, naming the searches it judges; an index
    without a ``verified_image`` record judges a bare image's verified search on ``verified``."""
    lines = []
    for kind in KINDS:
        if (record.get(kind) or {}).get("threshold") is None:
            continue
        line = SEARCHES[kind]
        if kind == "verified" and "verified_image" not in record:
            line = "search IMAGE --verify, and --all-pairs --verify: the verified threshold"
        lines.append(f"{line} {record[kind]['threshold']:g}")
    return lines


def search_kind(verify: bool, with_fields: bool, calibration: dict | None) -> str:
    """Which calibrated score a search's verdict uses: the embedding's without --verify; with it,
    ``verified_image`` for a bare query image when the index calibrated one (its verifiers of
    manifest rows have nothing to read), else ``verified``."""
    if not verify:
        return "embedding"
    return "verified_image" if not with_fields and "verified_image" in (calibration or {}) else "verified"


def calibrated_threshold(index_dir: IndexDir, kind: str, verifiers: list[str] | None = None) -> float:
    """The threshold ``calibrate`` stored for ``kind`` (:data:`KINDS`); ``verifiers``: those the
    search uses (all the index stores when empty), which must be the ones the threshold was
    calibrated on (a bare image's search may add the verifiers of manifest rows: they abstain on it)."""
    from receipt_embed.indexing.index_dir import IndexDirError

    calibration = index_dir.meta.get("calibration")
    if not calibration or kind not in calibration:
        what = "its verified scores" if kind != "embedding" and calibration else "it"
        raise IndexDirError(
            f"--threshold auto: {index_dir.path} has no calibration for {what}; run `receipt-embed calibrate "
            f"{index_dir.path}`{' (after `index --verify`)' if kind != 'embedding' else ''}, or give --threshold T"
        )
    used = list(verifiers or (index_dir.meta.get("verifiers") or {}))
    calibrated = list(calibration[kind].get("verifiers", []))
    missing = [name for name in calibrated if name not in used]
    # a bare image's search leaves out the verifiers of manifest rows (they abstain on it): those
    # ``verified`` was calibrated with beside the image ones are not extra there
    rows_only = set((calibration.get("verified") or {}).get("verifiers", [])) - set(calibrated)
    extra = [name for name in used if name not in calibrated and not (kind == "verified_image" and name in rows_only)]
    if kind != "embedding" and (missing or extra):
        change = f"leaves out {', '.join(missing)}" if missing else f"adds {', '.join(extra)}"
        raise IndexDirError(
            f"--threshold auto (the default once an index is calibrated): the {kind} threshold of {index_dir.path} "
            f"was calibrated with {', '.join(calibrated) or 'no verifier'}, and this search {change}, so its "
            "scores are not the ones calibrated; drop --verifier, run `receipt-embed calibrate` again, or give "
            "--threshold T"
        )
    threshold = calibration[kind].get("threshold")
    if threshold is None:
        raise IndexDirError(
            f"--threshold auto (the default once an index is calibrated): no {kind} threshold of {index_dir.path} "
            "reached the target precision "
            f"{calibration.get('target_precision')}; calibrate with a lower --target-precision, or give --threshold T"
        )
    return float(threshold)
