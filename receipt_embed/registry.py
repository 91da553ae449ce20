"""Named components (losses, encoders, augmentations, samplers, audit checks) and who provides them.

The registry is filled by calling each plugin's ``register_*`` hook with a ``register``
callback bound to that plugin, so every component knows its provider and a name clash can
name both plugins.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Callable

# component kind -> the hook that registers it
KINDS: dict[str, str] = {
    "loss": "register_losses",
    "encoder": "register_encoders",
    "augmentation": "register_augmentations",
    "sampler": "register_samplers",
    "audit_check": "register_audit_checks",
}


class ComponentError(ValueError):
    """A component could not be registered or found."""


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
    components: dict[str, dict[str, Component]] = field(
        default_factory=lambda: {kind: {} for kind in KINDS}
    )
    failures: dict[str, str] = field(default_factory=dict)  # plugin name -> error text
    plugin_manager: Any = None  # the pluggy manager, for the call hooks (on_epoch_end)
    strict: bool = False  # a plugin failing in a hook is fatal (--strict-plugins) instead of a warning

    def add(self, kind: str, plugin: str, name: str, factory: Callable[..., Any], description: str = "") -> None:
        if not isinstance(name, str) or not name:
            raise ComponentError(f"plugin {plugin!r} registered a {kind} with an invalid name {name!r}")
        if not callable(factory):
            raise ComponentError(f"plugin {plugin!r} registered {kind} {name!r} with a factory that is not callable")
        existing = self.components[kind].get(name)
        if existing is not None and existing.plugin == plugin:
            raise ComponentError(f"plugin {plugin!r} registers {kind} {name!r} twice")
        if existing is not None:
            raise ComponentError(
                f"{kind} {name!r} is registered by two plugins: {existing.plugin!r} and {plugin!r}; "
                f"disable one with RECEIPT_EMBED_DISABLE_PLUGINS={plugin}"
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
            raise ComponentError(f"unknown component kind {kind!r}; kinds: {', '.join(KINDS)}")
        available = self.components[kind]
        if name not in available:
            names = ", ".join(sorted(available)) or "(none registered)"
            close = difflib.get_close_matches(name, list(available), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ComponentError(f"unknown {kind} {name!r}. Available: {names}.{hint}")
        return available[name]

    def create(self, kind: str, name: str, **params: Any) -> Any:
        """Build component ``name`` of ``kind`` with ``params``; bad params name the component."""
        component = self.get(kind, name)
        try:
            return component.factory(**params)
        except TypeError as exc:
            raise ComponentError(f"{kind} {name!r} (from plugin {component.plugin!r}): {exc}") from exc

    def names(self, kind: str) -> list[str]:
        return sorted(self.components[kind])
