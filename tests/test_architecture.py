"""The package's layers, as docs/architecture.md draws them, hold in the code.

Every import inside ``receipt_embed`` (function-level ones included) goes from a layer to
the same or a lower one, and no two modules import each other, directly or around a loop.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "receipt_embed"

# low to high; a module may import its own layer and those below it
LAYERS = [
    # the base: files, errors, locks, config, the component-kind table
    {"version", "errors", "display", "batch_layout", "userfiles", "fileio", "npyfile", "stops", "plugin_watch", "orphans", "workers", "locking", "outdir", "staging", "page_crop", "images", "config",
     "kinds", "registry", "hookspecs", "distributed"},
    # plugins and the components they provide
    {"plugin_manager", "plugin_loader", "builtins", "augment", "sampling", "losses", "models", "verification"},
    {"ingest"},
    # sample sets, written as manifests ingest accepts (so they keep clear of its own columns)
    {"samples"},
    {"data"},
    {"evaluation"},
    {"training"},
    {"embedding"},
    {"indexing"},
    {"audit"},
    {"cli", "testing", "__main__", ""},
]  # fmt: skip


def _module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("receipt_embed", *path.relative_to(PACKAGE).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _imports() -> dict[str, set[str]]:
    modules = _module_names()
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
                ]
            for target in targets:
                while target and target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in modules and target != name:
                    edges[name].add(target)
    return edges


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    for number, members in enumerate(LAYERS):
        if top in members:
            return number
    raise AssertionError(f"{module} is in no layer: add its top-level name to LAYERS (and docs/architecture.md)")


def test_every_import_goes_down_the_layers():
    upward = [
        f"{source} -> {target}"
        for source, targets in _imports().items()
        for target in targets
        if _layer(target) > _layer(source)
    ]
    assert not upward, "imports from a lower layer up to a higher one:\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    edges = _imports()
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for target in sorted(edges[node]):
            if state.get(target) == 1:
                cycles.append(" -> ".join([*trail[trail.index(target) :], target]))
            elif target not in state:
                visit(target, [*trail, target])
        state[node] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_every_top_level_name_is_documented_in_the_architecture_page():
    page = (REPO / "docs" / "architecture.md").read_text()
    for members in LAYERS:
        for top in members - {"", "__main__"}:
            assert f"`{top}" in page, f"docs/architecture.md does not mention {top}"


def test_importing_the_augmentations_makes_no_network_request():
    """Attack round 18 H2: albumentations asked pypi.org for a newer release at import (a DNS
    lookup and a connect to port 443 on every train, index or search). receipt_embed turns that
    check off; a socket connect or address lookup during the import is a failure here."""
    code = (
        "import socket, sys\n"
        "calls = []\n"
        "socket.socket.connect = lambda self, address: calls.append(address)\n"
        "socket.getaddrinfo = lambda *a, **k: calls.append(a[:2]) or []\n"
        "import receipt_embed.augment.presets, albumentations\n"
        "print(calls)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NO_ALBUMENTATIONS_UPDATE"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout
