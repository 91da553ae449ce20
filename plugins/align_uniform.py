"""Alignment + uniformity loss (Wang & Isola, "Understanding Contrastive Representation
Learning through Alignment and Uniformity on the Hypersphere", ICML 2020).

    L = E ||f(x) - f(y)||^alpha  +  lam * (U(f(x)) + U(f(y))) / 2,
    U(z) = log E_{i<j} exp(-t ||z_i - z_j||^2)

on L2-normalised embeddings, for two-view batches ``[first views; second views]``. For
unit vectors ||u - v||^2 = 2 - 2 u.v, so the uniformity term is a log-sum-exp over the Gram
matrix: above ``chunk`` rows it is computed in row blocks, each recomputed in the backward
(activation checkpointing), so memory stays O(N x chunk) instead of the O(N^2) of
``torch.pdist``.

    receipt-embed train --set loss.name=align_uniform --set "loss.params={lam: 1.0}"
"""

from __future__ import annotations

import math

from receipt_embed.hookspecs import hookimpl


def uniformity(z, t: float = 2.0, chunk: int = 2048):
    """log mean over pairs i < j of exp(-t ||z_i - z_j||^2), z unit rows (N, d)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    n = z.shape[0]
    if n < 2:
        raise ValueError("uniformity needs at least 2 embeddings")
    if n <= chunk:
        return torch.pdist(z).pow(2).mul(-t).exp().mean().log()

    def block_lse(rows, start):
        # pairs (i, j) with i in this block and j > i
        sq = (2 - 2 * rows @ z.T).clamp_min(0)
        index = torch.arange(n, device=z.device)
        upper = index[None, :] > (start + torch.arange(rows.shape[0], device=z.device))[:, None]
        return torch.logsumexp((-t * sq).masked_fill(~upper, float("-inf")).flatten(), dim=0)

    parts = [checkpoint(block_lse, z[s : s + chunk], s, use_reentrant=False) for s in range(0, n - 1, chunk)]
    return torch.logsumexp(torch.stack(parts), dim=0) - math.log(n * (n - 1) / 2)


def make_loss(temperature: float = 0.0, lam: float = 1.0, alpha: float = 2.0, t: float = 2.0, chunk: int = 2048):
    """``temperature`` is accepted (train passes loss.temperature to every loss) and unused."""
    import torch
    import torch.nn.functional as F

    class AlignUniformLoss(torch.nn.Module):
        def forward(self, embeddings, labels=None):
            n = embeddings.shape[0]
            if n % 2 or n < 4:
                raise ValueError(f"align_uniform needs two-view batches [first views; second views], got {n} rows")
            if labels is not None and not torch.equal(labels[: n // 2], labels[n // 2 :]):
                raise ValueError(
                    "align_uniform needs two-view batches: row i and row i + B must share an identity "
                    "(use sampler unique_identity)"
                )
            z = F.normalize(embeddings.float(), dim=1)
            x, y = z[: n // 2], z[n // 2 :]
            align = (x - y).norm(dim=1).pow(alpha).mean()
            return align + lam * (uniformity(x, t, chunk) + uniformity(y, t, chunk)) / 2

    return AlignUniformLoss()


@hookimpl
def register_losses(register):
    register("align_uniform", make_loss, description="Wang & Isola alignment + uniformity (two views)")
