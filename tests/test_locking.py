"""One writer per output dir: a second writer is refused in one line naming the holder, a lock
left by a killed writer is taken over, and readers are never blocked."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY_TRAINING, run_cli
from test_overwrite import tree_digest, write_embeddings

from receipt_embed.locking import lock_path

HOLD = """
import sys, time
from receipt_embed.locking import write_lock
with write_lock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(60)
"""


def hold_lock(out: Path) -> subprocess.Popen:
    """A real process holding ``out``'s writer lock until it is killed."""
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert child.stdout.readline().strip() == "locked"
    return child


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_a_second_train_into_one_run_dir_is_refused_naming_the_first(tmp_path):
    from receipt_embed.ingest import ingest

    ingest(REPO / "data_samples", tmp_path / "ds")
    run = tmp_path / "run"
    sets = [arg for key in [*TINY_TRAINING[:-1], "train.epochs=50"] for arg in ("--set", key)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECEIPT_EMBED_")}
    first = subprocess.Popen(
        [sys.executable, "-m", "receipt_embed", "train", "--data", tmp_path / "ds", "--out", run, "-q", *sets],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: (tmp_path / ".run.lock").exists(), 60, "the first train to take its lock")
        second = run_cli("train", "--data", tmp_path / "ds", "--out", run, "-q", *sets, timeout=60)
        assert second.returncode == 2
        line = second.stderr.strip()
        assert len(line.splitlines()) == 1, second.stderr
        assert f"{run} is being written by pid {first.pid} on host" in line and "receipt-embed train" in line
        assert "wait for it to finish or stop it" in line
    finally:
        first.send_signal(signal.SIGTERM)  # stops it (saving last.pt if training had begun)
        _, first_err = first.communicate(timeout=120)
    # stopped while training (checkpoint saved) or before it began
    assert first.returncode == 143, (first.returncode, first_err)
    assert not (tmp_path / ".run.lock").exists(), "a writer stopped by SIGTERM removes its lock file"


def test_a_held_index_lock_refuses_writers_but_not_readers(tmp_path):
    x, manifest = write_embeddings(tmp_path, "e", 12)
    index = tmp_path / "ix"
    assert run_cli("index", "--embeddings", x, "--manifest", manifest, "--out", index, "-q").returncode == 0
    before = tree_digest(index)
    holder = hold_lock(index)
    try:
        writer = run_cli(
            "index", "--embeddings", x, "--manifest", manifest, "--out", index, "-q", "--force", timeout=60
        )
        assert writer.returncode == 2 and f"being written by pid {holder.pid}" in writer.stderr
        searched = run_cli("search", index, "--all-pairs", "--threshold", "0.99", "--out", "-", timeout=60)
        assert searched.returncode == 0, searched.stderr  # a reader is not blocked, not refused
    finally:
        holder.kill()
        holder.wait()
    assert tree_digest(index) == before


def test_a_stale_lock_of_a_killed_writer_is_taken_over_with_a_warning(tmp_path):
    holder = hold_lock(tmp_path / "ds")
    holder.kill()  # kill -9: the lock file stays, its flock goes with the process
    holder.wait()
    record = json.loads((tmp_path / ".ds.lock").read_text())
    assert record["pid"] == holder.pid
    result = run_cli("ingest", REPO / "data_samples", "--out", tmp_path / "ds", "-q")
    assert result.returncode == 0, result.stderr
    assert f"took over the lock on {tmp_path / 'ds'} left by pid {holder.pid}" in result.stderr
    assert not (tmp_path / ".ds.lock").exists()


def test_attack_round_22_ma2_ma3_a_lock_record_says_only_what_it_holds_and_another_host_is_not_called_gone(
    tmp_path,
):
    """A stale lock of another host was taken over as "no longer running" (a flock taken on another
    host may not show here), a record without a start time read "since ?", and a live lock whose
    holder had not written its record yet read "pid ? on host ?"."""
    import socket
    import warnings

    from receipt_embed.locking import DirLocked, write_lock

    out = tmp_path / "ds"

    def warnings_taking_over(record: dict) -> list[str]:
        (tmp_path / ".ds.lock").write_text(json.dumps(record))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with write_lock(out):
                pass
        return [str(w.message) for w in caught]

    assert warnings_taking_over({"pid": 4242, "host": "elsewhere", "command": "receipt-embed x"}) == [
        f"took over the lock on {out} left by pid 4242 on host elsewhere (`receipt-embed x`): its lock is free "
        f"here, but a writer on another host cannot be seen from {socket.gethostname()}; if it may still be "
        "writing, stop this command"
    ]
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = int(ended.stdout)
    assert warnings_taking_over({"pid": gone, "host": socket.gethostname()}) == [
        f"took over the lock on {out} left by pid {gone} on host {socket.gethostname()}, which is no longer running"
    ]
    # attack round 26 F6: a live pid that does not hold the flock was called "no longer running"
    assert warnings_taking_over({"pid": os.getpid(), "host": socket.gethostname()}) == [
        f"took over the lock on {out} left by pid {os.getpid()} on host {socket.gethostname()}: a process "
        f"{os.getpid()} is running, but it does not hold the lock (its pid was reused by another process, or it "
        "no longer writes there)"
    ]
    # a live holder that has taken the flock but not yet written its record
    hold = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
         "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)", str(tmp_path / ".ds.lock")],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        (tmp_path / ".ds.lock").write_text("")
        assert hold.stdout.readline().strip() == "locked"
        with pytest.raises(DirLocked) as refused:
            with write_lock(out):
                pass
        assert str(refused.value) == (
            f"{out} is being written by another process (which has not written its record yet): "
            "wait for it to finish or stop it"
        )
    finally:
        hold.kill()
        hold.wait()


def test_the_lock_is_reentrant_and_shared_with_child_processes(tmp_path):
    from receipt_embed.locking import DirLocked, held_locks_env, lock_path, write_lock

    out = tmp_path / "run"
    with write_lock(out):
        with write_lock(tmp_path / "." / "run"):  # another spelling of the same dir, same process
            assert lock_path(out).exists()
        assert lock_path(out).exists()
        check = "from receipt_embed.locking import write_lock; import sys\nwith write_lock(sys.argv[1]): print('in')"
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        refused = subprocess.run([sys.executable, "-c", check, str(out)], env=env, capture_output=True, text=True)
        assert refused.returncode == 1 and "DirLocked" in refused.stderr and str(os.getpid()) in refused.stderr
        told = subprocess.run(
            [sys.executable, "-c", check, str(out)], env={**env, **held_locks_env(out)}, capture_output=True, text=True
        )
        assert told.stdout.strip() == "in", told.stderr  # a --nproc rank whose launcher holds the lock
    assert not lock_path(out).exists()
    holder = hold_lock(out)
    try:
        with pytest.raises(DirLocked, match=f"pid {holder.pid}"), write_lock(out):
            pass
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_file_that_is_a_link_is_never_written_through(tmp_path):
    """F3: a symlink (or dangling symlink) in place of the lock file is refused in one line naming it,
    exit 2, and the file it points at is left as it was."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    lock = tmp_path / ".ds.lock"
    lock.symlink_to(victim)
    result = run_cli("ingest", REPO / "data_samples", "--out", tmp_path / "ds", "-q", timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip() == (
        f"Error: the lock file {lock} is a symbolic link, not a regular file receipt-embed "
        "wrote; it is never written through: remove it and try again"
    )
    assert victim.read_text() == "precious" and not (tmp_path / "ds").exists()
    lock.unlink()
    lock.symlink_to(tmp_path / "nowhere")
    from receipt_embed.locking import UnusableLockFile, write_lock

    with pytest.raises(UnusableLockFile, match="is a symbolic link"):
        with write_lock(tmp_path / "ds"):
            pass
    assert not (tmp_path / "nowhere").exists()


def test_a_fifo_folder_or_hard_linked_lock_file_is_refused_by_name(tmp_path):
    """F3 + F11: a FIFO (without hanging), a folder or a second name of another file as the lock file is
    refused naming the lock file, not a bare "[Errno 22] Invalid argument"."""
    from receipt_embed.locking import UnusableLockFile, write_lock

    out = tmp_path / "ds"
    os.mkfifo(tmp_path / ".ds.lock")
    result = run_cli("ingest", REPO / "data_samples", "--out", out, "-q", timeout=60)
    assert result.returncode == 2 and f"the lock file {tmp_path / '.ds.lock'} is a FIFO" in result.stderr, result.stderr
    os.unlink(tmp_path / ".ds.lock")
    (tmp_path / ".ds.lock").mkdir()
    with pytest.raises(UnusableLockFile, match=r"\.ds\.lock is a folder"):
        with write_lock(out):
            pass
    os.rmdir(tmp_path / ".ds.lock")
    other = tmp_path / "other.txt"
    other.write_text("mine")
    os.link(other, tmp_path / ".ds.lock")
    with pytest.raises(UnusableLockFile, match="2 names"):
        with write_lock(out):
            pass
    assert other.read_text() == "mine"


def test_sigterm_that_an_extension_turns_into_another_error_is_still_a_stop(tmp_path, capsys):
    """SIGTERM landing inside code that wraps what it catches (seen: torch's C++ import of
    torch.distributed answering `TypeError: expected a message argument`) still unwinds as a
    stop: exit 143, the one line, the lock gone; an ordinary error stays what it was."""
    from receipt_embed.locking import StoppedBySignal, write_lock

    out = tmp_path / "ix"
    with pytest.raises(StoppedBySignal) as stopped:
        with write_lock(out):
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
            except SystemExit:
                raise TypeError("expected a message argument") from None
    assert stopped.value.code == 143 and stopped.value.__cause__ is None
    assert capsys.readouterr().err == f"stopped by SIGTERM: {out} left as it was\n"
    assert not (tmp_path / ".ix.lock").exists() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with pytest.raises(TypeError, match="plain"), write_lock(out):
        raise TypeError("plain")
    assert capsys.readouterr().err == ""


SWALLOWING_LOSS = """
import os, signal, time
from receipt_embed.losses.supcon import SupConLoss
from receipt_embed.hookspecs import hookimpl

def make(**params):
    try:  # as torch's first optimizer step does: an import behind `except ImportError` eats the stop
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    except BaseException:
        pass
    return SupConLoss(**params)

@hookimpl
def register_losses(register):
    register("swallowing", make, description="SupCon, built while a stop signal is swallowed")
"""


def test_a_stop_a_library_swallowed_before_training_still_stops_it(tmp_path):
    """Found while chasing a flaky exit code: a SIGTERM landing in torch's import of triton (behind
    `except ImportError`, at the optimizer's first use) was dropped, and train ran every epoch and
    exited 0. The stop is recorded, and the training loop refuses to begin after one."""
    from receipt_embed.ingest import ingest

    ingest(REPO / "data_samples", tmp_path / "ds")
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "swallowing.py").write_text(SWALLOWING_LOSS)
    sets = [arg for key in [*TINY_TRAINING[:-1], "train.epochs=30", "loss.name=swallowing"] for arg in ("--set", key)]
    run = tmp_path / "run"
    result = run_cli(
        "--plugins-dir",
        tmp_path / "plugins",
        "train",
        "--data",
        tmp_path / "ds",
        "--out",
        run,
        "-q",
        *sets,
        timeout=120,
    )
    assert result.returncode == 143, result.stderr
    assert result.stderr.strip().splitlines()[-1] == f"stopped by SIGTERM: {run} left as it was"
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints" / "last.pt").exists()
    assert not (tmp_path / ".run.lock").exists()


def test_a_swallowed_stop_keeps_the_old_dir_instead_of_swapping_in_the_new(tmp_path):
    """The same swallowed stop while a new dir is staged: the old copy stays, the staging copy goes."""
    from receipt_embed.staging import replace_dir
    from receipt_embed.stops import StoppedBySignal, signals_stop_the_command

    out = tmp_path / "ix"
    out.mkdir()
    (out / "index.json").write_text("old")
    with pytest.raises(StoppedBySignal) as stopped, signals_stop_the_command():
        with replace_dir(out, "index", force=True) as staging:
            (staging / "index.json").write_text("new")
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
            except BaseException:
                pass
    assert stopped.value.code == 143
    assert (out / "index.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ix"]


def test_an_audit_into_the_index_dir_and_an_index_force_never_run_together(tmp_path):
    """Round 3 of the attack: an audit writing INDEX/audit while `index --force` replaced INDEX
    put the old index's report in the new one. The report inside the index dir is a write to the
    index dir: it takes the index's lock, so one of the two is refused by name."""
    x, manifest = write_embeddings(tmp_path, "e", 40)
    index = tmp_path / "ix"
    assert run_cli("index", "--embeddings", x, "--manifest", manifest, "--out", index, "-q").returncode == 0
    holder = hold_lock(index)  # as an `index --force` in progress would
    try:
        audit = run_cli("audit-shortcuts", index, "--gallery", "0", "-q", timeout=120)
        assert audit.returncode == 2 and f"{index} is being written by pid {holder.pid}" in audit.stderr
        assert not (index / "audit").exists()
        elsewhere = run_cli("audit-shortcuts", index, "--gallery", "0", "-q", "--out", tmp_path / "rep", timeout=120)
        assert elsewhere.returncode in (0, 1), elsewhere.stderr  # a report elsewhere only reads the index
    finally:
        holder.kill()
        holder.wait()
    assert run_cli("audit-shortcuts", index, "--gallery", "0", "-q").returncode in (0, 1)
    assert (index / "audit" / "audit.json").exists() and not (tmp_path / ".ix.lock").exists()


def test_attack_round_27_f2_an_audit_through_a_symlink_to_the_index_dir_holds_the_index_lock(tmp_path):
    """Attack round 27 F2: `audit-shortcuts LINK` (LINK -> INDEX) and `--out LINK/audit` locked
    .LINK.lock, never .INDEX.lock, so an `index --force INDEX` ran beside them and left a 30-item
    index with a 36-item audit. A symlink to a dir locks the dir it leads to."""
    x, manifest = write_embeddings(tmp_path, "e", 40)
    index = tmp_path / "ix"
    assert run_cli("index", "--embeddings", x, "--manifest", manifest, "--out", index, "-q").returncode == 0
    (tmp_path / "link").symlink_to("ix")
    assert lock_path(tmp_path / "link") == lock_path(index) == tmp_path / ".ix.lock"
    holder = hold_lock(index)  # as an `index --force` of the real dir in progress would
    try:
        for args in (["link"], ["ix", "--out", "link/audit"], ["link", "--out", "ix/audit"]):
            audit = run_cli("audit-shortcuts", *args, "--gallery", "0", "-q", cwd=tmp_path, timeout=120)
            assert audit.returncode == 2, (args, audit.stderr)
            assert f"is being written by pid {holder.pid}" in audit.stderr, (args, audit.stderr)
        assert not (index / "audit").exists()
    finally:
        holder.kill()
        holder.wait()


def test_a_writer_whose_lock_file_was_deleted_stops_before_writing_again(tmp_path):
    from receipt_embed.locking import LockLost, check_still_held, lock_path, write_lock

    out = tmp_path / "run"
    with write_lock(out):
        check_still_held(out)
        lock_path(out).unlink()  # someone deletes it: a second writer could now take a new one
        with pytest.raises(LockLost, match=r"the lock file .*\.run\.lock of .* was removed or replaced"):
            check_still_held(out)
        lock_path(out).write_text("{}")  # a new file in its place is not our lock either
        with pytest.raises(LockLost):
            check_still_held(out)
    check_still_held(out)  # not held by this process: nothing to compare


@pytest.mark.slow  # trains: a long run, kept out of the default suite (-m slow runs it)
def test_train_stops_when_its_lock_file_is_deleted_mid_run(tmp_path):
    from receipt_embed.ingest import ingest

    ingest(REPO / "data_samples", tmp_path / "ds")
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "deletes_lock.py").write_text(
        "from pathlib import Path\n"
        "from receipt_embed.hookspecs import hookimpl\n"
        "@hookimpl\n"
        "def on_epoch_end(run_dir, epoch):\n"
        "    if epoch == 1:\n"
        "        (Path(run_dir).parent / f'.{Path(run_dir).name}.lock').unlink()\n"
    )
    sets = [arg for key in [*TINY_TRAINING[:-1], "train.epochs=3"] for arg in ("--set", key)]
    run = tmp_path / "run"
    result = run_cli("--plugins-dir", plugins, "train", "--data", tmp_path / "ds", "--out", run, "-q", *sets)
    assert result.returncode == 2, result.stderr
    assert f"the lock file {tmp_path / '.run.lock'} of {run} was removed or replaced" in result.stderr
    epochs = [json.loads(line)["epoch"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert epochs == [1], "nothing is written after the lock is lost"


def test_a_writer_never_deletes_a_lock_file_that_replaced_its_own(tmp_path):
    """Round 4 of the attack: a writer whose lock file was deleted and taken by another removed
    the other writer's lock on its way out."""
    from receipt_embed.locking import lock_path, write_lock

    out = tmp_path / "run"
    with write_lock(out):
        lock_path(out).unlink()
        lock_path(out).write_text('{"pid": 1}')  # as the second writer's new lock would be
        theirs = lock_path(out).stat().st_ino
    assert lock_path(out).exists() and lock_path(out).stat().st_ino == theirs


def test_a_user_file_with_the_lock_files_name_is_never_overwritten(tmp_path):
    """Attack round 4: ``PARENT/.NAME.lock`` that holds someone's notes is refused, not truncated."""
    from receipt_embed.locking import UnusableLockFile, write_lock

    notes = tmp_path / ".ix.lock"
    notes.write_text("my notes, not a lock\n")
    with pytest.raises(UnusableLockFile, match=r"\.ix\.lock is where receipt-embed keeps the writer lock .* move it"):
        with write_lock(tmp_path / "ix"):
            pass
    assert notes.read_text() == "my notes, not a lock\n"
    notes.write_text("")  # empty: a writer killed before it wrote its record, so ours to take
    with write_lock(tmp_path / "ix"):
        assert json.loads(notes.read_text())["pid"] == os.getpid()
    assert not notes.exists()


NAP = """
import sys, time
import click
import receipt_embed.cli as cli

@click.command()
def nap():
    print("napping", flush=True)
    time.sleep(60)

@click.command()
def done():
    import atexit

    atexit.register(lambda: print("exiting", flush=True))  # the interpreter's shutdown: never reached
    print("napping", flush=True)  # (the line the test waits for)

cli.COMMANDS["nap"] = ("__main__:nap", "sleep")
cli.COMMANDS["done"] = ("__main__:done", "return at once")
sys.argv = ["receipt-embed", sys.argv[1]]
cli.run()
"""


def _hangup_as_a_terminal_leaves_it():
    """In the child: SIGHUP at its default, as a shell's command gets it (the suite itself may run
    under nohup, which would hand the ignored SIGHUP down)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_a_signal_outside_any_lock_is_one_line_and_the_signals_exit_code(sig, code):
    """Attack round 4: SIGINT outside training printed click's "Aborted!" with exit 1, and SIGTERM
    outside a lock killed the process silently (-15); both are now the stop's line and code.
    Attack round 16 (note d): SIGHUP (a closed terminal) killed a command silently."""
    child = subprocess.Popen(
        [sys.executable, "-c", NAP, "nap"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        preexec_fn=_hangup_as_a_terminal_leaves_it,
    )
    assert child.stdout.readline().strip() == "napping"
    child.send_signal(sig)
    _, err = child.communicate(timeout=30)
    assert (child.returncode, err) == (code, f"stopped by {sig.name}\n")


def test_a_command_started_with_sighup_ignored_keeps_ignoring_it():
    """Attack round 16 (note d): SIGHUP now stops a command, but not one run under `nohup`, which
    starts it with SIGHUP ignored: that one goes on (here until a SIGTERM ends it)."""
    child = subprocess.Popen(
        [sys.executable, "-c", NAP, "nap"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN),
    )
    assert child.stdout.readline().strip() == "napping"
    child.send_signal(signal.SIGHUP)
    time.sleep(1.5)  # past the window in which a second stop signal counts as a repeat of the first
    assert child.poll() is None, "SIGHUP stopped a command that was started with it ignored"
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=30)
    assert (child.returncode, err) == (143, "stopped by SIGTERM\n")


def test_a_signal_as_the_program_ends_is_never_a_silent_death():
    """Attack rounds 5 and 6: a SIGTERM just after a command's last line arrived while the interpreter
    tore torch down with the default handlers back, and killed it silently (-15). The program now
    leaves at once when the command is done (no exit handlers run), so it ends with 0, or with the
    stop's line and 143."""
    for _ in range(5):
        child = subprocess.Popen(
            [sys.executable, "-c", NAP, "done"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert child.stdout.readline().strip() == "napping"
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=30)
        assert (child.returncode, err) in ((0, ""), (143, "stopped by SIGTERM\n")), (child.returncode, err)
        assert "exiting" not in out


@pytest.mark.parametrize("first_stop_was_handled", [True, False])
def test_a_stop_signal_sent_twice_is_said_once(first_stop_was_handled):
    """Attack round 8: `timeout` sends SIGTERM to the command and then to its group; the first one
    stopped the command with its line, the repeat reached the program's exit path and printed a
    second "stopped by SIGTERM". A repeat within a second is the same stop: quiet, the same code."""
    child = (
        "import os, signal, time\n"
        "from receipt_embed import stops\n"
        "from receipt_embed.cli import _stop_at_once_on_signals\n"
        f"if {first_stop_was_handled}: stops.is_repeat()  # the first SIGTERM, handled and said\n"
        "_stop_at_once_on_signals()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(30)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", child],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 143
    assert result.stderr == ("" if first_stop_was_handled else "stopped by SIGTERM\n"), result.stderr


def test_a_held_locks_variable_is_trusted_only_from_the_holders_descendants(tmp_path):
    """Attack round 5: RECEIPT_EMBED_HELD_LOCKS naming a lock another live process held switched the
    lock off; it now counts only when that holder is an ancestor (a --nproc rank's launcher)."""
    from receipt_embed.locking import held_locks_env

    out = tmp_path / "ds"
    holder = hold_lock(out)
    try:
        result = run_cli("ingest", REPO / "data_samples", "--out", out, "-q", env=held_locks_env(out))
        assert result.returncode == 2 and f"is being written by pid {holder.pid}" in result.stderr, result.stderr
        assert not (out / "manifest.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()


STOPPED_IN_AN_IMPORT = """
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
from receipt_embed.stops import StoppedBySignal, signals_stop_the_command
try:
    with signals_stop_the_command():
        import slow_module  # sends itself SIGTERM half-way through its own import
        print("imported whole:", slow_module.WHOLE, flush=True)
        time.sleep(5)
    print("not stopped", flush=True)
except StoppedBySignal as stop:
    print("stopped", stop.code, flush=True)
"""


def test_a_stop_that_lands_inside_an_import_is_delivered_after_it(tmp_path):
    """A SIGTERM raised inside an import left numpy half-initialised (it then recursed until
    RecursionError: an internal error, exit 1) and aborted the process inside a C++ extension's
    initialisation (pybind11: "terminate called ... StoppedBySignal: 143", exit -6, seen in
    test_a_second_train_into_one_run_dir_is_refused_naming_the_first). The stop waits for the import."""
    (tmp_path / "slow_module.py").write_text(
        "import os, signal, time\nos.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(0.3)\nWHOLE = True\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", STOPPED_IN_AN_IMPORT, str(tmp_path)],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert result.stdout.splitlines() == ["imported whole: True", "stopped 143"], (result.stdout, result.stderr)


WRAPPED_STOP = """
import os, signal, sys, time
import click
import receipt_embed.cli as cli

@click.command()
def wrapped():
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    except SystemExit:
        raise RuntimeError("a library's own error for the stop") from None

cli.COMMANDS["wrapped"] = ("__main__:wrapped", "a stop that a library turns into its own error")
sys.argv = ["receipt-embed", "wrapped"]
cli.run()
"""


def test_a_stop_that_a_library_turns_into_its_own_error_is_the_stop_not_a_bug():
    """The stop's exception can arrive as another (an extension wrapping what it caught); outside
    any writer's lock that read "internal error: RuntimeError ... This is a bug" with exit 1."""
    result = subprocess.run(
        [sys.executable, "-c", WRAPPED_STOP], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert (result.returncode, result.stderr) == (143, "stopped by SIGTERM\n")


CONTENDER = """
import os, sys, time
from receipt_embed.locking import DirLocked, write_lock

out, marker, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
held = refused = 0
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    try:
        with write_lock(out):
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # fails if another holder is inside
            os.close(fd)
            held += 1
            os.unlink(marker)
    except DirLocked:
        refused += 1
print(held, refused)
"""


def test_writers_racing_for_one_lock_never_hold_it_together(tmp_path):
    """Attack round 13 suspected a race in releasing the lock: its holder deletes the lock file, so a
    writer that opened the old file and one that created a new file could both think they hold it.
    Four processes take and release the lock of one dir as fast as they can; a marker file created
    exclusively inside the lock would fail to be created (a traceback, no count) if two were inside."""
    children = [
        subprocess.Popen(
            [sys.executable, "-c", CONTENDER, str(tmp_path / "ix"), str(tmp_path / "inside"), "3"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        for _ in range(4)
    ]
    counts = []
    for child in children:
        out, err = child.communicate(timeout=60)
        assert child.returncode == 0 and "took over" not in err, err  # no live holder mistaken for a dead one
        counts.append([int(n) for n in out.split()])
    assert all(held > 0 for held, _ in counts) and sum(refused for _, refused in counts) > 0, counts
    assert not (tmp_path / ".ix.lock").exists() and not (tmp_path / "inside").exists()


def test_an_out_below_a_file_is_one_line_naming_the_file(tmp_path):
    """Attack round 14: `--out FILE/x` said only "File exists: 'FILE'"."""
    from receipt_embed.errors import BadInput
    from receipt_embed.locking import write_lock

    (tmp_path / "notes.csv").write_text("mine")
    with pytest.raises(BadInput) as info, write_lock(tmp_path / "notes.csv" / "sub" / "out"):
        pass
    assert str(info.value) == (
        f"--out {tmp_path / 'notes.csv' / 'sub' / 'out'}: {tmp_path / 'notes.csv'} is a file, not a folder, "
        "so nothing can be written below it"
    )
    assert (tmp_path / "notes.csv").read_text() == "mine"


LAUNCHER = """
import os, subprocess, sys
from receipt_embed.locking import held_locks_env, write_lock
rank = '''
import os, sys, time
from receipt_embed.locking import LockLost, check_still_held, write_lock
with write_lock(sys.argv[1]):
    for flag in ("first", "second"):
        while not os.path.exists(os.path.join(sys.argv[2], flag)):
            time.sleep(0.05)
        try:
            check_still_held(sys.argv[1])
            print("held", flush=True)
        except LockLost as exc:
            print("lost:", exc, flush=True)
'''
with write_lock(sys.argv[1]):
    child = subprocess.Popen([sys.executable, "-c", rank, *sys.argv[1:]], env={**os.environ, **held_locks_env(sys.argv[1])})
    print(child.pid, flush=True)
    child.wait()
"""


def test_a_rank_whose_launcher_died_stops_writing(tmp_path):
    """Attack round 14: a --nproc rank whose launcher was killed (kill -9, SIGHUP) kept writing a run
    dir whose lock the kernel had released, so a second writer mixed its epochs into it."""
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(out), str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True
    )
    rank = int(launcher.stdout.readline())
    try:
        (tmp_path / "first").touch()
        assert launcher.stdout.readline().strip() == "held"  # its launcher holds the lock: it may write
        launcher.kill()
        launcher.wait()
        (tmp_path / "second").touch()
        line = launcher.stdout.readline().strip()
        assert line.startswith("lost: the launcher that held the lock of") and f"(pid {launcher.pid}) is gone" in line
        assert "stops without writing more" in line and "--resume" in line
    finally:
        try:
            os.kill(rank, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_training_takes_sighup_as_a_stop_that_saves_unless_it_is_ignored():
    """Attack round 16 (note d): training's between-steps flag covers SIGHUP too (129), so a
    closed terminal saves last.pt; with SIGHUP ignored (nohup) it stays ignored."""
    from receipt_embed.training.signals import stop_on_signals
    from receipt_embed.training.trainer import TrainingInterrupted

    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)  # the suite itself may run under nohup
    try:
        with stop_on_signals() as received:
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.05)
        assert received == ["SIGHUP"] and TrainingInterrupted("x", received[0]).code == 129
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        with stop_on_signals() as received:
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.05)
        assert received == [] and signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_attack_round_26_a_forked_copy_of_the_lock_holder_ends_before_it_writes(tmp_path):
    """A child a plugin forked where no guard stood (a property read) inherited the lock, the held
    dicts and the staging dir's name, so it wrote, swapped or unlinked as a second writer. Reaching
    receipt-embed's writes, it now ends there with a line; the holder's lock is untouched."""
    import receipt_embed.locking as locking

    out = tmp_path / "run"
    with locking.write_lock(out) as path:
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the copy: its stderr is the pipe
            os.close(read_end)
            sys.stderr = os.fdopen(write_end, "w")
            try:
                locking.check_still_held(out)
            finally:
                os._exit(0)  # only when the check let it go on
        os.close(write_end)
        said = os.fdopen(read_end).read()
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        assert code == 1, said
        assert (
            f"process {pid}, forked by a plugin in process {os.getpid()}, reached receipt-embed's writes of {out}"
            in said
        )
        assert path.exists()
        locking.check_still_held(out)  # the holder goes on
    assert not path.exists()
