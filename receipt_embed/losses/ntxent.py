"""NT-Xent: the two-view InfoNCE loss of SimCLR."""

from __future__ import annotations

import torch

from receipt_embed.losses._common import TwoViewLoss, float32_logits
from receipt_embed.losses.engine import DEFAULT_TILE


class NTXentLoss(TwoViewLoss):
    r"""Normalised temperature-scaled cross entropy over two views (NT-Xent).

    Chen et al., "A Simple Framework for Contrastive Learning of Visual Representations"
    (SimCLR), ICML 2020, https://arxiv.org/abs/2002.05709; the InfoNCE bound of
    van den Oord et al. 2018, https://arxiv.org/abs/1807.03748.

    Rows are ``[first views of B identities; second views]``, so the positive of row ``i`` is
    ``p(i) = (i + B) mod 2B``. With unit vectors ``z`` and ``s_ij = <z_i, z_j> / t``:

    .. math::
        \ell_i = -\log \frac{\exp(s_{i p(i)})}
                            {\exp(s_{i p(i)}) + \sum_{j:\, y_j \ne y_i} \exp(s_{ij})},
        \qquad L = \frac{1}{2B} \sum_i \ell_i

    Self-similarity is never in the sum, and the loss is symmetric over both views (every row
    is an anchor). Any other row with the anchor's identity ``y_i`` -- a receipt that landed
    in two slots of the batch -- is *masked out* of the denominator (``duplicates="mask"``) or
    rejected (``duplicates="error"``); it is never treated as a negative. Without duplicates
    this is exactly SimCLR's loss.

    Args:
        temperature: 0 < ``t`` <= 100 (error otherwise; warning below 0.05).
        duplicates: ``"mask"`` (default) or ``"error"`` for identities repeated in the batch.
        tile_size: block edge of the tiled engine (memory is O(N d + tile^2)).
        path: ``"auto"`` (dense for tiny batches, tiled otherwise), ``"dense"``, ``"tiled"``.

    Call: ``loss(embeddings, labels=None)`` with unnormalised ``embeddings`` (2B, d) and integer
    ``labels`` (2B,) where ``labels[i] == labels[i + B]``; ``None`` means B distinct identities.
    After a call ``last_stats`` holds ``anchors``, ``duplicate_identities``,
    ``masked_duplicates``, ``anchors_without_negatives`` and the engine ``path``.

    Example::

        >>> loss_fn = NTXentLoss(temperature=0.1)
        >>> view1, view2 = encoder(batch1), encoder(batch2)          # (B, d) each
        >>> loss = loss_fn(torch.cat([view1, view2]), torch.cat([ids, ids]))
        >>> loss.backward()
    """

    name = "ntxent"

    def __init__(
        self, temperature: float = 0.1, duplicates: str = "mask", tile_size: int = DEFAULT_TILE, path: str = "auto"
    ):
        super().__init__(temperature, duplicates, tile_size, path)

    @float32_logits
    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        z, labels, b, _, stats = self._two_view_batch(embeddings, labels)
        pos = self._positive_logits(z, b, self.temperature)
        lse_neg, info = self._lse(z, None, labels, None, (1.0 / self.temperature,))
        loss = (torch.logaddexp(pos, lse_neg[:, 0]) - pos).mean()
        self.last_stats = {**stats, "path": info.path}
        return loss
