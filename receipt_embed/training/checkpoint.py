"""Checkpoints: written atomically, read with ``weights_only=True``, checked before use.

A checkpoint holds everything needed to continue a run exactly: model (encoder and head),
optimizer, scheduler, position (epoch and step), torch RNG state, loss state (e.g. the MoCo
queue), the momentum encoder when used, partial epoch sums, and the resolved config.
"""

from __future__ import annotations

import io
from pathlib import Path

import torch

from receipt_embed.fileio import atomic_open
from receipt_embed.userfiles import UnusableFile, open_regular

FORMAT_VERSION = 1
# config sections that define the model's shape; a mismatch makes a checkpoint unusable
ARCHITECTURE_KEYS = (
    ("model", "encoder"), ("model", "pooling"), ("model", "grid"), ("model", "head_hidden"),
    ("model", "head_dim"), ("model", "input_norm"), ("model", "params"), ("data", "image_size"), ("data", "grayscale"),
)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or from another architecture or config."""


def save_checkpoint(path: str | Path, state: dict) -> None:
    buffer = io.BytesIO()
    torch.save({"format_version": FORMAT_VERSION, **state}, buffer)
    with atomic_open(path, "wb") as handle:
        handle.write(buffer.getvalue())


def _torch_load(path: Path, handle) -> object:
    """``torch.load`` (weights only) from an open handle; any failure is a CheckpointError."""
    try:
        return torch.load(handle, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for damaged archives; none may escape as a crash
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "weights_only" in reason or "Weights only load failed" in reason:
            reason = "it holds objects that a safe (weights_only) load refuses"
        raise CheckpointError(f"{path} is not a readable checkpoint (corrupt or truncated?): {reason}") from None


def load_checkpoint(path: str | Path) -> dict:
    path = Path(path)
    try:
        handle = open_regular(path, None)  # a FIFO, device or folder is refused, never read
    except UnusableFile as exc:
        if exc.reason == "missing_file":
            raise CheckpointError(f"checkpoint not found: {path}") from None
        raise CheckpointError(f"{path} is not a checkpoint: {exc.detail}") from None
    with handle:
        head = handle.read(4)
        if head[:2] != b"PK":  # torch.save writes a zip archive
            what = "an empty file" if not head else "not a zip archive as torch.save writes"
            raise CheckpointError(f"{path} is not a checkpoint: {what}")
        handle.seek(0)
        state = _torch_load(path, handle)
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path} is not a receipt-embed checkpoint (format version {FORMAT_VERSION})")
    return state


def architecture(config: dict) -> dict:
    # model.params came later: a config without it had none
    return {".".join(key): config[key[0]].get(key[1], {} if key[1] == "params" else None) for key in ARCHITECTURE_KEYS}


def check_compatible(state: dict, config: dict, path: str | Path) -> None:
    """Refuse a checkpoint whose model shape differs from the config's, naming the keys."""
    saved, wanted = architecture(state["config"]), architecture(config)
    diffs = [f"{key}: checkpoint has {saved[key]!r}, config has {wanted[key]!r}" for key in saved if saved[key] != wanted[key]]
    if diffs:
        raise CheckpointError(f"{path} was trained with another architecture: " + "; ".join(diffs))

