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

import contextlib
import math
from dataclasses import dataclass

import torch

from receipt_embed.errors import BadInput

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


def autocast_off(device_type: str):
    """Keep logits in float32/float64 even inside a bf16/fp16 autocast region (forward and
    backward: the backward of a custom Function does not inherit the forward's state)."""
    try:
        return torch.autocast(device_type=device_type, enabled=False)
    except RuntimeError:  # a device type autocast does not know
        return contextlib.nullcontext()


def _masked_lse(queries, keys, query_labels, key_labels, scales, symmetric, tile_size, path, masking):
    queries = queries.contiguous()
    keys = queries if symmetric else keys.contiguous()
    query_labels = query_labels.to(device=queries.device, dtype=torch.long)
    key_labels = query_labels if symmetric else key_labels.to(device=queries.device, dtype=torch.long)
    n, m = queries.shape[0], keys.shape[0]
    lo, counts, order = _label_matches(query_labels, key_labels)
    masked_pairs = int(counts.sum())
    if masking == "auto":
        masking = "pairs" if masked_pairs <= _PAIRS_PER_ROW_LIMIT * (n + m) else "compare"

    if path == "auto":
        path = "dense" if n * m <= DENSE_MAX_ELEMENTS else "tiled"
    if path == "dense":  # the whole matrix as a single block, labels compared directly
        whole = max(n, m, 1)
        mask = _TileMask(None, query_labels, key_labels, whole)
        lse = _GeneralLSE.apply(queries, keys, scales, mask, whole, False)
        return lse, EngineInfo("dense", masked_pairs, "compare")

    # The fixed shift exp(s * cos - s) needs |cos| <= 1, i.e. unit rows, and a safe range.
    fixed_ok = 2.0 * max(scales) <= _FIXED_SHIFT_RANGE.get(queries.dtype, 0.0) and all(
        float(x.detach().pow(2).sum(dim=1).max()) <= 1.0 + 1e-4 for x in ((queries,) if symmetric else (queries, keys))
    )
    pairs = None
    if masking == "pairs":
        pairs = _pairs_by_tile(lo, counts, order, tile_size, n, m)
    if path == "tiled" and symmetric and fixed_ok:
        mask = _TileMask(pairs, query_labels, query_labels, tile_size)
        lse = _SymmetricLSE.apply(queries, scales, mask, tile_size)
        return lse, EngineInfo("tiled-symmetric", masked_pairs, masking)
    mask = _TileMask(pairs, query_labels, key_labels, tile_size)
    lse = _GeneralLSE.apply(queries, keys, scales, mask, tile_size, fixed_ok and path == "tiled")
    return lse, EngineInfo("tiled-general", masked_pairs, masking)


# ----------------------------------------------------------------------------- masking


def _label_matches(q_labels, k_labels):
    """For each query, the range of key positions (in label-sorted order) sharing its label."""
    k_sorted, order = torch.sort(k_labels, stable=True)
    lo = torch.searchsorted(k_sorted, q_labels, right=False)
    hi = torch.searchsorted(k_sorted, q_labels, right=True)
    return lo, hi - lo, order


def _pairs_by_tile(lo, counts, order, tile, n, m):
    """All (row, col) same-label pairs, sorted by block, plus each block's slice bounds."""
    total = int(counts.sum())
    rows = torch.repeat_interleave(torch.arange(n, device=lo.device), counts)
    starts = torch.repeat_interleave(lo - (torch.cumsum(counts, 0) - counts), counts)
    cols = order[torch.arange(total, device=lo.device) + starts]
    n_col_tiles = -(-m // tile)
    key = (rows // tile) * n_col_tiles + cols // tile
    key, perm = torch.sort(key, stable=True)
    n_row_tiles = -(-n // tile)
    bounds = torch.searchsorted(key, torch.arange(n_row_tiles * n_col_tiles + 1, device=lo.device))
    return rows[perm], cols[perm], bounds.tolist(), n_col_tiles


class _TileMask:
    """Fills the same-label entries of one block with -inf, from a pair list or by comparing."""

    def __init__(self, pairs, q_labels, k_labels, tile):
        self.pairs, self.q_labels, self.k_labels, self.tile = pairs, q_labels, k_labels, tile

    def apply(self, block, r0, c0):
        t = self.tile
        if self.pairs is None:
            rl = self.q_labels[r0 : r0 + block.shape[0]]
            cl = self.k_labels[c0 : c0 + block.shape[1]]
            block.masked_fill_(rl[:, None] == cl[None, :], float("-inf"))
            return
        rows, cols, bounds, n_col_tiles = self.pairs
        b = (r0 // t) * n_col_tiles + c0 // t
        lo, hi = bounds[b], bounds[b + 1]
        if hi > lo:
            block[rows[lo:hi] - r0, cols[lo:hi] - c0] = float("-inf")


# ----------------------------------------------------------------------------- kernels


def _shifted_cos(zl, zr, scale):
    """Left/right factors whose product is ``scale * (cos - 1)``: the shift rides in the
    matmul as one extra column, saving a full pass over each block."""
    one = torch.ones(zl.shape[0], 1, dtype=zl.dtype, device=zl.device)
    left = torch.cat([zl * scale, -scale * one], dim=1)
    right = torch.cat([zr, torch.ones(zr.shape[0], 1, dtype=zr.dtype, device=zr.device)], dim=1)
    return left, right


def _finite_or_zero(x):
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _tiles(n, t):
    return [(a, min(a + t, n)) for a in range(0, n, t)]


class _Buffers:
    """Reusable flat buffers for block-sized temporaries: fresh 2-D allocations of several MB
    per block cost page faults that measurably slow the matmuls (about 30% on CPU)."""

    def __init__(self, like, tile, count):
        self.flat = [like.new_empty(tile * tile) for _ in range(count)]

    def get(self, index, rows, cols):
        return self.flat[index][: rows * cols].view(rows, cols)


class _SymmetricLSE(torch.autograd.Function):
    """Keys are the queries: visit blocks (I, J) with I <= J, use each for rows and columns.

    With a fixed shift E = exp(s * (cos - 1)), row sums and column sums of one block both come
    from the same E; the backward block is H = E * (a_I + a_J^T) with
    a_i = g_i * s * exp(s - lse_i), so dZ_I += H @ Z_J and dZ_J += H^T @ Z_I.
    """

    @staticmethod
    def forward(ctx, z, scales, mask, tile):
        n = z.shape[0]
        sums = z.new_zeros(n, len(scales))
        with torch.no_grad():
            buffers = _Buffers(z, min(tile, n), 1 + len(scales))
            for (i0, i1), (j0, j1), c, e in _symmetric_blocks(z, scales, mask, tile, buffers):
                sums[i0:i1, c] += e.sum(dim=1)
                if i0 != j0:
                    sums[j0:j1, c] += e.sum(dim=0)
            lse = torch.tensor(scales, dtype=z.dtype, device=z.device) + torch.log(sums)
        ctx.save_for_backward(z, lse)
        ctx.scales, ctx.mask, ctx.tile = scales, mask, tile
        return lse

    @staticmethod
    def backward(ctx, grad_lse):
        z, lse = ctx.saved_tensors
        n, last = z.shape[0], len(ctx.scales) - 1
        scales = torch.tensor(ctx.scales, dtype=z.dtype, device=z.device)
        finite = torch.isfinite(lse)
        alpha = torch.where(finite, grad_lse * scales * torch.exp(scales - lse), torch.zeros_like(lse))
        dz = torch.zeros_like(z)
        with torch.no_grad(), autocast_off(z.device.type):
            buffers = _Buffers(z, min(ctx.tile, n), 3 + len(ctx.scales))
            for (i0, i1), (j0, j1), c, e in _symmetric_blocks(z, ctx.scales, ctx.mask, ctx.tile, buffers):
                weight = torch.add(alpha[i0:i1, c, None], alpha[None, j0:j1, c], out=buffers.get(-1, i1 - i0, j1 - j0))
                if c == 0:
                    h = e.mul_(weight)
                else:
                    h.addcmul_(e, weight)
                if c == last:
                    dz[i0:i1].addmm_(h, z[j0:j1])
                    if i0 != j0:
                        dz[j0:j1].addmm_(h.T, z[i0:i1])
        return dz, None, None, None


def _symmetric_blocks(z, scales, mask, tile, buffers):
    """Yield ((i0, i1), (j0, j1), channel, E) for blocks on and above the diagonal.

    E is written into ``buffers`` (slot 0 for one scale, else slot 1 + channel) and is only
    valid until the next item is drawn.
    """
    n = z.shape[0]
    single = len(scales) == 1
    left, right = _shifted_cos(z, z, scales[0] if single else 1.0)
    spans = _tiles(n, tile)
    for bi, (i0, i1) in enumerate(spans):
        for j0, j1 in spans[bi:]:
            block = torch.mm(left[i0:i1], right[j0:j1].T, out=buffers.get(0, i1 - i0, j1 - j0))
            mask.apply(block, i0, j0)  # block = s * (cos - 1), or (cos - 1) for several scales
            if single:
                yield (i0, i1), (j0, j1), 0, block.exp_()
            else:
                for c, s in enumerate(scales):
                    e = torch.mul(block, s, out=buffers.get(1 + c, i1 - i0, j1 - j0))
                    yield (i0, i1), (j0, j1), c, e.exp_()


class _GeneralLSE(torch.autograd.Function):
    """Queries against arbitrary keys, rows reduced with an online max-subtracted LSE.

    The backward needs no shift at all: with the final ``lse`` known, each recomputed block
    becomes P = exp(s * cos - lse_i) <= 1, and H = g * s * P gives dQ += H @ K, dK += H^T @ Q.
    ``fixed_shift`` skips the running max when the logit range is known to be safe.
    """

    @staticmethod
    def forward(ctx, q, k, scales, mask, tile, fixed_shift):
        n, m, nc = q.shape[0], k.shape[0], len(scales)
        lse = q.new_empty(n, nc)
        with torch.no_grad():
            buffers = _Buffers(q, min(tile, max(n, m)), 2)
            for i0, i1 in _tiles(n, tile):
                run_max = q.new_full((i1 - i0, nc), float("-inf"))
                run_sum = q.new_zeros(i1 - i0, nc)
                qi = q[i0:i1]
                for j0, j1 in _tiles(m, tile):
                    block = torch.mm(qi, k[j0:j1].T, out=buffers.get(0, i1 - i0, j1 - j0))
                    mask.apply(block, i0, j0)
                    for c, s in enumerate(scales):
                        x = torch.mul(block, s, out=buffers.get(1, i1 - i0, j1 - j0))
                        if fixed_shift:
                            run_sum[:, c] += x.sub_(s).exp_().sum(dim=1)
                            continue
                        new_max = torch.maximum(run_max[:, c], x.amax(dim=1))
                        shift = _finite_or_zero(new_max)  # a row masked so far has max -inf
                        rescale = torch.exp(run_max[:, c] - shift)
                        run_sum[:, c] = run_sum[:, c] * rescale + x.sub_(shift[:, None]).exp_().sum(dim=1)
                        run_max[:, c] = new_max
                if fixed_shift:
                    base = torch.tensor(scales, dtype=q.dtype, device=q.device).expand(i1 - i0, nc)
                else:
                    base = _finite_or_zero(run_max)
                lse[i0:i1] = base + torch.log(run_sum)
        ctx.save_for_backward(q, k, lse)
        ctx.scales, ctx.mask, ctx.tile = scales, mask, tile
        return lse

    @staticmethod
    def backward(ctx, grad_lse):
        q, k, lse = ctx.saved_tensors
        need_q, need_k = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        scales = torch.tensor(ctx.scales, dtype=q.dtype, device=q.device)
        finite = torch.isfinite(lse)
        alpha = torch.where(finite, grad_lse * scales, torch.zeros_like(lse))
        safe_lse = torch.where(finite, lse, torch.zeros_like(lse))
        dq = torch.zeros_like(q) if need_q else None
        dk = torch.zeros_like(k) if need_k else None
        n, m = q.shape[0], k.shape[0]
        with torch.no_grad(), autocast_off(q.device.type):
            buffers = _Buffers(q, min(ctx.tile, max(n, m)), 3)
            for i0, i1 in _tiles(n, ctx.tile):
                qi = q[i0:i1]
                for j0, j1 in _tiles(m, ctx.tile):
                    block = torch.mm(qi, k[j0:j1].T, out=buffers.get(0, i1 - i0, j1 - j0))
                    ctx.mask.apply(block, i0, j0)
                    h = None
                    for c, s in enumerate(ctx.scales):
                        # H accumulates in slot 1; the last channel may overwrite the block.
                        if c == len(ctx.scales) - 1:
                            p = block.mul_(s)
                        else:
                            p = torch.mul(block, s, out=buffers.get(1 if c == 0 else 2, i1 - i0, j1 - j0))
                        p.sub_(safe_lse[i0:i1, c, None]).exp_().mul_(alpha[i0:i1, c, None])
                        h = p if h is None else h.add_(p)
                    if need_q:
                        dq[i0:i1].addmm_(h, k[j0:j1])
                    if need_k:
                        dk[j0:j1].addmm_(h.T, qi)
        return dq, dk, None, None, None, None
