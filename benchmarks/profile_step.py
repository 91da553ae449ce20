"""Where a training step's time goes: making the views, forward, loss, backward, optimizer.

Runs real training steps of the configured recipe on a dataset dir (default: data_samples/
ingested into a temporary folder) and times each phase, then lists the torch operators that
take the most time (torch.profiler) over a few more steps:

    python benchmarks/profile_step.py [--data DATASET_DIR] [--steps 20] [--set key=value ...]

Prints a JSON line of per-step milliseconds and shares, then the operator table. Run it
alone on the machine: two torch processes at once halve each other's speed.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch
from training import benchmark_trainer  # benchmarks/training.py, beside this script

from receipt_embed.config import load_config
from receipt_embed.training.trainer import Trainer

PHASES = ("views", "forward", "loss", "backward", "optimizer")


def _timed_steps(trainer: Trainer, steps: int) -> dict[str, float]:
    """Mean seconds per phase over ``steps`` steps (after two warm-up steps)."""
    totals = dict.fromkeys(PHASES, 0.0)
    iterator = iter(trainer._make_loader())
    for step in range(steps + 2):
        started = time.perf_counter()
        try:
            views, labels = next(iterator)
        except StopIteration:
            iterator = iter(trainer._make_loader())
            views, labels = next(iterator)
        marks = [started, time.perf_counter()]
        trainer.model.train()
        _, projections = trainer.forward_model(views)
        marks.append(time.perf_counter())
        loss = trainer.loss_fn(projections.float(), labels)
        marks.append(time.perf_counter())
        trainer.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        marks.append(time.perf_counter())
        torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), trainer.config.train.grad_clip)
        trainer.optimizer.step()
        marks.append(time.perf_counter())
        if step >= 2:
            for phase, (begin, end) in zip(PHASES, zip(marks, marks[1:])):
                totals[phase] += end - begin
    return {phase: seconds / steps for phase, seconds in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=None)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--top", type=int, default=15, help="operators to list")
    args = parser.parse_args()
    config = load_config(overrides=args.overrides)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = benchmark_trainer(config, args.data, tmp)
        batch_views = len(next(iter(trainer._make_loader()))[0])
        phases = _timed_steps(trainer, args.steps)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            _timed_steps(trainer, 3)
    step = sum(phases.values())
    print(
        json.dumps(
            {
                "encoder": config.model.encoder,
                "image_size": list(config.data.image_size),
                "precision": trainer.precision,
                "batch_views": batch_views,
                "threads": torch.get_num_threads(),
                "step_ms": round(step * 1000, 1),
                "views_per_s": round(batch_views / step, 1),
                "ms": {phase: round(seconds * 1000, 1) for phase, seconds in phases.items()},
                "share": {phase: round(seconds / step, 3) for phase, seconds in phases.items()},
            }
        )
    )
    print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))


if __name__ == "__main__":
    main()
