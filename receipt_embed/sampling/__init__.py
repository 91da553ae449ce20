"""Batch samplers: which captures of which identities form a batch."""

from __future__ import annotations

import inspect

from receipt_embed.batch_layout import ANY, TWO_VIEW
from receipt_embed.kinds import AUTO as AUTO  # sampler.name that picks the sampler for the loss


def sampler_for_loss(loss) -> str:
    """The sampler ``sampler.name: auto`` stands for: P receipts x K captures (``pk``) for a loss
    that takes rows in any order (multi-positive, e.g. ``supcon``: every capture of a receipt in
    the batch is a positive), two views of each receipt (``unique_identity``) for any other loss,
    a plugin's loss that declares no ``batch_layout`` included."""
    return "pk" if getattr(loss, "batch_layout", TWO_VIEW) == ANY else "unique_identity"


def wants_metadata(factory) -> bool:
    """Whether a sampler factory declares a ``metadata`` parameter (the manifest rows)."""
    try:
        return "metadata" in inspect.signature(factory).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False


def build_sampler(registry, name: str, labels: list[int], rows: list[dict], batch_size: int, seed: int, params: dict):
    """Sampler ``name`` from the registry; ``rows`` (one manifest row per capture) are passed
    as ``metadata`` only to factories that ask for them, so older samplers keep working."""
    from receipt_embed.kinds import KINDS

    component = registry.get("sampler", name)
    supplied = {"identities": labels, "batch_size": batch_size, "seed": seed, "metadata": rows}
    framework = {
        argument.name: supplied[argument.name]  # the arguments the sampler kind's spec says it gets
        for argument in KINDS["sampler"].framework
        if argument.name != "metadata" or wants_metadata(component.factory)
    }
    if "metadata" in framework:
        framework["metadata"] = [dict(row) for row in rows]
    return registry.create_with("sampler", name, framework, dict(params))
