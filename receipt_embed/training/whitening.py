"""Fitting ``model.whiten`` at the end of a run: each checkpoint gets the learned whitening of its
own backbone features on the clean training captures (receipt_embed.models.whitening says why)."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from receipt_embed.evaluation.retrieval import retrieval_metrics
from receipt_embed.evaluation.validation import embed_cache
from receipt_embed.fileio import atomic_write_json
from receipt_embed.locking import check_still_held
from receipt_embed.models.whitening import CannotWhiten, fit_whitening
from receipt_embed.training.checkpoint import load_checkpoint, save_checkpoint
from receipt_embed.training.rundir import WHITENING_FILE

WHITENING_KEYS = ("whitening.mean", "whitening.projection", "whitening.fitted")


def fit_checkpoint_whitening(trainer, checkpoint: Path, state: dict, fitted: dict | None = None) -> dict:
    """Fit the whitening of ``checkpoint``'s model (``state``, the checkpoint as loaded) on the trainer's
    training captures and write it back (atomically); returns its record: val recall@1 before and after
    (None when val cannot tell).
    ``fitted`` remembers fits by the weights they were made for: best.pt and last.pt are often the
    same epoch, and the fit (an embedding pass and two eigendecompositions) is then made once.
    Raises CannotWhiten when the training captures cannot show a receipt's spread."""
    model = copy.deepcopy(trainer.model)
    model.load_state_dict(state["model"])
    model.whitening.reset()
    fitted = {} if fitted is None else fitted
    key = _weights_digest(state["model"])
    if key not in fitted:
        features, _ = embed_cache(model, trainer.train_cache, trainer.config)
        mean, projection = fit_whitening(features, trainer.train_set.labels, model.whitening.out_dim)
        before = _val_recall(model, trainer)
        model.whitening.set(mean, projection)
        after = _val_recall(model, trainer)
        fitted[key] = (mean, projection, {"val_recall_at_1_before": before, "val_recall_at_1_after": after})
    mean, projection, record = fitted[key]
    model.whitening.set(mean, projection)
    weights = model.state_dict()
    for key in WHITENING_KEYS:
        state["model"][key] = weights[key].clone()
    check_still_held(trainer.run_dir)
    save_checkpoint(checkpoint, state)
    return {"epoch": state.get("epoch"), **record}


def _weights_digest(weights: dict) -> str:
    """sha256 of a model's weights and buffers, the whitening's own left out."""
    digest = hashlib.sha256()
    for name in sorted(weights):
        if name not in WHITENING_KEYS:
            tensor = weights[name].detach().cpu().contiguous()
            digest.update(name.encode() + str(tensor.dtype).encode() + str(tuple(tensor.shape)).encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@torch.no_grad()
def _val_recall(model, trainer) -> float | None:
    """None without val captures, or when no val receipt has two (nothing to find)."""
    if not len(trainer.val_set):
        return None
    features, _ = embed_cache(model, trainer.val_cache, trainer.config)
    return retrieval_metrics(features, np.asarray(trainer.val_set.labels), ks=(1,), with_map=False)["recall_at_1"]


def is_whitened(state: dict) -> bool:
    """Whether a loaded checkpoint holds a fit: training saves its checkpoints unwhitened, so a fitted one
    was whitened at the end of an earlier call of the same run, for these very weights."""
    return bool(state["model"].get("whitening.fitted", False))


def fit_run_whitening(trainer, checkpoints: list[Path]) -> None:
    """Whiten each of a finished run's checkpoints that is not whitened yet, record the fits in the run
    dir's ``whitening.json`` and say so in one line."""
    record_path = trainer.run_dir / WHITENING_FILE
    states = {path: load_checkpoint(path) for path in checkpoints}  # each read once
    kept = [path for path in checkpoints if is_whitened(states[path])]
    if len(kept) == len(checkpoints):  # e.g. --resume of a finished run: nothing trained since
        names = ", ".join(path.name for path in checkpoints)
        trainer.log(f"{names} already whitened when the run last ended: their fit is kept")
        return
    earlier = _earlier_records(record_path)
    try:
        fitted: dict = {}
        records = {
            path.name: earlier.get(path.name)
            if path in kept
            else fit_checkpoint_whitening(trainer, path, states[path], fitted)
            for path in checkpoints
        }
    except CannotWhiten as exc:
        trainer.log(f"model.whiten: the backbone features were not whitened: {exc}")
        return
    captures, receipts = len(trainer.train_set), len(trainer.train_set.identities)
    check_still_held(trainer.run_dir)
    atomic_write_json(
        record_path, {"training_captures": captures, "training_receipts": receipts, "checkpoints": records}
    )
    names = ", ".join(path.name for path in checkpoints if path not in kept)
    first = records[checkpoints[0].name] or {}
    before, after = first.get("val_recall_at_1_before"), first.get("val_recall_at_1_after")
    best = f" (val recall@1 {before:.3f} -> {after:.3f}, {checkpoints[0].name})" if None not in (before, after) else ""
    trainer.log(
        f"whitened the backbone features of {names} on {captures} training captures of {receipts} receipts{best}; "
        f"recorded in {record_path}"
    )


def _earlier_records(path: Path) -> dict:
    """The per-checkpoint records of an earlier fit in ``whitening.json`` ({} when absent or unreadable:
    they are a record, not an input)."""
    try:
        records = json.loads(path.read_text(encoding="utf-8")).get("checkpoints", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return records if isinstance(records, dict) else {}
