"""kill -9 at many points of index and checkpoint writes: the dir always loads, as the old state
or the new one, never a mix, and the next writer tidies up what the killed one left.

Each writer runs in a real process that rewrites its dir in a loop (so a kill almost always
lands mid-write), and is killed with SIGKILL after a different delay each time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings

from conftest import REPO
from test_overwrite import write_embeddings

KILL_AFTER = (0.02, 0.07, 0.15, 0.26, 0.4, 0.6)  # seconds after the writer's first write began

INDEX_WRITER = """
import sys, warnings
warnings.simplefilter("ignore")  # leftovers of the previous kill are reported, and expected
from receipt_embed.indexing import index_embeddings
out, pairs = sys.argv[1], [sys.argv[2:4], sys.argv[4:6]]
print("ready", flush=True)
turn = 0
while True:
    index_embeddings(*pairs[turn % 2], out, force=True)
    turn += 1
    print("swapped", flush=True)
"""

CHECKPOINT_WRITER = """
import json, sys, torch
from receipt_embed.fileio import append_line
from receipt_embed.training.checkpoint import save_checkpoint
run, epoch = sys.argv[1], int(sys.argv[2])
weights = torch.randn(600_000)  # a 2.4 MB model
CONFIG = {"model": {}, "data": {}}  # the sections every checkpoint carries
print("ready", flush=True)
while True:
    epoch += 1
    append_line(f"{run}/metrics.jsonl", json.dumps({"epoch": epoch, "loss": 1.0 / epoch}))  # as the trainer: line first
    save_checkpoint(f"{run}/checkpoints/last.pt", {"epoch": epoch, "model": {"w": weights * epoch}, "config": CONFIG})
"""


def start(script: str, *args) -> subprocess.Popen:
    child = subprocess.Popen(
        [sys.executable, "-c", script, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert child.stdout.readline().strip() == "ready", child.stderr.read()
    return child


def kill_after(child: subprocess.Popen, delay: float, after_a_swap: bool = False) -> None:
    """SIGKILL ``delay`` seconds after the writer is ready (or after its first completed write)."""
    if after_a_swap:
        assert child.stdout.readline().strip() == "swapped", child.stderr.read()
    time.sleep(delay)
    assert child.poll() is None, child.stderr.read()
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)


def test_kill_9_during_index_writes_leaves_the_old_or_the_new_index(tmp_path):
    from receipt_embed.indexing import index_embeddings, load_index_dir
    from receipt_embed.indexing.index_dir import sha256_file
    from receipt_embed.staging import leftovers

    old = write_embeddings(tmp_path, "old", 3000, dim=64)
    new = write_embeddings(tmp_path, "new", 4000, dim=64, seed=1)
    states = {sha256_file(old[0]): 3000, sha256_file(new[0]): 4000}
    out = tmp_path / "ix"
    index_embeddings(*old, out)
    seen = set()
    for number, delay in enumerate(KILL_AFTER):
        kill_after(start(INDEX_WRITER, out, *new, *old), delay, after_a_swap=number % 2 == 1)
        loaded = load_index_dir(out)  # verifies every file against index.json
        digest = loaded.meta["source"]["embeddings_sha256"]
        assert digest in states and loaded.count == states[digest] == loaded.index.ntotal == len(loaded.embeddings)
        seen.add(digest)
    assert len(seen) == 2, "every kill left the old index (none after a swap)"
    remaining = leftovers(out)  # each writer removed what the one before left; the last kill's are here
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        index_embeddings(*old, out, force=True)  # the next writer removes what the killed ones left, and says so
    assert not leftovers(out) and load_index_dir(out).count == 3000
    said = [str(w.message) for w in caught if "leftover" in str(w.message)]
    assert not remaining or (len(said) == 1 and all(p.name in said[0] for p in remaining)), (remaining, said)


def test_kill_9_during_checkpoint_writes_leaves_a_resumable_run(tmp_path):
    import torch

    from receipt_embed.fileio import read_jsonl_tail_tolerant
    from receipt_embed.training.checkpoint import load_checkpoint, save_checkpoint

    run = tmp_path / "run"
    old_state = {"epoch": 0, "model": {"w": torch.ones(3)}, "config": {"model": {}, "data": {}}}
    save_checkpoint(run / "checkpoints" / "last.pt", old_state)
    epoch = 0
    for delay in KILL_AFTER[:4]:
        kill_after(start(CHECKPOINT_WRITER, run, epoch), delay)
        state = load_checkpoint(run / "checkpoints" / "last.pt")  # never torn: old or new
        assert state["epoch"] >= epoch and float(state["model"]["w"][0]) != 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a torn last line is expected now and then
            rows, _ = read_jsonl_tail_tolerant(run / "metrics.jsonl") if (run / "metrics.jsonl").exists() else ([], 0)
        epochs = [row["epoch"] for row in rows]
        assert epochs == list(range(1, len(epochs) + 1)), "only whole lines, in order"
        last = epochs[-1] if epochs else 0
        assert last in (state["epoch"], state["epoch"] + 1)  # at most one line ahead of the checkpoint
        epoch = last  # the next writer continues after the last line, as a resume would
        with open(run / "metrics.jsonl", "ab+") as handle:  # and drops a torn tail, as a resume does
            handle.seek(0)
            data = handle.read()
            handle.truncate(data.rfind(b"\n") + 1)
    from receipt_embed.training.replacement import settle_leftovers

    killed_mid_write = list((run / "checkpoints").glob(".last.pt.*.tmp"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        settle_leftovers(run)  # what train does under the lock before it writes
    assert not list(run.rglob("*.tmp")) and load_checkpoint(run / "checkpoints" / "last.pt")
    assert not killed_mid_write or any("temporary" in str(w.message) for w in caught)


def test_readers_see_one_whole_index_while_a_writer_swaps_it(tmp_path):
    from receipt_embed.indexing import index_embeddings, load_index_dir
    from receipt_embed.indexing.index_dir import sha256_file

    old = write_embeddings(tmp_path, "old", 2000, dim=32)
    new = write_embeddings(tmp_path, "new", 2500, dim=32, seed=1)
    states = {sha256_file(old[0]): 2000, sha256_file(new[0]): 2500}
    out = tmp_path / "ix"
    index_embeddings(*old, out)
    writer = start(INDEX_WRITER, out, *new, *old)
    seen = set()
    try:
        started = time.monotonic()
        while time.monotonic() < started + 2 or (len(seen) < 2 and time.monotonic() < started + 30):
            loaded = load_index_dir(out)  # never blocked by the writer's lock, never a mix of two copies
            digest = loaded.meta["source"]["embeddings_sha256"]
            assert loaded.count == states[digest] == len(loaded.items) == loaded.index.ntotal
            seen.add(digest)
    finally:
        writer.kill()
        writer.wait()
    assert len(seen) == 2, "the writer never swapped while the reader read"
