"""Training runs on the bundled samples at a tiny input size: outputs, resume, faults."""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import builtin_registry

from receipt_embed.config import config_with, load_config
from receipt_embed.ingest import ingest
from receipt_embed.plugin_manager import PluginLoader
from receipt_embed.training.checkpoint import CheckpointError, load_checkpoint
from receipt_embed.training.trainer import TrainingDiverged, train

REPO = Path(__file__).resolve().parents[1]
TINY = [
    "data.image_size=[64,32]",
    "train.batch_size=8",
    "train.eval_batch_size=64",
    "train.bn_recalibrate=32",
    "model.head_hidden=64",
    "model.head_dim=32",
    "train.num_workers=0",
    "train.precision=fp32",  # see TINY_TRAINING in conftest.py: bf16 at 64 x 32 gives NaN gradients now and then
]
TIMING_KEYS = {"views_per_s", "train_seconds"}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ds")
    ingest(REPO / "data_samples", out, load_config().ingest)
    return out


def _metrics(run: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if k not in TIMING_KEYS} for line in lines]


def test_run_dir_contents(dataset, tmp_path):
    config = load_config(overrides=[*TINY, "train.epochs=2"])
    result = train(config, dataset, tmp_path / "run", builtin_registry(), progress=False, log=lambda m: None)
    run = tmp_path / "run"
    assert load_config(run / "config.yaml") == config
    lines = _metrics(run)
    assert [line["epoch"] for line in lines] == [1, 2]
    line = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert line["steps"] == 6 and line["views_per_s"] > 0 and line["lr"] > 0
    assert line["sampler"] == {"tail_dropped": 0, "tail_filled": 0, "extra_views": 0}  # pk: 3 captures of each
    for features in ("backbone", "head"):
        assert 0.0 <= line["val"][features]["recall_at_1"] <= line["val"][features]["recall_at_5"] <= 1.0
        diag = line["val"]["diagnostics"][features]
        assert {"alignment", "uniformity", "effective_rank", "min_dim_std", "mean_dim_std", "similarity"} <= set(diag)
        assert set(diag["similarity"]) == {"positive", "negative"}
    last = load_checkpoint(run / "checkpoints" / "last.pt")
    best = load_checkpoint(run / "checkpoints" / "best.pt")
    assert last["epoch"] == 2 and best["epoch"] == result.best_epoch
    assert {"model", "optimizer", "scheduler", "loss", "torch_rng", "config", "sums", "step"} <= set(last)

    # the embedding path used by index/search reproduces the val figures of the best epoch
    from receipt_embed.data.dataset_dir import load_dataset_dir, select_split
    from receipt_embed.embedding import embed_paths, load_model
    from receipt_embed.evaluation.retrieval import retrieval_metrics

    loaded = load_model(run / "checkpoints" / "best.pt", builtin_registry())
    assert bool(loaded.model.whitening.fitted)  # model.whiten: fitted after the last epoch
    loaded.model.whitening.reset()  # the epochs were chosen on the features before whitening
    val = select_split(load_dataset_dir(dataset), "val")
    best_line = lines[result.best_epoch - 1]["val"]
    for features in ("backbone", "head"):
        x = embed_paths(loaded, val.paths, features=features, batch_size=7)
        assert x.shape == (len(val), loaded.model.encoder.feature_dim if features == "backbone" else 32)
        recall = retrieval_metrics(x, val.labels, ks=(1, 5), with_map=False)
        assert recall["recall_at_1"] == best_line[features]["recall_at_1"]
        assert recall["recall_at_5"] == best_line[features]["recall_at_5"]


def _train_cmd(dataset, run, *extra):
    sets = [item for key in [*TINY, "train.deterministic=true", *extra] for item in ("--set", key)]
    return [sys.executable, "-m", "receipt_embed", "train", "--data", str(dataset), "--out", str(run), "-q", *sets]


def _env():
    return {k: v for k, v in os.environ.items() if not k.startswith("RECEIPT_EMBED_")}


def test_resume_after_sigkill_reproduces_straight_run(dataset, tmp_path):
    straight = tmp_path / "straight"
    subprocess.run(_train_cmd(dataset, straight, "train.epochs=6"), check=True, env=_env(), capture_output=True)
    killed = tmp_path / "killed"
    process = subprocess.Popen(
        _train_cmd(dataset, killed, "train.epochs=6"), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    metrics = killed / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and process.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert len(metrics.read_text().splitlines()) < 6, "the run finished before it could be killed"
    resumed = subprocess.run(
        _train_cmd(dataset, killed, "train.epochs=6") + ["--resume"], env=_env(), capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming" in resumed.stderr
    assert _metrics(killed) == _metrics(straight)
    a = load_checkpoint(killed / "checkpoints" / "last.pt")["model"]
    b = load_checkpoint(straight / "checkpoints" / "last.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sigterm_saves_and_resume_finishes_identically(dataset, tmp_path):
    straight = tmp_path / "straight"
    subprocess.run(_train_cmd(dataset, straight, "train.epochs=8"), check=True, env=_env(), capture_output=True)
    run = tmp_path / "run"
    process = subprocess.Popen(
        _train_cmd(dataset, run, "train.epochs=8"),
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and process.poll() is None and not (metrics.exists() and metrics.read_text()):
        time.sleep(0.005)
    process.send_signal(signal.SIGTERM)  # during epoch 2 (or its evaluation)
    _, stderr = process.communicate(timeout=240)
    assert process.returncode == 143, stderr  # 128 + SIGTERM
    assert "SIGTERM received: saved" in stderr and "Traceback" not in stderr
    state = load_checkpoint(run / "checkpoints" / "last.pt")
    assert (state["epoch"], state["step"]) < (8, 0)
    # the run's config.yaml and its dataset (data.json) are reused: no --set, no --data needed
    resumed = subprocess.run(
        [sys.executable, "-m", "receipt_embed", "train", "--out", str(run), "-q", "--resume"],
        env=_env(),
        capture_output=True,
        text=True,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "ingesting" not in resumed.stderr and json.loads((run / "data.json").read_text())["data_dir"] == str(dataset)
    assert _metrics(run) == _metrics(straight)
    # a --set that changes the run is still refused, naming the key
    changed = subprocess.run(
        _train_cmd(dataset, run, "train.epochs=9", "train.lr=0.5") + ["--resume"],
        env=_env(),
        capture_output=True,
        text=True,
    )
    assert changed.returncode == 2 and "train.lr: checkpoint 0.001, now 0.5" in changed.stderr


NAN_PLUGIN = """
import torch
from receipt_embed.hookspecs import hookimpl

class NanAfter(torch.nn.Module):
    def __init__(self, temperature, after=7):
        super().__init__()
        self.calls, self.after = 0, after
    def forward(self, embeddings, labels):
        self.calls += 1
        value = embeddings.pow(2).mean()
        return value * float("nan") if self.calls > self.after else value

@hookimpl
def register_losses(register):
    register("nan_after", NanAfter)
"""


def plugins_with(tmp_path: Path, name: str, text: str) -> PluginLoader:
    """The built-ins and one plugin file ``tmp_path/plugins/NAME`` holding ``text``, loaded strictly
    (a plugin that fails to load fails the test instead of being skipped with a warning)."""
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / name).write_text(text)
    loader = PluginLoader(strict=True)
    loader.load_builtins()
    loader.load_folder(tmp_path / "plugins", required=True)
    loader.collect_components()
    return loader


def nan_loss_plugins(tmp_path: Path) -> PluginLoader:
    """The built-ins and ``NAN_PLUGIN`` (loss ``nan_after``) from ``tmp_path/plugins``, loaded."""
    return plugins_with(tmp_path, "nan_loss.py", NAN_PLUGIN)


def test_nan_loss_stops_with_context_and_keeps_last_checkpoint(dataset, tmp_path):
    loader = nan_loss_plugins(tmp_path)
    config = load_config(overrides=[*TINY, "train.epochs=3", "loss.name=nan_after", "loss.temperature=0.07"])
    with pytest.raises(
        TrainingDiverged, match=r"loss became nan at epoch 2, step 2 \(loss nan_after, temperature 0.07\)"
    ):
        train(config, dataset, tmp_path / "run", loader.registry, progress=False, log=lambda m: None)
    state = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    assert state["epoch"] == 1 and state["step"] == 0


def test_attack_round_22_mb6_a_nan_loss_before_any_update_blames_the_loss_not_the_learning_rate(dataset, tmp_path):
    loader = nan_loss_plugins(tmp_path)
    config = load_config(overrides=[*TINY, "loss.name=nan_after", "loss.temperature=0.07", "loss.params={after: 0}"])
    with pytest.raises(TrainingDiverged) as stopped:
        train(config, dataset, tmp_path / "run", loader.registry, progress=False, log=lambda m: None)
    assert str(stopped.value) == (
        "loss nan_after returned nan at epoch 1, step 1, before any update, from finite embeddings of the "
        "untrained model: the loss or its settings are at fault, not the learning rate (temperature 0.07, "
        "loss.params {'after': 0}); no checkpoint was written yet (it diverged in the first epoch)"
    )
    assert "train.lr" not in str(stopped.value)


def test_a_nan_loss_at_a_high_temperature_does_not_advise_a_higher_one(dataset, tmp_path):
    """Attack round 16 (F13): the NaN stop always advised "a higher loss.temperature", even at a
    temperature of 1e300; the advice now fits the run's values."""
    loader = nan_loss_plugins(tmp_path)
    config = load_config(
        overrides=[*TINY, "train.epochs=1", "loss.name=nan_after", "loss.params={after: 1}", "loss.temperature=50"]
    )
    with pytest.raises(TrainingDiverged) as info:
        train(config, dataset, tmp_path / "run", loader.registry, progress=False, log=lambda m: None)
    assert str(info.value).endswith("Try a lower train.lr (now 0.001).") and "higher" not in str(info.value)
    with pytest.raises(TrainingDiverged, match=r"or a higher loss.temperature \(now 0.07\) for a temperature"):
        train(
            config_with(config, ["loss.temperature=0.07", "train.grad_clip=0"]),
            dataset,
            tmp_path / "run2",
            loader.registry,
            progress=False,
            log=lambda m: None,
        )


@pytest.mark.parametrize(
    "batch_size, message",
    [
        ("8", "the embeddings became NaN at epoch 1, step 2, before the loss"),  # the update of step 1
        ("48", "the weight encoder."),  # one step an epoch: the weights are NaN before evaluation
    ],
)
def test_a_run_that_diverges_into_nan_embeddings_stops_like_a_nan_loss(cli, dataset, tmp_path, batch_size, message):
    """Attack round 16 (F13): `train.lr=1e300` ended as bad input, "embeddings contain NaN in 24 of 24
    rows" (exit 2), not through the divergence stop (exit 1, the documented code for a NaN loss)."""
    sets = [item for key in [*TINY, "train.epochs=1", "train.lr=1e300"] for item in ("--set", key)]
    result = cli(
        "train", "--data", dataset, "--out", tmp_path / "run", *sets, "--set", f"train.batch_size={batch_size}"
    )
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith(f"Error: {message}"), result.stderr
    assert "no checkpoint was written yet" in lines[-1] and lines[-1].endswith("Try a lower train.lr (now 1e+300).")


def test_checkpoint_errors(dataset, tmp_path):
    registry = builtin_registry()
    config = load_config(overrides=[*TINY, "train.epochs=1"])
    train(config, dataset, tmp_path / "run", registry, progress=False, log=lambda m: None)
    with pytest.raises(CheckpointError, match="already holds a run"):
        train(config, dataset, tmp_path / "run", registry, progress=False, log=lambda m: None)
    other = load_config(overrides=[*TINY, "train.epochs=2", "model.head_dim=16"])
    with pytest.raises(CheckpointError, match=r"config differs \(model.head_dim: checkpoint 32, now 16\)"):
        train(other, dataset, tmp_path / "run", registry, resume=True, progress=False, log=lambda m: None)
    last = tmp_path / "run" / "checkpoints" / "last.pt"
    last.write_bytes(last.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        load_checkpoint(last)
    with pytest.raises(CheckpointError, match="checkpoint not found"):
        load_checkpoint(tmp_path / "nope.pt")
    last.unlink()  # attack round 11: a run stopped before its first checkpoint said only "not found"
    (tmp_path / "run" / "checkpoints" / "best.pt").unlink()
    with pytest.raises(CheckpointError) as info:
        train(config, dataset, tmp_path / "run", registry, resume=True, progress=False, log=lambda m: None)
    assert str(info.value) == (
        f"checkpoint not found: {last}; the run was stopped before it saved one, so there is nothing to resume: "
        f"start it again with `receipt-embed train --data DATASET_DIR --out {tmp_path / 'run'} --force`"
    )


def test_cli_train_errors(cli, dataset, tmp_path):
    result = cli("train", "--data", dataset, "--out", tmp_path / "r", "--set", "loss.name=ntxnet")
    assert result.returncode == 2
    assert "unknown loss 'ntxnet'" in result.stderr and "Did you mean 'ntxent'?" in result.stderr


@pytest.mark.parametrize(
    "sets, message",
    [
        (
            ["sampler.name=pk", "sampler.params={k: 100000000}"],
            "Error: sampler 'pk' (from plugin 'builtin.samplers'): sampler.params.k must be at most 64 views per "
            "identity, got 100000000",
        ),
        (
            ["loss.name=moco", "loss.params={queue_size: 1000000000000}"],
            "Error: loss 'moco' (from plugin 'builtin.losses'): loss.params.queue_size must be at most 1048576 keys, "
            "got 1000000000000",
        ),
    ],
)
def test_a_sampler_k_or_moco_queue_beyond_memory_is_bad_input_naming_the_key(cli, dataset, tmp_path, sets, message):
    """Attack round 17 G1: these took all the machine's memory, then advised data.image_size and
    --batch-size; now one line naming the key, its value and the limit (exit 2), and no run dir."""
    result = cli("train", "--data", dataset, "--out", tmp_path / "run", *[a for s in sets for a in ("--set", s)])
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [message]
    assert not (tmp_path / "run").exists()


def test_moco_keeps_momentum_encoder_and_queue_in_checkpoint(dataset, tmp_path):
    config = load_config(
        overrides=[
            *TINY,
            "train.epochs=1",
            "loss.name=moco",
            "loss.temperature=0.2",
            "loss.params={queue_size: 64, dim: 32}",
            "train.momentum=0.9",
        ]
    )
    train(config, dataset, tmp_path / "run", builtin_registry(), progress=False, log=lambda m: None)
    state = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    assert int(state["loss"]["queue_count"]) == 64  # 6 steps x 8 keys, plus the random start
    assert set(state["momentum_model"]) == set(state["model"])
    assert not torch.equal(state["momentum_model"]["head.layers.3.weight"], state["model"]["head.layers.3.weight"])


@pytest.mark.slow  # long end-to-end run (tens of seconds): `pytest -m slow` runs it
def test_temperature_sweep_picks_by_val_recall(cli, dataset, tmp_path):
    sets = [item for key in [*TINY, "train.epochs=1"] for item in ("--set", key)]
    result = cli(
        "train", "--data", dataset, "--out", tmp_path / "sweep", "-q", *sets, "--sweep", "loss.temperature=0.1,0.3"
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert [run["value"] for run in summary["runs"]] == ["0.1", "0.3"]
    for run in summary["runs"]:
        line = json.loads(Path(run["run_dir"], "metrics.jsonl").read_text().splitlines()[-1])
        assert run["best_recall_at_1"] == line["val"]["backbone"]["recall_at_1"]  # train.select_on
        assert load_config(Path(run["run_dir"]) / "config.yaml").loss.temperature == float(run["value"])
    assert summary["best"]["best_recall_at_1"] == max(r["best_recall_at_1"] for r in summary["runs"])
    assert "<- selected" in result.stdout and "losses at different values are not compared" in result.stdout
    bad = cli("train", "--data", dataset, "--out", tmp_path / "bad", "--sweep", "loss.temperature=0.1")
    assert bad.returncode == 2 and "--sweep expects key=value1,value2" in bad.stderr
    # attack round 14: an existing run of a later value was refused only after the earlier values trained
    record = (tmp_path / "sweep" / "sweep.json").read_bytes()
    again = cli(
        "train", "--data", dataset, "--out", tmp_path / "sweep", "-q", *sets, "--sweep", "loss.temperature=0.5,0.3"
    )
    assert (
        again.returncode == 2 and f"{tmp_path / 'sweep' / 'loss.temperature=0.3'} already holds a run" in again.stderr
    )
    assert "already holds a run of this sweep: pass --force to sweep every value anew" in again.stderr  # not --resume
    assert not (tmp_path / "sweep" / "loss.temperature=0.5").exists()
    assert (tmp_path / "sweep" / "sweep.json").read_bytes() == record
    # attack round 27 F11: a sweep of another key into the same --out replaced sweep.json, the first's record
    other = cli("train", "--data", dataset, "--out", tmp_path / "sweep", "-q", *sets, "--sweep", "train.seed=3,4")
    assert (
        other.returncode == 2
        and (
            f"{tmp_path / 'sweep'} already holds the record of a sweep ({tmp_path / 'sweep' / 'sweep.json'}): pass "
            "--force to replace it"
        )
        in other.stderr
    )
    assert not (tmp_path / "sweep" / "train.seed=3").exists()
    assert (tmp_path / "sweep" / "sweep.json").read_bytes() == record
    # and a sweep dir given to a plain train is named as one, not as a folder of someone else's files
    plain = cli("train", "--data", dataset, "--out", tmp_path / "sweep", "-q", *sets, "--force")
    assert plain.returncode == 2 and "is a sweep dir (a run dir per value, KEY=VALUE), not a run dir" in plain.stderr


def test_a_second_sweep_equal_values_and_list_values_are_refused_before_anything_trains(cli, dataset, tmp_path):
    """Attack round 16 (F10): a second --sweep silently replaced the first (only train.lr was swept,
    the seed sweep vanished); `loss.temperature=0.1,0.10` trained the same value twice although
    repeated values are refused; a list value failed with a parse error on a fragment ('[64')."""
    sets = [item for key in [*TINY, "train.epochs=1"] for item in ("--set", key)]
    cases = {
        ("--sweep", "train.seed=1,2", "--sweep", "train.lr=0.1,0.2"): (
            "--sweep is given 2 times ('train.seed=1,2', 'train.lr=0.1,0.2'); a sweep trains once per value of "
            "one key: give one --sweep"
        ),
        ("--sweep", "loss.temperature=0.1,0.10"): (
            "--sweep values '0.1' and '0.10' of loss.temperature are the same value (0.1); give each value once"
        ),
        ("--sweep", "train.lr=1,2,1.0"): "--sweep values '1' and '1.0' of train.lr are the same value (1.0)",
        ("--sweep", "data.image_size=[64,32],[32,16]"): (
            "--sweep 'data.image_size=[64,32],[32,16]': list and mapping values cannot be swept (values are split "
            "at commas); sweep a number or a name, or train once per value with --set"
        ),
    }
    for args, message in cases.items():
        result = cli("train", "--data", dataset, "--out", tmp_path / "sweep", "-q", *sets, *args)
        assert result.returncode == 2, result.stdout + result.stderr
        assert result.stderr.startswith(f"Error: {message}") and len(result.stderr.splitlines()) == 1, result.stderr
        assert not (tmp_path / "sweep").exists()


def test_a_sweep_over_a_key_no_value_can_change_is_refused_before_anything_trains(cli, dataset, tmp_path):
    """Attack round 19 J6: `--sweep plugins.dir=A,B` trained every value with the plugins loaded once up
    front, recorded each value's folder in its run's config.yaml (a later --resume would import it) and
    selected a winner. Keys the runs share, and a value naming a missing component, are refused first."""
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "evil.py").write_text(f"open({str(tmp_path / 'PWNED')!r}, 'w').close()\n")
    sets = [item for key in [*TINY, "train.epochs=1"] for item in ("--set", key)]
    shared = (
        "plugins are loaded once, before the first value trains, so every run would use the same ones; give the "
        "folder with --set or --plugins-dir and sweep another key"
    )
    cases = {
        f"plugins.dir={tmp_path},{evil}": f"plugins.dir cannot differ between the runs of a sweep: {shared}",
        "plugins.strict=true,false": f"plugins.strict cannot differ between the runs of a sweep: {shared}",
        "ingest.seed=1,2": "ingest.seed cannot differ between the runs of a sweep: train uses a dataset split once",
        "model.encoder=receipt_cnn,nope": "unknown encoder 'nope'. Available: ",
    }
    for spec, message in cases.items():
        result = cli("train", "--data", dataset, "--out", tmp_path / "sweep", "-q", *sets, "--sweep", spec)
        assert result.returncode == 2, result.stdout + result.stderr
        where = spec if "encoder" not in spec else "model.encoder=nope"
        assert result.stderr.startswith(f"Error: --sweep '{where}': {message}"), result.stderr
        assert len(result.stderr.splitlines()) == 1, result.stderr
        assert not (tmp_path / "sweep").exists() and not (tmp_path / "PWNED").exists()


def test_bf16_autocast_trains_with_float32_weights(dataset, tmp_path):
    # stem 2 at this tiny size: with the default stem 4 a 64 x 32 page ends in 1 x 1 maps, whose bf16
    # convolution backward on this CPU gives NaN gradients for a finite loss in 1 to 3 of 18 steps
    # (measured over seeds 1-6; none at the default 256 x 128), now and then 5 in a row: "diverged"
    config = load_config(
        overrides=[*TINY, "train.epochs=1", "train.precision=bf16", "model.params={stem: 2}", "model.pretrained=none"]
    )
    result = train(config, dataset, tmp_path / "run", builtin_registry(), progress=False, log=lambda m: None)
    assert result.metrics[0]["loss"] == result.metrics[0]["loss"]  # finite, not NaN
    state = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    assert all(t.dtype == torch.float32 for k, t in state["model"].items() if t.is_floating_point())


def _cpuinfo_has_bf16() -> bool | None:
    """The kernel's own CPU flags (an independent reference for torch's probe), None off Linux."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    flags = set(" ".join(line for line in text.splitlines() if line.startswith("flags")).split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def test_precision_auto_is_bf16_exactly_where_the_cpu_has_native_bf16():
    from receipt_embed.training.precision import cpu_has_native_bf16, resolve_precision

    assert resolve_precision("auto", native_bf16=True) == "bf16"
    assert resolve_precision("auto", native_bf16=False) == "fp32"
    for setting in ("fp32", "bf16"):  # a setting is kept whatever the CPU
        assert resolve_precision(setting, native_bf16=True) == resolve_precision(setting, native_bf16=False) == setting
    assert resolve_precision("auto") == ("bf16" if cpu_has_native_bf16() else "fp32")
    reference = _cpuinfo_has_bf16()
    if reference is not None:
        assert cpu_has_native_bf16() == reference, "torch's probe disagrees with /proc/cpuinfo's flags"
    assert load_config().train.precision == "auto", "the default"


def test_a_run_says_which_precision_auto_chose_once(dataset, tmp_path):
    from receipt_embed.training.precision import cpu_has_native_bf16
    from receipt_embed.training.trainer import Trainer

    expected = "bf16" if cpu_has_native_bf16() else "fp32"
    said = []
    config = load_config(
        overrides=[*TINY, "train.epochs=1", "train.precision=auto", "model.params={stem: 2}", "model.pretrained=none"]
    )
    trainer = Trainer(config, dataset, tmp_path / "run", builtin_registry(), progress=False, log=said.append)
    assert trainer.precision == expected
    trainer.run()
    lines = [m for m in said if m.startswith("train.precision auto:")]
    assert lines == [lines[0]] and lines[0].startswith(f"train.precision auto: {expected}, as this CPU has "), said
    said.clear()
    fixed = load_config(overrides=[*TINY, "train.epochs=1", "train.precision=fp32"])
    Trainer(fixed, dataset, tmp_path / "run2", builtin_registry(), progress=False, log=said.append).run()
    assert not [m for m in said if m.startswith("train.precision")], "a precision set by hand is not explained"
    with pytest.raises(Exception, match="train.precision"):
        load_config(overrides=["train.precision=fp16"])


def test_schedule_replans_when_resumed_with_more_epochs():
    """Warmup then cosine to 0; a resumed run with a new train.epochs anneals to 0 at its new end."""
    import math

    from receipt_embed.training.schedule import lr_schedule as _scheduler

    def lrs(epochs, start_state=None, steps=None):
        param = torch.nn.Parameter(torch.zeros(1))
        optimizer = torch.optim.AdamW([param], lr=1.0)
        scheduler = _scheduler(
            optimizer, 10, epochs, load_config(overrides=[f"train.epochs={epochs}", "train.warmup_epochs=1"])
        )
        if start_state is not None:
            optimizer.load_state_dict(start_state[0])
            scheduler.load_state_dict(start_state[1])
        out = []
        for _ in range(steps if steps is not None else 10 * epochs):
            optimizer.step()
            scheduler.step()
            out.append(optimizer.param_groups[0]["lr"])
        return out, (optimizer.state_dict(), scheduler.state_dict())

    straight, _ = lrs(4)
    assert straight[4] == pytest.approx(0.01 + 0.99 * 5 / 10)  # warmup
    assert straight[-1] == pytest.approx(0.0, abs=1e-12)
    assert straight[19] == pytest.approx(0.5 * (1 + math.cos(math.pi * 10 / 30)))
    first, state = lrs(2)
    resumed, _ = lrs(4, state, steps=20)
    assert resumed[-1] == pytest.approx(0.0, abs=1e-12)
    assert all(b <= a + 1e-12 for a, b in zip(resumed, resumed[1:]))  # no climbing back up


def _train_epochs(data: Path, run: Path, epochs: int, resume: bool = False) -> None:
    """``train`` of the tiny config for ``epochs`` epochs, quietly."""
    config = load_config(overrides=[*TINY, f"train.epochs={epochs}"])
    train(config, data, run, builtin_registry(), resume=resume, progress=False, log=lambda m: None)


def test_resume_refuses_another_dataset(dataset, tmp_path):
    _train_epochs(dataset, tmp_path / "run", 1)
    other = tmp_path / "other"
    ingest(REPO / "data_samples", other, load_config(overrides=["ingest.seed=7"]).ingest)
    with pytest.raises(
        CheckpointError,
        match=rf"cannot resume .* the run was trained on {dataset}, whose manifest "
        rf"differs; resume with --data {dataset}",
    ):
        _train_epochs(other, tmp_path / "run", 2, resume=True)


def test_fresh_run_rewrites_data_json_and_a_missing_dataset_is_named(dataset, tmp_path):
    import shutil

    run = tmp_path / "run"
    (run).mkdir()
    (run / "data.json").write_text(
        '{"data_dir": "/somewhere/else", "manifest_sha256": "0"}'
    )  # leftovers, no checkpoint
    copy = tmp_path / "copy"
    shutil.copytree(dataset, copy)
    _train_epochs(copy, run, 1)
    assert json.loads((run / "data.json").read_text())["data_dir"] == str(copy)
    shutil.rmtree(copy)
    with pytest.raises(CheckpointError, match=rf"{copy} holds no manifest.jsonl \(moved or deleted\?\)"):
        _train_epochs(copy, run, 2, resume=True)


def test_resume_on_a_changed_manifest_does_not_advise_the_same_path(tmp_path):
    """F12: when the dataset dir given is the one the run recorded but its manifest changed, the advice
    is not the circular "resume with --data <the path it refused>"."""
    from receipt_embed.training.checkpoint import CheckpointError
    from receipt_embed.training.resume import check_same_dataset, dataset_record

    data = tmp_path / "ds"
    data.mkdir()
    (data / "manifest.jsonl").write_text('{"path": "a.jpg"}\n')
    run = tmp_path / "run"
    run.mkdir()
    (run / "data.json").write_text(json.dumps({"data_dir": str(data.resolve()), "manifest_sha256": "0" * 64}))
    with pytest.raises(CheckpointError) as caught:
        check_same_dataset(run, dataset_record(data))
    message = str(caught.value)
    assert f"the manifest of {data.resolve()} changed" in message and "--data" not in message, message


@pytest.fixture(scope="module")
def one_epoch_run(dataset, tmp_path_factory) -> Path:
    """A run dir of one tiny epoch; tests copy it before changing it."""
    run = tmp_path_factory.mktemp("one_epoch") / "run"
    _train_epochs(dataset, run, 1)
    return run


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_resume_refuses_a_data_json_naming_another_dataset_than_the_checkpoint(cli, dataset, one_epoch_run, tmp_path):
    """Attack round 18 H5: data.json swapped for one naming another dataset (its checksum right) took
    `train --resume` onto that dataset, one run trained on two; the checkpoint now records its
    dataset and the resume is refused in one line naming both, the run left as it was."""
    import shutil

    from test_overwrite import tree_digest

    run = tmp_path / "run"
    shutil.copytree(one_epoch_run, run)
    last = run / "checkpoints" / "last.pt"
    state = load_checkpoint(last)
    trained_sha = _sha256(dataset / "manifest.jsonl")
    assert state["data_dir"] == str(dataset.resolve()) and state["manifest_sha256"] == trained_sha
    other = tmp_path / "other"
    other.mkdir()
    (other / "manifest.jsonl").write_text('{"path": "a.jpg"}\n')
    other_sha = _sha256(other / "manifest.jsonl")
    (run / "data.json").write_text(json.dumps({"data_dir": str(other), "manifest_sha256": other_sha}))
    before = tree_digest(run)
    result = cli("train", "--out", run, "--resume", "-q", "--set", "train.epochs=2")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"Error: cannot resume {run}: {run / 'data.json'} names {other} (manifest sha256 {other_sha[:12]}...), "
        f"but {last} was trained on {dataset.resolve()} (manifest sha256 {trained_sha[:12]}...); put back the "
        "run's own data.json, or start a new run with --force"
    ]
    assert tree_digest(run) == before


def test_a_checkpoint_without_a_dataset_record_resumes_against_data_json_as_before(tmp_path):
    """Attack round 18 H5: checkpoints written before they recorded their dataset are compared with
    data.json alone (as before); a record of the wrong type is named."""
    from receipt_embed.training.resume import check_same_dataset, dataset_record

    data = tmp_path / "ds"
    data.mkdir()
    (data / "manifest.jsonl").write_text('{"path": "a.jpg"}\n')
    run = tmp_path / "run"
    run.mkdir()
    (run / "data.json").write_text(json.dumps(dataset_record(data)))
    last = run / "checkpoints" / "last.pt"
    check_same_dataset(run, dataset_record(data), {"epoch": 1}, last)  # an older checkpoint: data.json agrees
    trained = {"data_dir": "/elsewhere", "manifest_sha256": "0" * 64}
    with pytest.raises(
        CheckpointError, match=rf"but {last} was trained on /elsewhere \(manifest sha256 0{{12}}\.\.\.\)"
    ):
        check_same_dataset(run, dataset_record(data), trained, last)
    with pytest.raises(CheckpointError, match=rf"^{last}: data_dir is 7; --resume needs a dataset dir path$"):
        check_same_dataset(run, dataset_record(data), {"data_dir": 7, "manifest_sha256": "0" * 64}, last)


def test_resume_without_the_run_config_names_the_missing_file(cli, one_epoch_run, tmp_path):
    """Attack round 18 H6: with RUN_DIR/config.yaml deleted, --resume compared the defaults with the
    checkpoint and said "the config differs (data.image_size ...)"; now it names the missing file."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(one_epoch_run, run)
    (run / "config.yaml").unlink()
    result = cli("train", "--out", run, "--resume", "-q", "--set", "train.epochs=2")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"Error: cannot resume {run}: {run / 'config.yaml'} is missing, so the run's settings are unknown; put it "
        "back, or pass --config FILE with the settings the run was trained with (they are checked against "
        f"{run / 'checkpoints' / 'last.pt'})"
    ]
    assert not (run / "config.yaml").exists() and [line["epoch"] for line in _metrics(run)] == [1]


def test_the_schedule_runs_over_the_time_budget_when_that_ends_first():
    """The cosine position is the larger of the steps' and the budget's share: half the budget
    spent after a tenth of the steps is the rate of half the way; a spent budget is zero."""
    import math

    from receipt_embed.training.schedule import lr_schedule

    spent = {"share": 0.0}
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=1.0)
    config = load_config(overrides=["train.epochs=10", "train.warmup_epochs=0", "train.max_minutes=1"])
    scheduler = lr_schedule(optimizer, 10, config.train.epochs, config, lambda: spent["share"])
    rates = []
    for share in (0.0, 0.5, 0.5, 0.999, 1.0):
        spent["share"] = share
        optimizer.step()
        scheduler.step()
        rates.append(optimizer.param_groups[0]["lr"])
    assert rates[0] == pytest.approx(0.5 * (1 + math.cos(math.pi * 1 / 100)))  # the steps lead
    assert rates[1] == rates[2] == pytest.approx(0.5)  # the time leads
    assert rates[3] < 1e-5 and rates[4] == 0.0


def test_a_time_budget_stops_training_annealed_and_resume_carries_the_time_spent(dataset, tmp_path):
    """Tried as a new user would: a long recipe cut by the budget ends at a rate near zero, with
    best.pt chosen; --resume of a spent run trains nothing until the budget is raised."""
    from receipt_embed.fileio import read_jsonl

    budget = 0.1  # minutes: some steps, far fewer than 200 epochs
    config = load_config(overrides=[*TINY, "train.epochs=200", f"train.max_minutes={budget}"])
    logged = []
    started = time.perf_counter()
    train(config, dataset, tmp_path / "run", builtin_registry(), progress=False, log=logged.append)
    took = time.perf_counter() - started
    lines = list(read_jsonl(tmp_path / "run" / "metrics.jsonl"))
    assert lines[-1]["budget_spent"] == 1.0 and all(line["budget_spent"] < 1.0 for line in lines[:-1])
    assert lines[-1]["lr"] < 0.1 * config.train.lr, "annealed at the end, not near the peak"
    assert len(lines) < 200 and (tmp_path / "run" / "checkpoints" / "best.pt").exists()
    said_budget = [
        i for i, m in enumerate(logged) if m.startswith(f"time budget of {budget:g} min (train.max_minutes)")
    ]
    said_whitened = [i for i, m in enumerate(logged) if m.startswith("whitened the backbone features of best.pt")]
    assert len(said_budget) == len(said_whitened) == 1 and said_budget < said_whitened, logged  # why it stopped, first
    record = tmp_path / "run" / "whitening.json"
    fits = json.loads(record.read_text())
    assert set(fits["checkpoints"]) == {"best.pt", "last.pt"} and fits["training_receipts"] >= 2
    assert took < 60 * budget + 30, "stops soon after the budget (evaluation and caching on top)"
    state = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    assert state["spent_seconds"] >= 60 * budget

    logged.clear()
    train(config, dataset, tmp_path / "run", builtin_registry(), resume=True, progress=False, log=logged.append)
    assert any("has spent its time budget (0.1 min): nothing to train" in m for m in logged), logged
    assert not [m for m in logged if m.startswith("resuming")], "issue 13 U8: no 'resuming' of a spent run"
    assert "best.pt, last.pt already whitened when the run last ended: their fit is kept" in logged, logged
    assert not [m for m in logged if m.startswith("whitened")] and json.loads(record.read_text()) == fits
    assert len(list(read_jsonl(tmp_path / "run" / "metrics.jsonl"))) == len(lines)
    more = load_config(overrides=[*TINY, "train.epochs=200", f"train.max_minutes={2 * budget}"])
    logged.clear()
    train(more, dataset, tmp_path / "run", builtin_registry(), resume=True, progress=False, log=logged.append)
    assert any(m.startswith(f"resuming {tmp_path / 'run'} at epoch {len(lines) + 1}") for m in logged), logged
    resumed = list(read_jsonl(tmp_path / "run" / "metrics.jsonl"))
    assert len(resumed) > len(lines) and resumed[-1]["budget_spent"] == 1.0
    refitted = json.loads(record.read_text())["checkpoints"]
    assert refitted["last.pt"]["epoch"] > fits["checkpoints"]["last.pt"]["epoch"], "last.pt trained on: refitted"
    assert load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")["spent_seconds"] >= 120 * budget


def test_loss_koleo_weight_is_trained_with(dataset, tmp_path):
    """The regulariser reaches the logged training loss (same seed, same batches, another loss)."""
    losses = []
    for weight in (0.0, 10.0):
        config = load_config(overrides=[*TINY, "train.epochs=1", f"loss.koleo_weight={weight}"])
        result = train(
            config, dataset, tmp_path / f"run{weight}", builtin_registry(), progress=False, log=lambda m: None
        )
        losses.append(result.metrics[0]["loss"])
    assert math.isfinite(losses[1]) and abs(losses[1] - losses[0]) > 1e-3


def test_a_val_split_without_a_receipt_captured_twice_trains_and_keeps_the_last_epoch(tmp_path):
    """Attack round 8: the epoch line formatted val recall None with :.3f, an internal error, and no
    best.pt was ever written; now it says why there is no figure and best.pt is the last epoch."""
    import csv

    with open(REPO / "data_samples" / "manifest.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    receipts = sorted({row["receipt_id"] for row in rows})
    val = set(receipts[40:48])
    kept = []
    for row in rows:
        split = "val" if row["receipt_id"] in val else "train" if row["receipt_id"] in receipts[:40] else "heldout"
        if split != "val" or row["device"] == "phone_a":
            kept.append({**row, "path": str(REPO / "data_samples" / row["path"]), "split": split})
    with open(tmp_path / "manifest.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(kept[0]))
        writer.writeheader()
        writer.writerows(kept)
    ingest(
        tmp_path / "manifest.csv", tmp_path / "ds", load_config(overrides=["ingest.allow_absolute_paths=true"]).ingest
    )
    logged = []
    config = load_config(overrides=[*TINY, "train.epochs=2"])
    train(config, tmp_path / "ds", tmp_path / "run", builtin_registry(), progress=False, log=logged.append)
    assert sum("val recall@1 backbone n/a (no val receipt has two captures)" in m for m in logged) == 2, logged
    assert load_checkpoint(tmp_path / "run" / "checkpoints" / "best.pt")["epoch"] == 2


@pytest.mark.parametrize(
    "loss,sampler_stats",
    [
        ("supcon", {"tail_dropped": 0, "tail_filled": 0, "extra_views": 0}),  # pk: 3 captures of each receipt
        ("ntxent", {"tail_dropped": 0, "tail_filled": 0, "same_capture_pairs": 0}),  # unique_identity
        ("moco", {"tail_dropped": 0, "tail_filled": 0, "same_capture_pairs": 0}),
    ],
)
def test_sampler_auto_picks_the_layout_the_loss_needs(dataset, tmp_path, loss, sampler_stats):
    """`sampler.name: auto` is P x K batches for a multi-positive loss and two views of each receipt
    for a two-view one, so `--set loss.name=ntxent` over the supcon defaults just works."""
    own = ["loss.params={dim: 32}"] if loss == "moco" else []  # its queue is as wide as the head
    config = load_config(overrides=[*TINY, "train.epochs=1", f"loss.name={loss}", "sampler.name=auto", *own])
    train(config, dataset, tmp_path / "run", builtin_registry(), progress=False, log=lambda m: None)
    line = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert line["sampler"] == sampler_stats
    views = 8 * (3 if loss == "supcon" else 2)
    assert line["steps"] == math.ceil(48 / 8) and line["views_per_s"] * line["train_seconds"] == pytest.approx(
        views * line["steps"], rel=1e-6
    )


def test_auto_epochs_show_the_model_about_120_thousand_views(dataset, tmp_path):
    """`train.epochs: auto` scales the run to the dataset: about 120,000 augmented views, so the 48
    receipts of data_samples/ get many short epochs and a large dataset a few long ones."""
    from receipt_embed.training.schedule import AUTO_VIEWS, planned_epochs
    from receipt_embed.training.trainer import Trainer

    assert AUTO_VIEWS == 120_000
    assert planned_epochs(7, 2, 96) == 7, "a number is kept"
    assert planned_epochs("auto", 7, 96) == 179  # 214 receipts in batches of 32 x 3 views: 672 views an epoch
    assert planned_epochs("auto", 157, 96) == 8 and planned_epochs("auto", 1400, 96) == 1
    config = load_config(overrides=[*TINY, "train.epochs=auto", "loss.name=supcon", "sampler.name=auto"])
    trainer = Trainer(config, dataset, tmp_path / "run", builtin_registry(), progress=False, log=lambda m: None)
    assert (trainer.steps_per_epoch, trainer.epochs) == (6, math.ceil(120_000 / (6 * 8 * 3)))
    assert trainer.scheduler.lr_lambdas[0](6 * trainer.epochs) == pytest.approx(0.0, abs=1e-12), "annealed at the end"


NAN_GRADIENT_LOSS = '''
import torch
from receipt_embed.hookspecs import hookimpl
from receipt_embed.losses import NTXentLoss


class _NanGradient(torch.autograd.Function):
    """The identity forward; a NaN gradient backward (a kernel that misbehaves)."""

    @staticmethod
    def forward(ctx, z):
        return z.view_as(z)

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, float("nan"))


class NanOnSteps(torch.nn.Module):
    def __init__(self, temperature=0.2, steps=(1,)):
        super().__init__()
        self.inner, self.steps, self.calls = NTXentLoss(temperature=temperature), set(steps), 0

    def forward(self, z, labels):
        self.calls += 1
        return self.inner(_NanGradient.apply(z) if self.calls in self.steps else z, labels)


@hookimpl
def register_losses(register):
    register("nan_on_steps", NanOnSteps)
'''


@pytest.mark.parametrize("steps, diverges", [([2], False), (list(range(1, 100)), True)])
def test_a_finite_loss_with_non_finite_gradients_skips_the_update(dataset, tmp_path, steps, diverges):
    """A finite loss whose backward gave NaN gradients wrote NaN into every weight (clipping scales by
    a NaN norm), and the next step's embeddings were NaN: seen now and then under bf16 on CPU. The
    update is now skipped with a warning, and five such steps in a row are a diverged run."""
    from receipt_embed.training.step import MAX_SKIPPED_IN_A_ROW, TrainingDiverged

    loader = plugins_with(tmp_path, "nan_gradient.py", NAN_GRADIENT_LOSS)
    config = load_config(
        overrides=[
            *TINY,
            "train.epochs=1",
            "loss.name=nan_on_steps",
            f"loss.params={{steps: {steps}}}",
            "sampler.name=unique_identity",
        ]  # fmt: skip
    )
    said = []
    if diverges:
        with pytest.raises(TrainingDiverged, match=f"NaN or infinite for {MAX_SKIPPED_IN_A_ROW} steps in a row"):
            train(config, dataset, tmp_path / "run", loader.registry, progress=False, log=said.append)
        return
    train(config, dataset, tmp_path / "run", loader.registry, progress=False, log=said.append)
    assert [m for m in said if "non-finite gradients" in m] == [
        "warning: non-finite gradients at epoch 1, step 2: update skipped (1 in a row)"
    ]
    state = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    assert all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point())


FLAKY_BF16_ENCODER = '''
import torch
from receipt_embed.hookspecs import hookimpl


class FlakyBf16(torch.nn.Module):
    """A bf16 kernel that now and then gives NaN from finite input, as oneDNN's bf16 convolution does
    on CPU for a stride-2 convolution of a 4x2 map: its second autocast training forward is NaN, and
    the batch norm after it takes NaN statistics."""

    def __init__(self, in_channels):
        super().__init__()
        self.conv = torch.nn.Conv2d(in_channels, 8, 3, 4, 1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.feature_dim, self.forwards = 8, 0

    def forward(self, images):
        y = self.conv(images)
        if self.training and torch.is_autocast_enabled("cpu"):
            self.forwards += 1
            if self.forwards == 2:
                y = y * float("nan")
        return self.bn(y).mean(dim=(2, 3))


@hookimpl
def register_encoders(register):
    register("flaky_bf16", lambda pretrained, in_channels, pooling, grid: FlakyBf16(in_channels))
'''


def test_a_bf16_forward_that_gives_nan_from_finite_weights_reruns_in_fp32(dataset, tmp_path):
    """oneDNN's bf16 convolution on CPU gave NaN from finite weights and images in about one call in
    four for a stride-2 convolution of a 4x2 map (torch 2.14.1), and the run stopped as diverged one
    pytest run in three. Such a step now runs in fp32, with the batch-norm statistics the NaN forward
    wrote put back."""
    loader = plugins_with(tmp_path, "flaky_bf16.py", FLAKY_BF16_ENCODER)
    config = load_config(overrides=[*TINY, "train.epochs=1", "train.precision=bf16", "model.encoder=flaky_bf16"])
    said = []
    result = train(config, dataset, tmp_path / "run", loader.registry, progress=False, log=said.append)
    assert [m for m in said if "bf16" in m and not m.startswith("whitened")] == [  # its path has bf16 in it
        "warning: the bf16 forward at epoch 1, step 2 gave NaN from finite weights (a bf16 kernel fault on this "
        "CPU); the step ran in fp32"
    ]
    assert math.isfinite(result.metrics[0]["loss"])
    state = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    assert all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point())


@pytest.mark.slow  # long end-to-end run (tens of seconds): `pytest -m slow` runs it
def test_a_stopped_sweep_advises_what_works(dataset, tmp_path):
    """Attack round 17 G9: a `train --sweep` stopped by SIGHUP (a closed terminal) said "continue with
    --resume", which --sweep refuses. The stop names the value's run dir to resume, or --force to
    sweep again, and that advice works."""
    out = tmp_path / "sweep"
    first = out / "train.seed=1"
    process = subprocess.Popen(
        [*_train_cmd(dataset, out, "train.epochs=4"), "--sweep", "train.seed=1,2"],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),  # as a shell's command gets it
    )
    metrics = first / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and process.poll() is None and not (metrics.exists() and metrics.read_text()):
        time.sleep(0.005)
    process.send_signal(signal.SIGHUP)
    _, stderr = process.communicate(timeout=240)
    assert process.returncode == 129, stderr
    assert "SIGHUP received: saved" in stderr and "Traceback" not in stderr
    assert "continue with --resume" not in stderr
    assert (
        f"the sweep stopped there (no {out / 'sweep.json'} written; --sweep cannot --resume): finish this value "
        f"with `receipt-embed train --out {shlex.quote(str(first))} --resume`, or sweep every value anew by "
        "running the same `train --sweep` with --force\n"
    ) in stderr
    assert not (out / "train.seed=2").exists() and not (out / "sweep.json").exists()
    resumed = subprocess.run(
        [sys.executable, "-m", "receipt_embed", "train", "--out", str(first), "-q", "--resume"],
        env=_env(),
        capture_output=True,
        text=True,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert [line["epoch"] for line in _metrics(first)] == [1, 2, 3, 4]


NAN_ENCODER = """
import torch
from receipt_embed.hookspecs import hookimpl


class NanFrom(torch.nn.Module):
    \"\"\"Finite weights, NaN features from its nan_from-th training forward on.\"\"\"

    def __init__(self, in_channels, nan_from):
        super().__init__()
        self.layer = torch.nn.Linear(in_channels, 8)
        self.feature_dim, self.nan_from, self.forwards = 8, nan_from, 0

    def forward(self, images):
        y = self.layer(images.mean(dim=(2, 3)))
        if self.training:
            self.forwards += 1
            if self.forwards >= self.nan_from:
                y = y * float("nan")
        return y


@hookimpl
def register_encoders(register):
    register("nan_from", lambda pretrained, in_channels, pooling, grid, nan_from=1: NanFrom(in_channels, nan_from))
"""


def _nan_encoder_registry(tmp_path):
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "nan_encoder.py").write_text(NAN_ENCODER)
    loader = PluginLoader(strict=True)
    loader.load_builtins()
    loader.load_folder(tmp_path / "plugins", required=True)
    loader.collect_components()
    return loader.registry


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_an_encoder_giving_nan_from_finite_weights_before_any_update_is_named_not_divergence(
    dataset, tmp_path, precision
):
    """Attack round 17 G12: an encoder plugin returning NaN at step 1, its weights finite and never
    updated, was reported as "the model's weights diverged ... Try a lower train.lr"; it is the
    encoder's fault, named with its plugin (bad input, exit 2). bf16 still reruns the step in fp32 first."""
    from receipt_embed.errors import ComponentError

    config = load_config(overrides=[*TINY, "train.epochs=1", "model.encoder=nan_from", f"train.precision={precision}"])
    said = []
    with pytest.raises(ComponentError) as info:
        train(config, dataset, tmp_path / "run", _nan_encoder_registry(tmp_path), progress=False, log=said.append)
    assert str(info.value) == (
        "encoder 'nan_from' (from plugin 'nan_encoder') returned NaN embeddings from finite weights at epoch 1, "
        "step 1, before any update: its forward is at fault, not the learning rate (check the encoder and its "
        "model.params)"
    )
    assert any("the step ran in fp32" in m for m in said) == (precision == "bf16")


def test_nan_embeddings_from_finite_trained_weights_name_both_causes(dataset, tmp_path):
    """Attack round 17 G12: after updates, finite weights can have grown large enough to overflow, or
    the encoder gives NaN itself: the stop (exit 1, as a diverged run) names both, not only the weights."""
    config = load_config(overrides=[*TINY, "train.epochs=1", "model.encoder=nan_from", "model.params={nan_from: 3}"])
    with pytest.raises(TrainingDiverged) as info:
        train(config, dataset, tmp_path / "run", _nan_encoder_registry(tmp_path), progress=False, log=lambda m: None)
    message = str(info.value)
    assert message.startswith(
        "the embeddings became NaN at epoch 1, step 3, before the loss, from finite weights (the largest is "
    ), message
    assert (
        "the weights grew too large, or encoder 'nan_from' (from plugin 'nan_encoder') returned NaN values itself"
        in (message)
    )
    assert "(the model's weights diverged)" not in message and message.endswith("Try a lower train.lr (now 0.001).")


@pytest.mark.parametrize("val_receipts", [1, 3])
def test_a_val_split_too_small_to_choose_by_is_said(tmp_path, val_receipts):
    """Issue 13 U4 (README trial): a val split of one receipt logged "val recall@1 1.000" every epoch
    (its captures can only find each other) and chose best.pt by it without a word. One receipt is
    not evaluated and best.pt is the last epoch's; a few receipts are named as a coarse guide."""
    import csv
    import shutil

    samples = REPO / "data_samples"
    with open(samples / "manifest.csv", newline="") as handle:
        rows = [row for row in csv.DictReader(handle) if int(row["receipt_id"][1:]) < 10]
    (tmp_path / "images").mkdir()
    for row in rows:
        number = int(row["receipt_id"][1:])
        shutil.copy(samples / row["path"], tmp_path / row["path"])
        row["split"] = "val" if number < val_receipts else "heldout" if number == 9 else "train"
    with open(tmp_path / "manifest.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    ingest(tmp_path / "manifest.csv", tmp_path / "ds", load_config().ingest)
    logged: list[str] = []
    config = load_config(overrides=[*TINY, "train.epochs=1"])
    result = train(config, tmp_path / "ds", tmp_path / "run", builtin_registry(), progress=False, log=logged.append)
    advice = (
        "put more receipts in val: mark them val in the manifest's split column, or, without that column, "
        "`ingest --set 'ingest.split_ratios=[0.7,0.15,0.15]'`"
    )
    (line,) = _metrics(tmp_path / "run")
    if val_receipts == 1:
        assert (
            f"{tmp_path / 'ds'} has 1 val receipt, whose recall@1 is 1.000 whatever the model: nothing is "
            f"evaluated and best.pt is the last epoch's; {advice}"
        ) in logged, logged
        assert "val" not in line
        # attack round 24 P4: `demo` formatted the missing best recall and died with an internal error
        assert result.best_said() == "no val figures to choose by, so best.pt is the last epoch's"
    else:
        assert (
            f"{tmp_path / 'ds'} has only 3 val receipts: val recall@1 is a coarse guide to best.pt; {advice}"
        ) in logged, logged
        assert line["val"]["head"]["recall_at_1"] is not None
        chosen = line["val"][config.train.select_on]["recall_at_1"]
        assert result.best_said() == f"best val recall@1 {chosen:.3f} at epoch 1"
    assert (tmp_path / "run" / "checkpoints" / "best.pt").is_file()


HOOK_NOTES_ITS_CALLS = """
from receipt_embed.hookspecs import hookimpl

@hookimpl
def on_epoch_end(run_dir, epoch):
    (run_dir / f"hook_called_{epoch}").touch()
"""


@pytest.mark.parametrize("epochs", [2, 1])
def test_a_stop_during_evaluation_ends_the_epoch_before_its_hooks(dataset, tmp_path, monkeypatch, epochs):
    """Attack round 24 P5, P9: a SIGTERM that arrived while the epoch was evaluated only set training's
    flag, so a hook that then hung needed a second signal; and in the last epoch it was dropped: the run
    exited 0 as if no signal had come. The epoch is saved, its hooks are not called, and the stop is said."""
    import receipt_embed.training.trainer as trainer_module
    from receipt_embed.training.trainer import TrainingInterrupted

    loader = plugins_with(tmp_path, "notes.py", HOOK_NOTES_ITS_CALLS)
    real_evaluate = trainer_module.evaluate

    def evaluate_then_stop(*args, **kwargs):
        figures = real_evaluate(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)  # training's handler notes it: a flag
        return figures

    monkeypatch.setattr(trainer_module, "evaluate", evaluate_then_stop)
    run = tmp_path / "run"
    config = load_config(overrides=[*TINY, f"train.epochs={epochs}"])
    with pytest.raises(TrainingInterrupted) as info:
        train(config, dataset, run, loader.registry, progress=False, log=lambda m: None)
    then = "continue with --resume" if epochs == 2 else "that was the last epoch, so the run is complete"
    assert str(info.value) == (
        f"SIGTERM received: saved {run / 'checkpoints' / 'last.pt'} after epoch 1 (its epoch hooks were not "
        f"called); {then}"
    )
    assert info.value.code == 143 and info.value.complete == (epochs == 1)
    assert not (run / "hook_called_1").exists() and load_checkpoint(run / "checkpoints" / "last.pt")["epoch"] == 1
