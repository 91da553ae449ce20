"""Built-in losses, registered through the same hook as third-party plugins."""

from __future__ import annotations

from receipt_embed.builtins import lazy_target
from receipt_embed.hookspecs import hookimpl


def _factory(class_name: str):
    """Import torch and the loss classes only when a loss is built (keeps the CLI fast)."""

    def build(**params):
        from receipt_embed import losses

        return getattr(losses, class_name)(**params)

    build.__name__ = build.__qualname__ = f"build_{class_name}"
    build.signature_target = lazy_target(
        "receipt_embed.losses", class_name
    )  # its parameters' annotations, for the registry's checks
    return build


@hookimpl
def register_losses(register):
    register(
        "ntxent",
        _factory("NTXentLoss"),
        description="two-view NT-Xent (SimCLR); duplicate identities masked or refused",
    )
    register(
        "supcon",
        _factory("SupConLoss"),
        description="multi-positive SupCon L_out (Khosla et al. 2020) for P x K batches",
    )
    register(
        "debiased",
        _factory("DebiasedContrastiveLoss"),
        description="debiased contrastive loss (Chuang et al. 2020), param tau_plus",
    )
    register(
        "hard_negative",
        _factory("HardNegativeLoss"),
        description="hard-negative reweighting (Robinson et al. 2021), params beta, tau_plus",
    )
    register(
        "moco",
        _factory("MoCoLoss"),
        description="InfoNCE against a checkpointed, identity-labelled key queue (MoCo); call with keys=",
    )
