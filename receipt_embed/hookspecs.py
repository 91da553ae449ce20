"""The hooks a receipt-embed plugin can implement.

Every ``register_*`` hook receives a ``register`` callback; call it once per component::

    register(name, factory, description="...")

``factory(...)`` builds the component from its config parameters (the arguments per kind
are in each hook's docstring and in docs/plugins.md). Built-in components
are registered through these same hooks (see ``receipt_embed/builtins/``).

Two hooks are called at points of the pipeline instead: ``on_epoch_end`` after each training
epoch, and ``register_audit_checks`` adds figures to ``audit-shortcuts``.

Versioning (the promise in ``docs/plugins.md``): hooks are only ever added within a major
version. A hook's name and the meaning of its arguments do not change; new arguments may be
added, which is safe because pluggy passes an implementation only the arguments it names.
New keyword arguments of ``register`` are optional. ``HOOKSPEC_VERSION`` names the version
that last added a hook or an argument.
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "receipt_embed"
HOOKSPEC_VERSION = "0.3"  # 0.1: the four register_* hooks; 0.2: sampler metadata, on_epoch_end, register_audit_checks;
# 0.3: register_verifiers

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def register_losses(register):
    """Register loss factories: ``factory(temperature, **params)`` (``loss.temperature`` and
    ``loss.params``) returns a ``torch.nn.Module`` called as ``loss(embeddings, labels)`` that
    returns a scalar tensor. A loss without a temperature accepts and ignores it."""


@hookspec
def register_encoders(register):
    """Register encoder factories: ``factory(pretrained, in_channels, pooling, grid, **params)``
    returns a ``torch.nn.Module`` mapping images (N, C, H, W) to features (N, D) and exposing
    ``feature_dim`` = D."""


@hookspec
def register_augmentations(register):
    """Register augmentation presets: ``factory(image_size, **params)`` returns an
    albumentations transform taking and returning uint8 H x W x C numpy images."""


@hookspec
def register_samplers(register):
    """Register batch samplers: ``factory(identities, batch_size, seed, **params)`` returns an
    iterable of batches of dataset indices, with ``__len__``, ``set_epoch(epoch)`` and a
    ``batch_layout`` naming how a batch's rows are laid out (``"two_view"`` or ``"any"``, see
    :mod:`receipt_embed.batch_layout`).

    ``identities[i]`` is the integer receipt label of capture ``i``. A factory that declares a
    ``metadata`` parameter also receives the manifest rows, ``metadata[i]`` being capture
    ``i``'s row (path, receipt_id, device and any other column) - to batch by merchant, say."""


@hookspec
def register_audit_checks(register):
    """Register extra figures for ``audit-shortcuts``: ``factory(**params)`` (params from
    ``--check-set NAME.KEY=VALUE``) returns a callable
    ``check(context)`` taking an :class:`receipt_embed.audit.checks.AuditContext` and returning
    a dict with ``figures`` (JSON-ready) and optionally ``summary`` (one line), ``flagged``
    (bool; ``--fail-on-shortcut`` fails on it) and ``plot`` (a matplotlib figure)."""


@hookspec
def register_verifiers(register):
    """Register verifiers, the second stage that checks an embedding shortlist pair by pair:
    ``factory(**params)`` returns an object with ``extract(image, item)`` and
    ``score(query, candidate)``. ``extract`` runs once per capture (at index time for the
    gallery) on the decoded capture (uint8 H x W x 3 RGB; ``None`` when the object's
    ``needs_image`` is False) and its manifest row, and returns a dict of numpy arrays (no
    object dtype: they are stored in the index dir). ``score`` takes two such dicts and returns
    a dict with ``score``, a float in [0, 1] (higher: more likely the same receipt), and any
    other JSON-ready figures worth reporting."""


@hookspec
def on_epoch_end(run_dir, epoch, metrics, model, config):
    """Called after each training epoch, once its line is in ``metrics.jsonl`` and
    ``checkpoints/last.pt`` is saved (on the main process only, under torchrun).

    ``run_dir`` (Path), ``epoch`` (1-based int), ``metrics`` (a copy of the metrics line),
    ``model`` (the Embedder, in eval mode; do not modify it), ``config`` (the run's Config).
    Use it to send figures to an experiment tracker or to copy checkpoints elsewhere. The
    return value is ignored; an exception is reported as a warning naming the plugin and
    training goes on (fatal with ``--strict-plugins``)."""
