"""``receipt-embed search``: a receipt's other captures, or every near-duplicate pair."""

from __future__ import annotations

import csv
import json
import sys

import click

from receipt_embed.cli.options import InputError, load_registry


def _print_results(results: list[dict], threshold) -> None:
    for result in results:
        click.echo(result["query"])
        if threshold is not None:
            match = result["match"]
            verdict = (f"DUPLICATE of receipt {match['receipt_id']} (similarity {match['similarity']:.3f} >= {threshold})"
                       if match else f"no duplicate (best similarity below {threshold})")
            click.echo(f"  {verdict}")
        for rank, hit in enumerate(result["neighbours"], start=1):
            same = "  [same file]" if hit["same_file"] else ""
            click.echo(f"  {rank:>2}. {hit['similarity']:.3f}  {hit['receipt_id']}  {hit['device']}  {hit['path']}{same}")


@click.command()
@click.argument("index_dir", type=click.Path(file_okay=False))
@click.argument("images", nargs=-1, type=click.Path(dir_okay=False))
@click.option("--k", type=click.IntRange(min=1), default=5, show_default=True, help="Neighbours per query.")
@click.option("--threshold", type=click.FloatRange(-1, 1), default=None,
              help="Cosine similarity at or above which a neighbour counts as a duplicate.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--checkpoint", type=click.Path(dir_okay=False), default=None,
              help="The index's checkpoint at a new location (its sha256 must match index.json).")
@click.option("--all-pairs", is_flag=True, help="Every pair of indexed items at or above --threshold (no IMAGEs).")
@click.option("--out", "out_file", type=click.Path(dir_okay=False), default=None,
              help="With --all-pairs: CSV to write the pairs to.")
@click.pass_context
def search(ctx, index_dir, images, k, threshold, as_json, checkpoint, all_pairs, out_file):
    """Find the indexed captures nearest to each IMAGE, or (--all-pairs) every near-duplicate pair.

    \b
    receipt-embed search INDEX_DIR photo.jpg --k 5 --threshold 0.9
    receipt-embed search INDEX_DIR --all-pairs --threshold 0.9 --out pairs.csv"""
    from receipt_embed.images import ImageRejected
    from receipt_embed.indexing import IndexDirError, load_index_dir, search_images
    from receipt_embed.registry import ComponentError
    from receipt_embed.training.checkpoint import CheckpointError

    if all_pairs:
        if images:
            raise InputError("--all-pairs compares the indexed items with each other; give no IMAGE arguments")
        if threshold is None or out_file is None:
            raise InputError("--all-pairs needs --threshold T and --out pairs.csv")
    elif not images:
        raise InputError("give one or more IMAGE files to search for (or --all-pairs)")
    try:
        loaded_index = load_index_dir(index_dir)
        if all_pairs:
            _all_pairs(loaded_index, threshold, out_file)
            return
        results = search_images(loaded_index, list(images), load_registry(ctx), k=k, threshold=threshold,
                                checkpoint=checkpoint)
    except ImageRejected as exc:
        raise InputError(exc.detail) from None
    except (IndexDirError, CheckpointError, ComponentError, FileNotFoundError, ValueError) as exc:
        raise InputError(str(exc)) from None
    if as_json:
        click.echo(json.dumps(results, indent=2))
    else:
        _print_results(results, threshold)


def _all_pairs(index_dir, threshold: float, out_file: str) -> None:
    from receipt_embed.fileio import atomic_open
    from receipt_embed.indexing.search import PAIR_COLUMNS, all_pairs, pair_rows

    a, b, sims = all_pairs(index_dir.embeddings, threshold)
    same = cross = unknown = 0
    with atomic_open(out_file, "w") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(PAIR_COLUMNS)
        for row in pair_rows(index_dir, a, b, sims):
            writer.writerow(row)
            same += row[3] == "true"
            cross += row[3] == "false"
            unknown += row[3] == ""
    labelled = f": {same} same receipt, {cross} different receipts" + (f", {unknown} unlabelled" if unknown else "")
    click.echo(f"{len(a)} pairs with similarity >= {threshold} among {index_dir.count} items{labelled} -> {out_file}",
               file=sys.stdout)
