"""Plugins' ``on_epoch_end`` hooks, called after each epoch's line and checkpoints are written."""

from __future__ import annotations

import json


def call_epoch_hooks(registry, run_dir, line: dict, model, config) -> None:
    """Plugins' ``on_epoch_end`` (trackers, checkpoint copies); one failing plugin only warns. They get
    a copy of the epoch's line and the model in eval mode."""
    from receipt_embed.plugin_manager import call_hook, hook_implementations

    if not hook_implementations(registry, "on_epoch_end"):
        return
    model.eval()
    call_hook(
        registry,
        "on_epoch_end",
        where=f"epoch {line['epoch']}",
        run_dir=run_dir.resolve(),
        epoch=line["epoch"],
        metrics=json.loads(json.dumps(line)),
        model=model,
        config=config,
    )
