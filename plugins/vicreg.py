"""VICReg: variance-invariance-covariance regularisation (Bardes, Ponce & LeCun, ICLR 2022).

A non-contrastive loss: no negatives, collapse is prevented by the variance term (each
dimension's std kept above ``gamma``) and the covariance term (dimensions decorrelated).
It is the counterpart the collapse diagnostics in metrics.jsonl and audit-shortcuts
(effective rank, per-dimension std) are built to watch.

    L = sim * MSE(x, y) + var * (v(x) + v(y)) + cov * (c(x) + c(y))
    v(z) = mean_k relu(gamma - sqrt(Var z_k + eps)),  c(z) = sum_{k != l} Cov(z)_kl^2 / d

for two-view batches ``[first views; second views]`` of unnormalised projections.

    receipt-embed train --set loss.name=vicreg --set "loss.params={sim: 25, var: 25, cov: 1}"
"""

from __future__ import annotations

from receipt_embed.hookspecs import hookimpl


def make_loss(
    temperature: float = 0.0,
    sim: float = 25.0,
    var: float = 25.0,
    cov: float = 1.0,
    gamma: float = 1.0,
    eps: float = 1e-4,
):
    """``temperature`` is accepted (train passes loss.temperature to every loss) and unused."""
    import torch
    import torch.nn.functional as F

    def variance(z):
        return F.relu(gamma - torch.sqrt(z.var(dim=0) + eps)).mean()

    def covariance(z):
        n, d = z.shape
        centred = z - z.mean(dim=0)
        c = centred.T @ centred / (n - 1)
        return (c.pow(2).sum() - c.diagonal().pow(2).sum()) / d

    class VICRegLoss(torch.nn.Module):
        def forward(self, embeddings, labels=None):
            n = embeddings.shape[0]
            if n % 2 or n < 4:
                raise ValueError(f"vicreg needs two-view batches [first views; second views], got {n} rows")
            if labels is not None and not torch.equal(labels[: n // 2], labels[n // 2 :]):
                raise ValueError(
                    "vicreg needs two-view batches: row i and row i + B must share an identity "
                    "(use sampler unique_identity)"
                )
            z = embeddings.float()
            x, y = z[: n // 2], z[n // 2 :]
            return sim * F.mse_loss(x, y) + var * (variance(x) + variance(y)) + cov * (covariance(x) + covariance(y))

    return VICRegLoss()


@hookimpl
def register_losses(register):
    register("vicreg", make_loss, description="VICReg variance-invariance-covariance (two views, no negatives)")
