"""Loading plugins into a pluggy manager: built-ins, then the ``receipt_embed`` entry-point
group, then ``*.py`` files in a plugins folder, each checked before it counts.

Each plugin is loaded in its own try/except, so one broken plugin is reported by name and the
rest still load (or, with ``strict``, the first failure is fatal): a misspelled hook, a hook
wrapper, a function named like a hook without ``@hookimpl``, a plugin file that is not a
regular file, a ``register`` call breaking its rules. ``RECEIPT_EMBED_DISABLE_PLUGINS``
(comma separated plugin names) blocks plugins before they load.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import os
import sys
import traceback
import warnings
from importlib.metadata import entry_points
from pathlib import Path

import pluggy

from receipt_embed import hookspecs
from receipt_embed.display import quoted, shortened
from receipt_embed.errors import BadInput
from receipt_embed.kinds import KINDS
from receipt_embed.plugin_watch import DISABLE_ENV, PluginCalledExit, plugin_code
from receipt_embed.registry import ComponentClash, PluginInfo, Registry
from receipt_embed.userfiles import read_regular_text

ENTRY_POINT_GROUP = "receipt_embed"
DEFAULT_PLUGINS_DIR = "plugins"
MAX_PLUGIN_BYTES = 8 * 1024 * 1024  # a plugin is a page of Python; anything far larger is not one

BUILTIN_PLUGINS = (
    "receipt_embed.builtins.augmentations",
    "receipt_embed.builtins.encoders",
    "receipt_embed.builtins.losses",
    "receipt_embed.builtins.samplers",
    "receipt_embed.builtins.verifiers",
)


class PluginLoadError(BadInput, RuntimeError):
    """A plugin failed to import or register (fatal only under --strict-plugins)."""


class PluginLoadWarning(UserWarning):
    """A plugin failed to load and was skipped."""


# what a plugin's own code may raise while it loads or registers: an exit or a Ctrl-C it raises
# itself is a failure of that plugin, never a silent end of the command (a real stop signal
# still stops it: see PluginLoader._fail)
PLUGIN_RAISES = (BaseException,)


MAX_FAILURE_CHARACTERS = 2000  # of a plugin's error in a warning or listing: a message can be megabytes


def _safe_repr(value) -> str:
    try:
        return repr(value)
    except Exception:  # a value whose repr raises is the plugin's, and must not end the command
        return f"<{type(value).__name__} whose repr() failed>"


def disabled_plugins() -> set[str]:
    raw = os.environ.get(DISABLE_ENV, "")
    return {name.strip() for name in raw.split(",") if name.strip()}


def _register_signature(name, factory, description=""):
    """The signature of the ``register`` callback every register_* hook receives."""


REGISTER_SIGNATURE = inspect.signature(_register_signature)


FOLDER_PACKAGE = "receipt_embed_folder_plugins"


def _folder_package(folder: Path) -> str:
    """The package a folder's plugins are imported under: one per folder, with the folder as
    its path, so a plugin imports a helper of *its* folder relatively (``from ._shared import
    x``) even when two folders both have a ``_shared.py``. Returns the package name."""
    import hashlib
    import re
    import types

    root = sys.modules.get(FOLDER_PACKAGE)
    if root is None:
        root = types.ModuleType(FOLDER_PACKAGE, "folder plugins of receipt-embed")
        root.__path__ = []
        sys.modules[FOLDER_PACKAGE] = root
    folder = Path(folder).resolve()
    tag = re.sub(r"\W", "_", folder.name) or "root"
    name = f"{FOLDER_PACKAGE}.{tag}_{hashlib.sha1(str(folder).encode()).hexdigest()[:8]}"
    if name not in sys.modules:
        package = types.ModuleType(name, f"plugins in {folder}")
        package.__path__ = [str(folder)]
        sys.modules[name] = package
    return name


class PluginLoader:
    """Loads plugins into a pluggy manager and records where each came from."""

    def __init__(self, strict: bool = False, disabled: frozenset[str] | None = None):
        self.strict = strict
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.registry = Registry(plugin_manager=self.pm, strict=strict)
        self.blocked_seen: set[str] = set()
        self.disabled = frozenset(disabled_plugins() if disabled is None else disabled)
        for name in self.disabled:
            self.pm.set_blocked(name)

    def _fail(self, name: str, exc: BaseException) -> None:
        from receipt_embed.stops import is_real_stop

        if is_real_stop(exc):
            raise exc  # a real stop signal arrived while the plugin loaded: stop, do not blame the plugin
        if isinstance(exc, SyntaxError) and exc.lineno:  # one line, not the source and its caret
            exc = SyntaxError(f"{exc.msg} ({Path(exc.filename or '?').name}, line {exc.lineno})")
        elif isinstance(exc, PluginCalledExit):
            exc = RuntimeError(str(exc))
        elif not isinstance(exc, Exception):  # the plugin's own exit or interrupt: it must not end the command
            exc = RuntimeError(f"it raised {type(exc).__name__}({', '.join(map(_safe_repr, exc.args))})")
        detail = shortened(
            str(exc)
            if type(exc).__module__.split(".")[0] == "receipt_embed"  # our own messages read whole
            else "".join(traceback.format_exception_only(type(exc), exc)).strip(),
            MAX_FAILURE_CHARACTERS,
        )
        self.registry.failures[name] = detail
        if self.strict:
            raise PluginLoadError(f"plugin {quoted(name)} failed to load (--strict-plugins): {detail}") from exc
        warnings.warn(
            f"plugin {quoted(name)} failed to load and was skipped: {detail}", PluginLoadWarning, stacklevel=2
        )

    def _blocked(self, name: str) -> bool:
        if self.pm.is_blocked(name):
            self.blocked_seen.add(name)
            return True
        return False

    def _check_hook_names(self, module, name: str) -> None:
        """A misspelled hook is an error with a suggestion; a hook-named function without
        @hookimpl would be silently ignored by pluggy, so it gets a warning."""
        import difflib

        specs = {n for n in dir(hookspecs) if hasattr(getattr(hookspecs, n), f"{hookspecs.PROJECT_NAME}_spec")}
        for attr in dir(module):
            value = getattr(module, attr, None)
            if not callable(value) or getattr(value, "__module__", None) != module.__name__:
                continue
            marked = hasattr(value, f"{hookspecs.PROJECT_NAME}_impl")
            if marked and attr not in specs:
                close = difflib.get_close_matches(attr, sorted(specs), n=1)
                hint = f" (did you mean {quoted(close[0])}?)" if close else ""
                raise ValueError(
                    f"@hookimpl function {quoted(attr)} is not a receipt-embed hook{hint}; hooks: {', '.join(sorted(specs))}"
                )
            if marked and attr in specs:
                options = getattr(value, f"{hookspecs.PROJECT_NAME}_impl") or {}
                if options.get("wrapper") or options.get("hookwrapper"):
                    flag = "wrapper=True" if options.get("wrapper") else "hookwrapper=True"
                    raise ValueError(
                        f"{attr}() is a hook wrapper ({flag}); receipt-embed calls each plugin's hooks on their own "
                        "(so one failing plugin cannot stop the others), which would skip a wrapper's body: "
                        "use a plain @hookimpl"
                    )
                allowed = list(inspect.signature(getattr(hookspecs, attr)).parameters)
                wrong = [
                    a
                    for a, p in inspect.signature(value).parameters.items()
                    if a not in allowed
                    and p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
                ]
                if wrong:
                    raise ValueError(
                        f"{attr}() takes arguments named {', '.join(wrong)}; the hook offers "
                        f"{', '.join(allowed)} (use those names, any subset)"
                    )
            if not marked and attr in specs:
                warnings.warn(
                    f"plugin {quoted(name)} defines {attr}() without @hookimpl, so it is ignored; decorate it with "
                    "receipt_embed.hookspecs.hookimpl",
                    PluginLoadWarning,
                    stacklevel=3,
                )

    def _register(self, module, info: PluginInfo) -> None:
        if self._blocked(info.name):
            return
        try:
            # reading a module's names runs its own code (a module-level __getattr__), so a plugin's
            # is watched as its import is; builtins are ours
            watched = contextlib.nullcontext() if info.source == "builtin" else plugin_code(info.name, "loading")
            with watched:
                self._check_hook_names(module, info.name)
                self.pm.register(module, name=info.name)
                self.pm.check_pending()
        except PLUGIN_RAISES as exc:  # a bad hookimpl must not take the others down
            if self.pm.has_plugin(info.name):
                self.pm.unregister(name=info.name)
            self._fail(info.name, exc)
            return
        self.registry.plugins[info.name] = info

    def load_builtins(self) -> None:
        from receipt_embed.version import __version__

        for module_name in BUILTIN_PLUGINS:
            name = module_name.rsplit(".", 1)[-1]
            info = PluginInfo(f"builtin.{name}", "builtin", module_name, __version__)
            if self._blocked(info.name):
                continue
            self._register(importlib.import_module(module_name), info)

    def load_entry_points(self) -> None:
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if self._blocked(ep.name):
                continue
            dist = getattr(ep, "dist", None)
            info = PluginInfo(
                ep.name,
                "entry point",
                f"{dist.name if dist else '?'}: {ep.value}",
                dist.version if dist else None,
            )
            try:
                with plugin_code(ep.name, "loading"):
                    module = ep.load()
            except PLUGIN_RAISES as exc:
                self._fail(ep.name, exc)
                continue
            self._register(module, info)

    def load_folder(self, folder: Path, required: bool = False) -> None:
        """Load ``folder/*.py`` (not ``_*`` or ``.*``); a missing folder is fine unless the user named it."""
        if not folder.is_dir():
            problem = _not_a_folder(folder)
            if required and self.strict:  # a tracker plugin missing silently is what strict exists to prevent
                raise PluginLoadError(f"plugins folder {folder} {problem} (--strict-plugins)")
            if required:
                warnings.warn(
                    f"plugins folder {folder} {problem}; no folder plugins loaded", PluginLoadWarning, stacklevel=2
                )
            return
        for path in sorted(folder.glob("*.py")):
            name = path.stem
            # dot-files are editor and OS droppings (.#x.py lock links, macOS ._x.py), never plugins
            if name.startswith(("_", ".")) or self._blocked(name):
                continue
            module_name = f"{_folder_package(folder)}.{name}"
            try:
                # read as a regular file first (capped): a FIFO or a link to /dev/zero here must not hang
                source = read_regular_text(path, MAX_PLUGIN_BYTES)
                spec = importlib.util.spec_from_file_location(module_name, path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[module_name] = module
                with plugin_code(name, "loading"):
                    exec(compile(source, str(path), "exec"), module.__dict__)
                    # from the dict (a module-level __getattr__ is never asked), made text while
                    # watched (its __str__ is plugin code too)
                    version = module.__dict__.get("__version__")
                    version = None if version is None else str(version)
            except PLUGIN_RAISES as exc:
                sys.modules.pop(module_name, None)
                missing = getattr(exc, "name", None)
                if isinstance(exc, ModuleNotFoundError) and missing and (folder / f"{missing}.py").is_file():
                    exc = ModuleNotFoundError(
                        f"{exc}; {missing}.py is in the plugins folder: import it relatively, "
                        f"`from .{missing} import ...`"
                    )
                self._fail(name, exc)
                continue
            self._register(module, PluginInfo(name, "folder", str(path), version))

    def collect_components(self) -> None:
        """Call every plugin's register hooks with a callback bound to that plugin."""
        for kind, spec in KINDS.items():
            for impl in getattr(self.pm.hook, spec.hook).get_hookimpls():
                plugin = impl.plugin_name
                if plugin in self.registry.failures:
                    continue

                def register(*args, _kind=kind, _plugin=plugin, **kwargs):
                    try:
                        bound = REGISTER_SIGNATURE.bind(*args, **kwargs)
                    except TypeError as exc:
                        raise TypeError(f"register{REGISTER_SIGNATURE}: {exc}") from None
                    bound.apply_defaults()
                    self.registry.add(_kind, _plugin, **bound.arguments)

                try:
                    with plugin_code(plugin, f"calling {spec.hook} of"):
                        impl.function(register=register)
                except ComponentClash:
                    raise  # two plugins claim one name: the user has to choose
                except PLUGIN_RAISES as exc:
                    self.registry.drop_plugin(plugin)
                    self._fail(plugin, exc)

    def warn_unknown_disabled(self) -> None:
        """A name in RECEIPT_EMBED_DISABLE_PLUGINS that matched no plugin is probably a typo."""
        seen = set(self.registry.plugins) | set(self.registry.failures) | self.blocked_seen
        for name in sorted(self.disabled - seen):
            warnings.warn(
                f"{DISABLE_ENV} names {quoted(name)}, which is not a plugin here", PluginLoadWarning, stacklevel=2
            )


def _not_a_folder(path: Path) -> str:
    """Why ``path`` is no plugins folder, in words: missing, a link loop, or some other kind of file."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "does not exist"
    except OSError as exc:  # a symlink loop, a name too long, no permission
        return f"cannot be opened ({exc.strerror})"
    kinds = (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISREG, "a regular file"),
    )
    what = next((name for test, name in kinds if test(mode)), None)
    return f"is {what}, not a folder" if what else "is not a folder"
