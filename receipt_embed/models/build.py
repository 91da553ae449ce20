"""Building the model a config describes: the encoder plugin plus the projection head.

Used by training and by everything that loads a checkpoint (index, search, audit), so it
lives with the models rather than in the training loop.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from receipt_embed.config import Config
from receipt_embed.display import shortened
from receipt_embed.kinds import KINDS
from receipt_embed.models.embedder import Embedder, set_batchnorm_momentum
from receipt_embed.plugin_watch import forks_end_after_each_forward, forks_end_here
from receipt_embed.registry import ComponentError, plugin_errors

MAX_HEAD_PARAMETERS = 2**28  # about 1 GiB of float32: far beyond any receipt model, within this machine
# 2 GiB of float32; the largest built-in backbone (convnext_tiny) has 28 million. Counted on torch's meta
# device before anything is allocated: a checkpoint's model.params could otherwise ask for tens of GB
MAX_ENCODER_PARAMETERS = 2**29


def build_model(
    config: Config, registry, from_checkpoint: bool = False, weights_fit: Callable[[dict], None] | None = None
) -> Embedder:
    """Encoder plugin + projection head, as the config describes them. ``from_checkpoint``:
    the weights come from a checkpoint, so ``model.pretrained`` is never fetched or read.

    The model is first built on torch's meta device (shapes only, no memory) to count its weights
    and, with ``weights_fit``, to compare a checkpoint's tensors with its state dict, so a model too
    large or not the checkpoint's is refused before it takes any memory."""
    with forks_end_here():  # the plugin's properties (feature_dim) are read here too, outside its factory
        sketch = _sketch(config, registry)
        if sketch is not None and weights_fit is not None:
            weights_fit(sketch.state_dict())
        encoder = _build_encoder(config, registry, from_checkpoint)
        _check_head_size(encoder, config)
        model = Embedder(
            encoder, config.model.head_hidden, config.model.head_dim, config.model.input_norm, config.model.whiten
        )
        set_batchnorm_momentum(model, config.model.bn_momentum)
    return model


def _build_encoder(config: Config, registry, from_checkpoint: bool) -> torch.nn.Module:
    spec = KINDS["encoder"]
    framework = spec.framework_arguments(config, **({"pretrained": None} if from_checkpoint else {}))
    encoder = registry.create_with("encoder", spec.selected(config), framework, spec.params(config))
    plugin = registry.get("encoder", config.model.encoder).plugin
    if not isinstance(encoder, torch.nn.Module) or not isinstance(getattr(encoder, "feature_dim", None), int):
        raise ComponentError(
            f"encoder {config.model.encoder!r} (from plugin {plugin!r}) built an object of type "
            f"{type(encoder).__name__} that is not a torch.nn.Module with an integer feature_dim "
            "(see docs/plugins.md)"
        )
    if not plugin.startswith("builtin."):
        forks_end_after_each_forward(encoder)
    return encoder


def _sketch(config: Config, registry) -> Embedder | None:
    """The model on the meta device, its size checked; None when the encoder cannot be built there
    (a plugin that computes with real values while it builds): the real build then goes unchecked
    and names whatever else is wrong, as a bad parameter or an unknown encoder is named there too."""
    try:
        with torch.device("meta"):
            encoder = _build_encoder(config, registry, from_checkpoint=True)  # no weights to fetch for shapes
    except (ComponentError, OSError):
        return None
    weights = sum(t.numel() for t in (*encoder.parameters(), *encoder.buffers()))
    if weights > MAX_ENCODER_PARAMETERS:
        plugin = registry.get("encoder", config.model.encoder).plugin
        raise ComponentError(
            f"encoder {config.model.encoder!r} (from plugin {plugin!r}) would have {weights:,} weights with "
            f"model.params {shortened(dict(config.model.params))}, over the limit of {MAX_ENCODER_PARAMETERS:,} "
            "(2 GiB of float32): ask for a smaller encoder in model.params"
        )
    _check_head_size(encoder, config)
    with torch.device("meta"):
        return Embedder(
            encoder, config.model.head_hidden, config.model.head_dim, config.model.input_norm, config.model.whiten
        )


def _check_head_size(encoder: torch.nn.Module, config: Config) -> None:
    head = encoder.feature_dim * config.model.head_hidden + config.model.head_hidden * config.model.head_dim
    if head > MAX_HEAD_PARAMETERS:  # each size may be in bounds and their product still not fit in memory
        raise ComponentError(
            f"the projection head would have {head:,} weights ({encoder.feature_dim} features from encoder "
            f"{config.model.encoder!r} x model.head_hidden {config.model.head_hidden}, then x model.head_dim "
            f"{config.model.head_dim}), over the limit of {MAX_HEAD_PARAMETERS:,}: lower model.head_hidden or model.grid"
        )


@torch.no_grad()
def check_encoder_output(model: Embedder, config: Config, registry) -> None:
    """One forward of two blank images: an encoder whose output does not match its
    feature_dim is named here, not in the head's matrix multiply mid-epoch."""
    name = config.model.encoder
    channels = 1 if config.data.grayscale else 3
    was_training = model.encoder.training
    model.encoder.eval()
    with plugin_errors(registry, "encoder", name, "embedding two test images"):
        out = model.encoder(torch.zeros(2, channels, *config.data.image_size))
        expected = (2, model.encoder.feature_dim)
    model.encoder.train(was_training)
    if not torch.is_tensor(out) or tuple(out.shape) != expected:
        got = tuple(out.shape) if torch.is_tensor(out) else type(out).__name__
        plugin = registry.get("encoder", name).plugin
        raise ComponentError(
            f"encoder {name!r} (from plugin {plugin!r}) returned {got} for 2 images of "
            f"{channels} x {config.data.image_size[0]} x {config.data.image_size[1]}; "
            f"expected (N, feature_dim) = {expected}"
        )
