"""Shared test helpers: run the real CLI in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args, cwd=None, env=None, timeout=300) -> subprocess.CompletedProcess:
    """``python -m receipt_embed ARGS`` in a new process, so plugin discovery is fresh."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("RECEIPT_EMBED_")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "receipt_embed", *map(str, args)],
        cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout,
    )


@pytest.fixture
def cli():
    return run_cli


def builtin_registry():
    """Components of the built-in plugins only (no entry points, no plugins folder)."""
    from receipt_embed.plugin_manager import PluginLoader

    loader = PluginLoader()
    loader.load_builtins()
    loader.collect_components()
    return loader.registry
