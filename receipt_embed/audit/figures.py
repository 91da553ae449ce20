"""The figures of a shortcut audit: does the space find a receipt's other captures, and does
it cluster by capture metadata (device, merchant, ...) more than chance?

- retrieval: leave-one-out recall@1/5/10 and mAP over identities with 2+ captures, and per
  attribute a *cross-attribute* recall@1: same-identity items that share the query's value
  are removed from the candidates, so the hit must come from another device (the hard,
  realistic case of a receipt photographed on one phone and resubmitted from another).
- shortcuts per attribute: kNN agreement among other-identity neighbours against its chance
  base rate (lift), and a frozen linear probe (logistic regression, train/test split grouped
  by identity) against the best constant guess. ``status`` follows :class:`FlagRule`:
  flagged, clear, inconclusive (too few items to tell), or context (reported, never flagged).
- similarity: cosine means and quantiles of positives, negatives, and negatives that share
  or do not share the attribute value.
- diagnostics: alignment, uniformity, effective rank, per-dimension std (collapse).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from receipt_embed.display import quoted
from receipt_embed.errors import BadInput
from receipt_embed.evaluation.diagnostics import QUANTILES, embedding_diagnostics
from receipt_embed.evaluation.retrieval import l2_normalise, retrieval_metrics
from receipt_embed.evaluation.shortcuts import attribute_lift

MAX_PAIRWISE_ITEMS = 20_000  # uniformity and effective rank on a seeded subset above this
COLLAPSED_RANK = 2.0  # an effective rank below this: the embeddings lie on (nearly) one line
MAX_PROBE_ITEMS = 20_000  # the linear probe trains on the captures of a subset of identities above this


@dataclass(frozen=True)
class FlagRule:
    """An attribute is flagged as a shortcut when either test fires.

    max_lift: kNN agreement among other-receipt neighbours above this multiple of chance,
    and at least min_z standard errors above chance (so a handful of items cannot flag by luck).
    max_probe_gain: the linear probe's accuracy gain over majority-class chance, as a share of
    the possible gain, (accuracy - chance) / (1 - chance), above this value, measured on at
    least min_probe_items held-out items."""

    max_lift: float = 1.3
    max_probe_gain: float = 0.5
    min_z: float = 3.0
    min_probe_items: int = 20


def cross_attribute_recall(x: np.ndarray, labels: np.ndarray, values: np.ndarray) -> dict:
    """recall@1 when same-identity items with the query's own attribute value are excluded."""
    import faiss

    same = {}
    for i, key in enumerate(zip(labels.tolist(), values.tolist())):
        same.setdefault(key, []).append(i)
    by_label = {}
    for i, label in enumerate(labels.tolist()):
        by_label.setdefault(label, set()).add(values[i])
    queries = np.array([len(by_label[label]) > 1 for label in labels.tolist()])
    if not queries.any():
        return {"recall_at_1": None, "n_queries": 0}
    index = faiss.IndexFlatIP(x.shape[1])
    index.add(x)
    skip = max(len(group) for group in same.values())  # the query and its same-value twins
    _, ids = index.search(x[queries], min(len(x), skip + 1))
    hits = []
    for row, neighbours in zip(np.flatnonzero(queries), ids):
        excluded = set(same[(labels[row], values[row])])
        first = next((j for j in neighbours if j >= 0 and j not in excluded), None)
        hits.append(first is not None and labels[first] == labels[row])
    return {"recall_at_1": float(np.mean(hits)), "n_queries": int(queries.sum())}


def linear_probe(x: np.ndarray, labels: np.ndarray, values: np.ndarray, seed: int = 0, test_size: float = 0.3) -> dict:
    """Logistic-regression accuracy at predicting the attribute on held-out *identities*."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import GroupShuffleSplit

    if len(set(values.tolist())) < 2 or len(set(labels.tolist())) < 4:
        return {"probe_accuracy": None, "probe_chance": None, "probe_test_items": 0}
    if len(x) > MAX_PROBE_ITEMS:  # whole identities, so the grouped split stays honest
        identities = np.unique(labels)
        rng = np.random.default_rng(seed)
        keep_ids = rng.choice(identities, max(4, int(len(identities) * MAX_PROBE_ITEMS / len(x))), replace=False)
        keep = np.isin(labels, keep_ids)
        x, labels, values = x[keep], labels[keep], values[keep]
    train, test = next(GroupShuffleSplit(1, test_size=test_size, random_state=seed).split(x, values, labels))
    # chance: the best constant guess on the test items (their most frequent value)
    chance = float(np.unique(values[test], return_counts=True)[1].max() / len(test))
    if len(np.unique(values[train])) < 2:
        return {"probe_accuracy": None, "probe_chance": chance, "probe_test_items": int(len(test))}
    probe = LogisticRegression(max_iter=2000).fit(x[train], values[train])
    accuracy = float(np.mean(probe.predict(x[test]) == values[test]))
    return {"probe_accuracy": accuracy, "probe_chance": chance, "probe_test_items": int(len(test))}


def _describe(values: np.ndarray) -> dict:
    if not len(values):
        return {"mean": None, **{f"q{int(q * 100):02d}": None for q in QUANTILES}}
    return {"mean": float(values.mean()), **{f"q{int(q * 100):02d}": float(np.quantile(values, q)) for q in QUANTILES}}


def pair_similarities(
    x: np.ndarray, labels: np.ndarray, values: np.ndarray, max_items: int, seed: int = 0
) -> dict[str, np.ndarray]:
    """Cosine similarities of all pairs i < j among at most ``max_items`` items (a seeded
    subset), split into positives, negatives, and negatives sharing or not sharing the value."""
    subset = np.arange(len(x))
    if len(x) > max_items:
        subset = np.sort(np.random.default_rng(seed).choice(len(x), max_items, replace=False))
    sims = x[subset] @ x[subset].T
    upper = np.triu(np.ones_like(sims, dtype=bool), k=1)
    same_label = labels[subset][:, None] == labels[subset][None, :]
    same_value = values[subset][:, None] == values[subset][None, :]
    return {
        "positive": sims[upper & same_label],
        "negative": sims[upper & ~same_label],
        "same_attr_negative": sims[upper & ~same_label & same_value],
        "cross_attr_negative": sims[upper & ~same_label & ~same_value],
    }


def similarity_figures(
    x: np.ndarray, labels: np.ndarray, values: np.ndarray, max_items: int = 4000, seed: int = 0
) -> dict:
    """Means and quantiles of :func:`pair_similarities`."""
    return {kind: _describe(sims) for kind, sims in pair_similarities(x, labels, values, max_items, seed).items()}


def flag(figures: dict, rule: FlagRule, n_items: int) -> tuple[str, list[str]]:
    """Apply the rule: ("flagged" | "clear" | "inconclusive", reasons).

    Also records ``lift_z`` and ``probe_gain`` (None where they cannot be computed).
    Inconclusive: nothing fired, but a test that could have fired lacked the evidence (a
    lift above the limit on too few items, or too few held-out items for the probe)."""
    flagged, doubts = [], []
    agreement, base, lift = figures["knn_agreement"], figures["base_rate"], figures["lift"]
    figures["lift_z"] = figures["probe_gain"] = None
    if lift is not None and 0 < base < 1:
        # binomial standard error of the agreement over n_items x k neighbour slots
        z = (agreement - base) / math.sqrt(base * (1 - base) / (n_items * figures["k"]))
        figures["lift_z"] = z
        if lift > rule.max_lift:
            if z >= rule.min_z:
                flagged.append(f"kNN lift {lift:.2f} > {rule.max_lift}, {z:.1f} standard errors above chance")
            else:
                doubts.append(
                    f"kNN lift {lift:.2f} > {rule.max_lift} but only {z:.1f} standard errors above chance "
                    f"(needs {rule.min_z}; too few items)"
                )
    accuracy, chance = figures["probe_accuracy"], figures["probe_chance"]
    enough = figures["probe_test_items"] >= rule.min_probe_items
    if accuracy is not None and chance is not None and chance < 1:
        gain = (accuracy - chance) / (1 - chance)
        figures["probe_gain"] = gain
        if gain > rule.max_probe_gain and enough:
            flagged.append(f"probe gain {gain:.2f} > {rule.max_probe_gain}")
    if not enough:
        doubts.append(
            f"the probe had {figures['probe_test_items']} held-out items, needs {rule.min_probe_items}"
            + (f" (gain {figures['probe_gain']:.2f})" if figures["probe_gain"] is not None else "")
        )
    if flagged:
        return "flagged", flagged
    return ("inconclusive", doubts) if doubts else ("clear", [])


def testable(values: np.ndarray) -> str | None:
    """Why an attribute cannot be audited, or None."""
    distinct = len(set(values.tolist()))
    if distinct < 2:
        return f"it has a single value ({quoted(values[0])})"
    if distinct > len(values) / 2:
        return f"it has {distinct} distinct values for {len(values)} items: an attribute must group items"
    return None


def _unfilled(items: list[dict], names: list[str], context: tuple[str, ...]) -> dict[str, str]:
    """Why an attribute with empty values is not tested: empty for every item (no values to
    compare), or a context attribute empty for some (context is never flagged, so it is listed,
    not refused). An audited attribute empty for some items is an error: its shortcut figures would
    silently cover only part of the index."""
    reasons = {}
    for attribute in names:
        empty = [i for i, item in enumerate(items) if item.get(attribute) in (None, "")]
        if not empty:
            continue
        first = items[empty[0]].get("path", f"item {empty[0]}")
        if len(empty) == len(items):
            reasons[attribute] = "it is empty for every item"
        elif attribute in context:
            reasons[attribute] = f"it is empty or absent for {len(empty)} of {len(items)} items, first {first}"
        else:
            raise BadInput(
                f"attribute {quoted(attribute)} is empty or absent for {len(empty)} of {len(items)} items, first {first}"
            )
    return reasons


def _attribute_figures(x, labels, values, *, k: int, rule: FlagRule, n_items: int, context: bool, seed: int) -> dict:
    """Lift, probe and verdict of one attribute (a context attribute gets the figures, never a flag)."""
    figures = {**attribute_lift(x, labels, values, k=k), **linear_probe(x, labels, values, seed=seed)}
    figures["n_values"] = len(set(values.tolist()))
    status, reasons = flag(figures, rule, n_items)
    figures["context"] = context
    if context:
        status = "context"
    figures["status"], figures["reasons"] = status, reasons
    figures["flagged"] = status == "flagged"
    return figures


def _similarity_summary(x, labels, by_attribute: dict, seed: int) -> dict:
    """Mean similarities of positives and negatives, split by the first tested attribute."""
    first = next(iter(by_attribute), None)
    overall = by_attribute[first] if first else similarity_figures(x, labels, labels, seed=seed)
    return {
        "positive_mean": overall["positive"]["mean"],
        "negative_mean": overall["negative"]["mean"],
        "same_attr_negative_mean": overall["same_attr_negative"]["mean"] if first else None,
        "cross_attr_negative_mean": overall["cross_attr_negative"]["mean"] if first else None,
        "attribute": first,
        "by_attribute": by_attribute,
    }


def audit_figures(
    embeddings: np.ndarray,
    items: list[dict],
    attributes: list[str],
    k: int = 10,
    rule: FlagRule = FlagRule(),
    seed: int = 0,
    context: tuple[str, ...] = (),
) -> dict:
    """Every figure of ``audit.json`` for ``embeddings`` row-aligned with ``items``.

    ``attributes`` are tested against the rule; ``context`` attributes get the same figures
    but are never flagged (e.g. merchant, which captures of one shop share by design)."""
    names = [*attributes, *[c for c in context if c not in attributes]]
    unfilled = _unfilled(items, names, tuple(c for c in context if c not in attributes))
    receipt_ids = [str(item["receipt_id"]) for item in items]
    identities = {receipt_id: i for i, receipt_id in enumerate(sorted(set(receipt_ids)))}
    if len(identities) < 2:
        raise BadInput(f"an audit needs at least 2 receipts, the index holds {len(identities)} ({len(items)} items)")
    x = l2_normalise(embeddings)
    labels = np.array([identities[r] for r in receipt_ids])
    largest = int(np.bincount(labels).max())
    k_used = min(k, len(items) - largest)  # every item has at least this many other-receipt items
    retrieval = retrieval_metrics(x, labels, ks=(1, 5, 10))
    retrieval["cross_attribute"] = {}
    shortcuts, similarity_by_attribute, untestable = {}, {}, {}
    for attribute in names:
        if attribute in unfilled:
            untestable[attribute] = unfilled[attribute]
            continue
        values = np.array([str(item[attribute]) for item in items])
        reason = testable(values)
        if reason:
            untestable[attribute] = reason
            continue
        retrieval["cross_attribute"][attribute] = cross_attribute_recall(x, labels, values)
        shortcuts[attribute] = _attribute_figures(
            x, labels, values, k=k_used, rule=rule, n_items=len(items), context=attribute not in attributes, seed=seed
        )
        similarity_by_attribute[attribute] = similarity_figures(x, labels, values, seed=seed)
    diagnostics = embedding_diagnostics(x, labels, max_items=MAX_PAIRWISE_ITEMS, seed=seed)
    diagnostics.pop("similarity", None)
    diagnostics["pairwise_items"] = min(len(x), MAX_PAIRWISE_ITEMS)  # uniformity, effective rank
    return {
        "n_items": len(items),
        "n_identities": len(identities),
        "k": k_used,
        "k_requested": k,
        "rule": asdict(rule),
        "retrieval": retrieval,
        "shortcuts": shortcuts,
        "untestable": untestable,
        "similarity": _similarity_summary(x, labels, similarity_by_attribute, seed),
        "diagnostics": diagnostics,
        "collapsed": bool(diagnostics["effective_rank"] < COLLAPSED_RANK),
        "flagged": [a for a in shortcuts if shortcuts[a]["flagged"]],
        "inconclusive": [a for a in shortcuts if shortcuts[a]["status"] == "inconclusive"],
    }
