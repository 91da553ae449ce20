"""Does an embedding group captures by metadata (e.g. device) rather than by receipt?

knn_agreement: for each item, the share of its k nearest *other-identity* neighbours that
have the same attribute value. base_rate: the share expected by chance, i.e. among each
item's other-identity items, the fraction with its value (averaged over items). lift =
agreement / base rate; 1 means no shortcut, the device-clustering failure shows as lift >> 1.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from receipt_embed.evaluation.retrieval import knn


def attribute_lift(embeddings: np.ndarray, labels, values, k: int = 10) -> dict:
    labels, values = np.asarray(labels), np.asarray(values)
    group_size = Counter(labels.tolist())
    _, ids = knn(embeddings, min(len(labels) - 1, k + max(group_size.values()) - 1))
    agreements, base = [], []
    value_count = Counter(values.tolist())
    same_pair = Counter(zip(labels.tolist(), values.tolist()))
    for i in range(len(labels)):
        others = [j for j in ids[i] if j >= 0 and labels[j] != labels[i]][:k]
        if not others:
            continue
        agreements.append(np.mean(values[others] == values[i]))
        pool = len(labels) - group_size[labels[i]]
        base.append((value_count[values[i]] - same_pair[(labels[i], values[i])]) / pool)
    agreement, base_rate = float(np.mean(agreements)), float(np.mean(base))
    return {
        "knn_agreement": agreement,
        "base_rate": base_rate,
        "lift": agreement / base_rate if base_rate else None,
        "k": k,
    }
