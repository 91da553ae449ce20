"""Audit check ``hubness``: do a few items turn up in everybody's neighbour lists?

In high-dimensional spaces some points become *hubs*: they sit among the k nearest
neighbours of far more queries than their share, while *anti-hubs* are nobody's neighbour
(Radovanovic, Nanopoulos & Ivanovic, JMLR 2010). For receipt search a hub is the receipt
every lookup returns; an anti-hub is a receipt duplicate search can never find.

The figure is the distribution of the k-occurrence N_k(x) = how many items have x among
their k nearest other items (mean exactly k). Reported: its skewness (about 0 without hubs;
above 1 is usually called strong hubness), the largest N_k and the share of items with
N_k = 0. Flagged when the skewness exceeds ``max_skewness`` (default 3) on at least 50 items.

    receipt-embed audit-shortcuts INDEX_DIR          # runs every registered check, this one included
"""

from __future__ import annotations

import numpy as np

from receipt_embed.hookspecs import hookimpl

__version__ = "1.0"


def k_occurrence(indices: np.ndarray, n: int) -> np.ndarray:
    """N_k per item from an (N, k) array of neighbour indices."""
    return np.bincount(indices.ravel(), minlength=n)


def skewness(values: np.ndarray) -> float:
    """Standardised third moment (population), as in the hubness literature."""
    centred = values - values.mean()
    std = np.sqrt(np.mean(centred**2))
    return float(np.mean(centred**3) / std**3) if std > 0 else 0.0


def make_check(max_skewness: float = 3.0, min_items: int = 50):
    def check(context):
        _, indices = context.neighbours()
        n, k = len(context.embeddings), indices.shape[1]
        counts = k_occurrence(indices, n)
        skew = skewness(counts.astype(np.float64))
        top = int(counts.argmax())
        figures = {
            "k": k,
            "skewness": skew,
            "max_k_occurrence": int(counts.max()),
            "max_k_occurrence_receipt": str(context.items[top].get("receipt_id")),
            "anti_hub_share": float(np.mean(counts == 0)),
        }
        summary = (
            f"k-occurrence skewness {skew:.2f} (k = {k}); the strongest hub "
            f"({figures['max_k_occurrence_receipt']}) is a neighbour of {figures['max_k_occurrence']} items; "
            f"{figures['anti_hub_share']:.1%} of items are nobody's neighbour"
        )
        plot = None
        try:
            import matplotlib

            matplotlib.use("Agg", force=True)
            import matplotlib.pyplot as plt

            plot, axis = plt.subplots(figsize=(6, 3.4))
            axis.hist(counts, bins=np.arange(counts.max() + 2) - 0.5, color="#4477aa")
            axis.set_xlabel(f"k-occurrence N_{k} (times an item is among others' {k} nearest)")
            axis.set_ylabel("items")
            axis.set_title(f"hubness: skewness {skew:.2f}")
        except ImportError:  # the figures do not need the plot
            pass
        return {"figures": figures, "summary": summary, "flagged": n >= min_items and skew > max_skewness, "plot": plot}

    return check


@hookimpl
def register_audit_checks(register):
    register(
        "hubness", make_check, description="k-occurrence skewness: hubs every query returns, receipts nobody finds"
    )
