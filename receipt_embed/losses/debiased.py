"""Debiased contrastive loss (Chuang et al. 2020)."""

from __future__ import annotations

import torch

from receipt_embed.errors import BadInput
from receipt_embed.losses._common import TwoViewLoss, float32_logits
from receipt_embed.losses.engine import DEFAULT_TILE


def check_tau_plus(tau_plus) -> float:
    """The class prior of false negatives, in [0, 1)."""
    try:
        value = float(tau_plus)
    except (TypeError, ValueError):
        raise BadInput(f"tau_plus must be a number in [0, 1), got {tau_plus!r}") from None
    if not 0.0 <= value < 1.0:
        raise BadInput(f"tau_plus (class prior of false negatives) must be in [0, 1), got {tau_plus}")
    return value


def debiased_from_logs(log_neg_mass, pos, n_neg, tau_plus: float, temperature: float):
    r"""Per-anchor :math:`-\log \frac{e^{pos}}{e^{pos} + N_g}`, computed in log space.

    ``log_neg_mass`` is the log of the (possibly reweighted) negative sum, ``pos`` the
    positive logit, ``n_neg`` the number of negatives N of each anchor. With
    ``N_g = max((e^{log_neg_mass} - tau_plus * N * e^{pos}) / (1 - tau_plus), N e^{-1/t})``.
    Everything is scaled by ``exp(-m)``, ``m = max(pos, log_neg_mass)``, so ``tau = 0.01``
    stays finite in float32; an anchor with no negatives gets ``N_g = 0`` and loss 0.
    """
    m = torch.maximum(pos, log_neg_mass)
    neg = torch.exp(log_neg_mass - m)
    positive = torch.exp(pos - m)
    n_neg = n_neg.to(pos.dtype)
    ng = (neg - tau_plus * n_neg * positive) / (1.0 - tau_plus)
    floor = n_neg * torch.exp(-1.0 / temperature - m)
    ng = torch.maximum(ng, floor)
    return m + torch.log(positive + ng) - pos


class DebiasedContrastiveLoss(TwoViewLoss):
    r"""Debiased contrastive loss: NT-Xent corrected for same-class "negatives".

    Chuang et al., "Debiased Contrastive Learning", NeurIPS 2020,
    https://arxiv.org/abs/2007.00224 (eq. 6 and its reference code).

    Two-view layout as :class:`~receipt_embed.losses.NTXentLoss` (positive ``p(i) = (i + B)
    mod 2B``). The negatives of anchor ``i`` are the ``N_i`` rows of another identity (self,
    positive and masked duplicates excluded); with ``s_ij = <z_i, z_j> / t``:

    .. math::
        N_g = \max\Big( \frac{\sum_{j \in neg(i)} e^{s_{ij}} - \tau^+ N_i e^{s_{ip(i)}}}
                             {1 - \tau^+},\; N_i e^{-1/t} \Big),
        \qquad \ell_i = -\log \frac{e^{s_{ip(i)}}}{e^{s_{ip(i)}} + N_g}

    ``tau_plus`` (:math:`\tau^+`) is the prior probability that a random "negative" shares the
    anchor's class; ``tau_plus = 0`` gives NT-Xent. The clamp at ``N e^{-1/t}`` (the smallest
    value the true negative sum can take) is the paper's. Mean over all 2B anchors.

    Args:
        temperature: 0 < ``t`` <= 100. tau_plus: in [0, 1), default 0.1.
        duplicates, tile_size, path: as for NTXentLoss.

    Example::

        >>> loss_fn = DebiasedContrastiveLoss(temperature=0.5, tau_plus=0.1)
        >>> loss = loss_fn(torch.cat([view1, view2]), torch.cat([ids, ids]))
    """

    name = "debiased"

    def __init__(
        self,
        temperature: float = 0.1,
        tau_plus: float = 0.1,
        duplicates: str = "mask",
        tile_size: int = DEFAULT_TILE,
        path: str = "auto",
    ):
        super().__init__(temperature, duplicates, tile_size, path)
        self.tau_plus = check_tau_plus(tau_plus)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", tau_plus={self.tau_plus}"

    @float32_logits
    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        z, labels, b, n_neg, stats = self._two_view_batch(embeddings, labels)
        pos = self._positive_logits(z, b, self.temperature)
        lse_neg, info = self._lse(z, None, labels, None, (1.0 / self.temperature,))
        loss = debiased_from_logs(lse_neg[:, 0], pos, n_neg, self.tau_plus, self.temperature).mean()
        self.last_stats = {**stats, "path": info.path}
        return loss
