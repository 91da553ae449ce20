"""The application object: built once per command line, passed to every command.

It holds the global options and decides, in one place, which plugins folder is imported
(``--plugins-dir`` > the config's ``plugins.dir`` > ``./plugins``), loads the config and the
registry, and turns their errors into one-line exit-code-2 messages. Commands receive it with
``@click.pass_obj`` (as pypa/hatch passes its ``Application``).
"""

from __future__ import annotations

import re
from pathlib import Path

import click


class InputError(click.ClickException):
    """Bad input (a manifest, a config, a plugin name): exit code 2, no usage banner. The message
    often quotes values from files, so it prints escaped (one line; no terminal escape gets through)."""

    exit_code = 2

    def __init__(self, message: str, lines: list[str] | None = None):
        super().__init__(message)
        self.lines = lines  # several lines, each escaped on its own (``errors.BadInputLines``)

    @classmethod
    def of(cls, error: Exception) -> InputError:
        """The one- or several-line message of ``error``."""
        return cls(str(error), getattr(error, "lines", None))

    def format_message(self) -> str:
        from receipt_embed.display import printable

        if self.lines:
            return "\n".join(printable(line) for line in self.lines)
        return printable(re.sub(r"^\[Errno \d+\] ", "", self.message))  # an OSError's text: the words, not the number


class Application:
    """The global options of one invocation, and the config and registry built from them."""

    def __init__(self, plugins_dir: str | None = None, strict_plugins: bool = False, debug: bool = False):
        self.plugins_dir_option = plugins_dir
        self.strict_plugins_option = strict_plugins
        self.debug = debug

    def plugins_folder(self, config=None) -> tuple[Path, bool]:
        """The folder whose ``*.py`` plugins are imported, and whether the user named it (then it
        must exist): ``--plugins-dir``, else the config's ``plugins.dir``, else ``./plugins`` when
        present. A folder a run dir records is never imported: ``train --resume`` names it instead."""
        from receipt_embed.plugin_manager import resolve_plugins_dir

        named = self.plugins_dir_option or (config.plugins.dir if config is not None else None)
        return resolve_plugins_dir(named), named is not None

    def strict(self, config=None) -> bool:
        return self.strict_plugins_option or (config.plugins.strict if config is not None else False)

    def load_config(self, config_file, overrides):
        """The validated (frozen) config: defaults <- ``config_file`` <- ``overrides``."""
        from receipt_embed.config import ConfigError, load_config

        try:
            return load_config(config_file, overrides)
        except ConfigError as exc:
            raise InputError(str(exc)) from None

    def registry(self, config=None):
        """Every component from the built-ins, entry points and the plugins folder (once per folder)."""
        from receipt_embed.plugin_manager import PluginLoadError, get_registry
        from receipt_embed.registry import ComponentError

        folder, named = self.plugins_folder(config)
        try:
            return get_registry(folder, strict=self.strict(config), dir_required=named)
        except (PluginLoadError, ComponentError) as exc:
            raise InputError(str(exc)) from None


def current_app() -> Application:
    """The application of the command line being run (a fresh default one outside a command)."""
    ctx = click.get_current_context(silent=True)
    app = ctx.find_root().obj if ctx is not None else None
    return app if isinstance(app, Application) else Application()
