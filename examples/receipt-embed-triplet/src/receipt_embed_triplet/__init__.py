"""Batch-hard triplet loss (Hermans, Beyer & Leibe, "In Defense of the Triplet Loss for
Person Re-Identification", 2017) as a receipt-embed plugin.

For every anchor row: its hardest positive (the farthest row of the same receipt, never
itself) and its hardest negative (the nearest row of another receipt), on L2-normalised
embeddings:

    L = mean over anchors of  max(0, margin + d(a, p_hard) - d(a, n_hard))      (hinge)
                          or  log(1 + exp(d(a, p_hard) - d(a, n_hard)))         (soft=True)

Anchors without a positive in the batch are skipped (counted in ``last_stats``). Works with
two-view batches (``unique_identity``) and P x K batches (``pk``).

    receipt-embed train --data DATASET_DIR --set loss.name=batch_hard_triplet --set sampler.name=pk
"""

from __future__ import annotations

from receipt_embed.hookspecs import hookimpl

__version__ = "0.1.0"


def build(temperature: float = 0.0, margin: float = 0.2, soft: bool = False):
    """``temperature`` is accepted (train passes loss.temperature to every loss) and unused.

    torch is imported here, through .loss, not at module level: every receipt-embed command
    loads every installed plugin, and only training needs torch."""
    from receipt_embed_triplet.loss import BatchHardTriplet

    return BatchHardTriplet(margin=margin, soft=soft)


@hookimpl
def register_losses(register):
    register(
        "batch_hard_triplet", build, description="batch-hard triplet loss (Hermans et al. 2017); params margin, soft"
    )
