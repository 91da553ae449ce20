"""Supervised contrastive loss (L_out) for P identities x K captures."""

from __future__ import annotations

import torch

from receipt_embed.errors import BadInput
from receipt_embed.losses._common import ContrastiveLoss, check_embeddings, check_labels, float32_logits, normalize
from receipt_embed.losses.engine import DEFAULT_TILE


class SupConLoss(ContrastiveLoss):
    r"""Multi-positive contrastive loss, the :math:`\mathcal{L}^{sup}_{out}` form.

    Khosla et al., "Supervised Contrastive Learning", NeurIPS 2020,
    https://arxiv.org/abs/2004.11362 (eq. 2).

    Every other capture of the anchor's identity is a positive: for anchor ``i`` with positives
    ``P(i) = {p != i : y_p = y_i}`` and ``s_ij = <z_i, z_j> / t`` on unit vectors,

    .. math::
        \ell_i = \frac{1}{|P(i)|} \sum_{p \in P(i)}
                 -\log \frac{\exp(s_{ip})}{\sum_{a \ne i} \exp(s_{ia})},
        \qquad L = \frac{1}{|A|} \sum_{i \in A} \ell_i, \quad A = \{i : |P(i)| \ge 1\}

    As in the paper the denominator runs over every other item, so same-identity items appear
    there only as the positives they are; none is ever a negative term of its own. Anchors
    without a positive are left out of the mean and counted in
    ``last_stats["anchors_without_positives"]``; a batch in which no anchor has a positive
    raises ``ValueError`` rather than returning NaN or a silent 0.

    Rows can be in any order (no two-view layout needed); an identity may have 2, 3 or more
    captures in the batch.

    Args:
        temperature: 0 < ``t`` <= 100 (error otherwise; warning below 0.05).
        tile_size, path: engine settings, see :class:`~receipt_embed.losses.NTXentLoss`.

    Call: ``loss(embeddings, labels)`` with unnormalised ``embeddings`` (N, d) and integer
    ``labels`` (N,). ``last_stats``: ``anchors``, ``anchors_with_positives``,
    ``anchors_without_positives``, ``positive_pairs``, ``path``.

    Example::

        >>> loss_fn = SupConLoss(temperature=0.1)
        >>> feats = encoder(images)        # P x K captures, any order
        >>> loss = loss_fn(feats, receipt_ids)
    """

    batch_layout = "any"  # rows in any order: P identities x K captures

    def __init__(self, temperature: float = 0.1, tile_size: int = DEFAULT_TILE, path: str = "auto"):
        super().__init__(temperature, tile_size, path)

    @float32_logits
    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        check_embeddings(embeddings)
        n = embeddings.shape[0]
        labels = check_labels(labels, n, embeddings.device)
        _, inverse, counts = torch.unique(labels, return_inverse=True, return_counts=True)
        n_pos = counts[inverse] - 1
        has_pos = n_pos > 0
        n_anchors = int(has_pos.sum())
        if n_anchors == 0:
            raise BadInput(
                f"supcon: no anchor in this batch of {n} has a positive (every identity appears "
                "once); sample P identities x K >= 2 captures each"
            )
        z = normalize(embeddings)
        t = self.temperature
        # mean positive logit: <z_i, sum of its identity's rows - z_i> / (t |P(i)|), O(N d)
        identity_sums = z.new_zeros(counts.shape[0], z.shape[1]).index_add_(0, inverse, z)
        pos_mean = (z * (identity_sums[inverse] - z)).sum(dim=1) / (t * n_pos.clamp(min=1))
        # denominator: every a != i, i.e. labels that only exclude self
        self_only = torch.arange(n, device=z.device)
        lse, info = self._lse(z, None, self_only, None, (1.0 / t,))
        loss = (lse[:, 0] - pos_mean)[has_pos].mean()
        self.last_stats = {
            "anchors": n,
            "anchors_with_positives": n_anchors,
            "anchors_without_positives": n - n_anchors,
            "positive_pairs": int(n_pos.sum()),
            "path": info.path,
        }
        return loss
