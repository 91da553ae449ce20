"""``receipt-embed make-samples``: render receipts (or take scans) and capture them."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click
from click.core import ParameterSource
from tqdm import tqdm

from receipt_embed import samples
from receipt_embed.cli.options import ExistingPath, GivenPath, InputError
from receipt_embed.display import printable, shortened
from receipt_embed.errors import BadInput

MAX_RECEIPTS = 100_000  # about three hours of rendering per device on two cores


@click.command("make-samples")
@click.option(
    "--receipts",
    type=int,
    default=60,
    show_default=True,
    help="Number of synthetic receipts to render (not with --from-scans).",
)
@click.option(
    "--devices",
    type=int,
    default=3,
    show_default=True,
    help=f"Capture each receipt with the first D device profiles ({', '.join(d.name for d in samples.DEVICES)}).",
)
@click.option(
    "--seed",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Seed; the same seed and options give byte-identical files.",
)
@click.option(
    "--out",
    "out_dir",
    type=GivenPath(file_okay=False, path_type=Path),
    required=True,
    help="Output folder: images/ and manifest.csv are written there.",
)
@click.option(
    "--from-scans",
    "scans_dir",
    type=ExistingPath(file_okay=False, path_type=Path),
    default=None,
    help="Capture the receipt scans in this folder instead of rendering receipts (their manifest carries "
    "date, total, ... only where receipts.jsonl lists them).",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option("--force", is_flag=True, help="Replace a samples dir that make-samples wrote before.")
@click.pass_context
def make_samples(
    ctx: click.Context,
    receipts: int,
    devices: int,
    seed: int,
    out_dir: Path,
    scans_dir: Path | None,
    quiet: bool,
    force: bool,
) -> None:
    """Render synthetic receipts captured by simulated devices, with a manifest.csv.

    The manifest's columns: path, receipt_id, device, merchant, and for rendered receipts the
    date, total and receipt_number each prints, as printed (what the fields verifier
    compares). With --from-scans, the scans' receipts.jsonl metadata (company as merchant,
    date, total, ...) as listed: nothing is read off the scans themselves.

    OUT is written whole (staged beside, then swapped in) under a writer lock; an existing
    OUT is replaced only with --force and only if make-samples wrote it (its samples.json)."""
    available = len(samples.DEVICES)
    if not 1 <= devices <= available:
        raise click.BadParameter(
            f"{devices} is not between 1 and {available}, the number of device profiles "
            f"({', '.join(d.name for d in samples.DEVICES)}).",
            param_hint="--devices",
        )
    if scans_dir is not None:
        if ctx.get_parameter_source("receipts") is not ParameterSource.DEFAULT:
            raise click.UsageError("--receipts cannot be combined with --from-scans (every scan is used).")
        try:
            scans = samples.read_scans(scans_dir)
        except BadInput as err:
            raise InputError(str(err)) from None
        if not scans:
            raise click.BadParameter(
                f"no receipt images ({', '.join(sorted(samples.SCAN_SUFFIXES))}) in {scans_dir}.",
                param_hint="--from-scans",
            )
        receipts = len({scan.receipt_id for scan in scans})
    elif receipts < 1:
        raise click.BadParameter(f"must be at least 1, got {receipts}.", param_hint="--receipts")
    elif receipts > MAX_RECEIPTS:  # a count that would render for days, then fill the disk
        raise click.BadParameter(
            f"must be at most {MAX_RECEIPTS:,}, got {shortened(str(receipts))} (each receipt takes about 0.1 s to "
            "render and capture per device); make several sets for more",
            param_hint="--receipts",
        )

    started = time.perf_counter()
    try:
        manifest = _write_samples(out_dir, scans if scans_dir is not None else None, receipts, devices, seed, quiet,
                                  force, scans_dir)  # fmt: skip
    except click.ClickException:
        raise
    except BadInput as err:
        raise InputError(str(err)) from None
    except OSError as err:  # e.g. --out is a mount point, which cannot be swapped for its new copy
        raise InputError(f"cannot write {out_dir}: {err.strerror or err}") from None
    names = ", ".join(d.name for d in samples.select_devices(devices))
    sources = len(scans) if scans_dir is not None else receipts
    what = f"{receipts} receipts" if sources == receipts else f"{sources} scans of {receipts} receipts"
    click.echo(
        printable(
            f"Wrote {sources * devices} captures ({what} x {devices} devices: {names}) "
            f"and {manifest} in {time.perf_counter() - started:.1f}s"
        )
    )


def _write_samples(out_dir: Path, scans, receipts: int, devices: int, seed: int, quiet: bool, force: bool, scans_dir):
    """The set, written into a staging dir swapped in whole, with a samples.json saying how it was made."""
    from receipt_embed.fileio import DiskFull, atomic_write_json
    from receipt_embed.outdir import refuse_own_input
    from receipt_embed.staging import replace_dir

    refuse_own_input(out_dir, {"scans folder": scans_dir})
    with replace_dir(out_dir, "samples", force=force) as staging:
        with tqdm(
            total=receipts * devices, unit="capture", file=sys.stderr, disable=quiet or not sys.stderr.isatty()
        ) as bar:
            try:
                if scans is not None:
                    samples.capture_scans(scans, staging, devices, seed, progress=bar.update)
                else:
                    samples.make_samples(staging, receipts, devices, seed, progress=bar.update)
            except DiskFull:
                raise  # named as the file in out_dir by replace_dir
            except BadInput as err:  # a scan that cannot be decoded: one escaped line, no usage banner
                raise InputError(str(err)) from None
        record = {
            "receipts": receipts,
            "devices": devices,
            "seed": seed,
            "from_scans": str(scans_dir) if scans_dir else None,
        }
        atomic_write_json(staging / "samples.json", record)
    return out_dir / "manifest.csv"
