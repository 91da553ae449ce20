"""The README's examples work as written."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from receipt_embed.plugin_manager import PluginLoader

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def test_readme_folder_plugin_example_runs(tmp_path):
    match = re.search(r"`plugins/flip_views.py`:\n\n```python\n(.*?)```", README, re.S)
    assert match, "the README's folder plugin example is missing"
    (tmp_path / "flip_views.py").write_text(match.group(1))
    loader = PluginLoader()
    loader.load_builtins()
    loader.load_folder(tmp_path)
    loader.collect_components()
    component = loader.registry.get("augmentation", "flip")
    assert component.plugin == "flip_views"
    transform = loader.registry.create("augmentation", "flip", image_size=(20, 10), p=1.0)
    image = np.arange(30 * 15 * 3, dtype=np.uint8).reshape(30, 15, 3)
    assert transform(image=image)["image"].shape == (20, 10, 3)


def test_readme_states_the_two_commands_ci_runs():
    ci = (REPO / ".ci" / "run").read_text()
    assert 'pip install -e ".[dev]" && receipt-embed demo' in README
    assert "python -m pytest -q" in README and "python -m pytest -q" in ci


def test_readme_python_api_example_runs():
    match = re.search(r"## Losses and the Python API\n\n```python\n(.*?)```", README, re.S)
    assert match, "the README's Python API example is missing"
    namespace: dict = {}
    exec(match.group(1), namespace)
    assert namespace["loss"].ndim == 0 and namespace["views"].grad is not None
