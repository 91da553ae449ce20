"""Options and error handling shared by the subcommands."""

from __future__ import annotations

import functools

import click

from receipt_embed.cli.app import InputError, current_app


def param_name(param: click.Parameter | None) -> str:
    """How a message names an option (``--out``) or an argument (``SOURCE``)."""
    if isinstance(param, click.Option):
        return next((opt for opt in param.opts if opt.startswith("--")), param.opts[0])
    return param.human_readable_name if param is not None else "a path"


class GivenPath(click.Path):
    """``click.Path`` that refuses an empty value in one line: ``--out ''`` is almost always an unset
    shell variable (``--out "$OUT"``), and click takes it as the current directory."""

    def convert(self, value, param, ctx):
        refuse_empty(value, param)
        return super().convert(value, param, ctx)


def refuse_empty(value, param: click.Parameter | None) -> None:
    if isinstance(value, (str, bytes)) and not value:
        several = param is not None and (param.nargs != 1 or getattr(param, "multiple", False))
        raise InputError(f"{'a value of ' if several else ''}{param_name(param)} is empty (an unset shell variable?)")


class CheckpointPath(GivenPath):
    """An existing checkpoint file; one missing because an interrupted ``--force`` run set its run
    aside is named there, with how to put that run back (click would only say "does not exist")."""

    def __init__(self):
        super().__init__(dir_okay=False, exists=True)

    def convert(self, value, param, ctx):
        import os

        refuse_empty(value, param)
        if isinstance(value, str) and "\0" not in value and not os.path.lexists(value):
            from receipt_embed.training.replacement import set_aside_advice

            if (advice := set_aside_advice(value)) is not None:
                raise InputError(f"{param_name(param)}: checkpoint {value} not found: {advice}")
        return super().convert(value, param, ctx)


class ExistingPath(GivenPath):
    """``click.Path(exists=True)`` that names a symlink loop as one (click says "does not exist")."""

    def __init__(self, **kwargs):
        super().__init__(exists=True, **kwargs)

    def convert(self, value, param, ctx):
        import errno
        import os

        refuse_empty(value, param)
        try:
            os.stat(value)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                self.fail(f"{os.fsdecode(value)!r}: too many levels of symbolic links (a symlink loop)", param, ctx)
        except ValueError as exc:
            from receipt_embed.userfiles import unnameable

            self.fail(f"{value!r}: the path {unnameable(exc)}", param, ctx)
        converted = super().convert(value, param, ctx)
        if not self.file_okay and not os.path.isdir(converted):  # click lets a FIFO or device through
            self.fail(f"{os.fsdecode(value)} is not a folder", param, ctx)
        return converted


class DatasetDirPath(GivenPath):
    """An existing dataset dir; a file given in its place (its ``manifest.jsonl``, or the captures'
    ``manifest.csv``) is answered with the folder or the command to pass instead."""

    def __init__(self):
        super().__init__(file_okay=False, exists=True)

    def convert(self, value, param, ctx):
        import os
        from pathlib import Path

        refuse_empty(value, param)
        if isinstance(value, str) and "\0" not in value and os.path.isfile(value):
            path = Path(value)
            if path.name == "manifest.jsonl":
                self.fail(f"{value} is a dataset dir's manifest, not the dataset dir: pass its folder, {path.parent}")
            if path.suffix.lower() == ".csv":
                self.fail(
                    f"{value} is a file, not a dataset dir: ingest the captures it lists first, "
                    f"`receipt-embed ingest {path.parent} --out DATASET_DIR`, and pass DATASET_DIR"
                )
            self.fail(f"{value} is a file, not a dataset dir (the folder `receipt-embed ingest --out` writes)")
        return super().convert(value, param, ctx)


class FiniteFloatRange(click.FloatRange):
    """``click.FloatRange`` that refuses NaN: every comparison with NaN is false, so click lets it
    through any bound, and a NaN threshold silently flags or finds nothing."""

    def convert(self, value, param, ctx):
        import math

        number = super().convert(value, param, ctx)
        if math.isnan(number):
            self.fail(f"{value} is not a number; give a finite value", param, ctx)
        return number


def index_build_options(command):
    """``--factory``, ``--target-recall`` and ``--train-size``: how ``index`` and ``index-merge`` build
    the FAISS index (``indexing.factory.build_index``)."""
    for option in reversed(
        (
            click.option(
                "--factory",
                default="Flat",
                show_default=True,
                help="FAISS index-factory string: Flat (exact), HNSW32, IVF1024,Flat, IVF4096,PQ64, ...",
            ),
            click.option(
                "--target-recall",
                type=FiniteFloatRange(0, 1),
                default=0.95,
                show_default=True,
                help="Approximate indexes: raise nprobe/efSearch until recall@10 against exact search reaches this.",
            ),
            click.option(
                "--train-size",
                type=click.IntRange(min=1),
                default=100_000,
                show_default=True,
                help="Approximate indexes: vectors sampled to train the quantizers (across all shards when merging).",
            ),
        )
    ):
        command = option(command)
    return command


def config_options(command):
    """Add ``--config FILE`` and repeatable ``--set key.path=value`` to a command."""

    @click.option(
        "--config",
        "config_file",
        type=ExistingPath(dir_okay=False),
        multiple=True,  # merged in order, so a second one is never silently dropped
        help="YAML file merged over configs/default.yaml; repeatable: files merge in order, a later one wins.",
    )
    @click.option(
        "--set",
        "overrides",
        multiple=True,
        metavar="KEY=VALUE",
        help="Override one config key, e.g. --set train.epochs=5 (repeatable).",
    )
    @functools.wraps(command)
    def wrapper(*args, config_file=(), **kwargs):
        return command(*args, config_file=list(config_file) or None, **kwargs)  # the files in order, or None

    return wrapper


def resolve_config(config_file, overrides):
    """Load the config, turning a ConfigError into an exit-code-2 message."""
    return current_app().load_config(config_file, overrides)


def check_components(config, registry) -> None:
    """Every component the config names exists (else exit 2 listing the available ones)."""
    from receipt_embed.kinds import check_selected_components
    from receipt_embed.registry import ComponentError

    try:
        check_selected_components(config, registry)
    except ComponentError as exc:
        raise InputError(str(exc)) from None


def load_registry(ctx: click.Context | None = None, config=None):
    """The registry the application loads (see :class:`receipt_embed.cli.app.Application`)."""
    return current_app().registry(config)


MAX_SHORTLIST = 10_000


def shortlist_option(help_text: str):
    """``--shortlist K``, the embedding neighbours the verifiers check: one definition for search,
    calibrate and audit-shortcuts, so its range and default cannot drift apart."""
    return click.option(
        "--shortlist",
        type=click.IntRange(min=1, max=MAX_SHORTLIST),
        default=10,
        show_default=True,
        help=help_text,
    )
