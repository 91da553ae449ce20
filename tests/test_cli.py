"""The command line as a user meets it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from receipt_embed import __version__

REPO = Path(__file__).resolve().parents[1]


def test_help_lists_commands_and_module_entry(cli):
    result = cli("--help")
    assert result.returncode == 0
    for name in ("ingest", "plugins", "demo", "make-samples", "config"):
        assert name in result.stdout


def test_version(cli):
    assert cli("--version").stdout.strip() == f"receipt-embed, version {__version__}"


def test_console_script_installed():
    exe = Path(sys.executable).parent / "receipt-embed"
    assert exe.is_file(), "the receipt-embed console script is not installed next to python"
    assert "ingest" in subprocess.run([exe, "--help"], capture_output=True, text=True).stdout


def test_help_does_not_import_torch(cli):
    code = "import sys; from receipt_embed.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit: pass\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip().endswith("False")


def test_plugin_discovery_does_not_import_torch():
    """`receipt-embed plugins` from the repository root loads every example plugin; none may
    import torch at module level (discovery happens in every command)."""
    code = (
        "import sys; from receipt_embed.cli import main\ntry:\n    main(['plugins'])\nexcept SystemExit: pass\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert "same_merchant" in out.stdout and "hubness" in out.stdout and "metrics_csv" in out.stdout
    assert out.stdout.strip().endswith("False"), out.stderr


def test_unknown_command(cli):
    result = cli("trian")
    assert result.returncode == 2 and "No such command 'trian'" in result.stderr


def test_global_option_after_the_command_says_where_it_goes(cli, tmp_path):
    result = cli("plugins", "--plugins-dir", "x", cwd=tmp_path)
    assert result.returncode == 2
    assert (
        "--plugins-dir is an option of receipt-embed itself: put it before the command, "
        "e.g. receipt-embed --plugins-dir DIR plugins ..."
    ) in result.stderr


def test_an_internal_error_is_exit_1_with_a_hint_and_bad_input_is_exit_2(cli, tmp_path):
    """Bad input (any BadInput) is one line and exit 2; anything else is a bug: exit 1, a short
    message that says so and how to see the traceback, which --debug shows."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "breaks_listing.py").write_text(
        "import receipt_embed.cli.plugins as listing\n"
        "def broken(registry, plugin_name):\n"
        "    return {}['no such key']\n"
        "listing.call_hooks = broken  # a bug in the listing, as far as the command can tell\n"
    )
    crashed = cli("--plugins-dir", plugins, "plugins")
    assert crashed.returncode == 1, crashed.stderr
    assert crashed.stderr.splitlines()[0] == "Error: internal error: KeyError: 'no such key'"
    assert "not a problem with your input" in crashed.stderr and "--debug" in crashed.stderr
    assert "Traceback" not in crashed.stderr and len(crashed.stderr.strip().splitlines()) == 2

    debug = cli("--debug", "--plugins-dir", plugins, "plugins")
    assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr
    assert "in broken" in debug.stderr and debug.stderr.strip().endswith("KeyError: 'no such key'")

    bad = cli("--debug", "ingest", tmp_path / "missing_folder", "--out", tmp_path / "ds")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr

    from receipt_embed.config import ConfigError
    from receipt_embed.errors import BadInput
    from receipt_embed.fileio import DiskFull
    from receipt_embed.indexing.index_dir import IndexDirError
    from receipt_embed.training.checkpoint import CheckpointError
    from receipt_embed.userfiles import UnusableFile

    for error in (ConfigError, CheckpointError, DiskFull, IndexDirError, UnusableFile):
        assert issubclass(error, BadInput) and issubclass(error, ValueError), error


@pytest.mark.parametrize(
    "args",
    [
        ["audit-shortcuts", "{tmp}", "--max-lift", "nan"],
        ["audit-shortcuts", "{tmp}", "--min-z", "nan"],
        ["search", "{tmp}", "--all-pairs", "--threshold", "nan"],
    ],
    ids=["max-lift", "min-z", "threshold"],
)
def test_a_nan_threshold_is_refused_not_compared(cli, tmp_path, args):
    """Attack round 5: every comparison with NaN is false, so `--max-lift nan` flagged nothing and
    `--threshold nan` found nothing, both with exit 0."""
    result = cli(*[a.replace("{tmp}", str(tmp_path)) for a in args], cwd=tmp_path)
    assert result.returncode == 2 and "nan is not a number; give a finite value" in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("args", "name"),
    [
        (["ingest", str(REPO / "data_samples"), "--out", ""], "--out"),
        (["index", "--out", "", "--embeddings", "x.npy", "--manifest", "."], "--out"),
        (["index-merge", ".", "--out", ""], "--out"),
        (["train", "--out", "", "--data", "."], "--out"),
        (["demo", "--out", ""], "--out"),
        (["make-samples", "--out", ""], "--out"),
        (["audit-shortcuts", ".", "--out", ""], "--out"),
        (["search", ".", "--all-pairs", "--out", ""], "--out"),
        (["ingest", "", "--out", "x"], "SOURCE"),
        (["train", "--data", "", "--out", "x"], "--data"),
        (["search", ".", ""], "a value of IMAGES"),
        (["--plugins-dir", "", "config"], "--plugins-dir"),
        (["config", "--config", ""], "a value of --config"),  # repeatable: one of its values
    ],
    ids=[
        *(f"{command}-out" for command in ("ingest", "index", "index-merge", "train", "demo", "make-samples")),
        *("audit-out", "all-pairs-out", "ingest-source", "train-data", "search-images", "plugins-dir", "config"),
    ],
)
def test_an_empty_path_is_refused_in_one_line(cli, tmp_path, args, name):
    """Attack round 16 (F5): `--out ''` (an unset shell variable, `--out "$OUT"`) was taken as the
    current directory: ingest and index wrote their output there and swapped the shell's directory
    away, train wrote a run into it, and messages printed a blank name."""
    here = tmp_path / "here"
    here.mkdir()
    result = cli(*args, cwd=here)
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"Error: {name} is empty (an unset shell variable?)\n"
    assert here.is_dir() and list(here.iterdir()) == []


def test_every_path_option_and_argument_refuses_an_empty_value():
    """Attack round 16 (F5): every command's path options and arguments use the shared path type, so
    an empty one is refused before the command runs, whatever the command."""
    import click

    from receipt_embed.cli import COMMANDS, main
    from receipt_embed.cli.options import GivenPath

    ctx = click.Context(main)
    commands = [main, *(main.get_command(ctx, name) for name in COMMANDS)]
    plain = [
        f"{command.name} {param.name}"
        for command in commands
        for param in command.params
        if isinstance(param.type, click.Path) and not isinstance(param.type, GivenPath)
    ]
    assert plain == []


@pytest.mark.parametrize("args", [["config"], ["search", "{tmp}/index", "{tmp}/a.jpg"]], ids=["config", "search"])
def test_a_deleted_current_directory_is_one_line_and_exit_2(tmp_path, args):
    """Attack round 16 (F6): run from a deleted working directory, `config` (looking for ./plugins)
    was an "internal error: FileNotFoundError", and the commands that load torch died with "Intel
    oneMKL FATAL ERROR: Cannot load libtorch_cpu.so", which reads like a broken install."""
    import shlex

    gone = tmp_path / "gone"
    gone.mkdir()
    command = " ".join(shlex.quote(a.replace("{tmp}", str(tmp_path))) for a in args)
    script = f"cd {shlex.quote(str(gone))} && rmdir {shlex.quote(str(gone))} && exec "
    script += f"{shlex.quote(sys.executable)} -m receipt_embed {command}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECEIPT_EMBED_")}
    result = subprocess.run(["sh", "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        "Error: the current directory no longer exists (deleted or replaced): cd to an existing directory "
        "and run again\n"
    )


def test_make_samples_from_scans_that_is_a_fifo_is_a_usage_error(cli, tmp_path):
    """Attack round 5: a FIFO passed click's folder check and came back as an internal error."""
    import os

    os.mkfifo(tmp_path / "scans")
    result = cli("make-samples", "--from-scans", tmp_path / "scans", "--out", tmp_path / "out", cwd=tmp_path)
    assert result.returncode == 2 and "is not a folder" in result.stderr and "internal" not in result.stderr


def test_running_out_of_memory_is_one_line_and_exit_2_not_a_bug_report():
    """Attack round 13: under `ulimit -v` every command's MemoryError read "internal error ... This is
    a bug in receipt-embed" (exit 1); a memory limit is the machine's, and says what to shrink."""
    script = (
        "import sys, click\n"
        "from receipt_embed import cli\n"
        "@click.command()\n"
        "def oom():\n"
        "    raise MemoryError()\n"
        "cli.COMMANDS['oom'] = ('__main__:oom', 'run out of memory')\n"
        "sys.argv = ['receipt-embed', 'oom']\n"
        "cli.run()\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.startswith("Error: out of memory (a memory limit such as `ulimit -v`, or too little RAM")
    assert "internal error" not in result.stderr


def test_a_memory_limit_too_small_to_load_torch_is_one_line_and_exit_2(tmp_path):
    """Attack round 13: under `ulimit -v 300000` importing torch fails with "libtorch_cpu.so: failed
    to map segment from shared object", which was reported as an internal error (a bug)."""
    import resource

    def small_limit():
        resource.setrlimit(resource.RLIMIT_AS, (400 * 2**20, 400 * 2**20))

    (tmp_path / "q.jpg").write_bytes(b"")
    result = subprocess.run(
        [sys.executable, "-m", "receipt_embed", "search", str(tmp_path / "idx"), str(tmp_path / "q.jpg")],
        capture_output=True, text=True, timeout=60, preexec_fn=small_limit,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("Error: out of memory (a memory limit such as `ulimit -v`"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "internal error" not in result.stderr


@pytest.mark.parametrize("command", ["train", "index"])
def test_a_manifest_given_as_data_names_the_folder_or_command_to_pass(command, tmp_path):
    """Met in a new-user trial: `index --data data_samples/manifest.csv` got only click's "is a file"."""
    from click.testing import CliRunner

    from receipt_embed.cli import main

    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "manifest.jsonl").write_text("{}\n")
    (tmp_path / "notes.txt").write_text("x")
    said = {}
    for given in (REPO / "data_samples" / "manifest.csv", tmp_path / "ds" / "manifest.jsonl", tmp_path / "notes.txt"):
        result = CliRunner().invoke(main, [command, "--data", str(given), "--out", str(tmp_path / "out")])
        assert result.exit_code == 2, result.output
        said[given.name] = " ".join(result.output.split())
    samples = REPO / "data_samples"
    assert (
        f"{samples / 'manifest.csv'} is a file, not a dataset dir: ingest the captures it lists first, "
        f"`receipt-embed ingest {samples} --out DATASET_DIR`, and pass DATASET_DIR" in said["manifest.csv"]
    )
    assert (
        f"is a dataset dir's manifest, not the dataset dir: pass its folder, {tmp_path / 'ds'}"
        in said["manifest.jsonl"]
    )
    assert (
        "notes.txt is a file, not a dataset dir (the folder `receipt-embed ingest --out` writes)" in said["notes.txt"]
    )
    assert not (tmp_path / "out").exists()
