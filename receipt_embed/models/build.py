"""Building the model a config describes: the encoder plugin plus the projection head.

Used by training and by everything that loads a checkpoint (index, search, audit), so it
lives with the models rather than in the training loop.
"""

from __future__ import annotations

import torch

from receipt_embed.config import Config
from receipt_embed.kinds import KINDS
from receipt_embed.models.embedder import Embedder, set_batchnorm_momentum
from receipt_embed.registry import ComponentError, plugin_errors

MAX_HEAD_PARAMETERS = 2**28  # about 1 GiB of float32: far beyond any receipt model, within this machine


def build_model(config: Config, registry, from_checkpoint: bool = False) -> Embedder:
    """Encoder plugin + projection head, as the config describes them. ``from_checkpoint``:
    the weights come from a checkpoint, so ``model.pretrained`` is never fetched or read."""
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
    head = encoder.feature_dim * config.model.head_hidden + config.model.head_hidden * config.model.head_dim
    if head > MAX_HEAD_PARAMETERS:  # each size may be in bounds and their product still not fit in memory
        raise ComponentError(
            f"the projection head would have {head:,} weights ({encoder.feature_dim} features from encoder "
            f"{config.model.encoder!r} x model.head_hidden {config.model.head_hidden}, then x model.head_dim "
            f"{config.model.head_dim}), over the limit of {MAX_HEAD_PARAMETERS:,}: lower model.head_hidden or model.grid"
        )
    model = Embedder(encoder, config.model.head_hidden, config.model.head_dim, config.model.input_norm)
    set_batchnorm_momentum(model, config.model.bn_momentum)
    return model


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
    model.encoder.train(was_training)
    expected = (2, model.encoder.feature_dim)
    if not torch.is_tensor(out) or tuple(out.shape) != expected:
        got = tuple(out.shape) if torch.is_tensor(out) else type(out).__name__
        plugin = registry.get("encoder", name).plugin
        raise ComponentError(
            f"encoder {name!r} (from plugin {plugin!r}) returned {got} for 2 images of "
            f"{channels} x {config.data.image_size[0]} x {config.data.image_size[1]}; "
            f"expected (N, feature_dim) = {expected}"
        )
