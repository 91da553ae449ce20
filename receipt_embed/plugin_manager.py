"""Plugin discovery, once per process and set of options, and calling the pipeline's hooks.

``get_registry`` loads the built-ins, the entry points and (only when given) a plugins folder
through :class:`~receipt_embed.plugin_loader.PluginLoader` and caches the result;
``call_hook`` calls a hook on every plugin, one at a time, so a failing plugin only warns.
"""

from __future__ import annotations

import functools
import os
import traceback
import warnings
from pathlib import Path

import pluggy

from receipt_embed.display import quoted, shortened
from receipt_embed.errors import BadInput
from receipt_embed.plugin_loader import (  # noqa: F401  (re-exported: the names plugin authors and tests use)
    BUILTIN_PLUGINS,
    DEFAULT_PLUGINS_DIR,
    DISABLE_ENV,
    ENTRY_POINT_GROUP,
    MAX_FAILURE_CHARACTERS,
    PluginLoader,
    PluginLoadError,
    PluginLoadWarning,
    disabled_plugins,
)
from receipt_embed.plugin_watch import PluginCalledExit, plugin_code
from receipt_embed.registry import Registry


class PluginHookWarning(UserWarning):
    """A plugin's hook raised; the pipeline went on without it."""


def hook_implementations(registry: Registry, hook_name: str) -> list:
    """The loaded implementations of a call hook (empty for a registry built by hand)."""
    pm = registry.plugin_manager
    if pm is None:
        return []
    # pluggy calls the last registered first (tryfirst/trylast adjust that); keep its order
    return [
        impl
        for impl in reversed(getattr(pm.hook, hook_name).get_hookimpls())
        if impl.plugin_name not in registry.failures
    ]


def call_hook(registry: Registry, hook_name: str, where: str = "", **kwargs) -> dict[str, object]:
    """Call ``hook_name`` on every plugin implementing it, one at a time.

    Unlike a plain pluggy call, a plugin that raises does not stop the others: it gets a
    warning naming it (a PluginLoadError when the plugins were loaded strict). Each implementation receives
    only the arguments it names, as pluggy does. Returns results by plugin name."""
    results: dict[str, object] = {}
    for impl in hook_implementations(registry, hook_name):
        try:
            args = [kwargs[name] for name in impl.argnames]
            optional = {name: kwargs[name] for name in getattr(impl, "kwargnames", ()) if name in kwargs}
            with plugin_code(impl.plugin_name, f"calling {hook_name} of"):
                results[impl.plugin_name] = impl.function(*args, **optional)
        except BaseException as exc:  # an exit a hook raises is its failure, never the end of training
            from receipt_embed.stops import is_real_stop

            if is_real_stop(exc):
                raise
            detail = shortened(
                str(exc)
                if isinstance(exc, PluginCalledExit)
                else "".join(traceback.format_exception_only(type(exc), exc)).strip(),
                MAX_FAILURE_CHARACTERS,
            )
            at = f" ({where})" if where else ""
            if registry.strict:
                raise PluginLoadError(
                    f"plugin {quoted(impl.plugin_name)} failed in {hook_name}{at} (--strict-plugins): {detail}"
                ) from exc
            warnings.warn(
                f"plugin {quoted(impl.plugin_name)} failed in {hook_name}{at}: {detail}; going on without it this "
                "time (--strict-plugins makes this fatal)",
                PluginHookWarning,
                stacklevel=2,
            )
    return results


def resolve_plugins_dir(plugins_dir: str | os.PathLike | None) -> Path:
    """The folder the CLI loads: the one named, else ``./plugins``. An empty name is refused: as a
    path it is the current directory, and every ``*.py`` there would be imported."""
    if plugins_dir is not None and not os.fspath(plugins_dir):
        raise BadInput(
            "plugins_dir is empty, which reads as the current directory; name the plugins folder, or pass None"
        )
    folder = Path(plugins_dir if plugins_dir is not None else DEFAULT_PLUGINS_DIR)
    try:
        return folder.resolve()
    except (OSError, RuntimeError):  # a symlink loop: loading then finds no folder there, and says so
        return Path(os.path.abspath(folder))


@functools.lru_cache(maxsize=8)
def _load(
    plugins_dir: Path | None, strict: bool, disabled: frozenset[str], dir_required: bool
) -> tuple[pluggy.PluginManager, Registry]:
    loader = PluginLoader(strict=strict, disabled=disabled)
    loader.load_builtins()
    loader.load_entry_points()
    if plugins_dir is not None:
        loader.load_folder(plugins_dir, required=dir_required)
    loader.collect_components()
    loader.warn_unknown_disabled()
    loader.registry.blocked = sorted(loader.blocked_seen)
    return loader.pm, loader.registry


def _cached(plugins_dir, strict: bool, dir_required: bool | None):
    folder = resolve_plugins_dir(plugins_dir) if plugins_dir is not None else None
    required = folder is not None if dir_required is None else dir_required
    return _load(folder, strict, frozenset(disabled_plugins()), required)


def get_plugin_manager(
    plugins_dir=None, strict: bool = False, dir_required: bool | None = None
) -> pluggy.PluginManager:
    """The pluggy manager with every plugin loaded (cached per process)."""
    return _cached(plugins_dir, strict, dir_required)[0]


def get_registry(plugins_dir=None, strict: bool = False, dir_required: bool | None = None) -> Registry:
    """The registry of components from every loaded plugin (cached per process).

    Only a ``plugins_dir`` given is imported: library code never runs ``*.py`` files that
    happen to lie in the current directory (the CLI passes ``./plugins`` itself). A folder
    given that does not exist gets a warning, unless ``dir_required`` is False (the CLI's
    default folder may be absent)."""
    return _cached(plugins_dir, strict, dir_required)[1]
