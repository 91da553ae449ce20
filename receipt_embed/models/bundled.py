"""The starting model shipped in the package: ``model.pretrained: bundled``.

A receipt_cnn trained on generated receipts only (never on real scans), so a user with few
receipts of their own starts from an encoder that already reads receipt layouts instead of
from noise. ``benchmarks/bundled_model.py`` reproduces the weights file; the JSON beside it
records what it was trained with, and a config that asks for another architecture (stem,
widths, colour) is refused by name rather than failing in torch's shape check.
"""

from __future__ import annotations

import json
from pathlib import Path

from receipt_embed.errors import BadInput

BUNDLED = "bundled"
WEIGHTS = Path(__file__).resolve().parent.parent / "weights" / "receipt_cnn_generated.pt"
RECIPE = WEIGHTS.with_suffix(".json")


def is_bundled(pretrained) -> bool:
    return isinstance(pretrained, str) and pretrained.strip().lower() == BUNDLED


def bundled_recipe() -> dict:
    """What the bundled weights were trained with (architecture, data, command, figures)."""
    try:
        return json.loads(RECIPE.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BadInput(
            f"model.pretrained 'bundled': {RECIPE} is missing from this install (reinstall receipt-embed, "
            "or set model.pretrained to none)"
        ) from None


def bundled_weights(in_channels: int, widths: tuple[int, ...], stem: int) -> Path:
    """The bundled weights file, once the model asked for is the one they were trained as."""
    recipe = bundled_recipe()
    trained = (recipe["in_channels"], tuple(recipe["widths"]), recipe["stem"])
    if (in_channels, tuple(widths), stem) != trained:
        raise BadInput(
            f"model.pretrained 'bundled' is a receipt_cnn with model.params stem {trained[2]} and widths "
            f"{list(trained[1])}, {trained[0]} input channel{'s' if trained[0] != 1 else ''} "
            f"(data.grayscale {'true' if trained[0] == 1 else 'false'}); this config asks for stem {stem}, "
            f"widths {list(widths)}, {in_channels} channel{'s' if in_channels != 1 else ''}: "
            "keep those settings or set model.pretrained to none"
        )
    if not WEIGHTS.is_file():
        raise BadInput(
            f"model.pretrained 'bundled': {WEIGHTS} is missing from this install (reinstall receipt-embed, "
            "or set model.pretrained to none)"
        )
    return WEIGHTS


def refuse_for(encoder: str) -> None:
    raise BadInput(
        f"model.pretrained 'bundled' is a receipt_cnn; encoder {encoder!r} has no bundled weights "
        "(set model.pretrained to none, a torchvision weights name or a local weights file)"
    )
