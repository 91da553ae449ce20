"""How a sampler lays out the rows of its batches, declared by the sampler as ``batch_layout``.

Training reads the declaration instead of guessing the layout from labels: the two-view
losses, MoCo's momentum keys and the split of a batch across ranks need ``two_view``; a
sampler whose batches break what it declared is named at the first such batch.
"""

from __future__ import annotations

from collections.abc import Sequence

TWO_VIEW = "two_view"
ANY = "any"
LAYOUTS = {
    TWO_VIEW: "[first views of B distinct identities; second views of the same B, same order]",
    ANY: "rows in any order, several per identity (losses read the labels, not positions)",
}


def declared_layout(sampler) -> str | None:
    """The sampler's ``batch_layout`` if it is one of :data:`LAYOUTS`, else None."""
    layout = getattr(sampler, "batch_layout", None)
    return layout if isinstance(layout, str) and layout in LAYOUTS else None


def layout_problem(layout: str, rows: Sequence) -> str | None:
    """Why a batch whose rows have identities ``rows`` is not laid out as ``layout``, or None."""
    if layout != TWO_VIEW:
        return None
    half = len(rows) // 2
    if len(rows) % 2:
        return f"it has {len(rows)} rows, an odd number"
    if list(rows[:half]) != list(rows[half:]):
        first = next(i for i in range(half) if rows[i] != rows[half + i])
        return f"row {first} and row {half + first} are different identities"
    if len(set(rows[:half])) != half:
        return "an identity fills more than one of its B slots"
    return None
