"""Distributed contrastive loss: 2 CPU processes (gloo) against one process on the same batch."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_worker import make_loss, model_and_batch, momentum_keys, rows_for

from receipt_embed.distributed import identity_slice, two_view_order

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(tmp_path: Path, loss: str, mode: str, world: int = 2) -> list[dict]:
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(world),
        "OMP_NUM_THREADS": "1",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "dist_worker.py"), str(tmp_path / f"r{r}.pt"), loss, mode],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
    return [torch.load(tmp_path / f"r{r}.pt", weights_only=True) for r in range(world)]


def single_process(loss: str) -> dict:
    model, inputs = model_and_batch()
    x, labels = rows_for(inputs, list(range(inputs.shape[1])))
    loss_fn = make_loss(loss)
    if loss == "moco":
        value = loss_fn(model(x), labels, keys=momentum_keys(model, x))
    else:
        value = loss_fn(model(x), labels)
    value.backward()
    return {
        "loss": value.detach(),
        "grads": [p.grad.detach().clone() for p in model.parameters()],
        "state": loss_fn.state_dict(),
    }


@pytest.mark.parametrize("loss", ["ntxent", "supcon", "moco"])
def test_two_ranks_match_one_process(tmp_path, loss):
    reference = single_process(loss)
    ranks = run_ranks(tmp_path, loss, "differentiable")
    for rank in ranks:
        assert torch.allclose(rank["loss"], reference["loss"], atol=1e-5), (rank["loss"], reference["loss"])
        for got, want in zip(rank["grads"], reference["grads"]):
            assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
        # MoCo: every rank's queue holds the global batch's keys in the single-process order
        for name, value in reference["state"].items():
            assert torch.allclose(rank["state"][name].float(), value.float(), atol=1e-5), name


def test_detached_gather_gets_the_gradients_wrong(tmp_path):
    """Same loss value, but rows from the other rank act as constants: every parameter
    gradient comes out 1/W of the true one. This is why the gather must be differentiable."""
    reference = single_process("ntxent")
    ranks = run_ranks(tmp_path, "ntxent", "detached")
    assert torch.allclose(ranks[0]["loss"], reference["loss"], atol=1e-5)
    for got, want in zip(ranks[0]["grads"], reference["grads"]):
        assert not torch.allclose(got, want, atol=1e-4)
        assert torch.allclose(got, want / 2, atol=1e-5)


def test_two_view_order_and_identity_slices():
    order = two_view_order(world_size=2, local_identities=3)
    # gathered rows: rank 0 [a0 a1 a2 a0' a1' a2'], rank 1 [b0 b1 b2 b0' b1' b2']
    assert order.tolist() == [0, 1, 2, 6, 7, 8, 3, 4, 5, 9, 10, 11]
    assert identity_slice(list(range(8)), 1, 2) == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="does not split over 3 ranks"):
        identity_slice(list(range(8)), 0, 3)


@pytest.mark.slow  # long end-to-end run (tens of seconds): `pytest -m slow` runs it
def test_train_nproc_2_end_to_end(cli, tmp_path):
    """`train --nproc 2` launches torchrun; rank 0 writes the run dir; resume needs the same count."""
    from receipt_embed.config import load_config
    from receipt_embed.ingest import ingest

    ingest(REPO / "data_samples", tmp_path / "ds", load_config().ingest)
    tiny = [
        "--set",
        "data.image_size=[64,32]",
        "--set",
        "train.precision=fp32",
        "--set",
        "train.batch_size=8",
        "--set",
        "model.head_hidden=64",
        "--set",
        "model.head_dim=32",
        "--set",
        "train.eval_batch_size=64",
        "--set",
        "train.bn_recalibrate=32",
    ]
    result = cli(
        "train",
        "--data",
        tmp_path / "ds",
        "--out",
        tmp_path / "run",
        "--nproc",
        "2",
        "-q",
        "--set",
        "train.epochs=1",
        *tiny,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1  # one writer
    import json

    line = json.loads(lines[0])
    assert line["world_size"] == 2 and line["loss_stats"]["anchors"] == 24  # the global batch: 8 receipts x 3 captures
    assert line["global_unique_identities_per_step"] == 8
    assert "recall_at_1" in line["val"]["head"]
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert state["world_size"] == 2
    result = cli(
        "train",
        "--data",
        tmp_path / "ds",
        "--out",
        tmp_path / "run",
        "--resume",
        "-q",
        "--set",
        "train.epochs=2",
        *tiny,
    )
    assert result.returncode == 2 and "resume it with the same number (--nproc 2), not 1" in result.stderr
    result = cli(
        "train",
        "--data",
        tmp_path / "ds",
        "--out",
        tmp_path / "run",
        "--resume",
        "--nproc",
        "2",
        "-q",
        "--set",
        "train.epochs=2",
        *tiny,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [l["epoch"] for l in lines] == [1, 2] and lines[1]["world_size"] == 2
    result = cli("train", "--out", tmp_path / "run2", "--nproc", "2", "-q")
    assert result.returncode == 2 and "needs --data" in result.stderr
    result = cli(
        "train",
        "--data",
        tmp_path / "ds",
        "--out",
        tmp_path / "run3",
        "--nproc",
        "2",
        "-q",
        "--set",
        "train.epochs=1",
        *tiny[:4],
        "--set",
        "train.batch_size=7",
        *tiny[6:],
    )
    assert result.returncode == 2 and "does not split over 2 processes" in result.stderr  # checked before launching
    assert "Traceback" not in result.stderr


@pytest.mark.slow  # long end-to-end run (tens of seconds): `pytest -m slow` runs it
def test_sigterm_to_the_launcher_stops_every_rank_and_saves(tmp_path):
    import signal
    import time

    from receipt_embed.config import load_config
    from receipt_embed.ingest import ingest

    ingest(REPO / "data_samples", tmp_path / "ds", load_config().ingest)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECEIPT_EMBED_")}
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "receipt_embed",
            "train",
            "--data",
            str(tmp_path / "ds"),
            "--out",
            str(tmp_path / "run"),
            "--nproc",
            "2",
            "-q",
            "--set",
            "train.epochs=200",
            "--set",
            "data.image_size=[64,32]",
            "--set",
            "train.precision=fp32",
            "--set",
            "train.batch_size=8",
            "--set",
            "model.head_hidden=64",
            "--set",
            "model.head_dim=32",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        time.sleep(0.5)
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 143, err[-2000:]
    assert "SIGTERM received: saved" in err and err.count("received: saved") == 1  # rank 0 speaks for the run
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert state["world_size"] == 2 and state["epoch"] >= 1


@pytest.mark.slow  # long end-to-end run (tens of seconds): `pytest -m slow` runs it
def test_train_nproc_2_with_moco_keeps_one_queue(cli, tmp_path):
    from receipt_embed.config import load_config
    from receipt_embed.ingest import ingest

    ingest(REPO / "data_samples", tmp_path / "ds", load_config().ingest)
    result = cli(
        "train",
        "--data",
        tmp_path / "ds",
        "--out",
        tmp_path / "run",
        "--nproc",
        "2",
        "-q",
        "--set",
        "train.epochs=1",
        "--set",
        "data.image_size=[64,32]",
        "--set",
        "train.precision=fp32",
        "--set",
        "train.batch_size=8",
        "--set",
        "model.head_hidden=64",
        "--set",
        "model.head_dim=32",
        "--set",
        "loss.name=moco",
        "--set",
        "loss.params={queue_size: 64, dim: 32, queue_init: empty}",
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    # 6 steps x 16 global keys, into a queue of 64 that started empty: full, every slot labelled
    assert int(state["loss"]["queue_count"]) == 64 and "momentum_model" in state


def _children(pid: int) -> list[int]:
    """The live (not zombie) processes whose parent is ``pid``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_bytes().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != b"Z":
                found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def _start_nproc_2(tmp_path: Path, epochs: int) -> tuple[subprocess.Popen, int, dict[int, int]]:
    """A `train --nproc 2` past its first epoch: (the launcher, its torchrun's pid, {rank: pid})."""
    import time

    from receipt_embed.config import load_config
    from receipt_embed.ingest import ingest

    ingest(REPO / "data_samples", tmp_path / "ds", load_config().ingest)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECEIPT_EMBED_")}
    with open(tmp_path / "launcher.err", "w") as err:  # the launcher keeps its own descriptor
        launcher = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "receipt_embed",
                "train",
                "--data",
                str(tmp_path / "ds"),
                "--out",
                str(tmp_path / "run"),
            ]
            + [
                "--nproc",
                "2",
                "-q",
                "--set",
                f"train.epochs={epochs}",
                "--set",
                "data.image_size=[64,32]",
                "--set",
                "train.precision=fp32",
            ]
            + ["--set", "train.batch_size=8", "--set", "model.head_hidden=64", "--set", "model.head_dim=32"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    last = tmp_path / "run" / "checkpoints" / "last.pt"
    deadline = time.time() + 180
    while time.time() < deadline and not last.exists():
        time.sleep(0.2)
    assert last.exists(), (tmp_path / "launcher.err").read_text()[-2000:]
    (torchrun,) = _children(launcher.pid)
    ranks = {}
    for pid in _children(torchrun):
        variables = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        ranks[int(next(v for v in variables if v.startswith(b"RANK="))[5:])] = pid
    assert sorted(ranks) == [0, 1]
    return launcher, torchrun, ranks


@pytest.mark.slow  # long end-to-end run (tens of seconds): `pytest -m slow` runs it
def test_kill_9_of_the_launcher_stops_its_ranks_and_a_second_writer_never_mixes_with_them(cli, tmp_path):
    """Attack round 14: kill -9 of the --nproc launcher released the run dir's lock, torchrun and its
    ranks trained on, and a `train --force` then shared the run dir with them (mixed metrics.jsonl,
    the orphans' best.pt over the new run's)."""
    import json
    import time

    launcher, torchrun, ranks = _start_nproc_2(tmp_path, epochs=200)
    launcher.kill()
    launcher.wait()
    deadline = time.time() + 60
    while time.time() < deadline and any(_alive(pid) for pid in (torchrun, *ranks.values())):
        time.sleep(0.2)
    orphans = [pid for pid in (torchrun, *ranks.values()) if _alive(pid)]
    for pid in orphans:
        os.kill(pid, 9)
    assert not orphans, "torchrun or a rank outlived the launcher"
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)["world_size"] == 2
    result = cli(
        "train", "--data", tmp_path / "ds", "--out", tmp_path / "run", "--force", "-q", "--set", "train.epochs=1",
        "--set", "data.image_size=[64,32]", "--set", "train.precision=fp32", "--set", "train.batch_size=8", "--set", "model.head_hidden=64",
        "--set", "model.head_dim=32", timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    time.sleep(2)  # an orphan's write would land by now
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(line["epoch"], line["world_size"]) for line in lines] == [(1, 1)]
    for name in ("last.pt", "best.pt"):
        state = torch.load(tmp_path / "run" / "checkpoints" / name, weights_only=True)
        assert state["world_size"] == 1 and state["epoch"] == 1, name


@pytest.mark.slow  # long end-to-end run (tens of seconds): `pytest -m slow` runs it
def test_kill_9_of_one_rank_is_one_line_naming_it_and_how_to_continue(tmp_path):
    """Attack round 14: a rank killed by the OOM killer or kill -9 under --nproc printed "internal error"
    and "This is a bug in receipt-embed" from rank 0, then torchrun's ChildFailedError traceback."""
    import json

    launcher, _, ranks = _start_nproc_2(tmp_path, epochs=200)
    os.kill(ranks[1], 9)
    assert launcher.wait(timeout=120) == 1
    err = (tmp_path / "launcher.err").read_text()
    said = [line for line in err.splitlines() if not line.startswith(("epoch ", "launching "))]
    run = tmp_path / "run"
    assert said == [
        f"Error: rank 1 (pid {ranks[1]}) was killed by SIGKILL (kill -9, or the out-of-memory killer); "
        f"{run}/checkpoints/last.pt holds the last saved state: continue with "
        f"`receipt-embed train --out {run} --resume --nproc 2`"
    ], err[-3000:]
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    state = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    assert state["world_size"] == 2 and all(line["world_size"] == 2 for line in lines)
    assert [line["epoch"] for line in lines] == list(range(1, len(lines) + 1))


def test_which_failed_rank_torchrun_under_nproc_names(tmp_path):
    """Attack round 14: the rank that went first on its own is named (a signal death in one line; an
    exit code it explained itself is passed on), never one that only lost its peers."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from receipt_embed.cli.torchrun_main import failure_report
    from receipt_embed.distributed import PEER_GONE_EXIT, lost_a_peer

    def failed(rank, code):
        return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file="<N/A>")

    run = tmp_path / "run"
    code, line = failure_report({0: failed(0, PEER_GONE_EXIT), 1: failed(1, -9)}, run, 2)
    assert code == 1 and line.startswith("Error: rank 1 (pid 101) was killed by SIGKILL")
    assert line.endswith(f"no checkpoint was saved in {run} yet: start the run again")
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.pt").touch()
    code, line = failure_report({0: failed(0, -15), 1: failed(1, PEER_GONE_EXIT)}, run, 4)
    assert code == 1 and "rank 0 (pid 100) was killed by SIGTERM;" in line and "--resume --nproc 4`" in line
    assert failure_report({0: failed(0, 2), 1: failed(1, PEER_GONE_EXIT)}, run, 2) == (2, None)  # it said why
    code, line = failure_report({0: failed(0, PEER_GONE_EXIT), 1: failed(1, PEER_GONE_EXIT)}, run, 2)
    assert code == 1 and "lost its connection to the other ranks" in line
    gloo = RuntimeError("[../gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:13731: Connection reset by peer")
    wrapped = ValueError("while stepping")
    wrapped.__cause__ = gloo
    assert lost_a_peer(gloo) and lost_a_peer(wrapped) and not lost_a_peer(RuntimeError("shapes do not match"))


def test_a_batch_that_does_not_split_says_when_it_was_lowered_to_the_identity_count():
    """Attack round 15 (N8): `--nproc 100000 --set train.batch_size=100000` said "batch_size 48
    does not split": the 48 was the training identity count it had been silently lowered to."""
    from receipt_embed.training.resume import check_batch_splits

    check_batch_splits(100_000, 48, 2)  # lowered to 48, which splits over 2
    check_batch_splits(7, 48, 7)
    with pytest.raises(ValueError, match="^train.batch_size 7 does not split over 2 processes; use a multiple of 2$"):
        check_batch_splits(7, 48, 2)
    with pytest.raises(ValueError, match="batch_size 100000 is lowered to the 47 training identities, and 47 does not"):
        check_batch_splits(100_000, 47, 2)
    with pytest.raises(ValueError, match="100000 processes are more than the 48 training identities"):
        check_batch_splits(100_000, 48, 100_000)


def test_nproc_is_capped_before_anything_starts(tmp_path):
    """Attack round 16 (note a): `--nproc` was bounded only by the training identity count, so
    `--nproc 120` would start 120 torch processes on a two-core machine."""
    from click.testing import CliRunner

    from receipt_embed.cli import main
    from receipt_embed.cli.train import MAX_NPROC

    result = CliRunner().invoke(main, ["train", "--out", str(tmp_path / "run"), "--nproc", str(MAX_NPROC + 1)])
    assert result.exit_code == 2 and f"{MAX_NPROC + 1} is not in the range 1<=x<={MAX_NPROC}" in result.output
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "env,message",
    [
        ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' in the environment is not a whole number of 1 or more; "),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0' in the environment is not a whole number of 1 or more; "),
        ({"WORLD_SIZE": "-1"}, "WORLD_SIZE='-1' in the environment is not a whole number of 1 or more; "),
        ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK='2' in the environment is not a whole number from 0 to 1; "),
        ({"WORLD_SIZE": "2", "RANK": "0"}, "WORLD_SIZE=2 is set in the environment but MASTER_ADDR is not; "),
        ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "x"}, "MASTER_PORT='x' in "),
    ],
)
def test_bad_torch_distributed_variables_are_one_line_naming_them(cli, tmp_path, env, message):
    """Attack round 17 G2: a bad WORLD_SIZE ("abc", "0", "-1") was an internal error (a traceback)."""
    result = cli("train", "--data", tmp_path, "--out", tmp_path / "run", env=env)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"Error: {message}") and result.stderr.count("\n") == 1, result.stderr
    assert "start every rank (torchrun, or `receipt-embed train --nproc N`), or unset WORLD_SIZE" in result.stderr


def test_a_stray_world_size_says_whom_it_waits_for_gives_up_and_stops_on_sigterm(tmp_path):
    """Attack round 17 G2: a stray `WORLD_SIZE=2 RANK=0 MASTER_ADDR MASTER_PORT` (no launcher) waited
    silently for the other rank and ignored SIGTERM. It says so, gives up after the rendezvous timeout
    with one line, and SIGTERM stops the wait (exit 143)."""
    import signal
    import time

    from receipt_embed.config import load_config
    from receipt_embed.ingest import ingest

    ingest(REPO / "data_samples", tmp_path / "ds", load_config().ingest)
    port = _free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("RECEIPT_EMBED_", "TORCHELASTIC_"))},
        "WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "RECEIPT_EMBED_RENDEZVOUS_TIMEOUT": "4",
    }  # fmt: skip
    command = [sys.executable, "-m", "receipt_embed", "train", "--data", str(tmp_path / "ds"), "-q"]
    waiting = f"waiting for 1 more process at 127.0.0.1:{port} (WORLD_SIZE=2 from the environment), for up to 4 s"
    result = subprocess.run([*command, "--out", str(tmp_path / "a")], env=env, capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    assert waiting in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1].startswith(
        f"Error: no 1 more process joined at 127.0.0.1:{port} (WORLD_SIZE=2 from the environment) within 4 s; "
    )
    process = subprocess.Popen(
        [*command, "--out", str(tmp_path / "b")],
        env={**env, "RECEIPT_EMBED_RENDEZVOUS_TIMEOUT": "120"},
        stderr=subprocess.PIPE,
        text=True,
    )
    line = process.stderr.readline()
    assert line.startswith("waiting for 1 more process"), line
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    stderr = process.stderr.read()
    assert process.wait(timeout=60) == 143, stderr
    assert time.monotonic() - started < 30 and "stopped by SIGTERM" in stderr and "Traceback" not in stderr
