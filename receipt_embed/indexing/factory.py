"""Building a FAISS index from any index-factory string, and tuning approximate ones.

Vectors are L2-normalised and searched by inner product, so scores are cosine similarities.
An approximate index (IVF, HNSW, PQ...) is trained on a random sample, then its search
parameter (``nprobe`` for IVF, ``efSearch`` for HNSW) is raised step by step until recall@10
against exact search, measured on a sample of the indexed vectors used as queries, reaches
the target. The chosen parameters and the measured recall are what ``index.json`` records.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from receipt_embed.evaluation.retrieval import l2_normalise

EXACT_FACTORIES = ("Flat", "IDMap,Flat")
# candidate values for the one knob that trades speed for recall, in increasing cost
KNOBS = {
    "nprobe": (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
    "efSearch": (16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024),
}

PLATEAU = 0.005  # a costlier search setting must gain at least this much recall@10


class IndexBuildError(ValueError):
    """A factory string FAISS rejects, or too few vectors to train an index."""


@dataclass
class BuiltIndex:
    index: object  # faiss.Index
    factory: str
    exact: bool
    search_params: str  # "" or e.g. "nprobe=16" (faiss.ParameterSpace syntax)
    recall_at_10: float | None  # measured against exact search; None for an exact index
    recall_queries: int
    train_size: int
    build_seconds: float = 0.0  # train + add
    tune_seconds: float = 0.0  # search-parameter tuning and the recall measurement


def new_index(dim: int, factory: str):
    import faiss

    try:
        return faiss.index_factory(int(dim), factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as exc:
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else "rejected"
        raise IndexBuildError(
            f"FAISS cannot build factory {factory!r} for dim {dim}: {reason} "
            "(examples: Flat, HNSW32, IVF1024,Flat, IVF4096,PQ64)"
        ) from None


def nlist_of(index) -> int | None:
    import faiss

    try:
        return faiss.extract_index_ivf(index).nlist
    except (RuntimeError, ValueError):
        return None


def _train(index, vectors: np.ndarray, train_size: int | None, seed: int) -> int:
    if index.is_trained:
        return 0
    n = len(vectors)
    nlist = nlist_of(index)
    if nlist is not None and n < nlist:
        raise IndexBuildError(f"cannot train {nlist} IVF lists on {n} vectors; use fewer lists (e.g. IVF{max(1, n // 39)}) or Flat")
    _skip_polysemous_training(index)
    size = n if train_size is None else min(n, train_size)
    rows = np.sort(np.random.default_rng(seed).choice(n, size, replace=False)) if size < n else slice(None)
    try:
        index.train(np.ascontiguousarray(vectors[rows]))
    except RuntimeError as exc:
        raise IndexBuildError(f"training the index failed on {size} vectors: {str(exc).strip().splitlines()[-1]}") from None
    return size


def _skip_polysemous_training(index) -> None:
    """PQ codes' polysemous training (for Hamming pre-filtering, which we never switch on)
    costs minutes; it is FAISS's default for PQ indexes built by the factory."""
    import faiss

    try:
        ivf = faiss.extract_index_ivf(index)
    except (RuntimeError, ValueError):
        ivf = None
    for part in (faiss.downcast_index(index), ivf and faiss.downcast_index(ivf)):
        if part is not None and hasattr(part, "do_polysemous_training"):
            part.do_polysemous_training = False


def param_names(index) -> set[str]:
    """Search parameters FAISS can set on this index (nprobe, efSearch, k_factor_rf, ...)."""
    import faiss

    space = faiss.ParameterSpace()
    space.initialize(index)
    return {space.parameter_ranges.at(i).name for i in range(space.parameter_ranges.size())}


def tunable_knob(index) -> str | None:
    names = param_names(index)
    return next((knob for knob in KNOBS if knob in names), None)


def search_candidates(index) -> list[list[str]]:
    """Search-parameter settings, grouped by the main knob's value in increasing cost.

    Refined indexes (``...,RFlat``, ``Refine(SQ8)``) also re-rank k_factor_rf x k candidates
    with the finer codes; each group then tries k_factor_rf 2, 4 and 8."""
    knob = tunable_knob(index)
    if knob is None:
        return [[""]]
    limit = nlist_of(index) if knob == "nprobe" else None
    values = [v for v in KNOBS[knob] if limit is None or v <= limit]
    factors = (2, 4, 8) if "k_factor_rf" in param_names(index) else (None,)
    return [[f"{knob}={v}" + (f",k_factor_rf={f}" if f else "") for f in factors] for v in values]


def exact_neighbours(vectors: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    import faiss

    flat = faiss.IndexFlatIP(vectors.shape[1])
    flat.add(vectors)
    return flat.search(queries, k)[1]


def recall_at(found: np.ndarray, truth: np.ndarray) -> float:
    """Share of the true k nearest neighbours that the approximate search returned."""
    k = truth.shape[1]
    hits = sum(len(set(a[a >= 0]) & set(b)) for a, b in zip(found, truth))
    return hits / (len(truth) * k)


def set_search_params(index, params: str) -> None:
    import faiss

    if params:
        faiss.ParameterSpace().set_index_parameters(index, params)


def build_index(vectors: np.ndarray, factory: str = "Flat", *, train_size: int | None = 100_000,
                target_recall: float = 0.95, recall_queries: int = 1000, seed: int = 0,
                log=lambda message: None) -> BuiltIndex:
    """Index L2-normalised ``vectors`` (N, d) with ``factory``; tune and measure if approximate."""
    vectors = l2_normalise(vectors)
    n, dim = vectors.shape
    index = new_index(dim, factory)
    started = time.perf_counter()
    if factory.replace(" ", "") in EXACT_FACTORIES:
        index.add(vectors)
        return BuiltIndex(index, factory, True, "", None, 0, 0, round(time.perf_counter() - started, 3))
    trained_on = _train(index, vectors, train_size, seed)
    if trained_on:
        log(f"trained {factory} on {trained_on} vectors")
    index.add(vectors)
    built = time.perf_counter()
    k = min(10, n)
    queries = np.random.default_rng(seed + 1).choice(n, min(n, recall_queries), replace=False)
    truth = exact_neighbours(vectors, vectors[queries], k)
    params, recall = "", 0.0
    best: tuple[str, float] = ("", -1.0)
    for group in search_candidates(index):
        previous_best = best
        for params in group:
            set_search_params(index, params)
            recall = recall_at(index.search(vectors[queries], k)[1], truth)
            log(f"{params or factory}: recall@{k} {recall:.3f} against exact search")
            if recall > best[1]:
                best = (params, recall)
            if recall >= target_recall:
                break
        if best[1] >= target_recall:
            break
        if previous_best[1] >= 0 and best[1] - previous_best[1] < PLATEAU:
            best = previous_best  # the codes, not the search, limit recall: keep the cheaper setting
            log(f"recall stopped rising below the target {target_recall}; keeping {best[0]}")
            break
    params, recall = best
    set_search_params(index, params)
    return BuiltIndex(index, factory, False, params, round(recall, 4), len(queries), trained_on,
                      round(built - started, 3), round(time.perf_counter() - built, 3))
