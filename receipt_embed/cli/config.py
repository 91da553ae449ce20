"""``receipt-embed config``: print the resolved configuration."""

from __future__ import annotations

import click

from receipt_embed.cli.options import config_options, resolve_config


@click.command()
@config_options
def config(config_file, overrides):
    """Print the configuration after merging --config and --set over the defaults."""
    from receipt_embed.config import config_to_yaml

    click.echo(config_to_yaml(resolve_config(config_file, overrides)), nl=False)
