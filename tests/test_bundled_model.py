"""``model.pretrained: bundled``: the receipt_cnn shipped in the package loads exactly, fits the
default architecture, and a config it cannot fit is refused by name before any training."""

from __future__ import annotations

import pytest
import torch
from conftest import REPO, TINY_TRAINING, builtin_registry

from receipt_embed.config import load_config
from receipt_embed.errors import BadInput
from receipt_embed.models.build import build_model
from receipt_embed.models.bundled import RECIPE, WEIGHTS, bundled_recipe


def test_the_weights_and_their_recipe_are_in_the_package():
    assert WEIGHTS.is_file() and RECIPE.is_file()
    assert WEIGHTS.parent == REPO / "receipt_embed" / "weights"
    assert WEIGHTS.stat().st_size < 8 * 2**20  # a few MB, shipped in the wheel
    package_data = (REPO / "pyproject.toml").read_text()
    assert '"weights/*"' in package_data


def test_the_bundled_model_is_the_default_architecture():
    """Changing the defaults' encoder without retraining the bundled model would make
    ``model.pretrained=bundled`` fail for every user: retrain it (benchmarks/bundled_model.py)."""
    recipe, config = bundled_recipe(), load_config()
    assert recipe["encoder"] == config.model.encoder == "receipt_cnn"
    assert recipe["stem"] == config.model.params["stem"]
    assert recipe["in_channels"] == (1 if config.data.grayscale else 3)
    assert recipe["image_size"] == list(config.data.image_size)
    assert "generated receipts only" in recipe["trained_on"]


@pytest.mark.parametrize("spelling", ["bundled", "Bundled", " bundled "])
def test_bundled_loads_the_shipped_weights_exactly(spelling):
    shipped = torch.load(WEIGHTS, map_location="cpu", weights_only=True)
    config = load_config(overrides=[*TINY_TRAINING, f"model.pretrained='{spelling}'"])
    encoder = build_model(config, builtin_registry()).encoder.state_dict()
    assert set(encoder) == set(shipped)
    for name, tensor in shipped.items():
        assert torch.equal(encoder[name], tensor), name
    untrained = build_model(load_config(overrides=[*TINY_TRAINING, "model.pretrained=none"]), builtin_registry())
    untrained = untrained.encoder.state_dict()
    assert not torch.equal(untrained["trunk.0.0.weight"], shipped["trunk.0.0.weight"])


@pytest.mark.parametrize(
    ("overrides", "asked"),
    [
        (["model.params={stem: 2}"], "asks for stem 2, widths [32, 48, 64, 96, 128], 1 channel"),
        (["model.params={widths: [16, 32]}"], "asks for stem 4, widths [16, 32], 1 channel"),
        (["data.grayscale=false"], "asks for stem 4, widths [32, 48, 64, 96, 128], 3 channels"),
    ],
)
def test_bundled_refuses_an_architecture_it_was_not_trained_as(overrides, asked):
    config = load_config(overrides=[*TINY_TRAINING, "model.pretrained=bundled", *overrides])
    with pytest.raises(BadInput, match="model.pretrained 'bundled' is a receipt_cnn with model.params stem 4") as err:
        build_model(config, builtin_registry())
    assert asked in str(err.value)
    assert "set model.pretrained to none" in str(err.value)


def test_bundled_for_a_torchvision_encoder_is_refused_before_any_download():
    with pytest.raises(BadInput, match="encoder 'resnet18' has no bundled weights"):
        builtin_registry().create("encoder", "resnet18", pretrained="bundled", in_channels=1)


def test_train_with_bundled_and_another_stem_is_one_line_exit_2(cli, tmp_path):
    dataset = tmp_path / "ds"
    assert cli("ingest", REPO / "data_samples", "--out", dataset, "-q").returncode == 0
    sets = [arg for item in [*TINY_TRAINING, "model.pretrained=bundled", "model.params={stem: 2}"]
            for arg in ("--set", item)]  # fmt: skip
    result = cli("train", "--data", dataset, "--out", tmp_path / "run", "-q", *sets)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "model.pretrained 'bundled' is a receipt_cnn with model.params stem 4" in result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_bundled_is_the_default_and_goes_with_the_default_encoder(tmp_path):
    """Fine-tuned from the bundled model, held-out recall@1 beat training from scratch on two seeds
    (benchmarks/README.md), so it is the default; like receipt_cnn's params, it is dropped when another
    encoder is chosen (which it could not load), and kept when asked for by name."""
    assert load_config().model.pretrained == "bundled"
    assert load_config(overrides=["model.encoder=resnet18"]).model.pretrained == "none"
    (tmp_path / "mine.yaml").write_text("model:\n  encoder: mobilenet_v3_small\n")
    assert load_config(tmp_path / "mine.yaml").model.pretrained == "none"
    kept = load_config(overrides=["model.encoder=resnet18", "model.pretrained=bundled"])
    assert kept.model.pretrained == "bundled"
    with pytest.raises(BadInput, match="encoder 'resnet18' has no bundled weights"):
        build_model(kept, builtin_registry())
