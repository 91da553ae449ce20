"""Embedding images with a trained checkpoint: the one path used by evaluation, index and
search, so a capture embeds the same way everywhere.

Images are decoded at the training cache size and resized to the model input exactly as
the training loop's clean (unaugmented) views are.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from receipt_embed.config import Config, KeysDisagree, cache_size
from receipt_embed.data.cache import ImageCache
from receipt_embed.data.views import clean_batches
from receipt_embed.display import shortened
from receipt_embed.errors import BadInput
from receipt_embed.models.embedder import Embedder
from receipt_embed.plugin_watch import forks_end_here
from receipt_embed.training.checkpoint import CheckpointError, check_weights_fit, load_checkpoint, load_weights

FEATURES = ("backbone", "head")


@dataclass
class LoadedModel:
    model: Embedder
    config: Config
    checkpoint: Path
    registry: object = None  # the components' registry: a plugin encoder's failure names it


def load_model(checkpoint: str | Path, registry) -> LoadedModel:
    """Rebuild the model a checkpoint was trained with (its own resolved config), with the
    checkpoint's weights only: ``model.pretrained`` is never downloaded or read."""
    from pydantic import ValidationError

    from receipt_embed.models.build import build_model
    from receipt_embed.registry import ComponentError

    state = load_checkpoint(checkpoint)
    try:
        config = Config.model_validate(state["config"])
    except ValidationError as exc:
        first = exc.errors()[0]
        where, problem = ".".join(str(part) for part in first["loc"]), first["msg"]
        if isinstance(first.get("ctx", {}).get("error"), KeysDisagree):  # a check across sections names its key
            where, problem = first["ctx"]["error"].key, shortened(str(first["ctx"]["error"]))
        raise CheckpointError(f"{checkpoint}: config.{where}: {problem}") from None
    try:
        model = build_model(  # the tensors are compared with the model's shapes before it takes memory
            config,
            registry,
            from_checkpoint=True,
            weights_fit=lambda wanted: check_weights_fit(wanted, state["model"], checkpoint),
        )
    except ComponentError as exc:
        if config.plugins.dir and str(exc).startswith("unknown "):
            # never loaded automatically: that would run code named by a data file
            raise ComponentError(
                f"{exc} {checkpoint} was trained with plugins from {config.plugins.dir}: "
                f"run `receipt-embed --plugins-dir {config.plugins.dir} ...`"
            ) from None
        raise
    load_weights(model, state["model"], checkpoint)
    model.eval()
    return LoadedModel(model, config, Path(checkpoint), registry)


SLICE_BYTES = 256 * 2**20  # decoded captures held at once while embedding


@torch.no_grad()
def embed_paths(
    loaded: LoadedModel,
    paths: list[str],
    features: str = "backbone",
    batch_size: int = 128,
    progress: bool = False,
    digests: list[str | None] | None = None,
    limits: tuple[int, int] | None = None,
) -> np.ndarray:
    """(N, D) float32 embeddings (not normalised) of the images at ``paths``.

    Files are read within ``limits`` (max_pixels, max_bytes), by default the checkpoint
    config's ``ingest.max_pixels`` and ``max_bytes``; ``digests`` (sha256 per path, from a
    dataset dir) refuse captures replaced since ingest. An image that reaches the model as
    one colour (blank, or cut to blank paper by ``data.page_crop``) is refused, naming it:
    every such image embeds to the same vector."""
    if features not in FEATURES:
        raise BadInput(f"features must be one of {', '.join(FEATURES)}, got {features!r}")
    config = loaded.config
    size = cache_size(tuple(config.data.image_size), config.train.cache_margin)
    out = []
    # decode in slices of at most 1024 captures and SLICE_BYTES of decoded pixels, to bound memory
    step = max(1, min(1024, SLICE_BYTES // (size[0] * size[1] * 3)))
    with tqdm(total=len(paths), desc="embedding", unit="img", disable=not progress, file=sys.stderr) as bar:
        for start in range(0, len(paths), step):
            cache = ImageCache(
                paths[start : start + step],
                size,
                max_pixels=config.ingest.max_pixels if limits is None else limits[0],
                max_bytes=config.ingest.max_bytes if limits is None else limits[1],
                digests=None if digests is None else digests[start : start + step],
                crop_page=config.data.page_crop,
            )
            _refuse_blank(cache.images, paths, start, config.data.page_crop)
            for images in clean_batches(cache.images, tuple(config.data.image_size), config.data.grayscale, batch_size):
                with _encoder_errors(loaded):
                    backbone, head = loaded.model(images)
                out.append((backbone if features == "backbone" else head).float().numpy())
                bar.update(len(images))
    return np.concatenate(out) if out else np.zeros((0, embedding_dim(loaded, features)), np.float32)


def _refuse_blank(images: np.ndarray, paths: list[str], start: int, page_crop: bool) -> None:
    """Refuse decoded inputs of one colour: per-image normalisation makes them all the same
    input, so they would embed alike and be called duplicates of each other."""
    flat = images.reshape(len(images), -1)
    blank = np.flatnonzero(flat.max(axis=1) == flat.min(axis=1)) if flat.size else []
    if len(blank):
        how = " (after data.page_crop cut it to its page)" if page_crop else ""
        raise BadInput(
            f"{paths[start + blank[0]]} is blank: all its pixels are one colour once decoded{how}, so it embeds "
            f"to the same vector as every other blank image ({len(blank)} such among "
            f"{len(images)} decoded); remove it, or re-run `receipt-embed ingest`, which rejects blank captures"
        )


def embedding_dim(loaded: LoadedModel, features: str = "backbone") -> int:
    """The length of the ``features`` embeddings the model gives, known before any image is embedded."""
    with forks_end_here():  # a plugin encoder's property
        return loaded.model.head.out_dim if features == "head" else loaded.model.feature_dim


def _encoder_errors(loaded: LoadedModel):
    """Around the model's forward: a plugin encoder that fails (or raises an exit of its own) is named."""
    from contextlib import nullcontext

    from receipt_embed.registry import plugin_errors

    if loaded.registry is None:
        return nullcontext()
    return plugin_errors(loaded.registry, "encoder", loaded.config.model.encoder, "embedding captures")
