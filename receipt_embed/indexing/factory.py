"""Building a FAISS index from any index-factory string, and tuning approximate ones.

Vectors are L2-normalised and searched by inner product, so scores are cosine similarities.
An approximate index (IVF, HNSW, PQ...) is trained on a random sample, then its search
parameter (``nprobe`` for IVF, ``efSearch`` for HNSW) is raised step by step until recall@10
against exact search, measured on a sample of the indexed vectors used as queries, reaches
the target. The chosen parameters and the measured recall are what ``index.json`` records.
"""

from __future__ import annotations

import re
import time
import warnings
from dataclasses import dataclass

import numpy as np

from receipt_embed.display import quoted, shortened
from receipt_embed.errors import BadInput
from receipt_embed.evaluation.retrieval import l2_normalise

EXACT_FACTORIES = ("Flat",)
# candidate values for the one knob that trades speed for recall, in increasing cost
KNOBS = {
    "nprobe": (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
    "efSearch": (16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024),
}

DEFAULT_TRAIN_SIZE = 100_000  # vectors an approximate index is trained on (a random sample beyond)
PLATEAU = 0.1  # a costlier setting must close at least this share of the gap to the target

# Sizes in a factory string, checked before FAISS builds anything: FAISS allocates an IVF's
# lists and a PQ's codebooks while it parses the string (IVF30000000 took 5 GB), and an
# HNSW/NSG graph's links per vector as it adds them. Degrees outside these bounds crashed,
# hung or exhausted memory; FAISS's docs and wiki use HNSW M and NSG R of 4 to 64.
GRAPH_DEGREES = {"HNSW": (2, 256), "NSG": (8, 256)}  # HNSW0/1 abort or segfault, NSG4 hangs
# NNDescent, which builds NSG's graph, asserts on 100 vectors or fewer and aborted (SIGABRT) on 120
NSG_MIN_VECTORS = 500
MAX_STAGES = 32  # codebooks of a residual (RQ) or additive (LSQ) quantizer
MAX_CODE_BITS = 16  # bits of one PQ/RQ/LSQ sub-code: 8 is FAISS's default, 2**16 entries a codebook
MAX_TRANSFORM_GROWTH = 4  # PCA/RR/ITQ/OPQ output dim at most this many times the input dim


class IndexBuildError(BadInput):
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

    if factory.replace(" ", "").upper().startswith("IDMAP"):
        raise IndexBuildError(
            f"factory {quoted(shortened(factory))}: IDMap wrappers are not supported (an index dir's row number is each "
            "item's id already); use the factory without IDMap, e.g. Flat or HNSW32"
        )
    try:
        return faiss.index_factory(int(dim), factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as exc:
        reason = shortened(_faiss_reason(exc))
        raise IndexBuildError(
            f"FAISS cannot build factory {quoted(shortened(factory))} for dim {dim}: {reason} "
            "(examples: Flat, HNSW32, IVF1024,Flat, IVF4096,PQ64)"
        ) from None


def check_factory(factory: str, n: int, train_size: int | None, dim: int) -> None:
    """Everything about ``factory`` that can be told before any vector exists: its sizes
    (:func:`check_factory_sizes`), then whether FAISS can build it for ``dim`` at all, so a typo
    (``Flt``) is refused before the captures are embedded, not after."""
    check_factory_sizes(factory, n, train_size, dim)
    index = new_index(dim, factory)  # an empty index: nothing is trained or added
    if not index.is_trained:  # what FAISS's training will need, told before any capture is embedded
        _refuse_too_few_to_train(index, factory, n if train_size is None else min(n, train_size), n)


def _number(digits: str) -> int:
    """A count from the factory string; thousands of digits need not become an int to be too many."""
    return int(digits) if len(digits) <= 18 else 10**18


def _too_few_for_lists(factory: str, nlist: int | str, noun: str, size: int) -> IndexBuildError:
    return IndexBuildError(
        f"{shortened(factory)}: cannot train {nlist} IVF lists on {noun}; use fewer lists "
        f"(e.g. IVF{max(1, size // 39)}) or Flat"
    )


def _too_few_for_codebooks(factory: str, ksub: int, noun: str) -> IndexBuildError:
    return IndexBuildError(
        f"{shortened(factory)}: product quantization with {ksub}-entry codebooks needs at least "
        f"{ksub} training vectors, got {noun}; use Flat, HNSW32 or an SQ8 index"
    )


def _too_few_for_stage(factory: str, stage: str, need: int, why: str, noun: str, size: int, n: int) -> IndexBuildError:
    more = "raise --train-size (or index more vectors)" if size < n else "index more vectors"
    return IndexBuildError(
        f"{shortened(factory)}: {stage} needs at least {need} training vectors ({why}), got {noun}; "
        f"{more}, or use Flat, HNSW32 or an SQ8 index"
    )


def check_factory_sizes(factory: str, n: int, train_size: int | None = None, dim: int | None = None) -> None:
    """Refuse, from the string alone, sizes FAISS would allocate for before any check of ours
    could run: more IVF lists or PQ codebook entries than training vectors, a graph degree
    outside ``GRAPH_DEGREES``, codes over ``MAX_CODE_BITS`` bits, PQ sub-quantizers or a
    transform's output dim that ``dim`` cannot hold. Runs before ``faiss.index_factory``."""
    text = factory.replace(" ", "")
    if text in EXACT_FACTORIES:
        return
    size = n if train_size is None else min(n, train_size)
    noun = f"{size} training vectors" + (f" (sampled from {n})" if size < n else "")
    name = shortened(factory)
    for match in re.finditer(r"IVF(\d+)", text):
        nlist = _number(match[1])
        if nlist < 1:
            raise IndexBuildError(f"{name}: an IVF index needs at least 1 list (e.g. IVF{max(1, size // 39)},Flat)")
        if size < nlist:
            raise _too_few_for_lists(factory, shortened(match[1].lstrip("0"), 20), noun, size)
    for match in re.finditer(r"IMI(\d+)x(\d+)", text):
        bits = _number(match[1]) * _number(match[2])
        if bits > 62 or size < 2**bits:
            shown = f"2^{bits}" if bits > 62 else str(2**bits)
            raise _too_few_for_lists(factory, shown, noun, size)
    for kind, (low, high) in GRAPH_DEGREES.items():
        for match in re.finditer(kind + r"(\d+)", text):
            degree = _number(match[1])
            if not low <= degree <= high:
                raise IndexBuildError(
                    f"{name}: {kind}{shortened(match[1])} is outside {kind}{low} to {kind}{high}, the graph "
                    f"degrees receipt-embed builds (FAISS's docs use 4 to 64; e.g. {kind}32)"
                )
            if kind == "NSG" and 2 * degree > n:  # NSG160 on 180 vectors never finished, deaf to signals
                raise IndexBuildError(
                    f"{name}: {kind}{degree} needs at least {2 * degree} vectors (twice its degree), got {n}; "
                    f"use NSG{max(low, min(32, n // 2))}, HNSW32 or Flat"
                )
            if kind == "NSG" and n < NSG_MIN_VECTORS:
                raise IndexBuildError(
                    f"{name}: an NSG graph needs at least {NSG_MIN_VECTORS} vectors, got {n} (FAISS's graph build "
                    "refuses 100 or fewer and aborts the process on a few hundred); use HNSW32 or Flat, as fast at this size"
                )
    for match in re.finditer(r"Refine\(([^()]*(?:\([^()]*\))?[^()]*)\)", text):
        if re.search(r"IVF|IMI|HNSW|NSG", match[1]):  # FAISS aborts the process searching it
            raise IndexBuildError(
                f"{name}: a Refine(...) stage re-ranks with stored codes, so it must be Flat, SQ or PQ storage, "
                f"not {shortened(match[1])} (e.g. IVF64,PQ8,Refine(SQ8))"
            )
    for match in re.finditer(r"(?<![A-Za-z])PQ(\d+)(?:x(\d+))?(fs)?", text):
        m = _number(match[1])
        bits = _number(match[2]) if match[2] else 4 if match[3] else 8
        if dim is not None and m > dim:
            raise IndexBuildError(
                f"{name}: PQ{shortened(match[1])} splits each vector into {m} parts, more than its {dim} "
                f"dimensions; the part count must divide {dim}"
            )
        if m == 0 or bits == 0:  # FAISS crashes (a segfault) on a zero-sized code
            raise IndexBuildError(f"{name}: {shortened(match[0])} has an empty code; e.g. PQ8 or PQ8x8")
        if bits > MAX_CODE_BITS:
            raise IndexBuildError(f"{name}: {bits}-bit PQ codes are refused (at most {MAX_CODE_BITS}; 8 is usual)")
        if size < 2**bits:
            raise _too_few_for_codebooks(factory, 2**bits, noun)
    for match in re.finditer(r"(?:RQ|LSQ)(\d+(?:x\d+)?(?:_\d+(?:x\d+)?)*)", text):
        stages = 0
        for part in match[1].split("_"):  # MxB: M codebooks (stages) of B bits
            count, _, bits = part.partition("x")
            count, bits = _number(count), _number(bits) if bits else 8
            if count == 0 or bits == 0:  # FAISS crashes (a segfault) on a zero-sized code
                raise IndexBuildError(f"{name}: {shortened(match[0])} has an empty code; e.g. RQ4x8")
            if bits > MAX_CODE_BITS:
                raise IndexBuildError(
                    f"{name}: {bits}-bit residual codes are refused (at most {MAX_CODE_BITS}; 8 is usual)"
                )
            stages += count
        if stages > MAX_STAGES:  # each stage trains on its own: LSQ200x8 ran for minutes on 2,000 vectors
            raise IndexBuildError(
                f"{name}: {shortened(match[0])} has {stages} codebooks; at most {MAX_STAGES} are built (e.g. RQ4x8)"
            )
    if dim is None:
        return
    for match in re.finditer(r"(?<![A-Za-z])(?:PCAW?R?|RR|ITQ)(\d+)|OPQ\d+_(\d+)", text):
        out = _number(match[1] or match[2])
        if not 1 <= out <= MAX_TRANSFORM_GROWTH * dim:
            raise IndexBuildError(
                f"{name}: {shortened(match[0])} maps dim {dim} to {out}; give an output dim from 1 to "
                f"{MAX_TRANSFORM_GROWTH * dim}"
            )


def nlist_of(index) -> int | None:
    import faiss

    try:
        return faiss.extract_index_ivf(index).nlist
    except (RuntimeError, ValueError):
        return None


def _parts(index) -> list:
    """The index and the sub-indexes training looks at (IVF, refine base), downcast."""
    import faiss

    parts, seen = [], set()
    stack = [index]
    while stack:
        part = faiss.downcast_index(stack.pop())
        if id(part) in seen:
            continue
        seen.add(id(part))
        parts.append(part)
        for attr in ("base_index", "index", "refine_index"):
            child = getattr(part, attr, None)
            if child is not None and hasattr(child, "ntotal"):
                stack.append(child)
    try:
        parts.append(faiss.downcast_index(faiss.extract_index_ivf(index)))
    except (RuntimeError, ValueError):
        pass
    return parts


def _residual_quantizers(part) -> list:
    """The residual quantizers of one index part: its RQ, or each split of its PRQ."""
    import faiss

    if getattr(part, "rq", None) is not None:
        return [part.rq]
    prq = getattr(part, "prq", None)
    if prq is None:
        return []
    return [faiss.downcast_AdditiveQuantizer(prq.subquantizer(i)) for i in range(prq.nsplits)]


def _training_needs(index):
    """(stage, vectors needed, why) for each stage whose FAISS training needs more vectors than
    the checks on lists and PQ codebooks know: residual quantizers (RQ, PRQ) train a k-means of
    2**bits entries per codebook and, in their default progressive-dimension training, a PCA of
    the (sub)vectors; a PCA (also ITQ's) needs one vector per output dimension; OPQ trains
    256-entry PQ codebooks. FAISS says only "PCA matrix cannot output 1024 dimensions from 1024"
    or "Number of training points (180) should be at least as large as number of clusters (256)"."""
    import faiss

    for part in _parts(index):
        for rq in _residual_quantizers(part):
            entries = 2 ** max(rq.nbits.at(i) for i in range(rq.M))
            yield "its residual quantizer", entries, f"one per entry of its {entries}-entry codebooks"
            if getattr(rq, "train_type", 0) & faiss.ResidualQuantizer.Train_progressive_dim:
                yield "its residual quantizer", rq.d, f"one per dimension of the {rq.d}-dimensional vectors it codes"
    for transform in _transforms(index):
        if isinstance(transform, (faiss.PCAMatrix, faiss.ITQTransform)):
            why = f"one per output dimension of its PCA to {transform.d_out}"
            yield f"its {_stage_name(transform)} stage", transform.d_out, why
        elif isinstance(transform, faiss.OPQMatrix) and transform.pq is None:
            yield "its OPQ stage", 256, "it trains 256-entry PQ codebooks"


def _transforms(index) -> list:
    """The vector transforms (PCA, OPQ, ITQ, RR, ...) that the index's parts apply first, downcast."""
    import faiss

    found = []
    for part in _parts(index):
        chain = getattr(part, "chain", None)
        found += [faiss.downcast_VectorTransform(chain.at(i)) for i in range(chain.size() if chain is not None else 0)]
    return found


def _stage_name(transform) -> str:
    import faiss

    return "PCA" if isinstance(transform, faiss.PCAMatrix) else "ITQ"


def _refuse_too_few_to_train(index, factory: str, size: int, n: int) -> None:
    """A PCA that would output more dimensions than it is given (FAISS fails only when training),
    then the largest need of :func:`_training_needs` that ``size`` vectors cannot meet, in our terms."""
    import faiss

    for transform in _transforms(index):
        if isinstance(transform, (faiss.PCAMatrix, faiss.ITQTransform)) and transform.d_out > transform.d_in:
            raise IndexBuildError(
                f"{shortened(factory)}: its {_stage_name(transform)} stage cannot output {transform.d_out} "
                f"dimensions from {transform.d_in}: a PCA keeps at most as many as it is given; give it an "
                f"output dim of at most {transform.d_in} (RR{transform.d_out} rotates into more)"
            )
    noun = f"{size} training vectors" + (f" (sampled from {n})" if size < n else "")
    unmet = [(need, stage, why) for stage, need, why in _training_needs(index) if size < need]
    if unmet:
        need, stage, why = max(unmet)
        raise _too_few_for_stage(factory, stage, need, why, noun, size, n)


def _check_training_size(index, factory: str, size: int, n: int) -> None:
    """Clear errors for samples too small to train, our own warnings for thin ones (FAISS's
    C++ warnings, printed even with --quiet, are switched off)."""
    noun = f"{size} training vectors" + (f" (sampled from {n})" if size < n else "")
    _refuse_too_few_to_train(index, factory, size, n)
    for part in _parts(index):
        nlist = getattr(part, "nlist", None)
        if isinstance(nlist, int) and hasattr(part, "cp"):
            if size < nlist:
                raise _too_few_for_lists(factory, nlist, noun, size)
            if size < 39 * nlist:
                warnings.warn(f"{factory}: {noun} for {nlist} IVF lists; FAISS advises at least {39 * nlist}")
            part.cp.min_points_per_centroid = 1
        pq = getattr(part, "pq", None)
        if pq is not None and hasattr(pq, "ksub"):
            if size < pq.ksub:
                raise _too_few_for_codebooks(factory, pq.ksub, noun)
            if size < 39 * pq.ksub:
                warnings.warn(
                    f"{factory}: {noun} for {pq.ksub}-entry PQ codebooks; FAISS advises at least {39 * pq.ksub}"
                )
            pq.cp.min_points_per_centroid = 1


def _train(index, factory: str, vectors: np.ndarray, train_size: int | None, seed: int) -> int:
    if index.is_trained:
        return 0
    n = len(vectors)
    size = n if train_size is None else min(n, train_size)
    _check_training_size(index, factory, size, n)
    _skip_polysemous_training(index)
    rows = np.sort(np.random.default_rng(seed).choice(n, size, replace=False)) if size < n else slice(None)
    try:
        index.train(np.ascontiguousarray(vectors[rows]))
    except RuntimeError as exc:  # a need of FAISS's that the checks above do not know: say what it had, and what helps
        reason = _faiss_reason(exc)
        if pca := re.fullmatch(r"PCA matrix cannot output (\d+) dimensions from \d+", reason):
            reason = (
                f"a PCA inside it got fewer than the {pca[1]} vectors it needs to output {pca[1]} dimensions ({reason})"
            )
        more = "raise --train-size (or index more vectors)" if size < n else "index more vectors"
        raise IndexBuildError(
            f"training {shortened(factory)} failed on {size} training vectors of dim {vectors.shape[1]}: "
            f"{shortened(reason)}; if that is too few for one of its stages, {more}, use smaller codes, "
            "or use Flat, HNSW32 or an SQ8 index"
        ) from None
    return size


def _faiss_reason(exc: Exception) -> str:
    """The human part of a FAISS exception: without the C++ function and source line its text
    starts with (``Error in ... at /project/faiss/index_factory.cpp:1228: ``), and of a failed
    assertion only what it explains."""
    text = re.sub(r"\AError in .*? at \S+:\d+: ", "", str(exc).strip(), flags=re.DOTALL) or type(exc).__name__
    return text.split("' failed: ")[-1] if "' failed: " in text else text


def _skip_polysemous_training(index) -> None:
    """PQ codes' polysemous training (for Hamming pre-filtering, which we never switch on)
    costs minutes; it is FAISS's default for PQ indexes built by the factory."""
    for part in _parts(index):
        if hasattr(part, "do_polysemous_training"):
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


def _tune(index, factory: str, queries: np.ndarray, truth: np.ndarray, target_recall: float, log) -> tuple[str, float]:
    """The cheapest search setting whose recall against exact search reaches the target, or the
    best one before raising the cost stops paying (a plateau): (params, recall)."""
    k = truth.shape[1]
    best: tuple[str, float] = ("", -1.0)
    for group in search_candidates(index):
        previous_best = best
        tried: tuple[str, float] = ("", -1.0)  # the best of this group
        for params in group:
            set_search_params(index, params)
            recall = recall_at(index.search(queries, k)[1], truth)
            log(f"{params or factory}: recall@{k} {recall:.3f} against exact search")
            if recall > tried[1]:
                tried = (params, recall)
            if recall >= target_recall:
                break
        best = max(best, tried, key=lambda setting: setting[1])
        if best[1] >= target_recall:
            break
        gain = best[1] - previous_best[1]
        if previous_best[1] >= 0 and gain < PLATEAU * (target_recall - previous_best[1]):
            # doubling the search cost closed under a tenth of the gap: the codes limit recall
            log(
                f"{tried[0]} reached recall@{k} {tried[1]:.3f} against {previous_best[1]:.3f} at {previous_best[0]}; "
                f"keeping the cheaper {previous_best[0]}"
            )
            return previous_best
    return best


# FAISS index classes whose stored codes are lossy (PQ, SQ, LSH, residual and additive quantizers)
LOSSY_STORAGE = re.compile(r"PQ|ScalarQuantizer|SQ|LSH|Residual|LocalSearch|Additive")


def _recall_advice(index) -> str:
    """What limits recall against exact search in this index, and what would raise it: a transform
    that drops dimensions, a re-ranking stage with lossy codes, lossy codes without re-ranking."""
    import faiss

    limits = [
        f"its {type(t).__name__.removesuffix('Matrix').removesuffix('Transform')} stage keeps {t.d_out} of "
        f"{t.d_in} dimensions (a larger output dim, or none, raises it)"
        for t in _transforms(index)
        if t.d_out < t.d_in
    ]
    parts = _parts(index)
    refine = next((part for part in parts if hasattr(part, "refine_index")), None)
    if refine is not None:
        refined_with = faiss.downcast_index(refine.refine_index)
        if isinstance(refined_with, faiss.IndexFlat):
            limits.append("its first stage's codes are too coarse even for 8x exact re-ranking (give it more bytes)")
        else:
            limits.append("it re-ranks with lossy codes (Refine(Flat), or RFlat, re-ranks with the exact vectors)")
    elif any(LOSSY_STORAGE.search(type(part).__name__) for part in parts):
        limits.append("its codes are lossy (more PQ bytes, or an RFlat stage that re-ranks with the exact vectors)")
    if not limits:
        return "Flat or HNSW32 raise it"
    return "; ".join(limits)


def build_index(
    vectors: np.ndarray,
    factory: str = "Flat",
    *,
    train_size: int | None = DEFAULT_TRAIN_SIZE,
    target_recall: float = 0.95,
    recall_queries: int = 1000,
    seed: int = 0,
    log=lambda message: None,
) -> BuiltIndex:
    """Index L2-normalised ``vectors`` (N, d) with ``factory``; tune and measure if approximate."""
    n, dim = vectors.shape
    check_factory_sizes(factory, n, train_size, dim)  # before FAISS allocates anything
    vectors = l2_normalise(vectors)
    index = new_index(dim, factory)
    started = time.perf_counter()
    if factory.replace(" ", "") in EXACT_FACTORIES:
        index.add(vectors)
        return BuiltIndex(index, factory, True, "", None, 0, 0, round(time.perf_counter() - started, 3))
    trained_on = _train(index, factory, vectors, train_size, seed)
    if trained_on:
        log(f"trained {factory} on {trained_on} vectors")
    index.add(vectors)
    built = time.perf_counter()
    k = min(10, n)
    queries = np.random.default_rng(seed + 1).choice(n, min(n, recall_queries), replace=False)
    best = _tune(index, factory, vectors[queries], exact_neighbours(vectors, vectors[queries], k), target_recall, log)
    params, recall = best
    set_search_params(index, params)
    if recall < target_recall:
        warnings.warn(
            f"{factory}: recall@{k} {recall:.3f} against exact search stays below the target {target_recall}"
            + (f" at the best setting ({params})" if params else " (it has no search parameter to raise)")
            + f"; {_recall_advice(index)}"
        )
    return BuiltIndex(
        index,
        factory,
        False,
        params,
        round(recall, 4),
        len(queries),
        trained_on,
        round(built - started, 3),
        round(time.perf_counter() - built, 3),
    )
