"""Named components (losses, encoders, augmentations, samplers, audit checks, verifiers) and who provides them.

The registry is filled by calling each plugin's ``register_*`` hook with a ``register``
callback bound to that plugin, so every component knows its provider and a name clash can
name both plugins.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import math
import numbers
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from receipt_embed.display import quoted, shortened
from receipt_embed.errors import BadInput, ComponentError
from receipt_embed.kinds import KINDS as COMPONENT_KINDS
from receipt_embed.plugin_watch import forks_end_here

_PACKAGE_DIR = Path(__file__).resolve().parent  # receipt-embed's own code, told apart from a plugin's

# what each kind is (its hook, config keys, framework arguments): receipt_embed/kinds.py
KINDS = {name: spec.hook for name, spec in COMPONENT_KINDS.items()}  # kind -> the hook that registers it


class InvalidComponent(ComponentError):
    """A plugin registered something unusable (bad name, factory not callable, a name twice):
    that plugin is skipped like one that fails to import."""


class ComponentClash(ComponentError):
    """Two plugins registered the same name: fatal, since either could be the one meant."""


# names are typed on the command line (--set loss.name=NAME) and in YAML
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
# a search's ``verified`` dict holds the fused ``score`` beside each verifier's figures, by name
RESERVED_VERIFIER_NAMES = ("score",)


@contextlib.contextmanager
def plugin_errors(registry: Registry, kind: str, name: str, doing: str, exits_only: bool = False):
    """Errors raised inside a third-party component become one line naming it and where in
    its code it failed (built-ins keep their tracebacks: a bug there is ours). An exit or a
    KeyboardInterrupt the plugin raises itself (not a stop signal) is its failure too, never the
    silent end of the command. ``exits_only``: only those are turned, for a block that runs
    receipt-embed's own code around the plugin's (whose errors are not the plugin's)."""
    component = registry.get(kind, name)
    if component.plugin.startswith("builtin."):
        yield
        return
    try:
        with forks_end_here():
            yield
    except ComponentError:
        raise
    except BaseException as exc:
        import traceback

        from receipt_embed.stops import is_real_stop, note_stopped_while

        if is_real_stop(exc):  # a real stop signal arrived while the plugin's code ran: its line names it
            note_stopped_while(f"{doing} in {kind} {quoted(name)} (plugin {quoted(component.plugin)})")
            raise
        if exits_only and isinstance(exc, Exception):
            raise  # an error of our own code
        frames = traceback.extract_tb(exc.__traceback__)
        if isinstance(exc, BadInput) and frames and Path(frames[-1].filename).resolve().is_relative_to(_PACKAGE_DIR):
            raise  # receipt-embed's own check of what the plugin returned: its message names the component
        where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        text = _described(exc)
        raise ComponentError(
            f"{kind} {quoted(name)} (from plugin {quoted(component.plugin)}) failed while {doing}: "
            f"{type(exc).__name__}{': ' + text if text else ''}{where}"
        ) from exc


def _params_key(kind: str) -> str:
    return COMPONENT_KINDS[kind].params_key if kind in COMPONENT_KINDS else "params"


def _parameter_hint(factory, params: dict, kind: str) -> str:
    """'; it accepts a, b (did you mean 'margin'?)' for a parameter the factory lacks (a lazy
    built-in factory, ``**params``, is read through what it builds: its ``signature_target``)."""
    target = getattr(factory, "signature_target", None)
    try:
        parameters = inspect.signature(target() if target else factory).parameters
    except (TypeError, ValueError, ImportError, AttributeError):
        return ""
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return ""
    reserved = COMPONENT_KINDS[kind].framework_names if kind in COMPONENT_KINDS else ()
    missing = [key for key in params if key in reserved and key not in parameters]
    if missing:
        return (
            f"; receipt-embed passes {', '.join(map(repr, missing))} to every {kind} factory, so the factory must "
            "accept it (see docs/plugins.md)"
        )
    accepted = [
        n for n, p in parameters.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL and n not in reserved
    ]
    unknown = [key for key in params if key not in parameters]
    hint = f"; its {_params_key(kind)} may set {', '.join(accepted) or 'nothing'}"
    for key in unknown:
        close = difflib.get_close_matches(key, accepted, n=1)
        if close:
            hint += f" (did you mean {quoted(close[0])} for {quoted(key)}?)"
    return hint if unknown else ""


_NUMBER_TYPES = {"float": numbers.Real, "int": numbers.Integral}


def _mistyped_number(factory, params: dict) -> str | None:
    """Why a value cannot go to a parameter the factory annotates ``float`` or ``int`` (optionally
    ``| None``), or None: text such as ``nan`` read from ``--check-set x=nan``, NaN or infinity, a bool. A
    factory would compare with it and quietly never (or always) decide, or fail deep inside."""
    target = getattr(factory, "signature_target", None)  # a lazy factory names what it builds
    try:
        parameters = inspect.signature(target() if target else factory).parameters
    except (TypeError, ValueError, ImportError, AttributeError):
        return None
    for key, value in params.items():
        if key not in parameters:
            continue
        annotation = parameters[key].annotation
        text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
        number, optional = text.replace(" ", ""), False
        if number.endswith("|None"):
            number, optional = number[: -len("|None")], True
        if number not in _NUMBER_TYPES or (value is None and optional):
            continue
        if isinstance(value, bool) or not isinstance(value, _NUMBER_TYPES[number]):
            return f"parameter {quoted(key)} takes a number ({number}), got {quoted(shortened(value))}"
        if not math.isfinite(value):  # a NaN compares false with everything; JSON reports have neither
            return f"parameter {quoted(key)} takes a finite number ({number}), got {value}"
    return None


@dataclass(frozen=True)
class PluginInfo:
    """One loaded plugin: where it came from, for ``receipt-embed plugins``."""

    name: str
    source: str  # "builtin", "entry point", or "folder"
    location: str  # module name, distribution or file path
    version: str | None = None


@dataclass(frozen=True)
class Component:
    kind: str
    name: str
    factory: Callable[..., Any]
    plugin: str
    description: str = ""


@dataclass
class Registry:
    """Components by kind and name, plus the plugins that provided them."""

    plugins: dict[str, PluginInfo] = field(default_factory=dict)
    components: dict[str, dict[str, Component]] = field(default_factory=lambda: {kind: {} for kind in KINDS})
    failures: dict[str, str] = field(default_factory=dict)  # plugin name -> error text
    plugin_manager: Any = None  # the pluggy manager, for the call hooks (on_epoch_end)
    strict: bool = False  # a plugin failing in a hook is fatal (--strict-plugins) instead of a warning
    blocked: list[str] = field(default_factory=list)  # plugins blocked by RECEIPT_EMBED_DISABLE_PLUGINS

    def add(self, kind: str, plugin: str, name: str, factory: Callable[..., Any], description: str = "") -> None:
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise InvalidComponent(
                f"plugin {quoted(plugin)} registered a {kind} with an invalid name {quoted(name)} "
                "(letters, digits, '_', '-', '.'; no spaces)"
            )
        if kind == "verifier" and name in RESERVED_VERIFIER_NAMES:
            raise InvalidComponent(
                f"plugin {quoted(plugin)} registered a verifier named {quoted(name)}: a search's verified figures "
                f"hold the fused {name} under that key beside each verifier's own, so pick another name"
            )
        if not callable(factory):
            raise InvalidComponent(
                f"plugin {quoted(plugin)} registered {kind} {quoted(name)} with a factory that is not callable "
                f"({type(factory).__name__}); pass the function that builds it"
            )
        existing = self.components[kind].get(name)
        if existing is not None and existing.plugin == plugin:
            raise InvalidComponent(f"plugin {quoted(plugin)} registers {kind} {quoted(name)} twice")
        if existing is not None:
            from receipt_embed.plugin_watch import skip_advice

            raise ComponentClash(
                f"{kind} {quoted(name)} is registered by two plugins: {quoted(existing.plugin)} and {quoted(plugin)}; "
                f"leave one out: {skip_advice(plugin)}"
            )
        self.components[kind][name] = Component(kind, name, factory, plugin, description)

    def drop_plugin(self, plugin: str) -> None:
        """Forget a plugin that failed part-way through registering."""
        self.plugins.pop(plugin, None)
        for by_name in self.components.values():
            for name in [n for n, c in by_name.items() if c.plugin == plugin]:
                del by_name[name]

    def get(self, kind: str, name: str) -> Component:
        if kind not in self.components:
            raise ComponentError(f"unknown component kind {quoted(kind)}; kinds: {', '.join(KINDS)}")
        available = self.components[kind]
        if name not in available:
            names = ", ".join(sorted(available)) or "(none registered)"
            close = difflib.get_close_matches(name, list(available), n=1)
            hint = f" Did you mean {quoted(close[0])}?" if close else ""
            raise ComponentError(
                f"unknown {kind} {quoted(shortened(name))}. Available: {names}.{hint} (From a plugin? "
                "`receipt-embed plugins` lists what loads here, from ./plugins or --plugins-dir.)"
            )
        return available[name]

    def create(self, kind: str, name: str, **params: Any) -> Any:
        """Build component ``name`` of ``kind`` with ``params``; bad params name the component."""
        component = self.get(kind, name)
        wrong = _mistyped_number(component.factory, params)
        if wrong:
            raise ComponentError(f"{kind} {quoted(name)} (from plugin {quoted(component.plugin)}): {wrong}")
        try:
            with forks_end_here():
                return component.factory(**params)
        except TypeError as exc:
            raise ComponentError(
                f"{kind} {quoted(name)} (from plugin {quoted(component.plugin)}): {exc}"
                f"{_parameter_hint(component.factory, params, kind)}"
            ) from exc
        except (ComponentError, OSError):  # a missing weights file is the user's to fix, as it says
            raise
        except ValueError as exc:  # the factory rejected a parameter value: say whose
            raise ComponentError(f"{kind} {quoted(name)} (from plugin {quoted(component.plugin)}): {exc}") from exc
        except BaseException as exc:  # a plugin bug (an exit it raises too): name it, not a traceback
            from receipt_embed.stops import is_real_stop

            if is_real_stop(exc):
                raise  # a real stop signal arrived while the factory ran
            raise ComponentError(
                f"{kind} {quoted(name)} (from plugin {quoted(component.plugin)}) failed to build: "
                f"{type(exc).__name__}: {_described(exc)}"
            ) from exc

    def create_with(self, kind: str, name: str, framework: dict[str, Any], params: dict[str, Any]) -> Any:
        """``create`` with the arguments receipt-embed passes itself plus the user's params;
        a param that would override one of ours is an error saying which key to set instead."""
        spec = COMPONENT_KINDS.get(kind)
        ours = {argument.name: argument.set_by for argument in spec.framework} if spec else {}
        clash = sorted(set(params) & (set(framework) | set(ours)))
        if clash:
            instead = "; ".join(f"{key} comes from {ours[key]}" for key in clash if key in ours)
            raise ComponentError(
                f"{_params_key(kind)} sets {', '.join(map(repr, clash))}, which receipt-embed "
                f"passes to {kind} {quoted(name)} itself; remove it from {_params_key(kind)}"
                + (f" ({instead})" if instead else "")
            )
        return self.create(kind, name, **framework, **params)

    def names(self, kind: str) -> list[str]:
        return sorted(self.components[kind])


def _described(exc: BaseException) -> str:
    """``str(exc)``, or a note that it cannot be shown (a plugin's exception whose __str__ raises)."""
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - any failure of foreign code here is only a worse message
        return "(its message cannot be shown)"


def named_settings(settings, option: str, known: Callable[[str], str]) -> dict[str, dict]:
    """``NAME.KEY=VALUE`` options (``--check-set``, ``--verify-set``) into parameters by component
    name; VALUE reads exactly like a ``--set`` value (1e-1 is a number, yes is a string) and
    ``known(name)`` returns the name or raises naming the components there are."""
    from omegaconf import OmegaConf

    params: dict[str, dict] = {}
    for item in settings:
        key, sep, value = item.partition("=")
        name, dot, param = key.strip().partition(".")
        if not sep or not dot or not param:
            raise BadInput(f"{option} expects NAME.KEY=VALUE, got {quoted(shortened(item))}")
        try:
            parsed = OmegaConf.to_container(OmegaConf.from_dotlist([f"value={value}"]))["value"]
        except Exception as exc:
            raise BadInput(
                f"{option} {quoted(shortened(item))}: cannot read the value: {shortened(str(exc).splitlines()[0])}"
            ) from None
        params.setdefault(known(name), {})[param] = parsed
    return params
