"""``receipt-embed index``: embeddings into a FAISS index dir."""

from __future__ import annotations

import sys

import click

from receipt_embed.cli.options import (
    CheckpointPath,
    DatasetDirPath,
    GivenPath,
    InputError,
    index_build_options,
    load_registry,
)
from receipt_embed.display import printable
from receipt_embed.errors import BadInput


@click.command()
@click.option(
    "--checkpoint",
    type=CheckpointPath(),
    default=None,
    help="Checkpoint to embed with, e.g. RUN_DIR/checkpoints/best.pt.",
)
@click.option(
    "--data",
    "data_dir",
    type=DatasetDirPath(),
    default=None,
    help="Dataset dir from `ingest` whose captures are indexed (with --checkpoint).",
)
@click.option(
    "--split",
    type=click.Choice(["all", "train", "val", "heldout"]),
    default="all",
    show_default=True,
    help="Which captures of --data to index.",
)
@click.option(
    "--features",
    type=click.Choice(["backbone", "head"]),
    default="backbone",
    show_default=True,
    help="backbone: the encoder's features, meant for downstream use; head: the projection head's output.",
)
@click.option(
    "--embeddings",
    "embeddings_file",
    type=GivenPath(dir_okay=False),
    default=None,
    help="Index these (N, D) .npy embeddings of any model instead of embedding images.",
)
@click.option(
    "--manifest",
    default=None,
    type=GivenPath(exists=True),
    help="With --embeddings: manifest (CSV/JSONL or dataset dir) whose row i is embedding row i.",
)
@click.option("--out", "out_dir", required=True, type=GivenPath(file_okay=False), help="Index dir to write.")
@index_build_options
@click.option(
    "--batch-size", type=click.IntRange(min=1), default=128, show_default=True, help="Images per forward pass."
)
@click.option(
    "--shard",
    default=None,
    metavar="I/N",
    help="Embed only slice I of N (0-based) into a shard dir; join the N shards with `index-merge`.",
)
@click.option(
    "--verify",
    "verify",
    multiple=True,
    metavar="NAME",
    help="Also store this verifier's per-capture data (e.g. geometric), for `search --verify`; repeatable.",
)
@click.option(
    "--verify-set",
    "verify_settings",
    multiple=True,
    metavar="NAME.KEY=VALUE",
    help="A parameter of a --verify verifier (e.g. geometric.keypoints=2000); repeatable.",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option(
    "--force",
    is_flag=True,
    help="Replace an existing index (or shard) dir in --out; the old one stays until the new one is complete.",
)
@click.pass_context
def index(
    ctx,
    checkpoint,
    data_dir,
    split,
    features,
    embeddings_file,
    manifest,
    out_dir,
    factory,
    target_recall,
    train_size,
    batch_size,
    shard,
    verify,
    verify_settings,
    quiet,
    force,
):
    """Embed captures (or take external embeddings) into a FAISS index dir.

    Vectors are L2-normalised and searched by inner product (cosine similarity). The dir
    holds index.faiss, items.jsonl, embeddings.npy and index.json (checksums, source), and with
    --verify NAME a verifier-NAME.npz of each verifier's per-capture data.

    OUT is written beside the old copy and swapped in complete (searches never see a half-written
    index); an existing index dir needs --force; a dir of another kind, or one holding the
    inputs, is never replaced."""
    from receipt_embed.config import ConfigError
    from receipt_embed.indexing import IndexBuildError
    from receipt_embed.ingest.manifest import ManifestError
    from receipt_embed.registry import ComponentError
    from receipt_embed.training.checkpoint import CheckpointError

    log = (lambda message: None) if quiet else (lambda message: click.echo(printable(message), err=True))
    options = {"factory": factory, "target_recall": target_recall, "train_size": train_size, "log": log, "force": force}
    given = {
        name
        for name in ("split", "features", "batch_size", "target_recall", "train_size", "factory")
        if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT
    }
    if shard is None and factory.replace(" ", "") == "Flat" and given & {"target_recall", "train_size"}:
        click.echo(printable(f"Warning: {factory} is exact: --target-recall and --train-size do not apply"), err=True)
    images = {
        "split": split,
        "features": features,
        "batch_size": batch_size,
        "progress": not quiet and sys.stderr.isatty(),
    }
    try:
        verifiers = _verifier_params(ctx, verify, verify_settings)
        if verifiers and (embeddings_file is not None or shard is not None):
            raise InputError(
                f"--verify reads the captures' images: it goes with --checkpoint and --data, not with "
                f"{'--embeddings' if embeddings_file is not None else '--shard'} (not yet)"
            )
        if embeddings_file is not None:
            meta = _index_external(embeddings_file, manifest, out_dir, checkpoint, data_dir, shard, given, options)
        elif shard is not None:
            _index_shard(ctx, checkpoint, data_dir, manifest, out_dir, shard, given, images, log, force)
            return
        else:
            _check_image_inputs(checkpoint, data_dir, manifest)
            meta = _index_images(ctx, checkpoint, data_dir, out_dir, images, {**options, "verifiers": verifiers})
    except (CheckpointError, ComponentError, ConfigError, IndexBuildError, ManifestError, OSError, BadInput) as exc:
        raise InputError(str(exc)) from None
    click.echo(_summary(meta, out_dir, target_recall))


def _verifier_params(ctx, verify, settings) -> dict[str, dict]:
    """--verify NAME and --verify-set NAME.KEY=VALUE -> parameters by verifier (a typo names the verifiers there are)."""
    if not verify and not settings:
        return {}
    from receipt_embed.registry import named_settings

    registry = load_registry(ctx)

    def known(name: str) -> str:
        registry.get("verifier", name)
        if name not in verify:
            raise InputError(f"--verify-set {name}.KEY=VALUE: add --verify {name}, or drop the setting")
        return name

    for name in verify:
        registry.get("verifier", name)
    params = named_settings(settings, "--verify-set", known)
    return {name: params.get(name, {}) for name in dict.fromkeys(verify)}


def _index_external(embeddings_file, manifest, out_dir, checkpoint, data_dir, shard, given, options) -> dict:
    """An index dir from embeddings made elsewhere, after refusing the options that embed images."""
    from receipt_embed.indexing import index_embeddings

    images_only = [f"--{name.replace('_', '-')}" for name in ("split", "features", "batch_size") if name in given]
    if shard is not None:
        raise InputError("--shard splits the embedding of images; external --embeddings are already made")
    if checkpoint or data_dir or images_only:
        raise InputError(
            "--embeddings takes --manifest; "
            + ", ".join(["--checkpoint"] * bool(checkpoint) + ["--data"] * bool(data_dir) + images_only)
            + " are for embedding images"
        )
    if manifest is None:
        raise InputError("--embeddings needs --manifest: the captures its rows belong to, in order")
    return index_embeddings(embeddings_file, manifest, out_dir, **options)


def _check_image_inputs(checkpoint, data_dir, manifest) -> None:
    if manifest is not None:
        raise InputError("--manifest goes with --embeddings; to embed images use --checkpoint and --data")
    if not checkpoint or not data_dir:
        raise InputError("give --checkpoint and --data (or --embeddings with --manifest)")


def _index_images(ctx, checkpoint, data_dir, out_dir, images, options) -> dict:
    from receipt_embed.indexing import index_dataset

    return index_dataset(checkpoint, data_dir, out_dir, load_registry(ctx), **images, **options)


def _index_shard(ctx, checkpoint, data_dir, manifest, out_dir, shard, given, images, log, force) -> None:
    """One slice of the captures embedded into a shard dir (`index-merge` builds the index)."""
    from receipt_embed.indexing import index_dataset
    from receipt_embed.indexing.shards import parse_shard

    _check_image_inputs(checkpoint, data_dir, manifest)
    registry = load_registry(ctx)
    merge_options = [
        f"--{name.replace('_', '-')}" for name in ("factory", "target_recall", "train_size") if name in given
    ]
    if merge_options:
        raise InputError(
            f"{', '.join(merge_options)} belong(s) to `index-merge`: a shard holds vectors, the merge builds the index"
        )
    meta = index_dataset(
        checkpoint, data_dir, out_dir, registry, **images, shard=parse_shard(shard), log=log, force=force
    )
    click.echo(
        printable(
            f"Wrote shard {meta['shard']}/{meta['shards']} (rows {meta['rows'][0]}..{meta['rows'][1] - 1} "
            f"of {meta['total']}) -> {out_dir}; join all shards with `receipt-embed index-merge`"
        )
    )


def _summary(meta: dict, out_dir, target_recall: float) -> str:
    """The line `index` ends with: what was indexed, and how exact the search is."""
    recall = ""
    if not meta["exact"]:
        params = printable(meta["search_params"] or "no search parameter")
        below = f", below the target {target_recall}" if meta["recall_at_10"] < target_recall else ""
        recall = f", recall@10 {meta['recall_at_10']:.3f} against exact search ({params}{below})"
    return (
        f"Indexed {meta['count']} items of dim {meta['dim']} with {printable(meta['factory'])}{recall} -> "
        f"{printable(out_dir)}"
    )


@click.command("index-merge")
@click.argument("shard_dirs", nargs=-1, required=True, type=GivenPath(file_okay=False, exists=True))
@click.option("--out", "out_dir", required=True, type=GivenPath(file_okay=False), help="Index dir to write.")
@index_build_options
@click.option("--quiet", "-q", is_flag=True, help="Less output.")
@click.option("--force", is_flag=True, help="Replace an existing index dir in --out (swapped in once complete).")
def index_merge(shard_dirs, out_dir, factory, target_recall, train_size, quiet, force):
    """Join the shard dirs of `index --shard I/N` (all N of them) into one index dir.

    \b
    receipt-embed index --checkpoint C --data D --shard 0/2 --out shards/0   # jobs that
    receipt-embed index --checkpoint C --data D --shard 1/2 --out shards/1   # can run in parallel
    receipt-embed index-merge shards/0 shards/1 --out INDEX_DIR --factory HNSW32"""
    from receipt_embed.indexing import IndexBuildError, IndexDirError
    from receipt_embed.indexing.shards import merge_shards

    log = (lambda message: None) if quiet else (lambda message: click.echo(printable(message), err=True))
    try:
        meta = merge_shards(
            list(shard_dirs),
            out_dir,
            factory=factory,
            target_recall=target_recall,
            train_size=train_size,
            log=log,
            force=force,
        )
    except (IndexBuildError, IndexDirError, OSError, BadInput, KeyError) as exc:
        raise InputError(str(exc)) from None
    click.echo(
        f"Merged {len(shard_dirs)} shards: {meta['count']} items of dim {meta['dim']} with "
        f"{printable(meta['factory'])} -> {printable(out_dir)}"
    )
