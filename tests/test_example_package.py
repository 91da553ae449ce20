"""examples/receipt-embed-triplet: a complete plugin package with its own pyproject.toml.

It is pip-installed into a target folder (no index, no network), then `receipt-embed plugins`
lists it through its entry point, `train` uses its loss, and the package's own tests pass
against the installed copy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TINY_TRAINING

PACKAGE = REPO / "examples" / "receipt-embed-triplet"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("site")
    build = tmp_path_factory.mktemp("build")  # a copy, so the build leaves no files in the repository
    subprocess.run(["cp", "-r", str(PACKAGE), str(build)], check=True)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(build / PACKAGE.name),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    return target


def test_installed_package_is_listed_by_its_entry_point(cli, tmp_path, site):
    result = cli("plugins", "--json", cwd=tmp_path, env={"PYTHONPATH": str(site)})
    assert result.returncode == 0, result.stderr
    plugins = {p["name"]: p for p in json.loads(result.stdout)["plugins"]}
    triplet = plugins["triplet"]
    assert triplet["source"] == "entry point" and triplet["version"] == "0.1.0"
    assert triplet["location"] == "receipt-embed-triplet: receipt_embed_triplet"
    assert [c["name"] for c in triplet["components"]] == ["batch_hard_triplet"]
    # without the package on the path it is gone: nothing is imported from the repository
    result = cli("plugins", "--json", cwd=tmp_path)
    assert "triplet" not in {p["name"] for p in json.loads(result.stdout)["plugins"]}


def test_train_uses_the_installed_loss(cli, tmp_path, site):
    env = {"PYTHONPATH": str(site)}
    assert cli("ingest", REPO / "data_samples", "--out", tmp_path / "ds", cwd=tmp_path).returncode == 0
    sets = [arg for item in TINY_TRAINING for arg in ("--set", item)]
    result = cli(
        "train",
        "--data",
        tmp_path / "ds",
        "--out",
        tmp_path / "run",
        "-q",
        "--set",
        "loss.name=batch_hard_triplet",
        "--set",
        "sampler.name=pk",
        "--set",
        "loss.params={margin: 0.3}",
        *sets,
        cwd=tmp_path,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    line = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    # the package's loss ran: its own statistics are in the metrics line
    assert line["loss_stats"]["anchors"] == 8 * 3 and line["loss_stats"]["anchors_without_positive"] == 0
    assert 0.0 < line["loss"] < 0.3 + 2.0
    assert "loss:\n  name: batch_hard_triplet" in (tmp_path / "run" / "config.yaml").read_text()


def test_the_package_tests_pass_against_the_installed_copy(site):
    env = {**os.environ, "PYTHONPATH": str(site)}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            "--rootdir",
            str(PACKAGE),
            str(PACKAGE / "tests"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=PACKAGE,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 passed" in result.stdout


def test_installed_package_keeps_discovery_free_of_torch(tmp_path, site):
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = (
        "import sys; from receipt_embed.cli import main\ntry:\n    main(['plugins'])\nexcept SystemExit: pass\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert "batch_hard_triplet" in out.stdout and out.stdout.strip().endswith("False"), out.stdout + out.stderr
