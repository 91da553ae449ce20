"""``receipt-embed config``: print the resolved configuration."""

from __future__ import annotations

import click

from receipt_embed.cli.options import check_components, config_options, load_registry, resolve_config


@click.command()
@config_options
@click.pass_context
def config(ctx, config_file, overrides):
    """Print the configuration after merging --config and --set over the defaults, once the
    component names it uses (encoder, loss, augmentation, sampler) are checked."""
    from receipt_embed.config import config_to_yaml

    resolved = resolve_config(config_file, overrides)
    check_components(resolved, load_registry(ctx, resolved))
    click.echo(config_to_yaml(resolved), nl=False)
