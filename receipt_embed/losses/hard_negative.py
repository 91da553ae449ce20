"""Hard-negative contrastive loss (Robinson et al. 2021)."""

from __future__ import annotations

import math

import torch

from receipt_embed.errors import BadInput
from receipt_embed.losses._common import TwoViewLoss, float32_logits
from receipt_embed.losses.debiased import check_tau_plus, debiased_from_logs
from receipt_embed.losses.engine import DEFAULT_TILE


class HardNegativeLoss(TwoViewLoss):
    r"""Hard-negative contrastive loss: negatives reweighted by their similarity.

    Robinson et al., "Contrastive Learning with Hard Negative Samples", ICLR 2021,
    https://arxiv.org/abs/2010.04592 (eq. 3-4 and its reference code).

    Two-view layout as NTXentLoss. Each negative ``j`` of anchor ``i`` (``N_i`` of them, other
    identities only) gets importance weight ``w_ij ∝ exp(beta * s_ij)``, normalised to mean 1:

    .. math::
        R_i = N_i \frac{\sum_j e^{(1+\beta) s_{ij}}}{\sum_j e^{\beta s_{ij}}},\qquad
        N_g = \max\Big(\frac{R_i - \tau^+ N_i e^{s_{ip(i)}}}{1 - \tau^+},\; N_i e^{-1/t}\Big),
        \qquad \ell_i = -\log \frac{e^{s_{ip(i)}}}{e^{s_{ip(i)}} + N_g}

    ``beta = 0`` gives the debiased loss, ``beta = 0, tau_plus = 0`` gives NT-Xent. Debiasing
    is optional: ``tau_plus`` defaults to 0 (then the clamp never binds). Both sums are
    streamed by the tiled engine as two log-sum-exps of one similarity block.

    Args:
        temperature: 0 < ``t`` <= 100. beta: concentration >= 0 (paper: 0.5 or 1), default 1.0.
        tau_plus: in [0, 1), default 0.0. duplicates, tile_size, path: as for NTXentLoss.

    Example::

        >>> loss_fn = HardNegativeLoss(temperature=0.5, beta=1.0, tau_plus=0.1)
        >>> loss = loss_fn(torch.cat([view1, view2]), torch.cat([ids, ids]))
    """

    name = "hard_negative"

    def __init__(
        self,
        temperature: float = 0.1,
        beta: float = 1.0,
        tau_plus: float = 0.0,
        duplicates: str = "mask",
        tile_size: int = DEFAULT_TILE,
        path: str = "auto",
    ):
        super().__init__(temperature, duplicates, tile_size, path)
        beta = float(beta)
        if not (beta >= 0 and math.isfinite(beta)):
            raise BadInput(f"beta must be a finite number >= 0, got {beta}")
        self.beta = beta
        self.tau_plus = check_tau_plus(tau_plus)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", beta={self.beta}, tau_plus={self.tau_plus}"

    @float32_logits
    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        z, labels, b, n_neg, stats = self._two_view_batch(embeddings, labels)
        t = self.temperature
        pos = self._positive_logits(z, b, t)
        if self.beta == 0:
            lse, info = self._lse(z, None, labels, None, (1.0 / t,))
            log_mass = lse[:, 0]
        else:
            lse, info = self._lse(z, None, labels, None, ((1.0 + self.beta) / t, self.beta / t))
            has_neg = n_neg > 0
            # log R = log N + LSE((1 + beta) s) - LSE(beta s); -inf where there are no negatives
            finite = torch.where(has_neg[:, None], lse, torch.zeros_like(lse))
            log_r = torch.log(n_neg.clamp(min=1).to(z.dtype)) + finite[:, 0] - finite[:, 1]
            log_mass = torch.where(has_neg, log_r, torch.full_like(log_r, float("-inf")))
        loss = debiased_from_logs(log_mass, pos, n_neg, self.tau_plus, t).mean()
        self.last_stats = {**stats, "path": info.path}
        return loss
