"""The tiled log-sum-exp engine every contrastive loss here runs on.

All the losses in this package reduce to one primitive: for each query row ``i`` and each
scale ``s`` (an inverse temperature, possibly times a hardness factor), the log-sum-exp

    lse[i, c] = log sum_{j : key_label[j] != query_label[i]} exp(s_c * <q_i, k_j>)

over unit vectors ``q`` and ``k``. Excluding every key that shares the query's identity is
what keeps a same-receipt capture from ever acting as a negative; a loss that wants its
positive in the denominator adds it back with ``logaddexp``, and SupCon (whose denominator is
"everything but self") passes ``arange(N)`` as labels.

Why this engine exists: the (N, M) similarity matrix is the memory bottleneck of contrastive
learning (N = 65,536 views is 17 GB in float32, several times over once autograd keeps its
intermediates). Here the matrix is streamed in (tile x tile) blocks:

* forward: one matmul per block, then ``exp`` in place and row sums; nothing of size N x M is
  kept, only ``lse`` (N, C);
* backward (a custom :class:`torch.autograd.Function`): each block is recomputed and turned
  into its softmax block on the fly, and ``dQ += H @ K`` / ``dK += H^T @ Q`` accumulate.

Peak extra memory is therefore O(N x d + tile^2), and the two kernels are:

``symmetric`` (keys are the queries, the usual in-batch case): only blocks on or above the
diagonal are visited; each block serves its rows *and*, transposed, its columns, which halves
the matmuls. This needs one exponential per block for both directions, so it uses a fixed
shift ``exp(s * cos - s)`` (cosines are at most 1). That is exact whenever the logit range
``2 * s`` fits the dtype's exponent (<= 80 in float32, i.e. temperature >= 0.025).

``general`` (queries against other keys, e.g. a MoCo queue, and the fallback at very low
temperature): rows are reduced with an online, max-subtracted log-sum-exp
(Milakov & Gimelshein 2018), so any temperature stays finite in float32.

A dense path (the general kernel with one block spanning the whole matrix) serves tiny
problems where tiling only adds overhead; all paths agree to rounding and are tested against
each other and against plain float64 references. Every backward runs with autocast off, so
gradients stay float32 even when ``backward()`` is called inside an autocast region.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from receipt_embed.errors import BadInput
from receipt_embed.losses.tile_kernels import GeneralLSE, SymmetricLSE, autocast_off
from receipt_embed.losses.tile_mask import TileMask, label_matches, pairs_by_tile

__all__ = ["masked_logsumexp", "EngineInfo", "autocast_off", "DEFAULT_TILE", "DENSE_MAX_ELEMENTS"]

DEFAULT_TILE = 1024
# Up to this many similarity entries one whole-matrix block is at least as fast as tiling.
DENSE_MAX_ELEMENTS = 512 * 512
# Largest logit range (max - min) an exp with a fixed shift can hold without under/overflow.
_FIXED_SHIFT_RANGE = {torch.float32: 80.0, torch.float64: 700.0}
# Same-label pairs are masked from a sparse list unless they are this many per row or more.
_PAIRS_PER_ROW_LIMIT = 64


@dataclass
class EngineInfo:
    """How a call was computed, for diagnostics (``last_stats``) and tests."""

    path: str  # "dense", "tiled-symmetric" or "tiled-general"
    masked_pairs: int  # (row, column) pairs excluded because they share a label
    masking: str  # "pairs" (sparse list) or "compare" (labels compared per tile)


def masked_logsumexp(
    queries: torch.Tensor,
    keys: torch.Tensor | None,
    query_labels: torch.Tensor,
    key_labels: torch.Tensor | None,
    scales: tuple[float, ...] | list[float],
    *,
    tile_size: int = DEFAULT_TILE,
    path: str = "auto",
    masking: str = "auto",
) -> tuple[torch.Tensor, EngineInfo]:
    """Row-wise log-sum-exp of ``scale * <q_i, k_j>`` over keys of a different label.

    Args:
        queries: (N, d) unit vectors (float32 or float64).
        keys: (M, d) unit vectors, or ``None`` for the symmetric case (keys are the queries;
            the engine then visits only half the blocks).
        query_labels, key_labels: integer identities (N,), (M,); ``key_labels`` is ignored
            when ``keys`` is ``None``.
        scales: positive multipliers, one output column each (e.g. ``1 / temperature``).
        tile_size: block edge; memory is O(tile_size^2) per block buffer.
        path: ``"auto"``, ``"dense"``, ``"tiled"`` (symmetric kernel where it is exact, else
            general) or ``"tiled-general"`` (force the online kernel).
        masking: ``"auto"``, ``"pairs"`` or ``"compare"``: how same-label entries are found.

    Returns:
        ``(lse, info)``: ``lse`` is (N, len(scales)), ``-inf`` where a row has no allowed key;
        differentiable with respect to ``queries`` and ``keys``.
    """
    symmetric = keys is None
    if symmetric:
        keys, key_labels = queries, query_labels
    scales = tuple(float(s) for s in scales)
    if not scales or any(not (s > 0 and math.isfinite(s)) for s in scales):
        raise BadInput(f"scales must be positive and finite, got {scales}")
    if tile_size < 1:
        raise BadInput(f"tile_size must be >= 1, got {tile_size}")
    if path not in ("auto", "dense", "tiled", "tiled-general"):
        raise BadInput(f"path must be auto, dense, tiled or tiled-general, got {path!r}")
    if masking not in ("auto", "pairs", "compare"):
        raise BadInput(f"masking must be auto, pairs or compare, got {masking!r}")

    if queries.dtype not in (torch.float32, torch.float64) or keys.dtype != queries.dtype:
        raise BadInput(f"queries and keys must share dtype float32 or float64, got {queries.dtype}, {keys.dtype}")
    with autocast_off(queries.device.type):
        return _masked_lse(queries, keys, query_labels, key_labels, scales, symmetric, tile_size, path, masking)


def _masked_lse(queries, keys, query_labels, key_labels, scales, symmetric, tile_size, path, masking):
    queries = queries.contiguous()
    keys = queries if symmetric else keys.contiguous()
    query_labels = query_labels.to(device=queries.device, dtype=torch.long)
    key_labels = query_labels if symmetric else key_labels.to(device=queries.device, dtype=torch.long)
    n, m = queries.shape[0], keys.shape[0]
    lo, counts, order = label_matches(query_labels, key_labels)
    masked_pairs = int(counts.sum())
    if masking == "auto":
        masking = "pairs" if masked_pairs <= _PAIRS_PER_ROW_LIMIT * (n + m) else "compare"

    if path == "auto":
        path = "dense" if n * m <= DENSE_MAX_ELEMENTS else "tiled"
    if path == "dense":  # the whole matrix as a single block, labels compared directly
        whole = max(n, m, 1)
        mask = TileMask(None, query_labels, key_labels, whole)
        lse = GeneralLSE.apply(queries, keys, scales, mask, whole, False)
        return lse, EngineInfo("dense", masked_pairs, "compare")

    # The fixed shift exp(s * cos - s) needs |cos| <= 1, i.e. unit rows, and a safe range.
    fixed_ok = 2.0 * max(scales) <= _FIXED_SHIFT_RANGE.get(queries.dtype, 0.0) and all(
        float(x.detach().pow(2).sum(dim=1).max()) <= 1.0 + 1e-4 for x in ((queries,) if symmetric else (queries, keys))
    )
    pairs = None
    if masking == "pairs":
        pairs = pairs_by_tile(lo, counts, order, tile_size, n, m)
    if path == "tiled" and symmetric and fixed_ok:
        mask = TileMask(pairs, query_labels, query_labels, tile_size)
        lse = SymmetricLSE.apply(queries, scales, mask, tile_size)
        return lse, EngineInfo("tiled-symmetric", masked_pairs, masking)
    mask = TileMask(pairs, query_labels, key_labels, tile_size)
    lse = GeneralLSE.apply(queries, keys, scales, mask, tile_size, fixed_ok and path == "tiled")
    return lse, EngineInfo("tiled-general", masked_pairs, masking)
