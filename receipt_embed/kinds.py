"""One spec per component kind: everything receipt-embed knows about losses, encoders,
augmentations, samplers, audit checks and verifiers, in one table.

The registry, the plugin loader, training, the CLI, ``receipt_embed.testing`` and the docs
tests all read :data:`KINDS`; adding a kind is one entry here plus its hook in
``hookspecs.py``. A spec says which hook registers the kind, which config key selects a
component and which one holds its params, which arguments receipt-embed passes a factory
itself (and where the user sets each), what the built object must have, and the contract
check a plugin author runs in their own tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from receipt_embed.batch_layout import LAYOUTS, declared_layout
from receipt_embed.display import quoted
from receipt_embed.errors import BadInput, ComponentError


@dataclass(frozen=True)
class FrameworkArgument:
    """An argument receipt-embed passes a factory itself: ``params`` may not set it."""

    name: str
    set_by: str  # where the user sets it instead, for messages ("loss.temperature", "the dataset")
    from_config: Callable[[Any], Any] | None = None  # its value from a Config; None: the caller supplies it


@dataclass(frozen=True)
class ComponentKind:
    name: str
    hook: str  # the hookspec that registers components of this kind
    selected_by: str | None  # the config key that names the component (None: chosen per command)
    params_key: str  # where a user sets the component's own parameters
    framework: tuple[FrameworkArgument, ...]
    needs: tuple[str, ...]  # attributes the object a factory builds must have
    contract: str  # the check in receipt_embed.testing that a component of this kind passes
    check_values: Callable[[Any], str | None] | None = None  # what is wrong with a built object's values, or None

    @property
    def framework_names(self) -> tuple[str, ...]:
        return tuple(argument.name for argument in self.framework)

    def selected(self, config) -> str:
        """The component name ``config`` selects for this kind."""
        section, key = self.selected_by.split(".")
        return getattr(getattr(config, section), key)

    def params(self, config) -> dict:
        """The component's own parameters in ``config``."""
        section, key = self.params_key.split(".")
        return dict(getattr(getattr(config, section), key))

    def framework_arguments(self, config, **supplied) -> dict:
        """The arguments receipt-embed passes a factory of this kind: from the config, plus the
        ones only the caller knows (``supplied``, e.g. a sampler's identities)."""
        values = {}
        for argument in self.framework:
            if argument.name in supplied:
                values[argument.name] = supplied[argument.name]
            elif argument.from_config is not None:
                values[argument.name] = argument.from_config(config)
        return values

    def check_built(self, registry, name: str, built) -> None:
        """A factory returned something that lacks what this kind needs: say which component and rule."""
        missing = [attr for attr in self.needs if not hasattr(built, attr)]
        problem = None if missing or self.check_values is None else self.check_values(built)
        if missing or problem:
            plugin = registry.get(self.name, name).plugin
            rule = f"without {', '.join(missing)}; a {self.name} needs {', '.join(self.needs)}" if missing else problem
            raise ComponentError(
                f"{self.name} {quoted(name)} (from plugin {quoted(plugin)}) built a {type(built).__name__} "
                f"{rule} (see docs/plugins.md)"
            )


def _grayscale_channels(config) -> int:
    return 1 if config.data.grayscale else 3


def _sampler_values(sampler) -> str | None:
    if declared_layout(sampler) is None:
        return (
            f"whose batch_layout is {getattr(sampler, 'batch_layout', None)!r}; it must be one of {', '.join(LAYOUTS)}"
        )
    return None


KINDS: dict[str, ComponentKind] = {
    spec.name: spec
    for spec in (
        ComponentKind(
            "loss",
            "register_losses",
            "loss.name",
            "loss.params",
            (FrameworkArgument("temperature", "loss.temperature", lambda c: c.loss.temperature),),
            ("__call__",),
            "check_loss",
        ),
        ComponentKind(
            "encoder",
            "register_encoders",
            "model.encoder",
            "model.params",
            (
                FrameworkArgument("pretrained", "model.pretrained", lambda c: c.model.pretrained),
                FrameworkArgument("in_channels", "data.grayscale", _grayscale_channels),
                FrameworkArgument("pooling", "model.pooling", lambda c: c.model.pooling),
                FrameworkArgument("grid", "model.grid", lambda c: tuple(c.model.grid)),
            ),
            ("feature_dim",),
            "check_encoder",
        ),
        ComponentKind(
            "augmentation",
            "register_augmentations",
            "augment.preset",
            "augment.params",
            (FrameworkArgument("image_size", "data.image_size", lambda c: tuple(c.data.image_size)),),
            ("__call__", "set_random_seed"),
            "check_augmentation",
        ),
        ComponentKind(
            "sampler",
            "register_samplers",
            "sampler.name",
            "sampler.params",
            (
                FrameworkArgument("identities", "the dataset"),
                FrameworkArgument("batch_size", "train.batch_size", lambda c: c.train.batch_size),
                FrameworkArgument("seed", "train.seed", lambda c: c.train.seed),
                FrameworkArgument("metadata", "the manifest"),
            ),
            ("__len__", "__iter__", "set_epoch", "batch_layout"),
            "check_sampler",
            _sampler_values,
        ),
        ComponentKind(
            "audit_check",
            "register_audit_checks",
            None,
            "--check-set",
            (),
            ("__call__",),
            "check_audit_check",
        ),
        ComponentKind(
            "verifier",
            "register_verifiers",
            None,
            "--verify-set",
            (),
            ("extract", "score"),
            "check_verifier",
        ),
    )
}

# the kinds a training config selects, in the order a run builds them
CONFIGURED = tuple(KINDS[name] for name in ("encoder", "loss", "augmentation", "sampler"))
AUTO = "auto"  # sampler.name that picks the sampler for the loss (resolved when built, never registered)


def check_selected_components(config, registry) -> None:
    """Look up every component ``config`` selects, so a typo fails before anything is built: the
    registry's ComponentError names the first missing one and lists those available."""
    for spec in CONFIGURED:
        if spec.name == "sampler" and spec.selected(config) == AUTO:
            continue
        registry.get(spec.name, spec.selected(config))


def kind(name: str) -> ComponentKind:
    """The spec of kind ``name``; an unknown kind is bad input naming the known ones."""
    try:
        return KINDS[name]
    except KeyError:
        raise BadInput(f"unknown component kind {name!r}; kinds: {', '.join(KINDS)}") from None
