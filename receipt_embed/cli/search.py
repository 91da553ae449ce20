"""``receipt-embed search``: a receipt's other captures, or every near-duplicate pair."""

from __future__ import annotations

import csv
import io
import json
import sys

import click
import numpy as np

from receipt_embed.cli.options import (
    CheckpointPath,
    FiniteFloatRange,
    GivenPath,
    InputError,
    load_registry,
    shortlist_option,
)
from receipt_embed.display import printable, spreadsheet_safe, utf8_safe
from receipt_embed.errors import BadInput


def _print_results(results: list[dict], threshold, threshold_kind: str | None = None, fields=None) -> None:
    """The table; values from the index are escaped, so none can print a line of its own."""
    for result in results:
        click.echo(printable(result["query"]))
        if result.get("already_indexed") is not None:
            click.echo(f"  already indexed (row {result['already_indexed']}): the verdict is about its other captures")
        if threshold is not None:
            match = result["match"]
            source = "" if threshold_kind in (None, "given") else f", the calibrated {threshold_kind} threshold"
            if result.get("no_other_capture"):
                verdict = "no duplicate (the index holds no other capture)"
            elif result["duplicate"] is None:
                hint = (
                    "no indexed capture near it carries the fields given"
                    if fields
                    else "a verifier of printed fields needs the query's: give --field KEY=VALUE"
                )
                verdict = (
                    f"no verdict: every verifier abstained on every other capture (no evidence either way; {hint})"
                )
            elif match:
                verdict = (
                    f"DUPLICATE of receipt {printable(match['receipt_id'])} ({_score_name(match)} "
                    f"{_score_of(match):.3f} >= {threshold:g}{source})"
                )
            else:
                best = result["neighbours"][0] if result["neighbours"] else {}
                verdict = f"no duplicate (best {_score_name(best)} below {threshold:g}{source})"
            click.echo(f"  {verdict}")
        for rank, hit in enumerate(result["neighbours"], start=1):
            same = "  [same file]" if hit["same_file"] else ""
            values = "  ".join(printable(hit[key]) for key in ("receipt_id", "device", "path"))
            if "verified" in hit:
                line = f"verified {_verified_text(hit['verified']['score'])}  similarity {hit['similarity']:.3f}"
            else:
                line = f"{hit['similarity']:.3f}"
            click.echo(f"  {rank:>2}. {line}  {values}{same}")
            if "verified" in hit:
                click.echo(f"      {_verifier_figures(hit['verified'])}")


def _verifier_figures(verified: dict) -> str:
    """One line of each verifier's score and figures: ``geometric 0.815 (matches 223, inliers 177, ...)``."""
    parts = []
    for name, figures in verified.items():
        if name == "score":
            continue
        shown = {key: value for key, value in figures.items() if key not in ("score", "abstain", "veto")}
        if figures.get("abstain"):  # no evidence either way: its figures (nothing agreed, nothing differed) say nothing
            shown = {}
        extras = ", ".join(f"{printable(key)} {_figure(value)}" for key, value in shown.items())
        score = "abstained (nothing to compare)" if figures.get("abstain") else f"{figures['score']:.3f}"
        if figures.get("veto") and not figures.get("abstain"):
            score += ", vetoes the pair"
        parts.append(f"{printable(name)} {score}" + (f" ({extras})" if extras else ""))
    return "; ".join(parts)


def _verified_text(score) -> str:
    return "  -  " if score is None else f"{score:.3f}"


def _figure(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, list):  # the fields that agree: [date, total]
        return "[" + ", ".join(printable(part) for part in value) + "]"
    return printable(value)


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
        if isinstance(value, str) and "," in value:
            parts = [part.strip() for part in value.split(",") if part.strip()]
            self.fail(
                f"{value!r} is several numbers: give each its own option "
                f"({' '.join(f'--threshold {part}' for part in parts)})",
                param,
                ctx,
            )
        try:
            return FiniteFloatRange(-1, 1).convert(value, param, ctx)
        except click.BadParameter as exc:
            if "not a valid float" in str(exc.message):
                self.fail(f"{value!r} is not a number in [-1, 1] or auto", param, ctx)
            raise


@click.command()
@click.argument("index_dir", type=GivenPath(file_okay=False))
@click.argument("images", nargs=-1, type=GivenPath(dir_okay=False))
@click.option("-k", "--k", "k", type=click.IntRange(min=1), default=5, show_default=True, help="Neighbours per query.")
@click.option(
    "--threshold",
    "thresholds",
    type=ThresholdType(),
    multiple=True,
    help="Score at or above which a neighbour counts as a duplicate (cosine similarity, or the verified "
    "score with --verify), or auto: the one `receipt-embed calibrate` stored [auto when a calibration exists]. "
    "--all-pairs takes it several times and reports each.",
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
    "--field",
    "fields",
    multiple=True,
    metavar="KEY=VALUE",
    help="With --verify and one IMAGE: a printed field of the query (date=25/12/2018, total=9.00), "
    "which the fields verifier compares with the indexed captures' manifest columns.",
)
@shortlist_option("With --verify: embedding neighbours checked per query.")
@click.option("--all-pairs", is_flag=True, help="Every pair of indexed items at or above --threshold (no IMAGEs).")
@click.option(
    "--min-similarity",
    type=FiniteFloatRange(-1, 1),
    default=None,
    help="With --all-pairs --verify: only candidate pairs of at least this embedding similarity "
    "[every pair among each item's --shortlist nearest].",
)
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
    thresholds,
    as_json,
    checkpoint,
    max_pixels,
    max_bytes,
    verify,
    verifier_names,
    fields,
    shortlist,
    all_pairs,
    min_similarity,
    out_file,
    force,
):
    """Find the indexed captures nearest to each IMAGE, or (--all-pairs) every near-duplicate pair.

    \b
    receipt-embed search INDEX_DIR photo.jpg --k 5 --threshold 0.9
    receipt-embed search INDEX_DIR photo.jpg --verify --threshold 0.5
    receipt-embed search INDEX_DIR --all-pairs --threshold 0.9 --out pairs.csv
    receipt-embed search INDEX_DIR --all-pairs --verify --threshold 0.5 --threshold 0.9 --out pairs.csv"""
    from receipt_embed.indexing import IndexDirError, load_index_dir, search_images
    from receipt_embed.indexing.calibration import search_kind
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
    if min_similarity is not None and not (all_pairs and verify):
        raise InputError("--min-similarity goes with --all-pairs --verify (it limits the candidate pairs verified)")
    if all_pairs:
        if images:
            raise InputError("--all-pairs compares the indexed items with each other; give no IMAGE arguments")
        if out_file is None:
            raise InputError("--all-pairs writes its pairs to a CSV: give --out pairs.csv ('-' for standard output)")
        if as_json and out_file == "-":
            raise InputError("--all-pairs --json prints the summary to standard output: give --out a file")
        refused = given - {"verify", "verifier_names", "shortlist", "as_json"}
        if fields:
            refused = {*refused, "fields"}
        if refused:
            names = {
                "fields": "--field",
                "k": "--k",
                "checkpoint": "--checkpoint",
                "max_pixels": "--max-pixels",
                "max_bytes": "--max-bytes",
            }
            raise InputError(
                f"{', '.join(names[n] for n in sorted(refused))} "
                f"{'applies' if len(refused) == 1 else 'apply'} to image queries, not to --all-pairs"
            )
    else:
        if not images:
            raise InputError("give one or more IMAGE files to search for (or --all-pairs)")
        if out_file is not None or force:
            raise InputError(
                f"{'--out' if out_file is not None else '--force'} is for --all-pairs; image queries "
                "print to standard output (--json for JSON)"
            )
        if len(thresholds) > 1:
            raise InputError("give --threshold once for image queries (--all-pairs takes several)")
        if fields and not verify:
            raise InputError("--field goes with --verify (the fields verifier compares it)")
        if fields and len(images) > 1:
            raise InputError(f"--field describes one query image; {len(images)} were given: search them one at a time")
    negative = [t for t in thresholds if t != "auto" and t < 0]
    if verify and negative:
        raise InputError(
            f"--threshold {negative[0]:g} with --verify: verified scores are 0 to 1, so it would flag every pair"
        )
    query_fields = _parsed_fields(fields)
    try:
        if all_pairs:
            check_pairs_out(out_file, index_dir, force)
        loaded_index = load_index_dir(index_dir)
        if verify:  # verifiers and fields checked before any threshold is read: their errors are theirs
            from receipt_embed.indexing.verification import check_query_fields, verifiers_of

            checks = verifiers_of(loaded_index, list(verifier_names), load_registry(ctx))
            for note in check_query_fields(checks, query_fields):
                click.echo(printable(f"Note: {note}"), err=True)
        if all_pairs and not thresholds:  # a calibrated index's threshold, as for image queries
            kind = search_kind(verify, True, loaded_index.meta.get("calibration"))
            if ((loaded_index.meta.get("calibration") or {}).get(kind) or {}).get("threshold") is None:
                raise InputError(
                    f"--all-pairs needs --threshold T: {index_dir} has no calibrated {kind} threshold "
                    "(`receipt-embed calibrate` stores one, which --all-pairs then uses)"
                )
            thresholds = ("auto",)
        kind = search_kind(verify, all_pairs or bool(query_fields), loaded_index.meta.get("calibration"))
        calibrated = _uses_calibration(loaded_index, thresholds, kind, images_query=not all_pairs)
        resolved = list(
            dict.fromkeys(  # a threshold given twice (or auto and its value) is reported once
                _resolved_threshold(
                    loaded_index, threshold, kind, images_query=not all_pairs, verifiers=list(verifier_names)
                )
                for threshold in (thresholds or (None,))
            )
        )
        if all_pairs:
            registry = load_registry(ctx) if verify else None
            summary = _all_pairs(
                loaded_index,
                resolved,
                out_file,
                recheck=lambda: check_pairs_out(out_file, index_dir, force),
                verify=list(verifier_names) if verify else None,
                registry=registry,
                shortlist=shortlist,
                min_similarity=min_similarity,
                quiet=as_json,
            )
            if as_json:
                click.echo(json.dumps(summary, indent=2))
            return
        threshold = resolved[0]
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
            fields=query_fields,
        )
        if threshold is not None:  # which threshold judged: calibrate's (and for which score) or the user's
            for result in results:
                result["threshold_kind"] = kind if calibrated else "given"
    except BrokenPipeError:
        raise  # a closed pipe (`| head`): click ends the command quietly
    except (IndexDirError, CheckpointError, ComponentError, OSError, BadInput) as exc:
        raise InputError.of(exc) from None
    if as_json:
        click.echo(json.dumps(results, indent=2))
    else:
        _print_results(results, threshold, results[0].get("threshold_kind") if results else None, query_fields)


def _parsed_fields(given) -> dict:
    """``--field KEY=VALUE`` values as a dict; a key given twice or a value-less one is refused."""
    fields = {}
    for text in given:
        key, sep, value = text.partition("=")
        key = key.strip()
        if not sep or not key:
            raise InputError(f"--field {printable(text)}: give KEY=VALUE, such as date=25/12/2018")
        if key in fields:
            raise InputError(f"--field {printable(key)} is given twice")
        if not value.strip():
            raise InputError(f"--field {printable(key)}= has no value: give the printed value, or leave the field out")
        fields[key] = value.strip()
    return fields


def _uses_calibration(index, thresholds, kind: str, images_query: bool) -> bool:
    """Whether the verdict's threshold is the calibrated one (auto, given or by default)."""
    stored = ((index.meta.get("calibration") or {}).get(kind) or {}).get("threshold")
    return "auto" in thresholds or (not thresholds and images_query and stored is not None)


def _resolved_threshold(index, threshold, kind: str, images_query: bool, verifiers=()):
    """``auto`` becomes the threshold calibrated for ``kind``; none given is auto for image queries
    when the index holds that calibration (so a calibrated index gives verdicts by default)."""
    from receipt_embed.indexing.calibration import calibrated_threshold

    stored = ((index.meta.get("calibration") or {}).get(kind) or {}).get("threshold")
    if threshold is None and images_query and stored is not None:
        threshold = "auto"
    return calibrated_threshold(index, kind, list(verifiers)) if threshold == "auto" else threshold


def check_pairs_out(out_file: str, index_dir: str, force: bool) -> None:
    """The pairs CSV replaces an existing file only with --force and only if it is a pairs CSV
    (its header says so), and never goes inside the index dir or another dir replaced whole."""
    from pathlib import Path

    from receipt_embed.indexing.pairs import PAIR_COLUMNS
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
        if first.split(b",")[: len(PAIR_COLUMNS)] != [name.encode() for name in PAIR_COLUMNS]:
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


def _all_pairs(
    index_dir,
    thresholds: list[float],
    out_file: str,
    recheck=lambda: None,
    verify: list[str] | None = None,
    registry=None,
    shortlist: int = 10,
    min_similarity: float | None = None,
    quiet: bool = False,
) -> dict:
    """Write the pairs CSV and say, per threshold, what it flags against every same-receipt pair of
    the index; returns that summary. ``recheck`` repeats the --out checks once the lock is held, so a
    second run that checked before the first created the file cannot replace it without --force."""
    import time

    from receipt_embed.fileio import atomic_open
    from receipt_embed.indexing import pairs

    started = time.monotonic()
    verified, checks = None, None
    if verify is None:
        a, b, sims = pairs.all_pairs(index_dir.embeddings, min(thresholds))
        scores = sims
    else:
        from receipt_embed.indexing.verification import verifiers_of

        checks = verifiers_of(index_dir, verify, registry)
        a, b, sims = pairs.shortlist_pairs(index_dir.embeddings, shortlist, min_similarity)
        verified = pairs.verify_pairs(checks, registry, a, b, progress=not quiet and sys.stderr.isatty())
        no_evidence = int(np.count_nonzero(np.isnan(verified["score"])))
        keep = verified["score"] >= min(thresholds) - pairs.SIMILARITY_TOLERANCE  # NaN: never kept
        order = np.flatnonzero(keep)[np.lexsort((b[keep], a[keep], -sims[keep], -verified["score"][keep]))]
        candidates = len(a)
        a, b, sims = a[order], b[order], sims[order]
        verified = {name: values[order] for name, values in verified.items()}
        scores = verified["score"]
    extras = pairs.manifest_columns(index_dir.items)
    columns = pairs.pair_columns(list(checks or ()), extras)

    def write(handle, on_terminal=False):
        writer = _NewlineRows(handle)
        writer.writerow(terminal_safe(columns, on_terminal))  # a manifest column named =cmd is a header cell
        for row in pairs.pair_rows(index_dir, a, b, sims, verified, extras):
            writer.writerow(terminal_safe(row, on_terminal))

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
    duplicates = pairs.same_receipt_pairs(index_dir.items)
    same = pairs.same_receipt(index_dir.items, a, b)
    summary = {
        "items": index_dir.count,
        "same_receipt_pairs": duplicates,
        "score": "similarity" if checks is None else "verified",
        **(
            {}
            if checks is None
            else {
                "verifiers": list(checks),
                "shortlist": shortlist,
                "min_similarity": min_similarity,
                "candidates_verified": candidates,
                "no_evidence": no_evidence,
            }
        ),
        "seconds": round(time.monotonic() - started, 3),
        "out": out_file,
        "thresholds": pairs.summarise(scores, same, thresholds, duplicates),
    }
    if not quiet:
        for line in _summary_lines(summary):
            click.echo(printable(line), err=out_file == "-")
    return summary


def _summary_lines(summary: dict) -> list[str]:
    """The all-pairs summary a reviewer reads: the pairs each threshold flags, against every
    same-receipt pair of the index (so recall can be read, not only precision)."""
    duplicates = summary["same_receipt_pairs"]
    known = (
        f"{duplicates} same-receipt pairs among them"
        if duplicates is not None
        else "some unlabelled (no receipt_id), so recall is not known"
    )
    lines = [f"{summary['items']} item{'' if summary['items'] == 1 else 's'}, {known}"]
    if summary["score"] == "verified":
        cut = "" if summary["min_similarity"] is None else f" with similarity >= {summary['min_similarity']:g}"
        lines.append(
            f"verified {summary['candidates_verified']} candidate pairs (each item's {summary['shortlist']} nearest"
            f"{cut}) with {', '.join(summary['verifiers'])} in {summary['seconds']:.1f} s"
        )
        if summary["no_evidence"]:
            lines.append(
                f"  {summary['no_evidence']} of them have no verified score: every verifier abstained "
                "(no field in common), so they are never flagged"
            )
    for row in summary["thresholds"]:
        line = (
            f"  {summary['score']} >= {row['threshold']:g}: {row['pairs']} pairs, {row['same_receipt']} same receipt, "
            f"{row['different_receipts']} different receipts"
        )
        if row["unlabelled"]:
            line += f", {row['unlabelled']} unlabelled"
        if row["precision"] is not None:
            line += f"; precision {row['precision']:.1%}"
        if row["recall"] is not None:
            line += f", recall {row['recall']:.1%} of the same-receipt pairs"
        lines.append(line)
    if summary["out"] != "-":
        lines.append(f"-> {summary['out']}")
    return lines
