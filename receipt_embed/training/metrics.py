"""What a run logs: the running sums of an epoch, its line in ``metrics.jsonl``, and the line printed."""

from __future__ import annotations


def fresh_sums() -> dict:
    """What an epoch adds up as it goes (kept in checkpoints, so a resumed epoch reports it whole)."""
    return {"loss": 0.0, "steps": 0, "views": 0, "seconds": 0.0}


def describe_epoch(line: dict) -> str:
    """The one line printed per epoch."""
    text = f"epoch {line['epoch']}: loss {line['loss']:.4f}, {line['views_per_s']:.0f} views/s"
    if "val" in line:
        v = line["val"]
        text += (
            f", val recall@1 backbone {_figure(v['backbone']['recall_at_1'])} / head {_figure(v['head']['recall_at_1'])}"
            f", eff. rank {v['diagnostics']['head']['effective_rank']:.1f}"
        )
    return text


def _figure(value) -> str:
    """A recall, or why there is none: a val split whose receipts have one capture each has no query."""
    return "n/a (no val receipt has two captures)" if value is None else f"{value:.3f}"


def epoch_line(epoch: int, sums: dict, optimizer, sampler, ctx, rank_batches) -> dict:
    """The training figures of epoch ``epoch`` (0-based; ``val`` is added by evaluation)."""
    line = {
        "epoch": epoch + 1,
        "steps": sums["steps"],
        "loss": sums["loss"] / max(sums["steps"], 1),
        "lr": optimizer.param_groups[0]["lr"],
        "views_per_s": sums["views"] / max(sums["seconds"], 1e-9),
        "train_seconds": sums["seconds"],
        "sampler": dict(getattr(sampler, "stats", {})),
    }
    if "loss_stats" in sums:
        line["loss_stats"] = sums["loss_stats"]
    line["world_size"] = ctx.world_size
    if ctx.distributed and rank_batches is not None and sums["steps"]:
        # the loader may run ahead of training by a few prefetched batches; the count
        # is per global batch drawn this epoch
        line["global_unique_identities_per_step"] = rank_batches.unique_identities / sums["steps"]
        rank_batches.unique_identities = 0
    return line
