"""Built-in plugins: registered through the same hooks as third-party plugins."""

from __future__ import annotations

import importlib


def lazy_target(module: str, name: str):
    """What a built-in factory builds, imported only when asked for: the registry reads its
    parameters' annotations (``signature_target``) without importing torch at plugin listing."""

    def target():
        return getattr(importlib.import_module(module), name)

    return target
