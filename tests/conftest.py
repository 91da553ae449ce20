"""Shared test helpers: run the real CLI in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

if os.environ.get("PYTEST_XDIST_WORKER"):
    # the suite runs on two workers (pyproject's addopts): one thread each, and for every CLI
    # process a test starts, so processes x threads stays within the machine's cores
    for _variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_variable, "1")


def run_cli(*args, cwd=None, env=None, timeout=300) -> subprocess.CompletedProcess:
    """``python -m receipt_embed ARGS`` in a new process, so plugin discovery is fresh."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("RECEIPT_EMBED_")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "receipt_embed", *map(str, args)],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def cli():
    return run_cli


def browser_page(html: Path) -> dict:
    """What Chromium (Qt WebEngine, tests/browser_check.py) shows of a report: headings, verdict,
    images, the retrieval table; skips the test where no headless browser can start."""
    import json

    pytest.importorskip("PyQt6.QtWebEngineWidgets", reason="PyQt6-WebEngine not installed")
    done = subprocess.run(
        [sys.executable, str(REPO / "tests" / "browser_check.py"), str(html)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    if done.returncode == 3:
        pytest.skip(f"no headless browser could start: {done.stderr.strip()[-200:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def builtin_registry():
    """Components of the built-in plugins only (no entry points, no plugins folder)."""
    from receipt_embed.plugin_manager import PluginLoader

    loader = PluginLoader()
    loader.load_builtins()
    loader.collect_components()
    return loader.registry


# a model small enough to train one epoch on data_samples/ in seconds
TINY_TRAINING = [
    "data.image_size=[64,32]",
    "train.batch_size=8",
    "train.eval_batch_size=64",
    "train.bn_recalibrate=32",
    "model.head_hidden=64",
    "model.head_dim=32",
    # fp32: at 64 x 32 the default stem ends in 1 x 1 maps, whose bf16 convolution backward gives
    # NaN gradients now and then (test_bf16_autocast_trains_with_float32_weights); train.precision
    # auto is bf16 on a CPU with native bf16, so tiny runs pin fp32 to stay exact
    "train.precision=fp32",
    # the page crop (GrabCut) costs about 35 ms a capture, most of a tiny run and of every index and
    # search of its checkpoint; tests/test_page_crop.py and the demo's tests run it
    "data.page_crop=false",
    "train.epochs=1",  # last: some tests replace it (TINY_TRAINING[:-1])
]


def train_tiny(base: Path) -> tuple[Path, Path]:
    """data_samples/ ingested into BASE/dataset and one tiny epoch trained into BASE/run;
    returns (dataset dir, best checkpoint)."""
    from receipt_embed.config import load_config
    from receipt_embed.ingest import ingest
    from receipt_embed.training.trainer import train

    ingest(REPO / "data_samples", base / "dataset", load_config().ingest)
    train(
        load_config(overrides=TINY_TRAINING),
        base / "dataset",
        base / "run",
        builtin_registry(),
        progress=False,
        log=lambda m: None,
    )
    return base / "dataset", base / "run" / "checkpoints" / "best.pt"


def registry_with_examples():
    """Built-ins plus the worked examples in plugins/, loaded by folder discovery (strict)."""
    from receipt_embed.plugin_manager import PluginLoader

    loader = PluginLoader(strict=True)
    loader.load_builtins()
    loader.load_folder(REPO / "plugins", required=True)
    loader.collect_components()
    return loader.registry
