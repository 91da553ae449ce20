"""receipt-embed: learn, index and audit image embeddings of photographed paper receipts.

Heavy dependencies (torch, faiss) are imported lazily so that ``receipt-embed --help``
and plugin listing stay fast.
"""

from __future__ import annotations

import os

from receipt_embed.version import __version__

# albumentations asks pypi.org for a newer release when it is imported unless this is set: a
# network request on every command that nobody asked for (and up to 2 s offline)
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

__all__ = ["__version__", "create_loss", "get_registry"]


def get_registry(**kwargs):
    """Return the component registry: built-ins, entry points, and the plugins folder passed
    as ``plugins_dir=`` (none unless given: importing code from the current directory is the
    CLI's documented default, not the library's)."""
    from receipt_embed.plugin_manager import get_registry as _get_registry

    return _get_registry(**kwargs)


def create_loss(name: str, plugins_dir=None, **params):
    """Build the loss registered as ``name``; call it as ``loss(embeddings, labels)``.
    A loss from a plugins folder needs that folder as ``plugins_dir``."""
    return get_registry(plugins_dir=plugins_dir).create("loss", name, **params)
