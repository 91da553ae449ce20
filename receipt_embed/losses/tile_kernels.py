"""The two tiled log-sum-exp kernels of :mod:`.engine`, as custom autograd Functions.

``SymmetricLSE`` (keys are the queries) visits the blocks on and above the diagonal with a fixed
shift; ``GeneralLSE`` (queries against other keys) uses an online, max-subtracted log-sum-exp.
Both recompute each block in backward instead of keeping the (N, M) matrix; the engine's
docstring has the derivation and the memory bound.
"""

from __future__ import annotations

import contextlib

import torch


def autocast_off(device_type: str):
    """Keep logits in float32/float64 even inside a bf16/fp16 autocast region (forward and
    backward: the backward of a custom Function does not inherit the forward's state)."""
    try:
        return torch.autocast(device_type=device_type, enabled=False)
    except RuntimeError:  # a device type autocast does not know
        return contextlib.nullcontext()


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


class SymmetricLSE(torch.autograd.Function):
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


class GeneralLSE(torch.autograd.Function):
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
