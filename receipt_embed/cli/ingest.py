"""``receipt-embed ingest``: check captures and write a dataset dir."""

from __future__ import annotations

import sys

import click

from receipt_embed.cli.options import ExistingPath, GivenPath, InputError, config_options, resolve_config
from receipt_embed.display import printable, shortened
from receipt_embed.errors import BadInput


def _ratios(ctx, param, value):
    if value is None:
        return None
    try:
        parts = [float(x) for x in value.split(",")]
    except ValueError:
        raise click.BadParameter(f"expected three numbers like 0.8,0.1,0.1, got {value!r}") from None
    if len(parts) != 3:
        raise click.BadParameter(f"expected three ratios (train,val,heldout), got {len(parts)}")
    return parts


@click.command()
@click.argument("source", type=ExistingPath())
@click.option("--out", "out_dir", required=True, type=GivenPath(file_okay=False), help="Dataset dir to write.")
@click.option(
    "--split-ratios", callback=_ratios, default=None, help="train,val,heldout shares of identities [0.8,0.1,0.1]."
)
@click.option("--seed", type=int, default=None, help="Split seed [ingest.seed].")
@click.option(
    "--max-pixels", type=click.IntRange(min=1), default=None, help="Reject larger images [ingest.max_pixels]."
)
@click.option(
    "--max-bytes",
    type=click.IntRange(min=1),
    default=None,
    help="Reject larger capture files unread [ingest.max_bytes].",
)
@click.option("--allow-absolute-paths", is_flag=True, default=None, help="Accept absolute paths in the manifest.")
@click.option("--merge-duplicates", is_flag=True, default=None, help="Join receipt_ids whose files are identical.")
@click.option("--strict", is_flag=True, help="Exit with code 1 when any row was rejected.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option(
    "--force",
    is_flag=True,
    help="Replace an existing dataset dir in --out (swapped in whole once the new one is complete).",
)
@config_options
def ingest(
    source,
    out_dir,
    split_ratios,
    seed,
    max_pixels,
    max_bytes,
    allow_absolute_paths,
    merge_duplicates,
    strict,
    quiet,
    force,
    config_file,
    overrides,
):
    """Check every capture listed in SOURCE (a CSV/JSONL manifest, or a folder holding
    manifest.csv or manifest.jsonl) and write OUT/manifest.jsonl and OUT/ingest_report.json.

    Rejected rows are listed with their line and reason in the report; identical files are
    merged (same receipt) or flagged (different receipts); splits are by receipt. Exit code 1
    when no capture was accepted, or with --strict when any row was rejected.

    OUT is written beside the old copy and swapped in complete; an existing dataset dir needs
    --force, and a folder that is not a dataset dir (or holds SOURCE) is never replaced."""
    from receipt_embed.ingest import ManifestError
    from receipt_embed.ingest import ingest as run_ingest

    flags = {
        "split_ratios": f"[{','.join(map(str, split_ratios))}]" if split_ratios else None,
        "seed": seed,
        "max_pixels": max_pixels,
        "max_bytes": max_bytes,
        "allow_absolute_paths": allow_absolute_paths,
        "merge_duplicates": merge_duplicates,
    }
    extra = [f"ingest.{key}={value}" for key, value in flags.items() if value is not None]
    config = resolve_config(config_file, [*overrides, *extra])
    try:
        result = run_ingest(source, out_dir, config.ingest, progress=not quiet and sys.stderr.isatty(), force=force)
    except (ManifestError, OSError, BadInput) as exc:
        raise InputError(str(exc)) from None
    click.echo(result.summary())
    for entry in result.rejected[:10]:
        click.echo(f"  rejected: {printable(shortened(entry['detail'], 400))} [{entry['reason']}]", err=True)
    if len(result.rejected) > 10:
        click.echo(f"  ... {len(result.rejected) - 10} more in the report", err=True)
    for warning in result.warnings():
        click.echo(f"Warning: {printable(warning)}", err=True)
    if not result.rows or (strict and result.rejected):
        raise SystemExit(1)
