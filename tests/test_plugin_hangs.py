"""A plugin's code that hangs or ends the process: the command still stops on a signal, names the
plugin, and a plugin's ``os._exit`` is its failure, not a silent exit 0 (Attack round 22 MB1-MB3)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY_TRAINING

HANGS_IN_ITS_IMPORT = {
    "hang.py": "from . import _loop  # the loop runs inside importlib, where a stop used to wait for ever\n",
    "_loop.py": "import time\nwhile True:\n    time.sleep(0.01)\n",
}

HOOK_HANGS = """
import time
from receipt_embed.hookspecs import hookimpl

@hookimpl
def on_epoch_end(run_dir, epoch):
    (run_dir / f"hook_started_{epoch}").touch()
    while True:
        time.sleep(0.01)
"""

LOSS_HANGS = """
import time
from pathlib import Path

import torch
from receipt_embed.hookspecs import hookimpl


class Stuck(torch.nn.Module):
    def __init__(self, temperature=0.1, marker=""):
        super().__init__()
        self.calls, self.marker = 0, marker

    def forward(self, embeddings, labels):
        self.calls += 1
        if self.calls == 3:
            Path(self.marker).touch()
            while True:
                time.sleep(0.01)
        return embeddings.float().pow(2).mean()


@hookimpl
def register_losses(register):
    register("stuck", Stuck)
"""

EXITS_AT_IMPORT = "import os\nos._exit(0)\n"

HOOK_EXITS = """
import os
from receipt_embed.hookspecs import hookimpl

@hookimpl
def on_epoch_end(epoch):
    os._exit(0)
"""


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECEIPT_EMBED_")}
    env.update(extra)
    return env


def _program(args: list[str], **constants: float) -> list[str]:
    """``receipt-embed ARGS`` with module constants set first (the notice delays), in a new process."""
    sets = "".join(
        f"import {m.rsplit('.', 1)[0]} as _m; _m.{m.rsplit('.', 1)[1]} = {v!r}; " for m, v in constants.items()
    )
    return [
        sys.executable,
        "-c",
        f"import sys; {sets}from receipt_embed.cli import run; sys.argv[1:] = {args!r}; run()",
    ]


def _start(args: list[str], stderr=subprocess.PIPE, **constants: float) -> subprocess.Popen:
    """``receipt-embed ARGS`` started in the background, its stderr piped (or written to ``stderr``)."""
    return subprocess.Popen(
        _program(args, **constants), env=_env(), stdout=subprocess.DEVNULL, stderr=stderr, text=True
    )


def _folder(path: Path, files: dict[str, str]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (path / name).write_text(textwrap.dedent(text))
    return path


def _wait_for(condition, process: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline and process.poll() is None and not condition():
        time.sleep(0.02)
    assert process.poll() is None, f"the command ended before the test could stop it: {process.communicate()}"
    assert condition(), "the expected moment never came"


def _stop(process: subprocess.Popen, sig=signal.SIGTERM, seconds: float = 30) -> tuple[int, str]:
    process.send_signal(sig)
    try:
        _, stderr = process.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        _, stderr = process.communicate()
        pytest.fail(f"still running {seconds} s after {sig.name}: {stderr}")
    return process.returncode, stderr


def test_attack_round_22_mb1_a_plugin_whose_import_never_ends_is_named_and_sigterm_still_stops_the_command(
    tmp_path,
):
    folder = _folder(tmp_path / "plugins", HANGS_IN_ITS_IMPORT)
    notice = tmp_path / "stderr.txt"
    with open(notice, "w") as err:
        process = _start(
            ["--plugins-dir", str(folder), "plugins"], stderr=err, **{"receipt_embed.plugin_watch.NOTICE_AFTER_S": 0.3}
        )
        _wait_for(lambda: "still loading" in notice.read_text(), process)
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=30)
    stderr = notice.read_text()
    assert code == 143, stderr
    assert time.monotonic() - started < 15  # the stop waits at most IMPORT_WAIT_S for the import to end
    assert (
        "still loading plugin 'hang' after 0.3 s; if it hangs, stop with Ctrl-C and skip it with "
        "RECEIPT_EMBED_DISABLE_PLUGINS=hang"
    ) in stderr
    assert "stopped by SIGTERM while loading plugin 'hang'" in stderr and "Traceback" not in stderr
    # the advice works: skipped, the command runs
    skipped = subprocess.run(
        [sys.executable, "-m", "receipt_embed", "--plugins-dir", str(folder), "plugins", "--json"],
        env=_env(RECEIPT_EMBED_DISABLE_PLUGINS="hang"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert skipped.returncode == 0, skipped.stderr
    assert "hang" in json.loads(skipped.stdout)["blocked"]


def test_attack_round_22_mb8_the_skip_advice_only_names_the_variable_when_it_can_hold_the_name():
    from receipt_embed.plugin_watch import skip_advice

    assert skip_advice("tracker-2.v1") == "skip it with RECEIPT_EMBED_DISABLE_PLUGINS=tracker-2.v1"
    assert skip_advice("slow ep") == 'skip it with RECEIPT_EMBED_DISABLE_PLUGINS="slow ep"'  # inner spaces are kept
    for odd in ("a,b", " padded", "tab\there", ""):
        assert "RECEIPT_EMBED_DISABLE_PLUGINS=" not in skip_advice(odd)
        assert "moving its file away or uninstalling its package" in skip_advice(odd)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from receipt_embed.config import load_config
    from receipt_embed.ingest import ingest

    out = tmp_path_factory.mktemp("hang_dataset") / "dataset"
    ingest(REPO / "data_samples", out, load_config().ingest)
    return out


def _train_args(dataset: Path, run: Path, folder: Path, *sets: str) -> list[str]:
    args = ["--plugins-dir", str(folder), "train", "--data", str(dataset), "--out", str(run), "-q"]
    for item in [*TINY_TRAINING, *sets]:
        args += ["--set", item]
    return args


def _stop_in_the_first_epoch_hook(tmp_path: Path, dataset: Path, plugin: str, epochs: int) -> tuple[Path, int, str]:
    """Train with the hook plugin ``plugin`` (it touches ``hook_started_N``), SIGTERM once its first
    call began: the run dir, the exit code and stderr."""
    folder = _folder(tmp_path / "plugins", {"hook.py": plugin})
    run = tmp_path / "run"
    process = _start(_train_args(dataset, run, folder, f"train.epochs={epochs}"))
    _wait_for(lambda: (run / "hook_started_1").exists(), process, seconds=240)
    return (run, *_stop(process))


def test_attack_round_22_mb2_sigterm_stops_training_inside_a_hanging_epoch_hook_and_resume_goes_on(tmp_path, dataset):
    run, code, stderr = _stop_in_the_first_epoch_hook(tmp_path, dataset, HOOK_HANGS, epochs=3)
    folder = tmp_path / "plugins"
    assert code == 143, stderr
    assert (
        f"SIGTERM received while calling on_epoch_end of plugin 'hook': saved {run / 'checkpoints' / 'last.pt'} "
        "after epoch 1; continue with --resume"
    ) in stderr
    assert "Traceback" not in stderr and "left as it was" not in stderr, stderr
    assert not (run / ".receipt-embed.lock").exists()
    resumed = subprocess.run(
        [sys.executable, "-m", "receipt_embed", *_train_args(dataset, run, folder, "train.epochs=3"), "--resume"],
        env=_env(RECEIPT_EMBED_DISABLE_PLUGINS="hook"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr
    epochs = [json.loads(line)["epoch"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert epochs == [1, 2, 3]


def _two_stops_in_the_stuck_loss(tmp_path: Path, dataset: Path, *args: str, **constants: float) -> tuple[int, str]:
    """Train into tmp_path/run with a loss that never returns from its third call, then SIGTERM twice:
    the first is a flag for the end of the step, which never comes; the second stops at once."""
    marker = tmp_path / "stuck"
    folder = _folder(tmp_path / "plugins", {"stuck.py": LOSS_HANGS})
    sets = ("loss.name=stuck", f"loss.params={{marker: '{marker}'}}")
    process = _start([*_train_args(dataset, tmp_path / "run", folder, *sets), *args], **constants)
    _wait_for(marker.exists, process, seconds=240)
    process.send_signal(signal.SIGTERM)
    time.sleep(1.5)  # past the window in which a second SIGTERM is the same stop delivered twice
    assert process.poll() is None
    return _stop(process)


def test_attack_round_22_mb2_a_second_stop_ends_a_step_that_never_ends(tmp_path, dataset):
    run = tmp_path / "run"
    code, stderr = _two_stops_in_the_stuck_loss(
        tmp_path, dataset, **{"receipt_embed.training.signals.STILL_FINISHING_S": 0.3}
    )
    assert code == 143, stderr
    assert (
        "SIGTERM received 0.3 s ago and the current step has not ended; send it again (Ctrl-C) to stop at once"
    ) in stderr
    assert (
        "SIGTERM received after an earlier stop signal while computing the loss in loss 'stuck' (plugin 'stuck'): "
        "stopped at once in epoch 1, without waiting for the step to end; no checkpoint had been saved yet"
    ) in stderr
    assert "Traceback" not in stderr
    assert not (run / ".receipt-embed.lock").exists()


def test_attack_round_22_mb3_a_plugin_calling_os_exit_is_a_failed_plugin_not_a_silent_exit(cli, tmp_path):
    folder = _folder(tmp_path / "plugins", {"quits.py": EXITS_AT_IMPORT})
    result = cli("--plugins-dir", folder, "plugins", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["failed"] == [{"name": "quits", "error": "RuntimeError: it called os._exit(0)"}]
    assert "plugin 'quits' failed to load and was skipped: RuntimeError: it called os._exit(0)" in (result.stderr)
    strict = cli("--plugins-dir", folder, "--strict-plugins", "plugins")
    assert strict.returncode == 2 and "it called os._exit(0)" in strict.stderr


def test_attack_round_22_mb3_an_epoch_hook_calling_os_exit_warns_and_training_finishes(cli, tmp_path, dataset):
    folder = _folder(tmp_path / "plugins", {"quits.py": HOOK_EXITS})
    run = tmp_path / "run"
    result = cli(*_train_args(dataset, run, folder, "train.epochs=2"))
    assert result.returncode == 0, result.stderr
    assert "plugin 'quits' failed in on_epoch_end (epoch 1): it called os._exit(0)" in result.stderr
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2


def test_os_exit_of_a_child_the_plugin_forks_still_exits_the_child(tmp_path):
    """Attack round 23 N3, N10: ``os._exit(status=0)`` in a forked child raised TypeError there, so
    the child ran the rest of the command a second time; a copy kept for later stayed guarded."""
    from receipt_embed.plugin_watch import plugin_code

    with plugin_code("forks", "loading"):
        for call in (lambda: os._exit(7), lambda: os._exit(status=7)):
            pid = os.fork()
            if pid == 0:
                call()
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 7
        kept = os._exit
    with pytest.raises(BaseException, match=r"it called os\._exit\(3\)"):
        with plugin_code("quits", "loading"):
            os._exit(3)
    with pytest.raises(BaseException, match=r"it called os\._exit\(status=3\)"):
        with plugin_code("quits", "loading"):
            os._exit(status=3)
    assert os._exit.__name__ == "_exit"  # the real one is back
    pid = os.fork()
    if pid == 0:
        kept(5)  # the plugin's copy, called after its code ended: a real exit
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 5


HOOK_SWALLOWS = """
import time
from receipt_embed.hookspecs import hookimpl

@hookimpl
def on_epoch_end(run_dir, epoch):
    (run_dir / f"hook_started_{epoch}").touch()
    try:
        while True:
            time.sleep(0.01)
    except:  # noqa: E722  (a plugin that catches everything)
        (run_dir / "swallowed").touch()
"""

LOADS_FOREVER_CATCHING_EVERYTHING = """
import time
while True:
    try:
        time.sleep(0.01)
    except BaseException:
        pass
"""


def test_attack_round_23_n1_a_stop_an_epoch_hook_swallows_still_stops_training(tmp_path, dataset):
    """A hook with a bare ``except:`` caught the stop raised inside it, and training ran to its end, exit 0."""
    run, code, stderr = _stop_in_the_first_epoch_hook(tmp_path, dataset, HOOK_SWALLOWS, epochs=3)
    assert code == 143, stderr
    assert (run / "swallowed").exists()
    assert (
        f"SIGTERM received while calling on_epoch_end of plugin 'hook': saved {run / 'checkpoints' / 'last.pt'} "
        "after epoch 1; continue with --resume"
    ) in stderr
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1


def test_attack_round_23_n13_a_hook_stopped_after_the_last_epoch_says_the_run_is_complete(tmp_path, dataset):
    _, code, stderr = _stop_in_the_first_epoch_hook(tmp_path, dataset, HOOK_HANGS, epochs=1)
    assert code == 143, stderr
    assert "after epoch 1; that was the last epoch, so the run is complete" in stderr and "--resume" not in stderr


def test_attack_round_23_n2_a_stop_sent_again_ends_plugin_code_that_catches_everything(tmp_path):
    """A plugin looping with ``except BaseException: pass`` swallowed every stop: only kill -9 ended it."""
    folder = _folder(tmp_path / "plugins", {"sw.py": LOADS_FOREVER_CATCHING_EVERYTHING})
    notice = tmp_path / "stderr.txt"
    with open(notice, "w") as err:
        process = _start(
            ["--plugins-dir", str(folder), "plugins"], stderr=err, **{"receipt_embed.plugin_watch.NOTICE_AFTER_S": 0.3}
        )
        _wait_for(lambda: "still loading" in notice.read_text(), process)
        process.send_signal(signal.SIGTERM)  # swallowed
        time.sleep(1.5)
        assert process.poll() is None
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=30)
    assert code == 143
    assert "stopped by SIGTERM: sent again, the command had not stopped; exiting at once" in notice.read_text()


def test_attack_round_23_n8_n9_odd_and_huge_failures_of_a_plugin_are_its_own_and_shortened(cli, tmp_path):
    folder = _folder(
        tmp_path / "plugins",
        {
            "badrepr.py": "class B:\n    __repr__ = lambda self: 1 / 0\nraise SystemExit(B())\n",
            "huge.py": "raise RuntimeError('\\x1b[31mRED\\n' + 'A' * 300000)\n",
        },
    )
    result = cli("--plugins-dir", folder, "plugins", "--json")
    assert result.returncode == 0, result.stderr
    failed = {entry["name"]: entry["error"] for entry in json.loads(result.stdout)["failed"]}
    assert failed["badrepr"] == "RuntimeError: it raised SystemExit(<B whose repr() failed>)"
    assert failed["huge"].startswith("RuntimeError: \x1b[31mRED\nAAA") and len(failed["huge"]) < 2100
    assert failed["huge"].endswith("characters)")
    assert len(result.stderr) < 10_000


def test_a_plugin_with_a_syntax_error_is_named_in_one_line(cli, tmp_path):
    """README trial: the failure showed the source line and its caret as literal \\n escapes."""
    folder = _folder(tmp_path / "plugins", {"broken.py": "x = 1\n\n\ndef on_epoch_end(epoch)\n    pass\n"})
    result = cli("--plugins-dir", folder, "plugins", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["failed"] == [
        {"name": "broken", "error": "SyntaxError: expected ':' (broken.py, line 4)"}
    ]


def test_attack_round_24_p1_a_forked_child_leaving_plugin_code_exits_there():
    """A hook that forked, its child calling ``sys.exit(0)``, had that child reported as a failed
    plugin and then training on as a second trainer in the same run dir. However a forked child
    leaves the plugin's code (returning, an exit, an error), it exits there."""
    from receipt_embed import stops
    from receipt_embed.plugin_watch import plugin_code

    parent = os.getpid()
    for leave, expected in (("pass", 0), ("sys.exit(3)", 3), ("sys.exit('bye')", 1), ("raise ValueError", 1)):
        try:
            with plugin_code("forks", "calling on_epoch_end of"):
                pid = os.fork()
                if pid == 0:
                    exec(leave, {"sys": sys})
        except BaseException:
            if os.getpid() != parent:
                stops._hard_exit(99)  # the child came back into the caller: the failure this test catches
            raise
        if os.getpid() != parent:
            stops._hard_exit(99)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == expected, leave


HOOK_WRAPS_THE_STOP = """
import time
from receipt_embed.hookspecs import hookimpl

@hookimpl
def on_epoch_end(run_dir, epoch):
    (run_dir / f"hook_started_{epoch}").touch()
    try:
        while True:
            time.sleep(0.01)
    except BaseException as exc:
        raise RuntimeError("the hook was interrupted") from exc
"""

IMPORT_WRAPS_THE_STOP = """
import time
try:
    while True:
        time.sleep(0.01)
except BaseException as exc:
    raise ImportError("interrupted while loading") from exc
"""


def test_attack_round_24_p2_a_stop_a_hook_turns_into_its_own_error_still_stops_training(tmp_path, dataset):
    """The hook's RuntimeError read as a failed plugin: training went on and exited 0."""
    run, code, stderr = _stop_in_the_first_epoch_hook(tmp_path, dataset, HOOK_WRAPS_THE_STOP, epochs=3)
    assert code == 143, stderr
    assert (
        f"SIGTERM received while calling on_epoch_end of plugin 'hook': saved {run / 'checkpoints' / 'last.pt'} "
        "after epoch 1; continue with --resume"
    ) in stderr
    assert "failed" not in stderr and len((run / "metrics.jsonl").read_text().splitlines()) == 1


def test_attack_round_24_p2_a_stop_a_plugin_import_turns_into_an_import_error_still_stops(tmp_path):
    folder = _folder(tmp_path / "plugins", {"wrap.py": IMPORT_WRAPS_THE_STOP})
    notice = tmp_path / "stderr.txt"
    with open(notice, "w") as err:
        process = _start(
            ["--plugins-dir", str(folder), "plugins"], stderr=err, **{"receipt_embed.plugin_watch.NOTICE_AFTER_S": 0.3}
        )
        _wait_for(lambda: "still loading" in notice.read_text(), process)
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=30)
    stderr = notice.read_text()
    assert code == 143, stderr
    assert "stopped by SIGTERM while loading plugin 'wrap'" in stderr and "failed to load" not in stderr, stderr


def test_attack_round_24_p10_a_force_run_stopped_at_once_says_the_previous_run_is_kept(tmp_path, dataset):
    """It said "no checkpoint had been saved yet", true of the new run, while the old run's last.pt was back."""
    run = tmp_path / "run"
    folder = _folder(tmp_path / "plugins", {"stuck.py": LOSS_HANGS})
    first = subprocess.run(
        [sys.executable, "-m", "receipt_embed", *_train_args(dataset, run, folder, "train.epochs=1")],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert first.returncode == 0, first.stderr
    before = (run / "checkpoints" / "last.pt").read_bytes()
    code, stderr = _two_stops_in_the_stuck_loss(tmp_path, dataset, "--force")
    assert code == 143, stderr
    assert f"the new run had saved no checkpoint, so the previous run in {run} is kept" in stderr, stderr
    assert "the previous run in" not in stderr.replace(
        f"the new run had saved no checkpoint, so the previous run in {run} is kept", "", 1
    ), f"said once (attack round 25 M1): {stderr}"
    assert (run / "checkpoints" / "last.pt").read_bytes() == before


ENCODER_FORKS = """
import os
from receipt_embed.hookspecs import hookimpl
from receipt_embed.models.receipt_cnn import ReceiptCNN


class Forks(ReceiptCNN):
    forked = False

    def forward(self, images):
        features = super().forward(images)  # before the fork: torch's threads do not survive one
        if self.training and not Forks.forked:
            Forks.forked = True
            os.fork()  # a background job that forgets to end its child
        return features


@hookimpl
def register_encoders(register):
    register("forks", lambda **params: Forks(**params))
"""


def test_attack_round_25_f1_a_child_a_component_forks_exits_when_it_leaves_the_component(tmp_path, dataset):
    """An encoder whose forward forked made a second trainer in the run dir: every epoch twice in
    metrics.jsonl and a lock error. The child now exits on leaving the component's code, as one
    forked in a hook does."""
    folder = _folder(tmp_path / "plugins", {"forks.py": ENCODER_FORKS})
    run = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "receipt_embed",
            *_train_args(dataset, run, folder, "train.epochs=2", "model.encoder=forks"),
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and "lock" not in result.stderr, result.stderr
    assert [json.loads(line)["epoch"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]


ENCODER_STUCK_IN_EVALUATION = """
import os
import time

import torch

from receipt_embed.hookspecs import hookimpl
from receipt_embed.models.receipt_cnn import ReceiptCNN


class StuckInEvaluation(ReceiptCNN):
    def forward(self, images):
        if self.training and not torch.is_grad_enabled():  # BatchNorm recalibration before evaluating
            open(os.environ["STUCK_MARKER"], "w").close()
            while True:
                time.sleep(0.05)
        return super().forward(images)


@hookimpl
def register_encoders(register):
    register("stuck_in_evaluation", lambda **params: StuckInEvaluation(**params))
"""


def test_attack_round_25_m2_a_second_stop_during_evaluation_says_it_did_not_wait_for_the_evaluation(
    tmp_path, dataset, monkeypatch
):
    """A second stop while epoch 1 was being evaluated said it had not waited "for the step to end"."""
    marker = tmp_path / "stuck"
    monkeypatch.setenv("STUCK_MARKER", str(marker))
    folder = _folder(tmp_path / "plugins", {"stuck.py": ENCODER_STUCK_IN_EVALUATION})
    process = _start(_train_args(dataset, tmp_path / "run", folder, "model.encoder=stuck_in_evaluation"))
    _wait_for(marker.exists, process, seconds=240)
    process.send_signal(signal.SIGTERM)
    time.sleep(1.5)  # past the window in which a second SIGTERM is the same stop delivered twice
    assert process.poll() is None
    code, stderr = _stop(process)
    assert code == 143, stderr
    assert (
        "SIGTERM received after an earlier stop signal while evaluating in encoder 'stuck_in_evaluation' (plugin "
        "'stuck'): stopped at once in epoch 1, without waiting for the evaluation to end; no checkpoint had been "
        "saved yet"
    ) in stderr, stderr


FORKS_AT = """
import os
import time

import torch

from receipt_embed.hookspecs import hookimpl
from receipt_embed.losses import SupConLoss
from receipt_embed.models.receipt_cnn import ReceiptCNN

WHERE, MARKER = os.environ["FORK_AT"], os.environ["FORK_MARKER"]
forked, children = set(), []


def fork_once(where, child_hangs=False):
    if where != WHERE or where in forked:
        return
    forked.add(where)
    pid = os.fork()
    if pid == 0:
        with open(MARKER, "a") as marker:
            marker.write(f"{os.getpid()}\\n")
        if child_hangs:  # as a child deadlocked in torch's thread pool does
            while True:
                time.sleep(0.05)
    else:
        children.append(pid)


@hookimpl
def on_epoch_end(run_dir, epoch):  # whether each child has ended by now, while the command still runs
    for pid in children:
        deadline, state = time.time() + 10, "running"
        while time.time() < deadline and state == "running":
            state = "ended" if os.waitpid(pid, os.WNOHANG)[0] else "running"
            time.sleep(0.05)
        with open(MARKER + "_at_epoch_end", "a") as marker:
            marker.write(f"{pid} {state}\\n")


class ReadsForkEncoder(ReceiptCNN):
    @property
    def feature_dim(self):
        fork_once("feature_dim")
        return self._features

    @feature_dim.setter
    def feature_dim(self, value):
        self._features = value


class ForkingLoss(SupConLoss):
    def forward(self, embeddings, labels):
        fork_once("loss_forward", child_hangs=True)
        return super().forward(embeddings, labels)

    @property
    def last_stats(self):
        fork_once("last_stats")
        return self._stats

    @last_stats.setter
    def last_stats(self, value):
        self._stats = value


def check_that_forks(context):
    fork_once("audit_check")
    return {"figures": {"items": len(context.items)}, "summary": "forks once", "flagged": False}


def check_that_exits(context):
    os._exit(0)


@hookimpl
def register_encoders(register):
    register("reads_fork", lambda **params: ReadsForkEncoder(**params))


@hookimpl
def register_losses(register):
    register("forking", ForkingLoss)


@hookimpl
def register_audit_checks(register):
    if WHERE == "audit_check":
        register("forks", lambda: check_that_forks)
    if WHERE == "audit_exit":
        register("exits", lambda: check_that_exits)
"""


def _gone(pid: int, seconds: float = 10) -> bool:
    """Whether process ``pid`` has ended (a zombie no one reaps counts as ended) within ``seconds``."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def _run_forking(tmp_path: Path, where: str, args: list[str], timeout: float = 240):
    """``receipt-embed ARGS`` with the plugin that forks at ``where``, its stdout and stderr piped
    (a child that kept them open would keep communicate() waiting): result and the children's pids."""
    marker = tmp_path / f"children_{where}"
    folder = _folder(tmp_path / "fork_plugins", {"forks_at.py": FORKS_AT})
    process = subprocess.Popen(
        _program(["--plugins-dir", str(folder), *args]),
        env=_env(FORK_AT=where, FORK_MARKER=str(marker)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        process.kill()
    children = [int(line) for line in marker.read_text().split()] if marker.exists() else []
    return process.returncode, stdout, stderr, children


@pytest.mark.parametrize(
    ("where", "sets"),
    [
        ("feature_dim", ["model.encoder=reads_fork"]),  # read while the model is built, outside the factory
        ("last_stats", ["loss.name=forking"]),  # read by the trainer after each step
        ("loss_forward", ["loss.name=forking"]),  # the child hangs inside the loss, never leaving it
    ],
)
def test_attack_round_26_a_forked_child_never_trains_beside_the_command_or_outlives_it(tmp_path, dataset, where, sets):
    """F3-F5: a fork in an encoder's feature_dim property made a second trainer (exit 2 on the lock);
    one in a loss's last_stats left a child that never ended; one whose child hung in the loss kept
    a piped ``train`` from ever ending. Each child now ends in the plugin's code, or with the command."""
    run = tmp_path / "run"
    code, _, stderr, children = _run_forking(tmp_path, where, _train_args(dataset, run, Path(), *sets)[2:])
    assert code == 0, stderr
    assert len(children) == 1, f"the plugin forked once at {where}: {children}"
    assert "forked by a plugin" not in stderr and "lock" not in stderr, stderr
    assert [json.loads(line)["epoch"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1]
    assert _gone(children[0]), f"the child {children[0]} forked at {where} outlived the command"
    if where != "loss_forward":  # that child never leaves the loss: it ends with the command
        state = (tmp_path / f"children_{where}_at_epoch_end").read_text().split()
        assert state == [str(children[0]), "ended"], f"the child forked at {where} ran on beside the trainer: {state}"


def _pixel_index(tmp_path: Path, dataset: Path) -> Path:
    """An index of ``dataset`` over seeded random features (no model: the audit's checks are the test)."""
    import numpy as np

    from receipt_embed.data.dataset_dir import load_dataset_dir

    rows = len(load_dataset_dir(dataset))
    np.save(tmp_path / "features.npy", np.random.default_rng(0).normal(size=(rows, 16)).astype(np.float32))
    index = tmp_path / "index"
    result = subprocess.run(
        _program(
            [
                "index",
                "--embeddings",
                str(tmp_path / "features.npy"),
                "--manifest",
                str(dataset),
                "--out",
                str(index),
                "-q",
            ]
        ),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return index


def test_attack_round_26_f1_f2_an_audit_check_that_forks_or_exits(tmp_path, dataset):
    """F1: a check that forked had its child run the rest of audit-shortcuts as a second writer; F2:
    one that called os._exit(0) ended the audit silently with exit 0, its lock file left behind. A
    plugin's check now runs as its hooks do: the child ends where the check returns, and os._exit is
    the check's failure, reported, the audit written without it."""
    index = _pixel_index(tmp_path, dataset)
    report = tmp_path / "report"
    code, stdout, stderr, children = _run_forking(
        tmp_path, "audit_check", ["audit-shortcuts", str(index), "--attribute", "device", "--out", str(report)]
    )
    assert code == 0, stderr
    assert len(children) == 1 and _gone(children[0]), children
    assert "forked by a plugin" not in stderr and "lock" not in stderr, stderr
    assert stdout.count(str(report / "audit.html")) == 1, f"the rest of the audit ran once: {stdout}"
    assert json.loads((report / "audit.json").read_text())["checks"]["forks"]["figures"] == {"items": 180}

    code, stdout, stderr, _ = _run_forking(
        tmp_path,
        "audit_exit",
        ["audit-shortcuts", str(index), "--attribute", "device", "--out", str(report), "--force"],
    )
    assert code == 0, stderr
    assert "audit check 'exits' (plugin 'forks_at') failed: it called os._exit(0); the audit goes on without it" in (
        stderr
    )
    assert json.loads((report / "audit.json").read_text())["checks"]["exits"]["error"] == "it called os._exit(0)"
    assert not (tmp_path / ".report.lock").exists()


EXITS_IN_GETATTR = "import os\n\ndef __getattr__(name):\n    os._exit(0)\n"
VERSION_STR_RAISES = (
    "class Version:\n    def __str__(self):\n        raise RuntimeError('no str')\n\n__version__ = Version()\n"
)


@pytest.mark.parametrize("source", [EXITS_IN_GETATTR, "def __getattr__(name):\n    raise SystemExit(3)\n"])
def test_attack_round_27_f3_a_plugin_module_getattr_is_never_asked_by_the_loader(cli, tmp_path, source):
    """Attack round 27 F3: reading a folder plugin's __version__ called its module-level __getattr__
    outside the watch: os._exit(0) there ended `train` with exit 0 and nothing written, SystemExit(3)
    with exit 3. The version is read from the module's dict: the plugin loads, without a version."""
    folder = _folder(tmp_path / "plugins", {"odd.py": source})
    result = cli("--plugins-dir", folder, "plugins", "--json")
    assert result.returncode == 0, result.stderr
    listed = json.loads(result.stdout)
    assert listed["failed"] == []
    assert [(p["name"], p["version"]) for p in listed["plugins"] if p["source"] == "folder"] == [("odd", None)]


def test_attack_round_27_f3_a_version_whose_str_raises_is_the_plugin_failing_to_load(cli, tmp_path):
    """Attack round 27 F3: a __version__ whose __str__ raised made `receipt-embed plugins` an
    internal error naming no plugin; it is that plugin's load failure, and the others still load."""
    folder = _folder(tmp_path / "plugins", {"odd.py": VERSION_STR_RAISES})
    result = cli("--plugins-dir", folder, "plugins", "--json")
    assert result.returncode == 0, result.stderr
    listed = json.loads(result.stdout)
    assert listed["failed"] == [{"name": "odd", "error": "RuntimeError: no str"}]
    assert "plugin 'odd' failed to load and was skipped: RuntimeError: no str" in result.stderr
    assert any(p["name"] == "builtin.losses" for p in listed["plugins"])
