"""Built-in samplers."""

from __future__ import annotations

from receipt_embed.builtins import lazy_target
from receipt_embed.hookspecs import hookimpl


def build_unique_identity(identities, batch_size, seed, **params):
    from receipt_embed.sampling.samplers import UniqueIdentitySampler

    return UniqueIdentitySampler(identities, batch_size, seed, **params)


def build_pk(identities, batch_size, seed, **params):
    from receipt_embed.sampling.samplers import PKSampler

    return PKSampler(identities, batch_size, seed, **params)


# their parameters' annotations, for the registry's checks (k=3.0 would fail deep inside)
build_unique_identity.signature_target = lazy_target("receipt_embed.sampling.samplers", "UniqueIdentitySampler")
build_pk.signature_target = lazy_target("receipt_embed.sampling.samplers", "PKSampler")


@hookimpl
def register_samplers(register):
    register(
        "unique_identity",
        build_unique_identity,
        description="distinct identities per batch, two views each (different captures when available)",
    )
    register("pk", build_pk, description="P identities x K views (params: k, tail) for multi-positive losses")
