"""Reproduce the starting model shipped as ``model.pretrained: bundled``.

    python benchmarks/bundled_model.py --out DIR [--receipts 400] [--devices 11]
        [--leave-out-devices faded_thermal,screenshot] [--views 60000] [--seed 0] [--write]

Generated receipts only (``make-samples``: never the real scans the quality benchmark scores),
captured by the simulated devices except ``--leave-out-devices`` (by default the two styles
that benchmark keeps unseen, so its leave-device-out figures stay honest for a model started
from these weights too), split by receipt into train and 10% val, trained with the shipped
defaults from scratch (``model.pretrained: none``) for about ``--views`` augmented views (epochs
fixed, so the result does not depend on the machine's speed). ``--write`` copies the trained
encoder's weights (the backbone only: ``index`` embeds backbone features, and a fine-tune builds its own head) into
``receipt_embed/weights/`` with a JSON recipe beside them; without it they stay in DIR.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.quality import _registry, split_manifest  # noqa: E402
from receipt_embed.config import load_config  # noqa: E402
from receipt_embed.embedding import load_model  # noqa: E402
from receipt_embed.fileio import atomic_open, atomic_write_json, read_jsonl  # noqa: E402
from receipt_embed.ingest import ingest  # noqa: E402
from receipt_embed.models.bundled import RECIPE, WEIGHTS  # noqa: E402
from receipt_embed.models.receipt_cnn import ReceiptCNN  # noqa: E402
from receipt_embed.samples import make_samples  # noqa: E402
from receipt_embed.training.checkpoint import load_checkpoint  # noqa: E402
from receipt_embed.training.trainer import train  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--receipts", type=int, default=400)
    parser.add_argument("--devices", type=int, default=11)
    parser.add_argument("--leave-out-devices", default="faded_thermal,screenshot")
    parser.add_argument("--views", type=int, default=60_000, help="augmented training views to show the model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--write", action="store_true", help="install the weights into receipt_embed/weights/")
    args = parser.parse_args()
    out = Path(args.out)
    samples = out / "samples"
    started = time.perf_counter()
    if not (samples / "manifest.csv").exists():
        make_samples(samples, args.receipts, args.devices, args.seed)
    leave_out = set(filter(None, args.leave_out_devices.split(",")))
    split = split_manifest(samples, out, 0.0, leave_out)
    ingest(out / "manifest.csv", out / "dataset", load_config(overrides=["ingest.allow_absolute_paths=true"]).ingest)
    config = load_config(overrides=[f"train.seed={args.seed}"])
    train_receipts = split["receipts"] - split["val_receipts"]
    k = 3  # the defaults' sampler: P receipts x K = 3 captures each
    epochs = math.ceil(args.views / (train_receipts * k))
    # from scratch: the shipped defaults but model.pretrained, which is these weights' previous version
    config = load_config(overrides=[f"train.seed={args.seed}", f"train.epochs={epochs}", "model.pretrained=none"])
    run = out / "run"
    train(config, out / "dataset", run, _registry(None), progress=True, force=True)
    seconds = time.perf_counter() - started
    loaded = load_model(run / "checkpoints" / "best.pt", _registry(None))
    encoder = {name: tensor.detach().clone() for name, tensor in loaded.model.encoder.state_dict().items()}
    epochs_run = list(read_jsonl(run / "metrics.jsonl"))
    defaults = inspect.signature(ReceiptCNN).parameters
    recipe = {
        "encoder": config.model.encoder,
        "in_channels": 1 if config.data.grayscale else 3,
        "widths": list(config.model.params.get("widths", defaults["widths"].default)),
        "stem": config.model.params.get("stem", defaults["stem"].default),
        "image_size": list(config.data.image_size),
        "trained_on": (
            f"make-samples --receipts {args.receipts} --devices {args.devices} --seed {args.seed} "
            f"(generated receipts only), without the devices {sorted(leave_out)}"
        ),
        "train_receipts": train_receipts,
        "val_receipts": split["val_receipts"],
        "epochs": epochs,
        "best": load_checkpoint(run / "checkpoints" / "best.pt").get("best"),
        "epochs_run": len(epochs_run),
        "seconds": round(seconds),
        "command": "python benchmarks/bundled_model.py " + " ".join(sys.argv[1:]),
        "torch": torch.__version__,
    }
    target = WEIGHTS if args.write else out / WEIGHTS.name
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(target, "wb") as handle:
        torch.save(encoder, handle)
    atomic_write_json(RECIPE if args.write else out / RECIPE.name, recipe)
    shutil.copy2(run / "metrics.jsonl", out / "metrics.jsonl")
    print(json.dumps({**recipe, "weights": str(target), "bytes": target.stat().st_size}, indent=1))


if __name__ == "__main__":
    main()
