"""What a checkpoint holds of a run in progress, and putting it back on ``--resume``.

Besides the weights: the loss's, optimizer's and schedule's state, the epoch and step, the
epoch's running sums, the best epoch so far and the torch RNG, so a resumed run continues
exactly where the interrupted one stopped.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from receipt_embed.fileio import read_jsonl_tail_tolerant
from receipt_embed.training.checkpoint import CheckpointError, check_resumable, load_weights
from receipt_embed.training.rundir import METRICS_FILE


def run_state(trainer) -> dict:
    """The checkpoint of ``trainer`` (a :class:`~receipt_embed.training.trainer.Trainer`) as it is now."""
    return {
        "model": trainer.model.state_dict(),
        **({"momentum_model": trainer.key_model.state_dict()} if trainer.key_model is not None else {}),
        "loss": trainer.loss_fn.state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.scheduler.state_dict(),
        "epoch": trainer.epoch,
        "step": trainer.step,
        "sums": dict(trainer.sums),
        "best": trainer.best,
        "spent_seconds": trainer.budget.spent(),  # against train.max_minutes, carried on by --resume
        "torch_rng": torch.get_rng_state(),
        "config": trainer.config_dict,
        "world_size": trainer.ctx.world_size,
        **trainer.data_record,  # data_dir and manifest_sha256: --resume refuses a data.json naming another dataset
    }


def restore_state(trainer, state: dict, path: Path) -> None:
    """Put checkpoint ``state`` (read from ``path``) back into ``trainer``; each part that does not
    fit is a CheckpointError naming it."""
    check_resumable(state, path)
    load_weights(trainer.model, state["model"], path)
    if trainer.key_model is not None:
        if "momentum_model" not in state:
            raise CheckpointError(f"{path} lacks 'momentum_model', which the loss {trainer.config.loss.name!r} needs")
        load_weights(trainer.key_model, state["momentum_model"], path, "momentum_model")
    for key, target in (("loss", trainer.loss_fn), ("optimizer", trainer.optimizer), ("scheduler", trainer.scheduler)):
        try:
            target.load_state_dict(state[key])
        except (KeyError, IndexError, RuntimeError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: {key} does not fit this run: {str(exc).strip().splitlines()[0]}") from None
    if state["step"] > trainer.steps_per_epoch:
        raise CheckpointError(
            f"{path}: step is {state['step']}, but an epoch of this run has {trainer.steps_per_epoch} steps"
        )
    trainer.epoch, trainer.step = state["epoch"], state["step"]
    trainer.sums = dict(state["sums"])
    trainer.best = state.get("best")
    try:
        torch.set_rng_state(state["torch_rng"])
    except (RuntimeError, TypeError) as exc:
        raise CheckpointError(
            f"{path}: torch_rng is not a torch RNG state: {str(exc).strip().splitlines()[0]}"
        ) from None
    if trainer.ctx.is_main:  # rank 0 alone reads and writes the run's files
        trainer.confirmed_metrics = drop_unconfirmed_metrics(trainer.run_dir, trainer.epoch)


def drop_unconfirmed_metrics(run_dir: Path, epoch: int) -> list[dict] | None:
    """Metrics of epochs after the checkpoint were never confirmed (nor a torn last line): the rows
    to keep when some are dropped, else None. The trainer writes them with the resumed run's first
    epoch line, so a resume refused or stopped before then leaves the file as it found it."""
    metrics = Path(run_dir) / METRICS_FILE
    if not metrics.exists():
        return None
    rows, torn = read_jsonl_tail_tolerant(metrics)
    bad = [n for n, m in enumerate(rows, start=1) if not isinstance(m, dict) or type(m.get("epoch")) is not int]
    if bad:
        raise CheckpointError(f"{metrics}, line {bad[0]}: not an epoch record; move the file aside to resume")
    for line, (before, row) in enumerate(zip(rows, rows[1:]), start=2):  # one run logs each epoch once, in order
        if row["epoch"] <= before["epoch"]:
            raise CheckpointError(
                f"{metrics}, line {line}: epoch {row['epoch']} after epoch {before['epoch']} on line {line - 1}; "
                "a run logs each epoch once, in order, so this log is not one run's: move the file aside to resume"
            )
    logged = max((m["epoch"] for m in rows), default=0)
    if epoch > logged:  # last.pt is saved after its epoch's line: a checkpoint ahead of the log is not this run's
        torn_line = " (its torn last line dropped)" if torn else ""
        raise CheckpointError(
            f"{Path(run_dir) / 'checkpoints' / 'last.pt'}: epoch is {epoch}, but {metrics} records epochs up to "
            f"{logged}{torn_line}; the checkpoint does not belong to this run's log: train afresh with --force, "
            "or into another --out"
        )
    kept = [m for m in rows if m["epoch"] <= epoch]
    if len(kept) < len(rows):  # a crash after an epoch's line, before its checkpoint: said, as a torn line is
        warnings.warn(
            f"dropped {len(rows) - len(kept)} metrics line(s) past the checkpoint's epoch {epoch} from {metrics} "
            "(no checkpoint holds their epochs; they are trained again)"
        )
    return kept if torn or len(kept) < len(rows) else None
