"""The plugin components of a run, built from the config and checked before the first step.

A factory that returns something training cannot use is named here, with its plugin and
the rule it broke (exit 2 on the command line), not as a traceback in the middle of an epoch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from receipt_embed.batch_layout import TWO_VIEW
from receipt_embed.config import Config
from receipt_embed.data.views import SeededBatches, ViewDataset
from receipt_embed.display import quoted
from receipt_embed.kinds import KINDS
from receipt_embed.registry import ComponentError, plugin_errors
from receipt_embed.sampling import AUTO, build_sampler, sampler_for_loss


def check_built(registry, kind: str, name: str, built) -> None:
    """A plugin's factory returned something train cannot use: say which component and rule."""
    KINDS[kind].check_built(registry, name, built)


def build_loss(config: Config, registry) -> torch.nn.Module:
    """The loss plugin with its temperature and ``loss.params``; it must be a torch module."""
    spec = KINDS["loss"]
    loss = registry.create_with("loss", spec.selected(config), spec.framework_arguments(config), spec.params(config))
    if not isinstance(loss, torch.nn.Module):
        raise ComponentError(
            f"loss {config.loss.name!r} (from plugin {registry.get('loss', config.loss.name).plugin!r}) "
            f"built a {type(loss).__name__}, not a torch.nn.Module (see docs/plugins.md)"
        )
    return loss


def build_batches(config: Config, registry, train_set, log, loss=None) -> tuple[object, SeededBatches]:
    """The sampler plugin over the training identities, and its batches of (capture, view seed).
    A batch size above the identity count is lowered to it, with a line saying so;
    ``sampler.name: auto`` is the sampler that suits ``loss``."""
    train_cfg = config.train
    batch_size = min(train_cfg.batch_size, len(train_set.identities))
    if batch_size < train_cfg.batch_size:
        log(
            f"train.batch_size {train_cfg.batch_size} > {len(train_set.identities)} training identities; using {batch_size}"
        )
    name = config.sampler.name
    if name == AUTO:
        name = sampler_for_loss(loss)
    sampler = build_sampler(
        registry, name, train_set.labels, train_set.rows, batch_size, train_cfg.seed, config.sampler.params
    )
    check_built(registry, "sampler", name, sampler)
    source = f"sampler {name!r} (from plugin {registry.get('sampler', name).plugin!r})"
    guard = lambda: plugin_errors(registry, "sampler", name, "yielding a batch")  # noqa: E731
    return sampler, SeededBatches(sampler, train_cfg.seed, len(train_set), source, train_set.labels, guard)


def build_views(config: Config, registry, train_set, train_cache) -> ViewDataset:
    """Augmented views of the cached training captures, from the augmentation plugin; one test
    view is made at once, so a preset that breaks the view rules fails here, not in a loader worker."""
    preset = config.augment.preset
    size = tuple(config.data.image_size)
    spec = KINDS["augmentation"]
    transform = registry.create_with("augmentation", preset, spec.framework_arguments(config), spec.params(config))
    check_built(registry, "augmentation", preset, transform)
    dataset = ViewDataset(
        train_cache,
        transform,
        config.data.grayscale,
        train_set.labels,
        image_size=size,
        source=f"augmentation {preset!r}",
        guard=lambda: plugin_errors(registry, "augmentation", preset, "making a view"),
    )
    with plugin_errors(registry, "augmentation", preset, "making a test view"):
        dataset[(0, 0)]
    return dataset


def check_loss_value(loss, config: Config, registry) -> None:
    """A loss must return a scalar tensor."""
    if not torch.is_tensor(loss) or loss.ndim != 0:
        plugin = registry.get("loss", config.loss.name).plugin
        shape = tuple(loss.shape) if torch.is_tensor(loss) else type(loss).__name__
        raise ComponentError(
            f"loss {config.loss.name!r} (from plugin {plugin!r}) returned {shape}, "
            "not a scalar tensor; reduce it (e.g. .mean()) inside the loss"
        )


@dataclass
class RunComponents:
    """A run's model (and its DDP wrapper and momentum copy, when used), loss, sampler and views."""

    model: torch.nn.Module
    forward_model: torch.nn.Module
    key_model: torch.nn.Module | None
    loss: torch.nn.Module
    sampler: object
    batches: SeededBatches
    views: ViewDataset


def build_components(
    config: Config, registry, train_set, train_cache, ctx, from_checkpoint: bool, log
) -> RunComponents:
    """Every plugin component of a run, each checked before the first step (in this order)."""
    from receipt_embed.models.build import build_model, check_encoder_output
    from receipt_embed.training.resume import check_batch_splits

    model = build_model(config, registry, from_checkpoint=from_checkpoint)
    loss = build_loss(config, registry)
    sampler, batches = build_batches(config, registry, train_set, log, loss)
    if ctx.distributed:
        check_batch_splits(config.train.batch_size, len(train_set.identities), ctx.world_size)
    views = build_views(config, registry, train_set, train_cache)
    check_encoder_output(model, config, registry)
    key_model = None
    if getattr(loss, "wants_momentum_keys", False):
        from receipt_embed.losses.moco import make_momentum_encoder

        if batches.layout != TWO_VIEW:  # a key is the other view of a row's receipt: its place must be known
            raise ComponentError(
                f"loss {quoted(config.loss.name)} needs two-view batches, and sampler {quoted(config.sampler.name)} "
                f"declares batch_layout {batches.layout!r}; use sampler unique_identity"
            )

        key_model = make_momentum_encoder(model)
    forward_model = model
    if ctx.distributed:
        from torch.nn.parallel import DistributedDataParallel

        forward_model = DistributedDataParallel(model)
    return RunComponents(model, forward_model, key_model, loss, sampler, batches, views)
