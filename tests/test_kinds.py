"""The component-kind table is the one place a kind is described: every other part reads it.

These meta-tests fail when a kind is added (or changed) in one place and not the others.
"""

from __future__ import annotations

import inspect

import pytest

from receipt_embed import hookspecs, testing
from receipt_embed.config import load_config
from receipt_embed.kinds import CONFIGURED, KINDS, kind
from receipt_embed.registry import ComponentError, Registry


def test_every_register_hook_has_a_kind_and_every_kind_a_hook():
    hooks = {name for name in dir(hookspecs) if name.startswith("register_")}
    assert hooks == {spec.hook for spec in KINDS.values()}
    for spec in KINDS.values():
        doc = inspect.getdoc(getattr(hookspecs, spec.hook))
        for argument in spec.framework:  # the hook's docs name every argument a factory receives
            assert argument.name in doc, (spec.name, argument.name)


def test_every_kind_has_its_contract_check_for_authors():
    for spec in KINDS.values():
        check = getattr(testing, spec.contract)
        assert callable(check) and inspect.getdoc(check), spec.contract


def test_the_config_keys_of_each_configured_kind_exist_and_select_a_registered_component():
    from conftest import builtin_registry

    config = load_config()
    registry = builtin_registry()
    assert {spec.name for spec in CONFIGURED} == {s.name for s in KINDS.values() if s.selected_by}
    for spec in CONFIGURED:
        assert isinstance(spec.params(config), dict)
        name = spec.selected(config)
        if spec.name == "sampler" and name == "auto":  # resolved from the loss when a run is built
            from receipt_embed.sampling import sampler_for_loss

            name = sampler_for_loss(registry.create("loss", config.loss.name))
        registry.get(spec.name, name)  # the defaults name built-in components
        arguments = spec.framework_arguments(config)
        assert set(arguments) <= set(spec.framework_names)
        assert all(argument.from_config or argument.name not in arguments for argument in spec.framework)


def test_the_registry_and_its_messages_come_from_the_table():
    registry = Registry()
    assert list(registry.components) == list(KINDS)
    registry.add("sampler", "plugin_x", "mine", lambda identities, batch_size, seed: None)
    with pytest.raises(ComponentError) as refused:
        registry.create_with("sampler", "mine", {"identities": [0]}, {"seed": 3})
    assert str(refused.value) == (
        "sampler.params sets 'seed', which receipt-embed passes to sampler 'mine' itself; remove it from "
        "sampler.params (seed comes from train.seed)"
    )
    with pytest.raises(ValueError, match="unknown component kind 'metric'; kinds: loss, encoder"):
        kind("metric")
