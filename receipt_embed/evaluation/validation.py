"""Evaluating a model during training: clean embeddings of the val split, BatchNorm
statistics recomputed on clean captures, then retrieval figures and collapse diagnostics."""

from __future__ import annotations

import numpy as np
import torch

from receipt_embed.config import Config
from receipt_embed.data.cache import ImageCache
from receipt_embed.data.dataset_dir import Captures
from receipt_embed.data.views import clean_batches
from receipt_embed.evaluation.diagnostics import embedding_diagnostics
from receipt_embed.evaluation.retrieval import retrieval_metrics
from receipt_embed.models.embedder import Embedder


@torch.no_grad()
def embed_cache(model: Embedder, cache: ImageCache, config: Config) -> tuple[np.ndarray, np.ndarray]:
    """(backbone features, head projections) of clean (unaugmented) cached captures."""
    model.eval()
    features, projections = [], []
    for images in clean_batches(
        cache.images, tuple(config.data.image_size), config.data.grayscale, config.train.eval_batch_size
    ):
        f, p = model(images)
        features.append(f.float().numpy())
        projections.append(p.float().numpy())
    return np.concatenate(features), np.concatenate(projections)


@torch.no_grad()
def recalibrate_batchnorm(model: Embedder, cache: ImageCache, config: Config, count: int) -> None:
    """Recompute BatchNorm running statistics on clean training captures (a cumulative
    average), so evaluation does not use statistics of augmented views lagging behind."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not norms or count <= 0:
        return
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
    model.train()
    for images in clean_batches(
        cache.images[:count], tuple(config.data.image_size), config.data.grayscale, config.train.eval_batch_size
    ):
        if len(images) > 1:
            model(images)
    for m, momentum in zip(norms, momenta):
        m.momentum = momentum


def evaluate(model: Embedder, val: Captures, val_cache: ImageCache, config: Config) -> dict:
    """Recall@1/@5 and diagnostics of both feature kinds (backbone, head) on the val split."""
    features, projections = embed_cache(model, val_cache, config)
    labels = np.asarray(val.labels)
    result = {}
    for name, x in (("backbone", features), ("head", projections)):
        recall = retrieval_metrics(x, labels, ks=(1, 5), with_map=False)
        result[name] = {"recall_at_1": recall["recall_at_1"], "recall_at_5": recall["recall_at_5"]}
    result["diagnostics"] = {
        name: embedding_diagnostics(x, labels) for name, x in (("backbone", features), ("head", projections))
    }
    return result
