"""Identity-disjoint splits: every capture of one receipt lands in the same split.

Identities without an explicit split are ordered by a hash of (seed, receipt_id) and cut
at the requested ratios, so the assignment is deterministic, independent of row order,
and exact in counts even for small sets.
"""

from __future__ import annotations

import hashlib

SPLITS = ("train", "val", "heldout")


def identity_rank(receipt_id: str, seed: int) -> str:
    return hashlib.sha256(f"{seed}:{receipt_id}".encode()).hexdigest()


def assign_splits(
    identities: list[str],
    ratios: tuple[float, float, float],
    seed: int,
    fixed: dict[str, str] | None = None,
) -> dict[str, str]:
    """Map each identity to a split; ``fixed`` identities keep the split they were given."""
    fixed = fixed or {}
    free = sorted((i for i in set(identities) if i not in fixed), key=lambda i: identity_rank(i, seed))
    n = len(free)
    bounds, total = [], 0.0
    for ratio in ratios:
        total += ratio
        bounds.append(round(total * n))
    bounds[-1] = n
    assignment = dict(fixed)
    start = 0
    for split, stop in zip(SPLITS, bounds):
        for identity in free[start:stop]:
            assignment[identity] = split
        start = stop
    return assignment
