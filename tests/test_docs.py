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


GUIDE = (REPO / "docs" / "plugins.md").read_text()


def _block(marker: str, text: str = GUIDE) -> str:
    match = re.search(re.escape(marker) + r"\n\n```python\n(.*?)```", text, re.S)
    assert match, f"docs/plugins.md: no python block after {marker}"
    return match.group(1)


def test_plugin_tutorial_works_as_written(tmp_path):
    """The tutorial's plugin and test files, saved where it says, pass their tests; the
    plugin is listed, and train runs with it (a tiny model instead of the default)."""
    import json
    import os
    import subprocess
    import sys

    from conftest import TINY_TRAINING, run_cli

    (tmp_path / "plugins").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "plugins" / "pair_contrastive.py").write_text(_block("`plugins/pair_contrastive.py`:"))
    (tmp_path / "tests" / "test_pair_contrastive.py").write_text(_block("`tests/test_pair_contrastive.py`:"))
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ},
    )
    assert tests.returncode == 0 and "2 passed" in tests.stdout, tests.stdout + tests.stderr

    # the tutorial's lazy import keeps plugin discovery free of torch
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from receipt_embed.cli import main\ntry:\n"
            "    main(['plugins'])\nexcept SystemExit: pass\nprint('torch' in sys.modules)",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert probe.stdout.strip().endswith("False"), probe.stdout + probe.stderr
    listed = run_cli("plugins", cwd=tmp_path)
    assert f"pair_contrastive  [folder: {tmp_path / 'plugins' / 'pair_contrastive.py'}]" in listed.stdout
    assert "loss          pair_contrastive" in listed.stdout

    assert "receipt-embed ingest /path/to/receipt-embed/data_samples --out dataset" in GUIDE
    assert run_cli("ingest", REPO / "data_samples", "--out", "dataset", cwd=tmp_path).returncode == 0
    command = 'receipt-embed train --data dataset --out run --set loss.name=pair_contrastive --set "loss.params={margin: 0.3}"'
    assert command in GUIDE
    sets = [arg for item in TINY_TRAINING for arg in ("--set", item)]
    result = run_cli(
        "train",
        "--data",
        "dataset",
        "--out",
        "run",
        "--set",
        "loss.name=pair_contrastive",
        "--set",
        "loss.params={margin: 0.3}",
        "-q",
        *sets,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    line = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert 0 < line["loss"] < 2 and "val" in line
    bad = run_cli("train", "--data", "dataset", "--out", "run2", "--set", "loss.name=pair_contrastiv", cwd=tmp_path)
    assert bad.returncode == 2 and "Did you mean 'pair_contrastive'?" in bad.stderr


def test_plugin_guide_links_resolve():
    for path in re.findall(r"`((?:plugins|examples|benchmarks|tests)/[\w./-]+)`", GUIDE):
        if "pair_contrastive" in path:  # the tutorial's own files
            continue
        assert (REPO / path).exists(), f"docs/plugins.md names {path}, which does not exist"


def test_every_ingest_reason_code_is_in_the_readme_table():
    """Attack round 27 F7: ingest rejected rows as `permission_denied`, a reason the README's table
    did not list. Every code a row is rejected with (a file-level one or a row check's) is listed."""
    source = "".join(path.read_text() for path in (REPO / "receipt_embed").rglob("*.py"))
    codes = set(re.findall(r'UnusableFile\(\s*"([a-z_]+)"', source))
    codes |= set(re.findall(r'reject\(\s*\w+,\s*\w+,\s*"([a-z_]+)"', source))
    assert {"permission_denied", "missing_field", "repeated_row"} <= codes  # the patterns still find them
    table = README.split("| reason | what happened |", 1)[1].split("\n\n", 1)[0]
    assert [code for code in sorted(codes) if f"`{code}`" not in table] == []
