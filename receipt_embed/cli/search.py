"""``receipt-embed search``: a receipt's other captures, or every near-duplicate pair."""

from __future__ import annotations

import csv
import io
import json
import sys

import click

from receipt_embed.cli.options import CheckpointPath, FiniteFloatRange, GivenPath, InputError, load_registry
from receipt_embed.display import printable, spreadsheet_safe, utf8_safe
from receipt_embed.errors import BadInput


def _print_results(results: list[dict], threshold) -> None:
    """The table; values from the index are escaped, so none can print a line of its own."""
    for result in results:
        click.echo(printable(result["query"]))
        if result.get("already_indexed") is not None:
            click.echo(f"  already indexed (row {result['already_indexed']}): the verdict is about its other captures")
        if threshold is not None:
            match = result["match"]
            verdict = (
                f"DUPLICATE of receipt {printable(match['receipt_id'])} ({_score_name(match)} "
                f"{_score_of(match):.3f} >= {threshold:g})"
                if match
                else f"no duplicate (best {_score_name(result['neighbours'][0] if result['neighbours'] else {})} "
                f"below {threshold:g})"
            )
            click.echo(f"  {verdict}")
        for rank, hit in enumerate(result["neighbours"], start=1):
            same = "  [same file]" if hit["same_file"] else ""
            values = "  ".join(printable(hit[key]) for key in ("receipt_id", "device", "path"))
            verified = f"verified {hit['verified']['score']:.3f}  " if "verified" in hit else ""
            click.echo(f"  {rank:>2}. {verified}{hit['similarity']:.3f}  {values}{same}")
            if "verified" in hit:
                click.echo(f"      {_verifier_figures(hit['verified'])}")


def _verifier_figures(verified: dict) -> str:
    """One line of each verifier's score and figures: ``geometric 0.815 (matches 223, inliers 177, ...)``."""
    parts = []
    for name, figures in verified.items():
        if name == "score":
            continue
        extras = ", ".join(
            f"{printable(key)} {value:.3g}" if isinstance(value, float) else f"{printable(key)} {printable(value)}"
            for key, value in figures.items()
            if key != "score"
        )
        parts.append(f"{printable(name)} {figures['score']:.3f}" + (f" ({extras})" if extras else ""))
    return "; ".join(parts)


def _score_name(hit: dict) -> str:
    return "verified score" if "verified" in hit else "similarity"


def _score_of(hit: dict) -> float:
    return hit["verified"]["score"] if "verified" in hit else hit["similarity"]


class ThresholdType(click.ParamType):
    """A finite number in [-1, 1], or ``auto``: the threshold `receipt-embed calibrate` stored."""

    name = "T|auto"

    def convert(self, value, param, ctx):
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        return FiniteFloatRange(-1, 1).convert(value, param, ctx)


@click.command()
@click.argument("index_dir", type=GivenPath(file_okay=False))
@click.argument("images", nargs=-1, type=GivenPath(dir_okay=False))
@click.option("-k", "--k", "k", type=click.IntRange(min=1), default=5, show_default=True, help="Neighbours per query.")
@click.option(
    "--threshold",
    type=ThresholdType(),
    default=None,
    help="Score at or above which a neighbour counts as a duplicate (cosine similarity, or the verified "
    "score with --verify), or auto: the one `receipt-embed calibrate` stored [auto when a calibration exists].",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option(
    "--checkpoint",
    type=CheckpointPath(),
    default=None,
    help="The index's checkpoint at a new location (its sha256 must match index.json).",
)
@click.option(
    "--max-pixels",
    type=click.IntRange(min=1),
    default=None,
    help="Refuse query images with more pixels [the default limit, or the checkpoint's if lower].",
)
@click.option(
    "--max-bytes",
    type=click.IntRange(min=1),
    default=None,
    help="Refuse larger query files unread [the default limit, or the checkpoint's if lower].",
)
@click.option(
    "--verify",
    is_flag=True,
    help="Re-rank the top --shortlist neighbours by the verifiers the index stores (`index --verify`); "
    "--threshold then applies to the verified score (0 to 1).",
)
@click.option(
    "--verifier",
    "verifier_names",
    multiple=True,
    metavar="NAME",
    help="With --verify: only this stored verifier (repeatable) [all the index stores].",
)
@click.option(
    "--shortlist",
    type=click.IntRange(min=1, max=10_000),
    default=10,
    show_default=True,
    help="With --verify: embedding neighbours checked per query.",
)
@click.option("--all-pairs", is_flag=True, help="Every pair of indexed items at or above --threshold (no IMAGEs).")
@click.option(
    "--out",
    "out_file",
    type=GivenPath(dir_okay=False),
    default=None,
    help="With --all-pairs: CSV to write the pairs to ('-' for standard output).",
)
@click.option("--force", is_flag=True, help="With --all-pairs --out FILE: replace an existing FILE.")
@click.pass_context
def search(
    ctx,
    index_dir,
    images,
    k,
    threshold,
    as_json,
    checkpoint,
    max_pixels,
    max_bytes,
    verify,
    verifier_names,
    shortlist,
    all_pairs,
    out_file,
    force,
):
    """Find the indexed captures nearest to each IMAGE, or (--all-pairs) every near-duplicate pair.

    \b
    receipt-embed search INDEX_DIR photo.jpg --k 5 --threshold 0.9
    receipt-embed search INDEX_DIR photo.jpg --verify --threshold 0.5
    receipt-embed search INDEX_DIR --all-pairs --threshold 0.9 --out pairs.csv"""
    from receipt_embed.indexing import IndexDirError, load_index_dir, search_images
    from receipt_embed.registry import ComponentError
    from receipt_embed.training.checkpoint import CheckpointError

    given = {
        name
        for name in ("k", "as_json", "checkpoint", "max_pixels", "max_bytes", "verify", "verifier_names", "shortlist")
        if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT
    }
    if not verify and given & {"verifier_names", "shortlist"}:
        raise InputError(
            f"{'--verifier' if 'verifier_names' in given else '--shortlist'} goes with --verify (re-ranking by verifiers)"
        )
    if all_pairs:
        if images:
            raise InputError("--all-pairs compares the indexed items with each other; give no IMAGE arguments")
        if threshold is None or out_file is None:
            raise InputError("--all-pairs needs --threshold T and --out pairs.csv")
        if given:
            names = {
                "k": "--k",
                "as_json": "--json",
                "checkpoint": "--checkpoint",
                "max_pixels": "--max-pixels",
                "max_bytes": "--max-bytes",
                "verify": "--verify",
                "verifier_names": "--verifier",
                "shortlist": "--shortlist",
            }
            raise InputError(f"{', '.join(names[n] for n in sorted(given))} apply to image queries, not to --all-pairs")
    else:
        if not images:
            raise InputError("give one or more IMAGE files to search for (or --all-pairs)")
        if out_file is not None or force:
            raise InputError(
                f"{'--out' if out_file is not None else '--force'} is for --all-pairs; image queries "
                "print to standard output (--json for JSON)"
            )
    try:
        if all_pairs:
            check_pairs_out(out_file, index_dir, force)
        loaded_index = load_index_dir(index_dir)
        threshold = _resolved_threshold(
            loaded_index,
            threshold,
            verify and not all_pairs,
            images_query=not all_pairs,
            verifiers=list(verifier_names),
        )
        if all_pairs:
            _all_pairs(loaded_index, threshold, out_file, recheck=lambda: check_pairs_out(out_file, index_dir, force))
            return
        results = search_images(
            loaded_index,
            list(images),
            load_registry(ctx),
            k=k,
            threshold=threshold,
            checkpoint=checkpoint,
            max_pixels=max_pixels,
            max_bytes=max_bytes,
            verify=list(verifier_names) if verify else None,
            shortlist=shortlist,
        )
    except BrokenPipeError:
        raise  # a closed pipe (`| head`): click ends the command quietly
    except (IndexDirError, CheckpointError, ComponentError, OSError, BadInput) as exc:
        raise InputError.of(exc) from None
    if as_json:
        click.echo(json.dumps(results, indent=2))
    else:
        _print_results(results, threshold)


def _resolved_threshold(index, threshold, verified: bool, images_query: bool, verifiers=()):
    """``auto`` becomes the calibrated threshold; none given is auto for image queries when the
    index holds a calibration of that score (so a calibrated index gives verdicts by default)."""
    from receipt_embed.indexing.calibration import calibrated_threshold

    kind = "verified" if verified else "embedding"
    stored = ((index.meta.get("calibration") or {}).get(kind) or {}).get("threshold")
    if threshold is None and images_query and stored is not None:
        threshold = "auto"
    return calibrated_threshold(index, verified, list(verifiers)) if threshold == "auto" else threshold


def check_pairs_out(out_file: str, index_dir: str, force: bool) -> None:
    """The pairs CSV replaces an existing file only with --force and only if it is a pairs CSV
    (its header says so), and never goes inside the index dir or another dir replaced whole."""
    from pathlib import Path

    from receipt_embed.indexing.search import PAIR_COLUMNS
    from receipt_embed.outdir import refuse_nested
    from receipt_embed.userfiles import open_regular

    if out_file == "-":
        return
    out, index = Path(out_file).resolve(), Path(index_dir).resolve()
    if out == index or out.is_relative_to(index):
        raise InputError(
            f"--out {out_file} is inside the index dir {index_dir} this command reads; writing there "
            "would change the index dir: choose another --out"
        )
    refuse_nested(out_file, "pairs")
    if Path(out_file).exists() or Path(out_file).is_symlink():
        if Path(out_file).is_symlink() or not Path(out_file).is_file():
            raise InputError(f"--out {out_file} exists and is not a regular file: choose another --out")
        if not force:
            raise InputError(f"--out {out_file} already exists; pass --force to replace it, or choose another --out")
        with open_regular(out_file, None) as handle:
            first = handle.read(4096).split(b"\n", 1)[0].rstrip(b"\r")
        if first != ",".join(PAIR_COLUMNS).encode():
            raise InputError(
                f"--out {out_file} is not a pairs CSV that search wrote (its first line is not the pairs header); "
                "it is never replaced (not even with --force): choose another --out"
            )


def terminal_safe(row, on_terminal: bool):
    """A CSV row as written: to a file or a pipe with only the spreadsheet guards
    (``display.spreadsheet_safe``: no formula, no bidi override); on a terminal, text values are
    escaped (``display.printable``) so a receipt id cannot move the cursor or print a line of its own."""
    if not on_terminal:
        return tuple(spreadsheet_safe(value) for value in row)
    return tuple(printable(value) if isinstance(value, str) else value for value in row)


class _NewlineRows:
    """CSV rows ending in a bare newline in which a field holding a carriage return is quoted too:
    the csv module quotes only the characters of its line terminator, and a bare CR in an
    unquoted field would split the row for every CSV reader. A lone surrogate (a value of a dataset
    an older ingest accepted) is written as its escape: UTF-8 has no bytes for it."""

    def __init__(self, handle):
        self.handle, self.buffer = handle, io.StringIO()
        self.writer = csv.writer(self.buffer, lineterminator="\r\n")

    def writerow(self, row) -> None:
        self.writer.writerow(row)
        line = self.buffer.getvalue()
        self.buffer.seek(0)
        self.buffer.truncate()
        self.handle.write(utf8_safe(line[:-2]) + "\n")


def _all_pairs(index_dir, threshold: float, out_file: str, recheck=lambda: None) -> None:
    """Write the pairs CSV; ``recheck`` repeats the --out checks once the lock is held, so a second
    run that checked before the first created the file cannot replace it without --force."""
    from receipt_embed.fileio import atomic_open
    from receipt_embed.indexing.search import PAIR_COLUMNS, all_pairs, pair_rows

    a, b, sims = all_pairs(index_dir.embeddings, threshold)
    counts = {"true": 0, "false": 0, "": 0}

    def write(handle, on_terminal=False):
        writer = _NewlineRows(handle)
        writer.writerow(PAIR_COLUMNS)
        for row in pair_rows(index_dir, a, b, sims):
            writer.writerow(terminal_safe(row, on_terminal))
            counts[row[3]] += 1

    if out_file == "-":
        write(sys.stdout, on_terminal=sys.stdout.isatty())
    else:
        from receipt_embed.locking import write_lock
        from receipt_embed.staging import clean_temporaries

        with write_lock(out_file):  # one writer; SIGTERM removes the partial file and says so
            recheck()
            clean_temporaries(out_file, log=lambda message: click.echo(printable(f"Warning: {message}"), err=True))
            with atomic_open(out_file, "w") as handle:
                write(handle)
    labelled = f": {counts['true']} same receipt, {counts['false']} different receipts" + (
        f", {counts['']} unlabelled" if counts[""] else ""
    )
    where = "" if out_file == "-" else f" -> {out_file}"
    click.echo(
        printable(f"{len(a)} pairs with similarity >= {threshold} among {index_dir.count} items{labelled}{where}"),
        err=out_file == "-",
    )
