"""A training time budget (``train.max_minutes``): the run stops when it is spent, annealed.

A fixed epoch count is a poor plan on a CPU: a new dataset's epoch may take any time, and a
100-epoch recipe cut at epoch 20 stops with the learning rate still near its peak. With a
budget the cosine schedule runs over the time instead (its position is the larger of the
share of steps done and the share of the budget spent), so the last step is taken at a
learning rate near zero whenever the budget ends; ``train.epochs`` stays an upper bound.
Time spent evaluating and saving counts; a resumed run carries on the time already spent.
"""

from __future__ import annotations

import time


class TimeBudget:
    """Seconds spent by a run against its budget (None: no budget, never exhausted)."""

    def __init__(self, max_minutes: float | None, spent_before: float = 0.0):
        self.seconds = None if max_minutes is None else 60.0 * max_minutes
        self.spent_before = spent_before
        self.started: float | None = None

    def start(self) -> None:
        self.started = time.perf_counter()

    def spent(self) -> float:
        running = 0.0 if self.started is None else time.perf_counter() - self.started
        return self.spent_before + running

    def progress(self) -> float:
        """The share of the budget spent (0 without a budget)."""
        return 0.0 if self.seconds is None else min(1.0, self.spent() / self.seconds)


def budget_spent(max_minutes: float, last_line: dict, steps_per_epoch: int) -> str:
    """The line a run stopped by its budget logs."""
    return (
        f"time budget of {max_minutes:g} min (train.max_minutes) spent in epoch {last_line['epoch']} at step "
        f"{last_line['steps']} of {steps_per_epoch}: stopped, with the learning rate annealed over the budget"
    )


def nothing_to_train(run_dir, epoch: int, epochs: int, max_minutes: float | None) -> str:
    """What a resumed run that has nothing left to do logs: its epochs, or its time, are spent."""
    if epoch >= epochs:
        return (
            f"{run_dir} has trained {epoch} epoch(s), train.epochs is {epochs}: nothing to train "
            "(raise it with --set train.epochs=N to train on)"
        )
    return (
        f"{run_dir} has spent its time budget ({max_minutes:g} min): nothing to train "
        "(raise it with --set train.max_minutes=N to train on)"
    )
