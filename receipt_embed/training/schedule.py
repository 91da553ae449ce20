"""The learning-rate schedule: linear warmup, then cosine decay to zero."""

from __future__ import annotations

import math

import torch

from receipt_embed.config import Config

AUTO_VIEWS = 120_000  # the views `train.epochs: auto` trains on (benchmarks/README.md, "bf16 by default")


def planned_epochs(epochs: int | str, steps_per_epoch: int, views_per_step: int) -> int:
    """``train.epochs``, or for ``auto`` the epochs that show the model about :data:`AUTO_VIEWS`
    augmented views: the recipe the quality benchmark measured best (180 epochs of 214 receipts
    there with bf16 autocast; held-out recall@1 0.804 / 0.842 against 0.801 / 0.826 at 60,000
    views, in 450 s of two cores), so a larger dataset gets fewer, longer epochs rather than a
    run many times as long."""
    if epochs != "auto":
        return int(epochs)
    return max(1, math.ceil(AUTO_VIEWS / max(1, steps_per_epoch * views_per_step)))


def lr_schedule(optimizer, steps_per_epoch: int, epochs: int, config: Config, time_spent=None):
    """Linear warmup from 1% then cosine decay to 0 at the last step of ``epochs``, or
    when the time budget ends if that comes first (``time_spent``: a callable giving the share
    of ``train.max_minutes`` spent, see :mod:`receipt_embed.training.budget`).

    The factor is a function of the step, the time spent and the *current* plan, so a run
    resumed with a different ``train.epochs`` re-plans its cosine over the new total and still
    anneals to 0 at its end (a stateful cosine would keep the old period and climb back up)."""
    total = max(1, steps_per_epoch * epochs)
    warmup = min(total - 1, round(config.train.warmup_epochs * steps_per_epoch))

    def factor(step: int) -> float:
        if step < warmup:
            return 0.01 + 0.99 * step / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if time_spent is not None:
            progress = max(progress, time_spent())
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
