"""Reads of run, dataset and index dir files a hostile copy could have replaced.

Each test names the finding it covers (F4: non-regular run files, F5: YAML alias bombs,
F6: too wide a thumbnail root, F7: a substituted index.faiss, F8: lying .npy headers,
F12: misleading messages, F14: non-string manifest values). Where a regression would
hang, the CLI runs in a subprocess with a timeout.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from conftest import run_cli, train_tiny

HANG = 60

BOMB = """a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("readside"))


def _copy_run(trained, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(trained[1].parents[1], run)
    return run


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_non_regular_metrics_file_stops_resume_at_once(trained, tmp_path, kind):
    """F4: a FIFO (hang) or a /dev/zero symlink (memory exhaustion) as metrics.jsonl is named, exit 2."""
    run = _copy_run(trained, tmp_path)
    (run / "metrics.jsonl").unlink()
    if kind == "fifo":
        os.mkfifo(run / "metrics.jsonl")
    else:
        os.symlink("/dev/zero", run / "metrics.jsonl")
    result = run_cli("train", "--out", run, "--resume", "--set", "train.epochs=2", "-q", timeout=HANG)
    assert result.returncode == 2, result.stderr
    assert "metrics.jsonl" in result.stderr and "not a regular file" in result.stderr
    assert "Traceback" not in result.stderr


def test_non_regular_data_record_is_named(trained, tmp_path):
    """F4: data.json as a FIFO is refused by name, not skipped or read."""
    from receipt_embed.training.trainer import recorded_data_dir
    from receipt_embed.userfiles import UnusableFile

    run = _copy_run(trained, tmp_path)
    (run / "data.json").unlink()
    os.mkfifo(run / "data.json")
    with pytest.raises(UnusableFile, match="data.json.*FIFO"):
        recorded_data_dir(run)


def test_read_jsonl_refuses_devices():
    """F4: the shared JSON-lines reader never opens a device."""
    from receipt_embed.fileio import read_jsonl, read_jsonl_tail_tolerant
    from receipt_embed.userfiles import UnusableFile

    with pytest.raises(UnusableFile, match="character device"):
        read_jsonl("/dev/zero")
    with pytest.raises(UnusableFile, match="character device"):
        read_jsonl_tail_tolerant("/dev/zero")


def test_alias_bomb_config_fails_fast_naming_the_file(tmp_path):
    """F5: a billion-laughs --config is refused with its name, exit 2, in well under the timeout."""
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BOMB)
    result = run_cli("config", "--config", bomb, timeout=HANG)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert str(bomb) in result.stderr and "alias" in result.stderr
    assert "Traceback" not in result.stderr


def test_alias_bomb_in_a_run_config_fails_resume(trained, tmp_path):
    """F5: the same bomb as a run's config.yaml stops --resume, naming the file."""
    run = _copy_run(trained, tmp_path)
    (run / "config.yaml").write_text(BOMB)
    result = run_cli("train", "--out", run, "--resume", "-q", timeout=HANG)
    assert result.returncode == 2, result.stderr
    assert "config.yaml" in result.stderr and "alias" in result.stderr
