"""Sweeps: train once per value of one config key and pick by val retrieval.

Losses at different temperatures are on different scales and never compared; each run's
best val recall@1 (of ``train.select_on`` features) decides.
"""

from __future__ import annotations

import os
import re
import shlex
from collections import Counter
from pathlib import Path

from receipt_embed.config import MAX_CONFIG_DEPTH, ConfigError, config_with, key_levels
from receipt_embed.display import quoted, shortened
from receipt_embed.errors import BadInput
from receipt_embed.fileio import atomic_write_json
from receipt_embed.training.checkpoint import CheckpointError
from receipt_embed.training.resume import open_run
from receipt_embed.training.rundir import check_run_out
from receipt_embed.training.trainer import TrainingInterrupted, train

SWEEP_FILE = "sweep.json"

# keys every run of a sweep shares, whatever the value: read once, before the first value trains
UNSWEPT_KEYS = {
    "plugins": (
        "plugins are loaded once, before the first value trains, so every run would use the same ones; "
        "give the folder with --set or --plugins-dir and sweep another key"
    ),
    **dict.fromkeys(
        ("ingest.split_ratios", "ingest.seed", "ingest.allow_absolute_paths", "ingest.merge_duplicates"),
        "train uses a dataset split once (by `ingest`, or by train itself before the first value), so every "
        "run would use the same one; ingest once per value and train on each dataset dir",
    ),
}


def parse_sweep(spec: str) -> tuple[str, list[str]]:
    """``loss.temperature=0.05,0.1,0.2`` -> (key, values); a value given twice is refused up front."""
    key, _, raw = spec.partition("=")
    plain = re.sub(r"\$\{[^{}]*\}", "", raw)  # an interpolation ${...} is a value, not a mapping
    if any(bracket in plain for bracket in "[]{}"):  # values are split at commas: [64,32] would be cut in two
        raise ConfigError(
            f"--sweep {quoted(shortened(spec))}: list and mapping values cannot be swept (values are split "
            "at commas); sweep a number or a name, or train once per value with --set"
        )
    values = [v.strip() for v in raw.split(",") if v.strip()]
    if not key.strip() or len(values) < 2:
        raise ConfigError(f"--sweep expects key=value1,value2[,...], got {quoted(spec)}")
    if key_levels(key) > MAX_CONFIG_DEPTH:  # as --set refuses it (the config library recurses on each part)
        raise ConfigError(
            f"--sweep {quoted(shortened(spec))}: the key path is nested more than {MAX_CONFIG_DEPTH} levels deep; "
            "a config never needs that"
        )
    _refuse_shared_key(key.strip(), spec)
    seen: set[str] = set()
    for value in values:
        if value in seen:
            raise ConfigError(f"--sweep gives the value {quoted(value)} more than once; give each value once")
        seen.add(value)
    names = [run_name(key.strip(), v) for v in values]
    counts = Counter(names)
    clash = next((n for n in names if counts[n] > 1), None)
    if clash is not None:
        raise ConfigError(
            f"--sweep values {', '.join(quoted(v) for v, n in zip(values, names) if n == clash)} "
            f"would share the run dir {clash}; give values that differ in letters or digits"
        )
    return key.strip(), values


def _refuse_shared_key(key: str, spec: str) -> None:
    """A key no value can change (``plugins.dir``) would train the same run once per value, record a
    different value in each run's config.yaml and still select a winner: refused up front."""
    for shared, why in UNSWEPT_KEYS.items():
        if key == shared or key.startswith(f"{shared}."):
            raise ConfigError(
                f"--sweep {quoted(shortened(spec))}: {shortened(key)} cannot differ between the runs of a sweep: {why}"
            )


def run_name(key: str, value: str) -> str:
    """The run dir name of one sweep value, always one plain name inside OUT: ``KEY=VALUE`` with
    every character other than letters, digits and ``.,_+-=`` replaced by ``_`` (a value such as
    ``../x`` or ``a/b`` can never name a dir elsewhere), and a leading dot made ``_``."""
    name = re.sub(r"[^A-Za-z0-9.,_+\-=]", "_", f"{key}={value}")[:200]
    return "_" + name[1:] if name.startswith(".") else name


def run_sweep(
    spec: str,
    config,
    data_dir,
    out_dir,
    registry,
    progress=True,
    log=print,
    force: bool = False,
) -> dict:
    """One run per value into OUT/KEY=VALUE (``force`` replaces existing ones), under OUT's
    writer lock, then OUT/sweep.json. ``config`` is the resolved config every run starts from."""
    from receipt_embed.locking import write_lock
    from receipt_embed.training.rundir import refuse_dataset_inside

    with write_lock(out_dir):
        check_run_out(out_dir, sweep=True)
        refuse_dataset_inside(out_dir, data_dir)
        return _run_sweep(spec, config, data_dir, out_dir, registry, progress, log, force)


def _run_sweep(spec, config, data_dir, out_dir, registry, progress, log, force) -> dict:
    key, values = parse_sweep(spec)
    configs = [_swept(config, key, value) for value in values]  # validate all first
    _refuse_equal_values(key, values, configs)
    for value, swept in zip(values, configs):
        _check_components(swept, registry, key, value)
    out_dir = Path(out_dir)
    for value in values:  # and refuse an existing run of any value before the first one trains
        check_run_out(out_dir / run_name(key, value))
        try:
            open_run(out_dir / run_name(key, value), resume=False, force=force, world_size=1)
        except CheckpointError:  # the trainer's advice (--resume) does not apply: --sweep cannot resume
            raise CheckpointError(
                f"{out_dir / run_name(key, value)} already holds a run of this sweep: pass --force to sweep every "
                f"value anew, continue that value's run on its own with `receipt-embed train --out "
                f"{shlex.quote(str(out_dir / run_name(key, value)))} --resume`, or choose another --out"
            ) from None
    _refuse_an_earlier_sweep(out_dir, force)
    runs = []
    for value, config in zip(values, configs):
        run_dir = out_dir / run_name(key, value)
        log(f"sweep {key}={value} -> {run_dir}")
        try:
            result = train(config, data_dir, run_dir, registry, progress=progress, log=log, force=force)
        except TrainingInterrupted as exc:
            raise _sweep_stopped(exc, out_dir, run_dir, [run["value"] for run in runs]) from None
        runs.append(
            {
                "value": value,
                "run_dir": str(run_dir),
                "best_recall_at_1": result.best_recall_at_1,
                "best_epoch": result.best_epoch,
                "checkpoint": str(run_dir / "checkpoints" / "best.pt"),
            }
        )
    scored = [run for run in runs if run["best_recall_at_1"] is not None]
    best = max(scored, key=lambda run: run["best_recall_at_1"]) if scored else None
    summary = {
        "key": key,
        "select_on": configs[0].train.select_on,
        "metric": "val recall_at_1",
        "runs": runs,
        "best": best,
    }
    atomic_write_json(out_dir / SWEEP_FILE, summary)
    return summary


def _refuse_an_earlier_sweep(out_dir: Path, force: bool) -> None:
    """An OUT/sweep.json of an earlier sweep (of another key, or other values) is its only record of
    which run won: replaced only with --force (the earlier sweep's run dirs stay)."""
    record = out_dir / SWEEP_FILE
    if force or not os.path.lexists(record):
        return
    raise BadInput(
        f"{out_dir} already holds the record of a sweep ({record}): pass --force to replace it "
        "(that sweep's run dirs stay), or choose another --out"
    )


def _sweep_stopped(exc: TrainingInterrupted, out_dir: Path, run_dir: Path, done: list[str]) -> TrainingInterrupted:
    """The stop of a sweep, with advice that works: ``train --sweep`` refuses ``--resume`` (so the
    trainer's "continue with --resume" does not apply), but the interrupted value's run dir resumes
    on its own, and the sweep reruns with ``--force``."""

    finished = f"values done: {', '.join(done)}; " if done else ""
    stopped = TrainingInterrupted(
        f"{str(exc).removesuffix('; continue with --resume')}; the sweep stopped there ({finished}no "
        f"{out_dir / SWEEP_FILE} written; --sweep cannot --resume): finish this value with "
        f"`receipt-embed train --out {shlex.quote(str(run_dir))} --resume`, or sweep every value anew by "
        "running the same `train --sweep` with --force"
    )
    stopped.code = exc.code
    return stopped


def _swept(config, key: str, value: str):
    """``config`` with ``key=value``; a value it cannot take is refused naming --sweep and the value."""
    try:
        return config_with(config, [f"{key}={value}"], flag="--sweep")
    except ConfigError as exc:
        where = f"--sweep '{shortened(f'{key}={value}')}'"
        raise ConfigError(str(exc) if where in str(exc) else f"{where}: {exc}") from None


def _check_components(config, registry, key: str, value: str) -> None:
    """Every component a value selects exists (``model.encoder=receipt_cnn,typo``): the command
    line checks the config the sweep starts from, not each value, before the first one trains."""
    from receipt_embed.kinds import check_selected_components
    from receipt_embed.registry import ComponentError

    try:
        check_selected_components(config, registry)
    except ComponentError as exc:
        raise ConfigError(f"--sweep '{shortened(f'{key}={value}')}': {exc}") from None


def _refuse_equal_values(key: str, values: list[str], configs: list) -> None:
    """Two values the config reads as one (``0.1`` and ``0.10``, ``1`` and ``1.0`` for a number)
    would train the same run twice: refused, naming both as given."""
    seen: dict[str, str] = {}
    for value, swept in zip(values, configs):
        node = swept.model_dump(mode="json")
        try:
            for part in key.split("."):
                node = node[part]
        except (KeyError, TypeError, IndexError):  # not a path into the config's sections: nothing to compare
            return
        read = repr(node)
        if read in seen:
            raise ConfigError(
                f"--sweep values {quoted(seen[read])} and {quoted(value)} of {key} are the same value ({read}); "
                "give each value once"
            )
        seen[read] = value


def format_sweep(summary: dict) -> str:
    rows = [f"{summary['key']:<20} val recall@1 ({summary['select_on']})  best epoch  run"]
    for run in summary["runs"]:
        mark = "  <- selected" if summary["best"] == run else ""
        recall = "-" if run["best_recall_at_1"] is None else f"{run['best_recall_at_1']:.3f}"
        rows.append(f"{run['value']:<20} {recall:<25} {str(run['best_epoch']):<11} {run['run_dir']}{mark}")
    return "\n".join(rows)
