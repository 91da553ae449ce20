"""A failed write to standard output is one line and exit code 2, also when it happens as the output
is flushed at exit; a closed pipe is still click's quiet exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO


def run_to(stdout, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECEIPT_EMBED_")}
    return subprocess.run(
        [sys.executable, "-m", "receipt_embed", *map(str, args)],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("args", [("config",), ("--help",), ("ingest", REPO / "data_samples", "--out", "{tmp}/ds")])
def test_a_full_standard_output_is_one_line_exit_2(tmp_path, args):
    """F10: `... > /dev/full` (ENOSPC on stdout) is "cannot write to standard output: No space left on
    device", exit 2, no traceback; the command's own files are still complete."""
    args = [str(a).replace("{tmp}", str(tmp_path)) for a in args]
    with open("/dev/full", "w") as full:
        result = run_to(full, *args)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == "Error: cannot write to standard output: No space left on device", result.stderr
    if "ingest" in args:
        assert (tmp_path / "ds" / "manifest.jsonl").is_file()


def test_a_closed_pipe_is_still_quiet(tmp_path):
    """F10: EPIPE stays click's: no traceback, no 'cannot write' line. Attack round 7: it exited 1,
    like any error; now 141, as a shell reports a process that SIGPIPE ended (`yes | head`)."""
    reader, writer = os.pipe()
    os.close(reader)
    with os.fdopen(writer, "w") as closed:
        result = run_to(closed, "--help")
    assert result.stderr == "" and result.returncode == 141
    yes = subprocess.run(["bash", "-c", "yes | head -1 >/dev/null; echo ${PIPESTATUS[0]}"], capture_output=True)
    assert yes.stdout.strip() == b"141", "the code a shell gives a writer whose reader went away"


def test_all_pairs_into_a_closed_pipe_is_quiet(tmp_path):
    """Round 3 of the attack: `search --all-pairs --out - | head -1` printed a Broken pipe error."""
    import numpy as np

    from receipt_embed.indexing import index_embeddings

    rows = [{"path": f"img{i}.jpg", "receipt_id": f"r{i // 2}", "device": "d"} for i in range(400)]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    np.save(tmp_path / "x.npy", np.random.default_rng(0).normal(size=(400, 8)).astype(np.float32))
    index_embeddings(tmp_path / "x.npy", tmp_path / "m.jsonl", tmp_path / "ix")
    reader, writer = os.pipe()
    os.close(reader)
    with os.fdopen(writer, "w") as closed:
        result = run_to(closed, "search", tmp_path / "ix", "--all-pairs", "--threshold", "-1", "--out", "-")
    assert "Traceback" not in result.stderr and "Broken pipe" not in result.stderr, result.stderr
    assert "Error" not in result.stderr and result.returncode == 141


@pytest.mark.parametrize("unbuffered", ["1", ""])
def test_a_large_write_cut_by_the_reader_is_not_dropped_silently(unbuffered):
    """Attack round 8: with PYTHONUNBUFFERED=1, `search --json | head -c1` exited 0, the JSON past the
    first 64 KB dropped without an error by the text layer over the raw file. The command line's
    stdout writes all of a large write or raises, so the closed pipe is seen (exit 141)."""
    child = (
        "import sys\n"
        "from receipt_embed.cli import _whole_writes\n"
        "out = _whole_writes(sys.stdout)\n"
        "try:\n"
        "    out.write('x' * 300_000); out.flush()\n"
        "    print('all written', file=sys.stderr)\n"
        "except BrokenPipeError:\n"
        "    print('broken pipe', file=sys.stderr)\n"
    )
    reader, writer = os.pipe()
    env = {**os.environ, "PYTHONUNBUFFERED": unbuffered}
    process = subprocess.Popen([sys.executable, "-c", child], stdout=writer, stderr=subprocess.PIPE, env=env, text=True)
    os.close(writer)
    with os.fdopen(reader, "rb") as pipe:
        assert len(pipe.read(1)) == 1  # the child's write is under way and fills the pipe
    _, stderr = process.communicate(timeout=60)
    assert stderr.strip() == "broken pipe", stderr


def test_a_reader_of_the_messages_that_goes_away_stops_no_training(tmp_path):
    """Attack round 9: `train ... 2>&1 | head -1` stopped the run after the epoch in which the pipe
    closed (exit 1): its epoch lines go to standard error. The messages are lost, not the work: the
    run trains every epoch and exits 141, as a writer whose reader went away."""
    import torch
    from conftest import TINY_TRAINING

    from receipt_embed.config import load_config
    from receipt_embed.ingest import ingest

    ingest(REPO / "data_samples", tmp_path / "ds", load_config().ingest)
    sets = [item for key in [*TINY_TRAINING, "train.epochs=3"] for item in ("--set", key)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECEIPT_EMBED_")}
    command = [
        sys.executable,
        "-m",
        "receipt_embed",
        "train",
        "--data",
        tmp_path / "ds",
        "--out",
        tmp_path / "run",
        *sets,
    ]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    assert child.stdout.readline()  # the first epoch's line
    child.stdout.close()
    assert child.wait(timeout=300) == 141
    last = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert last["epoch"] == 3, "every epoch was trained"
