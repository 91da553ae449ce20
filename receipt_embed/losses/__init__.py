"""Contrastive losses on one tiled log-sum-exp engine.

Every loss is a ``torch.nn.Module`` called as ``loss(embeddings, labels)`` with unnormalised
embeddings (N, d) and integer identity labels (N,); it L2-normalises, computes logits in
float32 (also under autocast) and never counts a same-identity item as a negative.

========================  ==========================================  =====================
registry name             class                                       batch layout
========================  ==========================================  =====================
``ntxent``                :class:`NTXentLoss`                         two views
``supcon``                :class:`SupConLoss`                         P identities x K
``debiased``              :class:`DebiasedContrastiveLoss`            two views
``hard_negative``         :class:`HardNegativeLoss`                   two views
``moco``                  :class:`MoCoLoss` (``keys=`` from EMA net)   queries + keys
========================  ==========================================  =====================

The engine (:func:`masked_logsumexp`) streams the similarity matrix in blocks with a
recomputing backward, so memory is O(N d + tile^2); see ``engine.py``.
"""

from receipt_embed.losses._common import LOW_TEMPERATURE, ContrastiveLoss, check_temperature
from receipt_embed.losses.debiased import DebiasedContrastiveLoss
from receipt_embed.losses.engine import DEFAULT_TILE, EngineInfo, masked_logsumexp
from receipt_embed.losses.hard_negative import HardNegativeLoss
from receipt_embed.losses.moco import MoCoLoss, make_momentum_encoder, momentum_update
from receipt_embed.losses.ntxent import NTXentLoss
from receipt_embed.losses.supcon import SupConLoss

__all__ = [
    "ContrastiveLoss",
    "DebiasedContrastiveLoss",
    "HardNegativeLoss",
    "MoCoLoss",
    "NTXentLoss",
    "SupConLoss",
    "DEFAULT_TILE",
    "EngineInfo",
    "LOW_TEMPERATURE",
    "check_temperature",
    "make_momentum_encoder",
    "masked_logsumexp",
    "momentum_update",
]
