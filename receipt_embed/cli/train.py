"""``receipt-embed train``: contrastive training on a dataset dir."""

from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path

import click

from receipt_embed.cli.app import current_app
from receipt_embed.cli.options import (
    DatasetDirPath,
    GivenPath,
    InputError,
    check_components,
    config_options,
    load_registry,
    resolve_config,
)
from receipt_embed.config import config_with
from receipt_embed.display import printable, printable_lines, quoted, shortened
from receipt_embed.errors import BadInput
from receipt_embed.orphans import PARENT_PID_ENV, stop_with_parent

# ranks on one machine: each is a whole torch process; far more is a fork bomb, not a speed-up
MAX_NPROC = 64


def ensure_dataset(data_dir: str | None, out_dir: Path, config, progress: bool, log) -> Path:
    """A dataset dir to train on: the given one, or data_samples/ ingested into OUT/dataset."""
    if data_dir is not None:
        return Path(data_dir)
    from receipt_embed.cli.demo import find_samples
    from receipt_embed.ingest import ingest

    samples = find_samples()
    if samples is None:
        raise InputError("no --data given and data_samples/ not found; run `receipt-embed ingest` first")
    target = out_dir / "dataset"
    log(f"no --data given: ingesting {samples} into {target}")
    ingest(samples, target, config.ingest, progress=progress, force=True)  # the run's own copy of the samples
    return target


def settle_interrupted(out_dir) -> None:
    """Give back the run an interrupted ``train --force`` set aside before --resume reads the run's
    data.json and config.yaml (else it reads those of the run that never wrote a checkpoint)."""
    from receipt_embed.locking import write_lock
    from receipt_embed.training.replacement import leftovers_of, settle_leftovers

    if leftovers_of(out_dir):
        with write_lock(out_dir):
            settle_leftovers(out_dir, log=lambda message: click.echo(printable(f"Warning: {message}"), err=True))


def plugins_to_load(app, configured: str | None) -> str | None:
    """The plugins folder a run imports, made absolute to be recorded: --plugins-dir, else the
    config's, else ./plugins when it holds plugins (a run dir's own record is never one)."""
    if app.plugins_dir_option:
        return str(Path(app.plugins_dir_option).resolve())
    if configured is None and any(Path("plugins").glob("*.py")):
        return str(Path("plugins").resolve())
    return configured


def worker_message(exc: Exception) -> str:
    """An error re-raised from a DataLoader worker carries the worker's traceback in its
    message; the user needs its last line."""
    text = str(exc)
    if text.startswith("Caught ") and "Original Traceback" in text:
        last = text.strip().splitlines()[-1]
        return last.split(": ", 1)[1] if ": " in last else last
    return text


@click.command()
@click.option(
    "--data",
    "data_dir",
    type=DatasetDirPath(),
    default=None,
    help="Dataset dir from `ingest` [data_samples/, ingested on the fly].",
)
@click.option(
    "--out",
    "out_dir",
    type=GivenPath(file_okay=False),
    default="runs/train",
    show_default=True,
    help="Run dir: config.yaml, metrics.jsonl, checkpoints/.",
)
@click.option(
    "--resume",
    is_flag=True,
    help="Continue the run in --out from checkpoints/last.pt, with the run's config.yaml (unless --config).",
)
@click.option(
    "--sweep",
    "sweeps",
    multiple=True,  # taken as often as given, so a second one is refused rather than silently replacing the first
    metavar="KEY=V1,V2,...",
    help="Train once per value (e.g. loss.temperature=0.05,0.1,0.2) into OUT/KEY=V; pick by val recall@1. "
    "One key per sweep.",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress bars; one log line per epoch.")
@click.option(
    "--nproc",
    type=click.IntRange(min=1, max=MAX_NPROC),
    default=1,
    show_default=True,
    help=f"Processes on this machine (torch.distributed via torchrun; gloo on CPU, nccl on GPU), at most {MAX_NPROC}.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Replace the run in --out: its files are set aside and deleted only once the new run has written "
    "its first checkpoint (restored if it stops before).",
)
@config_options
@click.pass_context
def train(ctx, data_dir, out_dir, resume, sweeps, quiet, nproc, force, config_file, overrides):
    """Train an encoder so that captures of one receipt embed close together.

    SIGINT/SIGTERM save checkpoints/last.pt and stop (exit code 130 for SIGINT, 143 for SIGTERM); --resume continues.
    --nproc N (or `torchrun --nproc-per-node N -m receipt_embed train ...`) splits each global
    batch over N processes; the loss still sees the whole batch. Needs --data.
    One writer per run dir: a second `train` into the same --out is refused while the first runs."""
    import os

    if len(sweeps) > 1:
        raise InputError(
            f"--sweep is given {len(sweeps)} times ({', '.join(quoted(shortened(item)) for item in sweeps)}); "
            "a sweep trains once per value of one key: give one --sweep"
        )
    sweep = sweeps[0] if sweeps else None
    if sweep is not None:  # a spec it refuses, before the config is read or anything is ingested or trained
        from receipt_embed.training.sweep import parse_sweep

        try:
            parse_sweep(sweep)
        except BadInput as exc:
            raise InputError(str(exc)) from None
    from receipt_embed.distributed import env_context, rendezvous_timeout

    try:  # a bad or stray torch.distributed variable is one line naming it, before anything starts
        world = env_context().world_size
        rendezvous_timeout()
    except BadInput as exc:
        raise InputError(str(exc)) from None
    if world > 1 and os.environ.get(PARENT_PID_ENV, "").isdigit():  # a rank of train --nproc: stop with torchrun
        stop_with_parent(int(os.environ[PARENT_PID_ENV]))
    data_dir = _data_dir_of(out_dir, data_dir, resume, sweep)
    if nproc > 1 or world > 1:
        if data_dir is None:
            raise InputError("distributed training needs --data DATASET_DIR (run `receipt-embed ingest` first)")
        if sweep is not None:
            raise InputError("--sweep runs one process per value; it cannot be combined with --nproc")
    config, registry = _config_and_registry(ctx, out_dir, resume, config_file, overrides)
    if resume and force:
        raise InputError("--resume continues the run in --out and --force replaces it: give one of them")
    from receipt_embed.locking import write_lock

    main = int(os.environ.get("RANK", "0")) == 0
    try:
        with write_lock(out_dir) if main else nullcontext():  # reentrant: train() takes it again
            _train(
                config,
                registry,
                data_dir,
                Path(out_dir),
                resume,
                sweep,
                quiet,
                nproc,
                force,
                world,
            )
    except BadInput as exc:  # the lock is held by another writer, or the disk is full
        raise InputError(str(exc)) from None


def _data_dir_of(out_dir, data_dir, resume: bool, sweep):
    """--data, or on --resume the dataset the run records; the run dir is checked first (before
    its config.yaml or data.json is read) and an interrupted --force is settled."""
    import os

    from receipt_embed.training.rundir import check_run_out

    try:
        check_run_out(out_dir, sweep=sweep is not None)
        if resume and int(os.environ.get("RANK", "0")) == 0:
            settle_interrupted(out_dir)
    except BadInput as exc:
        raise InputError(str(exc)) from None
    if not resume or data_dir is not None:
        return data_dir
    from receipt_embed.training.checkpoint import CheckpointError
    from receipt_embed.training.resume import recorded_data_dir

    try:
        data_dir = recorded_data_dir(out_dir)  # the run's own dataset, not the bundled samples
    except (CheckpointError, BadInput) as exc:  # ValueError: data.json is not a regular file
        raise InputError(str(exc)) from None
    if data_dir is None and os.path.lexists(Path(out_dir) / "config.yaml"):
        raise InputError(f"{out_dir} does not record its dataset (an older run): resume with --data DATASET_DIR")
    return data_dir


def _config_and_registry(ctx, out_dir, resume: bool, config_file, overrides):
    """The run's config (on --resume its own config.yaml, --set on top) and the registry of the
    plugins it loads; the config records where they came from, for the next resume."""
    import os

    saved = Path(out_dir) / "config.yaml"
    from_run_dir = resume and config_file is None and os.path.lexists(saved)  # a FIFO is refused by name when read
    last = Path(out_dir) / "checkpoints" / "last.pt"
    if resume and config_file is None and not from_run_dir and os.path.lexists(last):  # not the defaults instead
        raise InputError(
            f"cannot resume {out_dir}: {saved} is missing, so the run's settings are unknown; put it back, "
            f"or pass --config FILE with the settings the run was trained with (they are checked against {last})"
        )
    if from_run_dir:
        config_file = str(saved)  # the run's own settings; --set still applies on top
    config = resolve_config(config_file, overrides)
    recorded = config.plugins.dir if from_run_dir else None
    loading = plugins_to_load(current_app(), None if from_run_dir else config.plugins.dir)
    registry = load_registry(ctx, config_with(config, values={"plugins": {"dir": loading}}))
    try:
        check_components(config, registry)
    except InputError as exc:
        if recorded and recorded != loading:
            raise InputError(
                f"{exc.message} The run was trained with plugins from {recorded}: resume with "
                f"`receipt-embed --plugins-dir {recorded} train --out {out_dir} --resume` (plugins are "
                "never loaded from a folder a run dir names)."
            ) from None
        raise
    return config_with(config, values={"plugins": {"dir": loading if loading is not None else recorded}}), registry


def _launch(config, data_dir, out, resume, nproc, force) -> None:
    """``--nproc N`` in the launcher: the checks every rank would make, once, then torchrun."""
    from receipt_embed.cli.launch import launch_torchrun
    from receipt_embed.training.checkpoint import CheckpointError
    from receipt_embed.training.resume import preflight

    try:
        preflight(config, data_dir, out, resume, nproc, force)
    except (CheckpointError, FileNotFoundError, BadInput) as exc:
        raise InputError(str(exc)) from None
    raise SystemExit(launch_torchrun(nproc, out))


def _raise_if_a_peer_is_gone(exc: Exception, out: Path, world: int) -> None:
    """Another rank was killed or failed: this one stops with ``PEER_GONE_EXIT``, not as a bug. Under
    ``--nproc`` the launcher's torchrun names the rank that went, in one line; under torchrun started
    directly rank 0 says what happened here."""
    import os

    from receipt_embed.distributed import PEER_GONE_EXIT, lost_a_peer

    if world <= 1 or not lost_a_peer(exc):
        return
    if int(os.environ.get("RANK", "0")) == 0 and PARENT_PID_ENV not in os.environ:
        last = out / "checkpoints" / "last.pt"
        saved = f"{last} holds the last saved state: continue with --resume" if last.exists() else "no checkpoint yet"
        detail = shortened(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__, 160)
        click.echo(printable(f"Error: another rank failed or was killed ({detail}); {saved}"), err=True)
    raise SystemExit(PEER_GONE_EXIT) from None


def _train(config, registry, data_dir, out, resume, sweep, quiet, nproc, force, world) -> None:
    """The run itself, under the run dir's writer lock."""
    import os

    from receipt_embed.config import ConfigError
    from receipt_embed.plugin_manager import PluginLoadError
    from receipt_embed.registry import ComponentError
    from receipt_embed.stops import StopAlreadySaid
    from receipt_embed.training.checkpoint import CheckpointError
    from receipt_embed.training.trainer import TrainingDiverged, TrainingInterrupted
    from receipt_embed.training.trainer import train as run_training

    if nproc > 1 and world == 1:
        _launch(config, data_dir, out, resume, nproc, force)
    progress = not quiet and sys.stderr.isatty()
    log = lambda message: click.echo(printable(message), err=True)  # noqa: E731  (paths: no terminal escapes)

    try:
        from receipt_embed.training.rundir import check_run_out, refuse_dataset_inside

        check_run_out(out, sweep=sweep is not None)  # before anything is written into it
        refuse_dataset_inside(out, data_dir)
        data = ensure_dataset(data_dir, out, config, progress, log)
        if sweep is not None:
            if resume:
                raise InputError("--resume cannot be combined with --sweep")
            from receipt_embed.training.sweep import format_sweep, run_sweep

            summary = run_sweep(sweep, config, data, out, registry, progress=progress, log=log, force=force)
            click.echo(printable_lines(format_sweep(summary)))
            click.echo(printable(f"Wrote {out / 'sweep.json'}; losses at different values are not compared"))
            return
        result = run_training(config, data, out, registry, resume=resume, progress=progress, log=log, force=force)
    except (ComponentError, CheckpointError, ConfigError, FileNotFoundError, BadInput) as exc:
        raise InputError(worker_message(exc)) from None
    except PluginLoadError as exc:  # a plugin hook failed under --strict-plugins
        raise InputError(str(exc)) from None
    except TrainingDiverged as exc:
        raise click.ClickException(str(exc)) from None
    except TrainingInterrupted as exc:
        if int(os.environ.get("RANK", "0")) == 0:
            click.echo(printable(str(exc)), err=True)
        raise StopAlreadySaid(exc.code) from None  # the line above said it
    except Exception as exc:
        _raise_if_a_peer_is_gone(exc, out, world)
        raise
    if world > 1:
        from receipt_embed.distributed import shutdown

        try:
            shutdown()
        except Exception as exc:
            _raise_if_a_peer_is_gone(exc, out, world)
            raise
    if int(os.environ.get("RANK", "0")) != 0:
        return
    if not result.metrics:  # nothing to train: its line said so
        return
    click.echo(printable(f"Trained {out}: {result.best_said()}; checkpoints in {out / 'checkpoints'}"))
