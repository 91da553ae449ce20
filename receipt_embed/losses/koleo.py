"""The KoLeo (Kozachenko-Leonenko) entropy regulariser: push each embedding away from its
nearest *other-receipt* neighbour.

SSCD (Pizzi et al., 2022) adds it to the contrastive loss for copy detection: with a low
temperature the InfoNCE loss already separates the hardest negatives, and the regulariser
spreads the rest of the space uniformly, so that near-duplicates of *different* images (here:
same-shop receipts sharing one printed template) do not collapse together. For each row i,
``rho_i`` is the Euclidean distance between L2-normalised embeddings to the nearest row of
another identity (a capture of the same receipt is never pushed away: it is a positive), and

    L = -(1 / n) * sum_i log(rho_i + eps)

over the rows that have another identity in the batch. Weighted by ``loss.koleo_weight``
(SSCD: about 10-30 against an InfoNCE loss at temperature 0.05) and added to the loss.
Memory O(chunk x N): the nearest neighbour is found block by block without gradients, then
only the chosen pairs' distances are recomputed with them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

EPS = 1e-8
CHUNK = 1024


def koleo(embeddings: torch.Tensor, labels: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """The regulariser of ``embeddings`` (N, d, unnormalised) with identity ``labels`` (N,);
    0 when no row has another identity in the batch."""
    z = F.normalize(embeddings.float(), dim=1)
    labels = labels.to(z.device)
    nearest = torch.full((len(z),), -1, dtype=torch.long, device=z.device)
    with torch.no_grad():
        for start in range(0, len(z), CHUNK):
            sims = z[start : start + CHUNK] @ z.T
            same = labels[start : start + CHUNK, None] == labels[None, :]
            sims = sims.masked_fill(same, float("-inf"))
            best, index = sims.max(dim=1)
            nearest[start : start + CHUNK] = torch.where(torch.isfinite(best), index, -1)
    rows = torch.nonzero(nearest >= 0).flatten()
    if not len(rows):
        return embeddings.sum() * 0.0  # keeps the graph: a batch of one receipt adds nothing
    distances = (z[rows] - z[nearest[rows]]).norm(dim=1)
    return -torch.log(distances + eps).mean()


def with_koleo(loss_fn, weight: float):
    """``loss_fn`` plus ``weight`` times :func:`koleo` of the same rows (the gathered global
    batch when training over several processes); ``loss_fn`` itself when the weight is 0."""
    if not weight:
        return loss_fn

    def regularised(embeddings, labels, **kwargs):
        return loss_fn(embeddings, labels, **kwargs) + weight * koleo(embeddings, labels)

    return regularised
