"""The command line as a user meets it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
