"""``receipt-embed audit-shortcuts``: retrieval and metadata-shortcut audit of an index dir."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from receipt_embed.cli.options import FiniteFloatRange, GivenPath, InputError, load_registry, shortlist_option
from receipt_embed.display import printable, quoted
from receipt_embed.errors import BadInput


def _folders_only(values):
    """click's Path(file_okay=False) lets a FIFO or a device through: only folders are roots."""
    import os

    for value in values:
        if not os.path.isdir(value):
            raise click.BadParameter(f"{value!r} is not a folder", param_hint="--images-root")
    return values


@click.command("audit-shortcuts")
@click.argument("index_dir", type=GivenPath(file_okay=False))
@click.option(
    "--attribute",
    "attributes",
    multiple=True,
    default=("device",),
    show_default=True,
    help="Metadata column tested as a shortcut (repeatable; giving any replaces the default device).",
)
@click.option(
    "--context-attribute",
    "context",
    multiple=True,
    help="Column reported with the same figures but never flagged, for attributes expected to cluster "
    "(e.g. merchant: one shop's receipts share a template). Repeatable.",
)
@click.option(
    "-k",
    "--k",
    "k",
    type=click.IntRange(min=1),
    default=10,
    show_default=True,
    help="Other-receipt neighbours per item for the kNN agreement.",
)
@click.option(
    "--out",
    "out_dir",
    type=GivenPath(file_okay=False),
    default=None,
    help="Report dir for audit.json and audit.html [INDEX_DIR/audit].",
)
@click.option(
    "--max-lift",
    type=FiniteFloatRange(min=1.0),
    default=1.3,
    show_default=True,
    help="Flag when kNN agreement exceeds this multiple of chance (and --min-z holds).",
)
@click.option(
    "--min-z",
    type=FiniteFloatRange(min=0),
    default=3.0,
    show_default=True,
    help="The lift test also needs the agreement this many standard errors above chance.",
)
@click.option(
    "--max-probe-gain",
    type=FiniteFloatRange(0, 1),
    default=0.5,
    show_default=True,
    help="Flag when a linear probe's (accuracy - chance) / (1 - chance) exceeds this, on at least 20 held-out items.",
)
@click.option(
    "--gallery",
    type=click.IntRange(min=0),
    default=8,
    show_default=True,
    help="Worst retrieval failures shown with thumbnails (0: none).",
)
@click.option(
    "--fail-on-shortcut",
    is_flag=True,
    help="Exit with code 1 when an attribute or a plugin check is flagged, or the space has collapsed (a CI gate).",
)
@click.option(
    "--skip-check",
    "skip_checks",
    multiple=True,
    metavar="NAME",
    help="Do not run this plugin audit check (repeatable; `receipt-embed plugins` lists them).",
)
@click.option(
    "--check-set",
    "check_settings",
    multiple=True,
    metavar="NAME.KEY=VALUE",
    help="A parameter for a plugin audit check, e.g. hubness.max_skewness=5 (repeatable).",
)
@click.option(
    "--images-root",
    "images_roots",
    multiple=True,
    type=GivenPath(file_okay=False, exists=True),
    callback=lambda ctx, param, values: _folders_only(values),
    help="Folder the gallery may read thumbnails from besides the dataset's capture folders "
    "(repeatable); images anywhere else are not read.",
)
@click.option(
    "--verify",
    is_flag=True,
    help="Also the retrieval figures after the index's verifiers (`index --verify`) re-rank each item's "
    "--shortlist nearest (retrieval.verified), and the precision-recall curves of both scores.",
)
@shortlist_option("With --verify: embedding neighbours re-ranked per item.")
@click.option("--quiet", "-q", is_flag=True, help="Only the summary.")
@click.option(
    "--force", is_flag=True, help="Replace an existing report in the report dir (written whole, then swapped in)."
)
def audit_shortcuts(
    index_dir,
    attributes,
    context,
    k,
    out_dir,
    max_lift,
    min_z,
    max_probe_gain,
    gallery,
    fail_on_shortcut,
    skip_checks,
    check_settings,
    images_roots,
    verify,
    shortlist,
    quiet,
    force,
):
    """Does the embedding find a receipt's other captures, and does it cluster by capture
    metadata (device, ...) more than chance? Writes audit.json and a self-contained audit.html.

    \b
    receipt-embed audit-shortcuts runs/demo/index --attribute device --context-attribute merchant
    Audit checks from plugins (register_audit_checks) run too and add their figures.
    Exit codes: 0 done, 1 an attribute or check flagged, or collapsed, with --fail-on-shortcut; 2 bad input."""
    from receipt_embed.audit.checks import AuditCheckError, parse_check_settings
    from receipt_embed.audit.figures import FlagRule
    from receipt_embed.audit.run import run_audit, summary
    from receipt_embed.indexing import IndexDirError
    from receipt_embed.registry import ComponentError

    if not verify and click.get_current_context().get_parameter_source("shortlist").name != "DEFAULT":
        raise InputError("--shortlist goes with --verify (re-ranking by verifiers)")
    if out_dir == "-":
        raise InputError("--out takes a directory for audit.json and audit.html; the summary always goes to stdout")
    out = Path(out_dir) if out_dir else Path(index_dir) / "audit"
    log = (lambda message: None) if quiet else (lambda message: click.echo(printable(message), err=True))
    both = [name for name in dict.fromkeys(context) if name in attributes]
    if both:
        raise InputError(
            f"--attribute {quoted(both[0])} and --context-attribute {quoted(both[0])}: a column cannot be both "
            "audited (and flagged) and used as context (never flagged); give it to one of them"
        )
    registry = load_registry(click.get_current_context())
    try:
        skip, params = parse_check_settings(registry, skip_checks, check_settings)
        figures = run_audit(
            index_dir,
            list(dict.fromkeys(attributes)),
            out,
            k=k,
            rule=FlagRule(max_lift, max_probe_gain, min_z),
            gallery=gallery,
            context=tuple(dict.fromkeys(context)),
            registry=registry,
            skip_checks=skip,
            check_params=params,
            images_roots=images_roots,
            log=log,
            force=force,
            verify=verify,
            shortlist=shortlist,
            progress=not quiet and sys.stderr.isatty(),
        )
    except (IndexDirError, OSError, BadInput, AuditCheckError, ComponentError) as exc:
        raise InputError(str(exc)) from None
    click.echo(summary(figures))
    click.echo(printable(f"Report: {out / 'audit.html'} (figures in {out / 'audit.json'})"))
    if fail_on_shortcut and (figures["flagged"] or figures["collapsed"] or figures["flagged_checks"]):
        raise SystemExit(1)
