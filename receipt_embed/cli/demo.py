"""``receipt-embed demo``: the whole pipeline on the bundled sample receipts."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import click

from receipt_embed.cli.options import (
    GivenPath,
    InputError,
    check_components,
    config_options,
    load_registry,
    resolve_config,
)
from receipt_embed.display import printable, printable_lines
from receipt_embed.errors import BadInput
from receipt_embed.stops import StopAlreadySaid, StoppedBySignal, told_by_the_caller
from receipt_embed.training.rundir import LAST_CHECKPOINT


def find_samples() -> Path | None:
    """``data_samples/`` in the working directory or next to the package (a clone)."""
    import receipt_embed

    for base in (Path.cwd(), Path(receipt_embed.__file__).resolve().parents[1]):
        if (base / "data_samples" / "manifest.csv").is_file():
            return base / "data_samples"
    return None


def _plugin_failures() -> tuple[type, ...]:
    """What a plugin can raise through the demo under --strict-plugins or a broken contract."""
    from receipt_embed.audit.checks import AuditCheckError
    from receipt_embed.plugin_manager import PluginLoadError
    from receipt_embed.registry import ComponentError

    return (AuditCheckError, PluginLoadError, ComponentError)


def heldout_retrieval(checkpoint: Path, dataset: Path, registry) -> dict:
    """Leave-one-out retrieval on the held-out split with both feature kinds."""
    from receipt_embed.data.dataset_dir import load_dataset_dir, select_split, verify_captures
    from receipt_embed.embedding import FEATURES, embed_paths, load_model
    from receipt_embed.evaluation.retrieval import retrieval_metrics

    loaded = load_model(checkpoint, registry)
    heldout = select_split(load_dataset_dir(dataset), "heldout")
    verify_captures(heldout.rows)
    return {
        features: retrieval_metrics(
            embed_paths(loaded, heldout.paths, features=features, digests=heldout.digests), heldout.labels
        )
        for features in FEATURES
    }


def meta_first_path(index_dir: Path) -> str:
    with open(index_dir / "items.jsonl", encoding="utf-8") as handle:
        return json.loads(handle.readline())["path"]


@click.command()
@click.option("--out", "out_dir", default="runs/demo", show_default=True, type=GivenPath(file_okay=False))
@click.option(
    "--samples",
    type=GivenPath(file_okay=False, exists=True),
    default=None,
    help="Sample folder with manifest.csv [data_samples/, generated if absent].",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
@click.option(
    "--force",
    is_flag=True,
    help="Replace a demo run already in OUT (the dataset and run are kept until their new copies are complete; "
    "the old index and audit, built from the old run, are removed once the new run has replaced the old one).",
)
@config_options
@click.pass_context
def demo(ctx, out_dir, samples, quiet, force, config_file, overrides):
    """Run ingest -> train -> index -> audit on data_samples/ and leave the results in OUT.

    Settings: configs/default.yaml, then configs/demo.yaml, then --config and --set."""
    from receipt_embed.config import DEMO_CONFIG
    from receipt_embed.locking import write_lock
    from receipt_embed.outdir import refuse_current_dir_in, refuse_nested

    config = resolve_config([str(DEMO_CONFIG), *(config_file or [])], overrides)
    registry = load_registry(ctx, config)
    check_components(config, registry)
    out = Path(out_dir)
    try:
        refuse_nested(out, "demo")  # inside a dataset, run or samples dir: refused before its lock is taken there
        with write_lock(out):
            check_demo_out(out, samples)
            held = [name for name in DEMO_STEPS if os.path.lexists(out / name)]
            if held and not force:  # a failed demo's dataset too: replacing what OUT holds needs --force
                what = (
                    "a demo run"
                    if (out / "run" / "checkpoints" / "last.pt").exists()
                    else f"a demo's {', '.join(held)}"
                )
                raise InputError(
                    f"{out} already holds {what}; pass --force to replace it, remove it or pass another --out"
                )
            refuse_current_dir_in(out, replaced_parts(out, samples), "the demo replaces")
            _run_demo(config, registry, out, samples, quiet)
    except (OSError, BadInput) as exc:  # a second writer, a full disk, a part of OUT that is not ours
        raise InputError(str(exc)) from None


DEMO_PARTS = {
    "samples": None,
    "dataset": "dataset",
    "run": "run",
    "index": "index",
    "audit": "audit",
    "heldout_retrieval.json": None,
}


def check_demo_out(out: Path, samples) -> None:
    """Refuse (even with --force) an OUT the demo did not write, or one holding the --samples it reads:
    each part of OUT is replaced, so each must be the demo's own (a run dir may hold its plugins' files)."""
    from receipt_embed.outdir import _ours_hidden, dir_kind
    from receipt_embed.training.rundir import is_run_dir

    foreign = f"{out} holds files that receipt-embed did not write"
    never = "it is never replaced (not even with --force): choose another --out"
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise InputError(f"{out} is not a folder; {never}")
    if not out.exists():
        return
    extra = sorted(e.name for e in out.iterdir() if not _ours_hidden(e.name) and e.name not in DEMO_PARTS)
    if extra:
        shown = ", ".join(extra[:3]) + (", ..." if len(extra) > 3 else "")
        raise InputError(f"{foreign} ({shown}), not a demo run; {never}")
    for name, kind in DEMO_PARTS.items():
        part = out / name
        if kind == "run":
            ours = is_run_dir(part)
        elif kind is not None:
            ours = dir_kind(part) in (None, kind)
        else:
            ours = not part.is_symlink() and (
                not part.exists() or part.is_file() if name.endswith(".json") else not part.exists() or part.is_dir()
            )
        if not ours:
            raise InputError(f"{foreign} (in {part}), not a demo run; {never}")
    if samples is not None:
        given, target = Path(samples).resolve(), out.resolve()
        if given.is_relative_to(target) and not given.is_relative_to(target / "samples"):
            where = "is" if given == target else "holds"
            raise InputError(
                f"--out {out} {where} the samples folder {samples} this command reads; writing there "
                "would destroy its own input: choose another --out"
            )


def replaced_parts(out: Path, samples) -> list[Path]:
    """The folders of OUT the demo removes or replaces (OUT itself and OUT/run stay): refused up
    front when they hold the shell's current directory, not after some parts are already new."""
    from receipt_embed.training.replacement import run_entries

    parts = [out / "dataset", *(out / "run" / name for name in run_entries(out / "run")), out / "index", out / "audit"]
    return parts + ([out / "samples"] if samples is None and find_samples() is None else [])


DEMO_STEPS = ("dataset", "run", "index", "audit")
BUILT_FROM_RUN = ("index", "audit")  # the old ones describe a run that is gone once the new one is trained


def _remove_stale(out: Path, names, quietly: bool = False) -> list[str]:
    """Remove the old copies of ``names`` once the new run replaced the one they were built from: a
    dir under its own writer lock, renamed aside first (a kill leaves a copy the next writer cleans
    up). ``quietly``: on the way out of a failed step, where the step's own error is the one to tell."""
    import os
    import shutil

    from receipt_embed.locking import write_lock
    from receipt_embed.outdir import check_replaceable

    removed = []
    for name in names:
        part = out / name
        if not part.exists():
            continue
        try:
            if name.endswith(".json"):
                part.unlink()
            else:
                with write_lock(part):
                    check_replaceable(part, name, force=True)
                    aside = out / f".{name}.old-{os.getpid()}"
                    os.rename(part, aside)
                    shutil.rmtree(aside, ignore_errors=True)
        except (OSError, BadInput):
            if not quietly:
                raise
            continue
        if not name.endswith(".json"):
            removed.append(name)
    return removed


def _run_demo(config, registry, out: Path, samples, quiet: bool) -> None:
    """The four steps; each part of OUT is ours (the demo's own check came first), so each replaces its old copy."""
    progress = not quiet and sys.stderr.isatty()
    started = time.perf_counter()
    source = Path(samples) if samples else find_samples()
    if source is None:
        from receipt_embed.samples import make_samples

        source = out / "samples"
        click.echo(printable(f"data_samples/ not found; generating sample receipts into {source}"))
        make_samples(source, receipts=60, devices=3, seed=0)
    trained: list[bool] = []  # set once the new run's training has returned: the run is complete
    steps = (
        ("dataset", lambda: _ingest_step(config, source, out, progress)),
        ("run", lambda: _train_step(config, registry, out, progress, quiet, trained)),
        ("index", lambda: _index_step(config, registry, out, progress)),
        ("audit", lambda: _audit_step(registry, out)),
    )
    done: list[str] = []
    removed: list[str] = []
    for part, step in steps:
        before = _checkpoint_of(out)
        try:
            with told_by_the_caller():  # the line below (or the lock of OUT) tells a stop, not the step's own lock
                if part == "index":  # the run is the new one now
                    removed = _remove_stale(out, BUILT_FROM_RUN)
                step()
        except BaseException as exc:
            replaced = part == "run" and _checkpoint_of(out) != before  # the old run is gone
            if replaced:  # what was built from the old run describes a run that is gone
                removed = _remove_stale(out, (*BUILT_FROM_RUN, "heldout_retrieval.json"), quietly=True)
                if trained:  # complete; only its held-out figures were not written
                    done.append(part)
            unfinished = replaced and not trained
            if isinstance(exc, _TrainingStopped):  # training's own line, with what OUT holds now
                line = f"{exc.said}; {_state_of(out, done, removed, unfinished)}"
                if unfinished:
                    line += f", or finish the training with `receipt-embed train --out {out / 'run'} --resume`"
                click.echo(printable(line), err=True)
                raise StopAlreadySaid(exc.code) from None
            if isinstance(exc, StoppedBySignal):  # between or inside steps: say which parts of OUT are new
                _say_stopped(exc, out, done, removed, unfinished)
            elif isinstance(exc, (OSError, BadInput, click.ClickException)) and (done or unfinished):
                message = exc.format_message() if isinstance(exc, click.ClickException) else str(exc)
                raise InputError(f"{message}; {_state_of(out, done, removed, unfinished)}") from None
            raise
        done.append(part)
    click.echo(printable(f"Done in {time.perf_counter() - started:.0f}s; results in {out}"))


def _checkpoint_of(out: Path):
    """Which ``OUT/run/checkpoints/last.pt`` is there (each save writes a new file), None for none."""
    try:
        found = (out / "run" / LAST_CHECKPOINT).stat()
    except OSError:
        return None
    return found.st_dev, found.st_ino, found.st_mtime_ns


def _state_of(out: Path, done: list[str], removed: list[str], unfinished: bool = False) -> str:
    """What OUT holds after a demo that ended between or inside its steps: the parts it replaced,
    the old ones it removed (built from the replaced run) and those of the previous run that remain."""
    replaced = [*done, *(["run (the new one, unfinished)"] if unfinished else [])]
    gone = [name for name in removed if name not in done]
    rest = [name for name in DEMO_STEPS if name not in done and name not in gone and not (unfinished and name == "run")]
    said = [f"the demo in {out} replaced {', '.join(replaced)}"]
    if gone:
        said.append(f"removed the previous {' and '.join(gone)} (built from the replaced run)")
    old = [name for name in rest if (out / name).exists()]
    if old:
        said.append(f"{', '.join(old)} {'is' if len(old) == 1 else 'are'} the previous run's")
    missing = [name for name in rest if name not in old]
    if missing:
        said.append(f"{', '.join(missing)} {'was' if len(missing) == 1 else 'were'} not made")
    return f"{'; '.join(said)}: run it again with `receipt-embed demo --out {out} --force`"


def _say_stopped(stop, out: Path, done: list[str], removed: list[str], unfinished: bool = False) -> None:
    """One line for a demo stopped by a signal: ``OUT left as it was`` is true only before its
    first step ended; after that some parts are the new run's and the others the old ones."""
    from receipt_embed.stops import stop_line

    if not done and not unfinished:
        return  # the lock of OUT says it in its own line
    print(
        printable(f"{stop_line(stop)}: {_state_of(out, done, removed, unfinished)}"),
        file=sys.stderr,
        flush=True,
    )
    stop.reported = True


def _ingest_step(config, source: Path, out: Path, progress: bool) -> None:
    from receipt_embed.ingest import ingest

    click.echo(printable(f"[1/4] ingest {source} -> {out / 'dataset'}"))
    result = ingest(source, out / "dataset", config.ingest, progress=progress, force=True)
    click.echo(result.summary())
    heldout = result.report["per_split"].get("heldout", {}).get("identities", 0)
    if heldout < 2:  # known now, not after training: the index and the audit hold the held-out receipts
        raise InputError(
            f"{source} gives {heldout} held-out receipt(s) of {result.report['counts']['identities']}; the demo "
            "indexes and audits the held-out receipts and needs at least 2: use a set of 20 receipts or more, or "
            "hold out more with --set 'ingest.split_ratios=[0.6,0.1,0.3]'"
        )


class _TrainingStopped(SystemExit):
    """Training stopped by a signal (``last.pt`` saved, or no checkpoint yet): its own words, which
    the demo completes with what OUT holds."""

    def __init__(self, said: str, code):
        super().__init__(code)
        self.said = said


def _train_step(config, registry, out: Path, progress: bool, quiet: bool, trained: list | None = None) -> None:
    """Train, then the held-out retrieval of the best checkpoint (``heldout_retrieval.json``)."""
    from receipt_embed.fileio import atomic_write_json
    from receipt_embed.training.trainer import TrainingInterrupted, train

    click.echo(
        printable(
            f"[2/4] train {config.model.encoder}, {config.loss.name} (temperature {config.loss.temperature}), "
            f"{config.train.epochs} epochs -> {out / 'run'}"
        )
    )
    try:
        result = train(
            config,
            out / "dataset",
            out / "run",
            registry,
            progress=progress,
            force=True,
            log=(lambda message: None) if quiet else (lambda message: click.echo(printable(f"  {message}"))),
        )
    except _plugin_failures() as exc:
        raise InputError(str(exc)) from None
    except TrainingInterrupted as exc:  # the demo's later steps never ran; _run_demo says what OUT holds
        if exc.complete and trained is not None:
            trained.append(True)
        raise _TrainingStopped(str(exc).removesuffix("; continue with --resume"), exc.code) from None
    if trained is not None:
        trained.append(True)
    click.echo(f"  {result.best_said()}")
    figures = heldout_retrieval(out / "run" / "checkpoints" / "best.pt", out / "dataset", registry)
    atomic_write_json(out / "heldout_retrieval.json", figures)
    for features, f in figures.items():
        click.echo(
            f"  held-out ({f['n_queries']} captures) {features} features: recall@1 {f['recall_at_1']:.3f}, "
            f"recall@5 {f['recall_at_5']:.3f}, mAP {f['map']:.3f}"
        )


def _index_step(config, registry, out: Path, progress: bool) -> None:
    from receipt_embed.indexing import index_dataset

    features = config.train.select_on
    click.echo(
        printable(
            f"[3/4] index the held-out captures ({features} features, the ones the checkpoint was selected on) "
            f"-> {out / 'index'}"
        )
    )
    meta = index_dataset(
        out / "run" / "checkpoints" / "best.pt",
        out / "dataset",
        out / "index",
        registry,
        split="heldout",
        features=features,
        progress=progress,
        force=True,
    )
    click.echo(
        printable(
            f"  {meta['count']} items of dim {meta['dim']}. Try: receipt-embed search {out / 'index'} "
            f"{meta_first_path(out / 'index')} --k 3"
        )
        + "\n  (the query itself comes first, marked [same file]; its receipt's other captures should follow)"
    )


def _audit_step(registry, out: Path) -> None:
    from receipt_embed.audit.run import run_audit, summary

    click.echo(printable(f"[4/4] audit-shortcuts {out / 'index'} for device (merchant as context) -> {out / 'audit'}"))
    try:
        figures = run_audit(
            out / "index", ["device"], out / "audit", context=("merchant",), registry=registry, force=True
        )
    except _plugin_failures() as exc:
        raise InputError(str(exc)) from None
    click.echo(printable_lines("\n".join(f"  {line}" for line in summary(figures).splitlines())))
    click.echo(printable(f"  report: {out / 'audit' / 'audit.html'}"))
