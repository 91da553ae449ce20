"""The hooks a receipt-embed plugin can implement.

Every ``register_*`` hook receives a ``register`` callback; call it once per component::

    register(name, factory, description="...")

``factory(**params)`` builds the component from its config parameters. Built-in components
are registered through these same hooks (see ``receipt_embed/builtins/``).

Versioning: hooks are only ever added. A hook's name and arguments do not change within a
major version; new keyword arguments of ``register`` are optional.
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "receipt_embed"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def register_losses(register):
    """Register loss factories: ``factory(**params)`` returns a ``torch.nn.Module`` called as
    ``loss(embeddings, labels)`` that returns a scalar tensor."""


@hookspec
def register_encoders(register):
    """Register encoder factories: ``factory(**params)`` returns a ``torch.nn.Module`` mapping
    images (N, C, H, W) to features (N, D) and exposing ``feature_dim``."""


@hookspec
def register_augmentations(register):
    """Register augmentation presets: ``factory(image_size, **params)`` returns an
    albumentations transform taking and returning uint8 H x W x C numpy images."""


@hookspec
def register_samplers(register):
    """Register batch samplers: ``factory(identities, batch_size, seed, **params)`` returns an
    iterable of batches of dataset indices."""
