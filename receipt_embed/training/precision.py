"""Which arithmetic a training step runs in: ``train.precision`` auto, fp32 or bf16.

bf16 autocast gives about 1.6x the training views/s of fp32 on a CPU with native bf16
instructions (AVX-512 BF16 or AMX); without them oneDNN emulates bf16 at 0.7x the views/s of fp32
(benchmarks/README.md, "bf16 by default"). ``auto`` therefore takes bf16 only where the CPU
has them, so the default is the faster one on every machine."""

from __future__ import annotations

import torch


def cpu_has_native_bf16() -> bool:
    """Whether this CPU runs bf16 matrix and convolution kernels natively (AVX-512 BF16 or AMX
    tiles): torch's own probes, which report False on a CPU or build that lacks them."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


def resolve_precision(setting: str, native_bf16: bool | None = None) -> str:
    """``fp32`` or ``bf16``: the setting itself, or for ``auto`` bf16 exactly when the CPU has
    native bf16 (``native_bf16``, probed when None)."""
    if setting != "auto":
        return setting
    if native_bf16 is None:
        native_bf16 = cpu_has_native_bf16()
    return "bf16" if native_bf16 else "fp32"


def describe_precision(setting: str, resolved: str) -> str:
    """The line a run logs at its start when ``train.precision`` is auto: what it chose and why."""
    if resolved == "bf16":
        why = "this CPU has native bf16 instructions (AVX-512 BF16 or AMX)"
    else:
        why = "this CPU has no native bf16 instructions, and emulated bf16 is slower than fp32"
    return f"train.precision {setting}: {resolved}, as {why}; set train.precision=fp32 or bf16 to choose"
