"""Checkpoints: written atomically, read with ``weights_only=True``, checked before use.

A checkpoint holds everything needed to continue a run exactly: model (encoder and head),
optimizer, scheduler, position (epoch and step), torch RNG state, loss state (e.g. the MoCo
queue), the momentum encoder when used, partial epoch sums, and the resolved config.
"""

from __future__ import annotations

import io
import math
import warnings
from pathlib import Path

import torch

from receipt_embed.display import shortened
from receipt_embed.errors import BadInput
from receipt_embed.fileio import atomic_open
from receipt_embed.userfiles import UnusableFile, open_regular

FORMAT_VERSION = 1
# the largest torchvision backbone here (convnext) with its optimizer state is about 1 GB
MAX_CHECKPOINT_BYTES = 8 * 1024**3


class CheckpointError(BadInput, RuntimeError):
    """A checkpoint is missing, corrupt, or from another architecture or config."""


def save_checkpoint(path: str | Path, state: dict) -> None:
    buffer = io.BytesIO()
    torch.save({"format_version": FORMAT_VERSION, **state}, buffer)
    with atomic_open(path, "wb") as handle:
        handle.write(buffer.getvalue())


def _torch_load(path: Path, handle) -> object:
    """``torch.load`` (weights only) from an open handle; any failure is a CheckpointError."""
    try:
        with warnings.catch_warnings():  # torch notes it validates a sparse tensor; one is refused by name below
            warnings.filterwarnings("ignore", message=".*[Ss]parse.*")
            return torch.load(handle, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for damaged archives; none may escape as a crash
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "weights_only" in reason or "Weights only load failed" in reason:
            reason = "it holds objects that a safe (weights_only) load refuses"
        raise CheckpointError(f"{path} is not a readable checkpoint (corrupt or truncated?): {reason}") from None


def _detached(state: object) -> object:
    """``train`` saves plain tensors; an ``nn.Parameter`` (``requires_grad``) in a hand-made file would
    make torch warn at every ``float(t)`` of the checks below, so each is replaced by its data."""
    pending, seen = [state], set()
    while pending:
        node = pending.pop()
        if id(node) in seen:  # a pickle may hold a list inside itself
            continue
        seen.add(id(node))
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in list(items):
            if torch.is_tensor(value) and value.requires_grad:
                node[key] = value.detach()
            elif isinstance(value, (dict, list)):
                pending.append(value)
    return state


def load_checkpoint(path: str | Path) -> dict:
    path = Path(path)
    try:
        handle = open_regular(path, MAX_CHECKPOINT_BYTES)  # a FIFO, device, folder or huge file is refused
    except UnusableFile as exc:
        if exc.reason == "missing_file":
            from receipt_embed.training.replacement import set_aside_advice

            advice = set_aside_advice(path)
            raise CheckpointError(f"checkpoint not found: {path}" + (f": {advice}" if advice else "")) from None
        raise CheckpointError(f"{path} is not a checkpoint: {exc.detail}") from None
    with handle:
        head = handle.read(4)
        if head[:2] != b"PK":  # torch.save writes a zip archive
            what = "an empty file" if not head else "not a zip archive as torch.save writes"
            raise CheckpointError(f"{path} is not a checkpoint: {what}")
        handle.seek(0)
        state = _detached(_torch_load(path, handle))
    # type, not ==: True == 1, and a bool is no format version
    version = state.get("format_version") if isinstance(state, dict) else None
    if type(version) is not int or version != FORMAT_VERSION:
        found = f"; its format_version is {shortened(repr(version))}" if version is not None else ""
        raise CheckpointError(f"{path} is not a receipt-embed checkpoint (format version {FORMAT_VERSION}{found})")
    check_contents(state, path)
    return state


def _article(name: str) -> str:
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _type_name(value) -> str:
    return "a tensor" if torch.is_tensor(value) else _article(type(value).__name__)


def _check_tensor_dict(value, key: str, path) -> None:
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: {key} is {_type_name(value)}, not a dict of tensors")
    for name, tensor in value.items():
        if not isinstance(name, str) or not torch.is_tensor(tensor):
            raise CheckpointError(f"{path}: {key}.{name} is {_type_name(tensor)}, not a tensor")
        _check_dense(tensor, f"{key}.{name}", path)
        _check_finite(tensor, f"{key}.{name}", path)
        if name.endswith("running_var"):
            _check_variance(tensor, f"{key}.{name}", path)


def _check_dense(tensor: torch.Tensor, name: str, path) -> None:
    """``train`` writes dense CPU tensors; a sparse one fails in torch's value checks ("Could not run
    'aten::ne.Scalar' ... 'SparseCPU'") and a meta one has no values at all: name the key instead."""
    if tensor.layout != torch.strided:
        layout = str(tensor.layout).removeprefix("torch.")
        kind = f"a sparse tensor ({layout})" if layout.startswith("sparse") else f"a {layout} tensor"
        raise CheckpointError(f"{path}: {name} is {kind}, the architecture needs a dense one")
    if tensor.device.type != "cpu":  # map_location="cpu" moves every real device; a meta tensor stays
        raise CheckpointError(
            f"{path}: {name} is a tensor on the {tensor.device.type} device, which holds no values; "
            "the checkpoint is corrupt"
        )


def _check_variance(tensor: torch.Tensor, name: str, path) -> None:
    """A BatchNorm variance below 0 makes every embedding NaN, which then reads as the images' fault."""
    if tensor.is_floating_point() and tensor.numel() and bool((tensor < 0).any()):
        raise CheckpointError(f"{path}: {name} holds negative values; the checkpoint is corrupt")


# trained weights stay many orders of magnitude below this; a flipped exponent bit does not
MAX_WEIGHT_MAGNITUDE = 1e20


def _check_finite(tensor: torch.Tensor, name: str, path) -> None:
    """A bit-flipped checkpoint loads, then fails far away ("SVD did not converge"): name it here."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return
    if not bool(torch.isfinite(tensor).all()):
        raise CheckpointError(f"{path}: {name} holds NaN or Inf values; the checkpoint is corrupt")
    if float(tensor.abs().max()) > MAX_WEIGHT_MAGNITUDE:
        raise CheckpointError(f"{path}: {name} holds values beyond {MAX_WEIGHT_MAGNITUDE:g}; the checkpoint is corrupt")


def check_contents(state: dict, path) -> None:
    """What every use of a checkpoint needs: a config dict and the model's tensors."""
    for key in ("config", "model"):
        if key not in state:
            raise CheckpointError(f"{path} lacks {key!r}: not a checkpoint written by `receipt-embed train`")
    if not isinstance(state["config"], dict):
        raise CheckpointError(f"{path}: config is {_type_name(state['config'])}, not a dict")
    for section in ("model", "data"):
        if not isinstance(state["config"].get(section), dict):
            raise CheckpointError(f"{path}: config.{section} is missing or not a dict")
    _check_tensor_dict(state["model"], "model", path)


# what resuming a run reads besides the model, and the type each must have
RESUME_KEYS = {
    "optimizer": dict,
    "scheduler": dict,
    "loss": dict,
    "epoch": int,
    "step": int,
    "sums": dict,
    "torch_rng": torch.Tensor,
}


def check_resumable(state: dict, path) -> None:
    """The keys ``train --resume`` restores, by type, so a wrong one is named before any is used."""
    for key, kind in RESUME_KEYS.items():
        if key not in state:
            raise CheckpointError(f"{path} lacks {key!r}, which --resume needs")
        value = state[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            wanted = "a tensor" if kind is torch.Tensor else _article(kind.__name__)
            raise CheckpointError(f"{path}: {key} is {_type_name(value)}, --resume needs {wanted}")
    for key in ("epoch", "step"):
        if state[key] < 0:
            raise CheckpointError(f"{path}: {key} is {state[key]}; --resume needs a count of 0 or more")
    _check_best(state.get("best"), state["epoch"], path)
    _check_schedule(state, path)
    spent = state.get("spent_seconds", 0.0)  # absent in checkpoints written before time budgets
    if not isinstance(spent, (int, float)) or isinstance(spent, bool) or not math.isfinite(spent) or spent < 0:
        raise CheckpointError(f"{path}: spent_seconds is {spent!r}; --resume needs a finite number of 0 or more")
    _check_sums(state["sums"], path)
    if "momentum_model" in state:
        _check_tensor_dict(state["momentum_model"], "momentum_model", path)


def _check_best(best, epoch: int, path) -> None:
    """The best epoch so far: None, or an epoch already done with a recall in [0, 1] (an ``inf`` there
    would keep every later epoch from ever being selected)."""
    if best is None:
        return
    if not isinstance(best, dict):
        raise CheckpointError(f"{path}: best is {_type_name(best)}, not a dict or None")
    best_epoch, recall = best.get("epoch"), best.get("recall_at_1")
    if type(best_epoch) is not int or not 1 <= best_epoch <= epoch:
        raise CheckpointError(f"{path}: best.epoch is {best_epoch!r}; --resume needs an epoch in 1..{epoch}")
    if not isinstance(recall, (int, float)) or isinstance(recall, bool) or not 0.0 <= recall <= 1.0:
        raise CheckpointError(f"{path}: best.recall_at_1 is {recall!r}; --resume needs a recall in [0, 1]")


def _numbers(value):
    """Every int and float (not bool) in ``value``, through lists, tuples and dicts."""
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _numbers(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _numbers(item)


def _check_schedule(state: dict, path) -> None:
    """The learning-rate schedule's position and base rates, and the optimizer's hyperparameters:
    finite and not negative (a negative step or rate would train uphill, NaN would poison every weight)."""
    last = state["scheduler"].get("last_epoch")
    if type(last) is not int or last < 0:
        raise CheckpointError(f"{path}: scheduler.last_epoch is {last!r}; --resume needs a step count of 0 or more")
    for where, value in (
        ("scheduler.base_lrs", state["scheduler"].get("base_lrs", [])),
        ("optimizer.param_groups", state["optimizer"].get("param_groups", [])),
    ):
        bad = next((n for n in _numbers(value) if not math.isfinite(n) or n < 0), None)
        if bad is not None:
            raise CheckpointError(f"{path}: {where} holds {bad}; --resume needs finite numbers of 0 or more")


SUMS = {"loss": (int, float), "steps": (int,), "views": (int,), "seconds": (int, float)}


def _check_sums(sums: dict, path) -> None:
    """The running sums of the epoch in progress: numbers, none negative but the loss."""
    for key, kinds in SUMS.items():
        value = sums.get(key)
        if not isinstance(value, kinds) or isinstance(value, bool):
            raise CheckpointError(f"{path}: sums.{key} is {_type_name(value)}, --resume needs a number")
        if not math.isfinite(value):
            raise CheckpointError(f"{path}: sums.{key} is {value}; --resume needs a finite number")
        if key != "loss" and value < 0:
            raise CheckpointError(f"{path}: sums.{key} is {value}; --resume needs 0 or more")
    if sums["steps"] == 0 and (sums["loss"] != 0 or sums["views"] != 0):  # nothing summed before a first step
        raise CheckpointError(
            f"{path}: sums has loss {sums['loss']} and views {sums['views']} over 0 steps; a run has 0 and 0 there"
        )
    if not isinstance(sums.get("loss_stats", {}), dict):
        raise CheckpointError(f"{path}: sums.loss_stats is {_type_name(sums['loss_stats'])}, not a dict")


def _shape(tensor) -> str:
    return "(" + ",".join(str(n) for n in tensor.shape) + ")"


def load_weights(module: torch.nn.Module, weights: dict, path, key: str = "model") -> None:
    """``module.load_state_dict`` after naming the first key or shape that does not fit, e.g.
    "model.encoder.conv1.weight has shape (8,1,3,3), the architecture needs (16,1,3,3)"."""
    check_weights_fit(module.state_dict(), weights, path, key)
    try:
        module.load_state_dict(weights)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: {key} cannot be loaded: {str(exc).strip().splitlines()[0]}") from None


def check_weights_fit(wanted: dict, weights: dict, path, key: str = "model") -> None:
    """Every key, shape and dtype of ``weights`` against ``wanted`` (a state dict, which may be on
    torch's meta device: then a mismatch is named before the model takes any memory)."""
    for name, tensor in wanted.items():
        if name not in weights:
            raise CheckpointError(f"{path}: {key}.{name} is missing; the checkpoint is from another architecture")
        if tuple(weights[name].shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"{path}: {key}.{name} has shape {_shape(weights[name])}, the architecture needs {_shape(tensor)}"
            )
        if weights[name].dtype != tensor.dtype:  # load_state_dict casts: int64 weights would load as whole numbers
            raise CheckpointError(
                f"{path}: {key}.{name} holds {str(weights[name].dtype).removeprefix('torch.')} values, the "
                f"architecture needs {str(tensor.dtype).removeprefix('torch.')}"
            )
    extra = [name for name in weights if name not in wanted]
    if extra:
        raise CheckpointError(
            f"{path}: {key}.{extra[0]} is not part of the architecture ({len(extra)} unexpected keys)"
        )
