"""``receipt-embed plugins``: what is loaded, where it came from, what it provides."""

from __future__ import annotations

import json
from dataclasses import asdict

import click

from receipt_embed.cli.options import config_options, load_registry, resolve_config
from receipt_embed.display import printable


def call_hooks(registry, plugin_name: str) -> list[str]:
    """The hooks other than ``register_*`` a plugin implements (e.g. on_epoch_end)."""
    pm = registry.plugin_manager
    plugin = pm.get_plugin(plugin_name) if pm is not None else None
    if plugin is None:
        return []
    return sorted(caller.name for caller in pm.get_hookcallers(plugin) or [] if not caller.name.startswith("register_"))


def describe(registry) -> dict:
    """A JSON-ready description of loaded plugins, their components and load failures."""
    by_plugin: dict[str, list[dict]] = {name: [] for name in registry.plugins}
    for kind, components in registry.components.items():
        for component in components.values():
            by_plugin.setdefault(component.plugin, []).append(
                {"kind": kind, "name": component.name, "description": component.description}
            )
    return {
        "plugins": [
            {
                **asdict(info),
                "components": sorted(by_plugin[name], key=lambda c: (c["kind"], c["name"])),
                "hooks": call_hooks(registry, name),
            }
            for name, info in registry.plugins.items()
        ],
        "failed": [{"name": name, "error": error} for name, error in registry.failures.items()],
        "blocked": list(registry.blocked),
    }


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")
@config_options
@click.pass_context
def plugins(ctx, as_json, config_file, overrides):
    """List plugins (built-ins, entry points, plugins folder) and their components."""
    info = describe(load_registry(ctx, resolve_config(config_file, overrides)))
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    # names, versions and descriptions are the plugins' own strings: escaped, one line each
    for plugin in info["plugins"]:
        version = f" {printable(plugin['version'])}" if plugin["version"] else ""
        click.echo(f"{printable(plugin['name'])}{version}  [{plugin['source']}: {printable(plugin['location'])}]")
        for component in plugin["components"]:
            click.echo(
                f"    {component['kind']:<13} {printable(component['name']):<22} {printable(component['description'])}"
            )
        for hook in plugin["hooks"]:
            click.echo(f"    {'hook':<13} {hook}")
    for failure in info["failed"]:
        click.echo(f"FAILED {printable(failure['name'])}: {printable(failure['error'])}")
    for name in info["blocked"]:
        click.echo(f"blocked {printable(name)} (RECEIPT_EMBED_DISABLE_PLUGINS)")
