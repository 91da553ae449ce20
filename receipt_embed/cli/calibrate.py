"""``receipt-embed calibrate``: duplicate thresholds a reviewer can trust, stored in index.json."""

from __future__ import annotations

import json

import click

from receipt_embed.cli.options import FiniteFloatRange, GivenPath, InputError, load_registry, shortlist_option
from receipt_embed.display import printable
from receipt_embed.errors import BadInput


@click.command()
@click.argument("index_dir", type=GivenPath(file_okay=False))
@click.option(
    "--target-precision",
    type=FiniteFloatRange(0, 1, min_open=True),
    default=0.99,
    show_default=True,
    help="Share of flagged queries that must be real duplicates.",
)
@shortlist_option("Embedding neighbours the verifiers re-rank (when the index stores verifiers).")
@click.option("--json", "as_json", is_flag=True, help="Print the calibration record as JSON.")
@click.pass_context
def calibrate(ctx, index_dir, target_precision, shortlist, as_json):
    """Pick the duplicate threshold that reaches --target-precision with the highest recall.

    Every capture of a labelled INDEX_DIR is a query against the others: it is flagged when its
    best score reaches the threshold, rightly when that capture is of the same receipt. Done for
    the embedding similarity and, when the index stores verifiers (`index --verify`), for the
    verified score: with every verifier (all-pairs, and searches given the query's --field
    values), and with the image's verifiers alone (a search of a bare image). Stored in
    index.json, where `search --threshold auto` reads it.

    \b
    receipt-embed calibrate INDEX_DIR --target-precision 0.99"""
    from receipt_embed.indexing import IndexDirError, load_index_dir
    from receipt_embed.indexing.calibration import KINDS, calibration_warnings, in_words, searches_using
    from receipt_embed.indexing.calibration import calibrate as calibrated
    from receipt_embed.indexing.index_dir import write_calibration
    from receipt_embed.registry import ComponentError

    try:
        index = load_index_dir(index_dir, check_calibration=False)  # the block it replaces may be malformed
        registry = load_registry(ctx) if index.meta.get("verifiers") else None
        record = calibrated(index, registry, target_precision, shortlist)
        write_calibration(index_dir, record, calibrated=index.meta)
    except (IndexDirError, ComponentError, OSError, BadInput) as exc:
        raise InputError.of(exc) from None
    if as_json:
        click.echo(json.dumps(record, indent=2))
        return
    click.echo(
        printable(
            f"{record['queries']} captures of {record['receipts']} receipts as queries; "
            f"{record['duplicates_findable']} have another capture of their receipt in the index"
        )
    )
    for kind in KINDS:
        if kind in record:
            click.echo(f"  {in_words(kind, record[kind], target_precision)}")
    for warning in calibration_warnings(record, target_precision):
        click.echo(printable(f"Warning: {warning}"), err=True)
    uses = searches_using(record)
    if uses:
        click.echo(printable(f"stored in {index_dir}/index.json; `search --threshold auto` (the default) uses:"))
        for line in uses:
            click.echo(printable(f"  {line}"))
        click.echo(
            "  (each figure is of a capture's best other capture, as a new submission is judged; --all-pairs "
            "counts every pair at or above the threshold, so its precision is lower: its summary prints it)"
        )
    else:
        click.echo(
            printable(
                f"stored in {index_dir}/index.json (the curves), but no threshold reached the target, so "
                "`search --threshold auto` has none to use: give --threshold T, or a lower --target-precision"
            )
        )
