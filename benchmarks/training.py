"""Training throughput: can data loading keep up with the model?

Measures on a dataset dir (default: data_samples/ ingested into a temporary folder):
- loader views/s: augmented views out of the DataLoader with no model (train.num_workers
  workers), i.e. what the input pipeline can supply;
- train views/s: full training steps (forward, loss, backward, AdamW) fed by that loader.

    python benchmarks/training.py [--data DATASET_DIR] [--steps 30] [--set key=value ...]

Prints one JSON line. The end-to-end demo figures (wall time, held-out recall@1) come from
`receipt-embed demo`, timed with /usr/bin/time; see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from receipt_embed.config import load_config
from receipt_embed.ingest import ingest
from receipt_embed.plugin_manager import PluginLoader
from receipt_embed.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]


def _views_per_second(batches, steps: int, work=None) -> float:
    seen, started, iterator = 0, None, iter(batches)
    for step in range(steps + 2):
        try:
            views, labels = next(iterator)
        except StopIteration:
            iterator = iter(batches)
            views, labels = next(iterator)
        if step == 2:  # skip worker start-up and the first allocations
            started = time.perf_counter()
        if work is not None:
            work(views, labels)
        if step >= 2:
            seen += len(views)
    return seen / (time.perf_counter() - started)


def benchmark_trainer(config, data: str | None, tmp: str) -> Trainer:
    """A trainer of ``config`` with the built-in components on dataset dir ``data`` (default:
    data_samples/ ingested into ``tmp``), its run dir in ``tmp``; also used by profile_step.py."""
    loader = PluginLoader()
    loader.load_builtins()
    loader.collect_components()
    if data is None:
        data = Path(tmp) / "dataset"
        ingest(REPO / "data_samples", data, config.ingest)
    return Trainer(config, data, Path(tmp) / "run", loader.registry, progress=False, log=lambda m: None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=None)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    config = load_config(overrides=args.overrides)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = benchmark_trainer(config, args.data, tmp)
        batches = trainer._make_loader()
        loader_rate = _views_per_second(batches, args.steps)
        train_rate = _views_per_second(batches, args.steps, work=trainer._train_step)
    print(
        json.dumps(
            {
                "encoder": config.model.encoder,
                "image_size": list(config.data.image_size),
                "batch_views": len(next(iter(batches))[0]),
                "num_workers": config.train.num_workers,
                "threads": torch.get_num_threads(),
                "loader_views_per_s": round(loader_rate, 1),
                "train_views_per_s": round(train_rate, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
