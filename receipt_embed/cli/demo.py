"""``receipt-embed demo``: the whole pipeline on the bundled sample receipts."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from receipt_embed.cli.options import config_options, resolve_config

NOT_BUILT_YET = ("train", "index", "audit-shortcuts")


def find_samples() -> Path | None:
    """``data_samples/`` in the working directory or next to the package (a clone)."""
    import receipt_embed

    for base in (Path.cwd(), Path(receipt_embed.__file__).resolve().parents[1]):
        if (base / "data_samples" / "manifest.csv").is_file():
            return base / "data_samples"
    return None


@click.command()
@click.option("--out", "out_dir", default="runs/demo", show_default=True, type=click.Path(file_okay=False))
@click.option("--samples", type=click.Path(file_okay=False, exists=True), default=None,
              help="Sample folder with manifest.csv [data_samples/, generated if absent].")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
@config_options
def demo(out_dir, samples, quiet, config_file, overrides):
    """Run ingest -> train -> index -> audit on data_samples/ and leave the results in OUT."""
    from receipt_embed.ingest import ingest

    config = resolve_config(config_file, overrides)
    out = Path(out_dir)
    progress = not quiet and sys.stderr.isatty()
    source = Path(samples) if samples else find_samples()
    if source is None:
        from receipt_embed.samples import make_samples

        source = out / "samples"
        click.echo(f"data_samples/ not found; generating sample receipts into {source}")
        make_samples(source, receipts=60, devices=3, seed=0)

    click.echo(f"[1/4] ingest {source} -> {out / 'dataset'}")
    result = ingest(source, out / "dataset", config.ingest, progress=progress)
    click.echo(result.summary())
    for step, name in enumerate(NOT_BUILT_YET, start=2):
        click.echo(f"[{step}/4] {name}: not built yet (see the README's roadmap)")
