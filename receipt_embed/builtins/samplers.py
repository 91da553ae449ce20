"""Built-in samplers."""

from __future__ import annotations

from receipt_embed.hookspecs import hookimpl


def build_unique_identity(identities, batch_size, seed, **params):
    from receipt_embed.sampling.samplers import UniqueIdentitySampler

    return UniqueIdentitySampler(identities, batch_size, seed, **params)


def build_pk(identities, batch_size, seed, **params):
    from receipt_embed.sampling.samplers import PKSampler

    return PKSampler(identities, batch_size, seed, **params)


def _sampler_class(name: str):
    def target():
        from receipt_embed.sampling import samplers

        return getattr(samplers, name)

    return target


# their parameters' annotations, for the registry's checks (k=3.0 would fail deep inside)
build_unique_identity.signature_target = _sampler_class("UniqueIdentitySampler")
build_pk.signature_target = _sampler_class("PKSampler")


@hookimpl
def register_samplers(register):
    register(
        "unique_identity",
        build_unique_identity,
        description="distinct identities per batch, two views each (different captures when available)",
    )
    register("pk", build_pk, description="P identities x K views (params: k, tail) for multi-positive losses")
