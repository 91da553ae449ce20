"""The training loop: identity-aware batches of augmented views -> encoder + head -> loss.

One epoch = one pass of the sampler over the training identities. After each epoch the
model is evaluated on the identity-disjoint val split (retrieval through FAISS plus
collapse diagnostics), a line goes to ``metrics.jsonl``, ``checkpoints/last.pt`` is
replaced atomically, and ``checkpoints/best.pt`` follows the best val recall@1 (never the
loss). SIGINT/SIGTERM finish the current step, save ``last.pt`` and stop; ``resume``
continues from it and reproduces the uninterrupted run (exactly, in deterministic mode).
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from receipt_embed.config import Config, save_config
from receipt_embed.data.cache import ImageCache, cache_size
from receipt_embed.data.dataset_dir import Captures, cache_captures, load_dataset_dir, select_split
from receipt_embed.data.views import SeededBatches, ViewDataset, clean_batches
from receipt_embed.evaluation.diagnostics import embedding_diagnostics
from receipt_embed.evaluation.retrieval import retrieval_metrics
from receipt_embed.fileio import append_line, atomic_write_json, atomic_write_jsonl, read_jsonl_tail_tolerant
from receipt_embed.models.embedder import Embedder, set_batchnorm_momentum
from receipt_embed.registry import ComponentError, plugin_errors
from receipt_embed.sampling import build_sampler
from receipt_embed.training.checkpoint import (
    CheckpointError,
    check_resumable,
    load_checkpoint,
    load_weights,
    save_checkpoint,
)

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"
DATA_FILE = "data.json"  # the dataset dir a run trains on, and its manifest's sha256
LAST, BEST = "checkpoints/last.pt", "checkpoints/best.pt"
# config keys that may change when resuming (everything else must match the checkpoint)
RESUMABLE_CHANGES = {"train.epochs", "train.num_workers", "plugins.dir", "plugins.strict"}


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the last good checkpoint is left intact."""


class TrainingInterrupted(RuntimeError):
    """SIGINT or SIGTERM arrived; a checkpoint was saved to resume from."""


@dataclass
class TrainResult:
    run_dir: Path
    metrics: list[dict] = field(default_factory=list)
    best_epoch: int | None = None
    best_recall_at_1: float | None = None


def build_model(config: Config, registry, from_checkpoint: bool = False) -> Embedder:
    """Encoder plugin + projection head, as the config describes them. ``from_checkpoint``:
    the weights come from a checkpoint, so ``model.pretrained`` is never fetched or read."""
    framework = {
        "pretrained": None if from_checkpoint else config.model.pretrained,
        "in_channels": 1 if config.data.grayscale else 3,
        "pooling": config.model.pooling,
        "grid": tuple(config.model.grid),
    }
    encoder = registry.create_with("encoder", config.model.encoder, framework, dict(config.model.params))
    plugin = registry.get("encoder", config.model.encoder).plugin
    if not isinstance(encoder, torch.nn.Module) or not isinstance(getattr(encoder, "feature_dim", None), int):
        raise ComponentError(
            f"encoder {config.model.encoder!r} (from plugin {plugin!r}) built an object of type "
            f"{type(encoder).__name__} that is not a torch.nn.Module with an integer feature_dim "
            "(see docs/plugins.md)"
        )
    model = Embedder(encoder, config.model.head_hidden, config.model.head_dim, config.model.input_norm)
    set_batchnorm_momentum(model, config.model.bn_momentum)
    return model


def dataset_record(data_dir) -> dict:
    """Where a run's data lives and what it was, so --resume can find it and refuse another."""
    from receipt_embed.data.dataset_dir import MANIFEST_FILE
    from receipt_embed.indexing.index_dir import sha256_file

    manifest = Path(data_dir) / MANIFEST_FILE
    return {
        "data_dir": str(Path(data_dir).resolve()),
        "manifest_sha256": sha256_file(manifest) if manifest.is_file() else None,
    }


def _read_data_record(run_dir) -> dict | None:
    from receipt_embed.fileio import read_json
    from receipt_embed.userfiles import UnusableFile

    path = Path(run_dir) / DATA_FILE
    if not os.path.lexists(path):
        return None
    try:
        saved = read_json(path)
        saved["data_dir"]
    except UnusableFile:
        raise  # a FIFO or device named as such: never read
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(
            f"{path} is damaged; resume with --data DATASET_DIR (it is rewritten by a fresh run)"
        ) from None
    return saved


def recorded_data_dir(run_dir) -> str | None:
    """The dataset dir a run was started on (None for a run without data.json)."""
    saved = _read_data_record(run_dir)
    return saved["data_dir"] if saved else None


def check_same_dataset(run_dir, record: dict) -> None:
    saved = _read_data_record(run_dir)
    if saved is None:
        return
    if record["manifest_sha256"] is None:
        raise CheckpointError(
            f"cannot resume {run_dir}: {record['data_dir']} holds no manifest.jsonl (moved or "
            "deleted?); pass --data with the dataset dir the run was trained on"
        )
    if saved.get("manifest_sha256") and record["manifest_sha256"] != saved["manifest_sha256"]:
        if Path(record["data_dir"]) == Path(saved["data_dir"]):  # the same dir, re-ingested or edited since
            raise CheckpointError(
                f"cannot resume {run_dir}: the manifest of {record['data_dir']} changed since the "
                f"run was trained on it (its sha256 is not the one in {Path(run_dir) / DATA_FILE}); "
                "resume on the dataset as it was, or start a new run with --force"
            )
        raise CheckpointError(
            f"cannot resume {run_dir} on {record['data_dir']}: the run was trained on "
            f"{saved['data_dir']}, whose manifest differs; resume with --data {saved['data_dir']}"
        )


def _check_built(registry, kind: str, name: str, built, needs: tuple[str, ...]) -> None:
    """A plugin's factory returned something train cannot use: say which component and rule."""
    missing = [attr for attr in needs if not hasattr(built, attr)]
    if missing:
        plugin = registry.get(kind, name).plugin
        raise ComponentError(
            f"{kind} {name!r} (from plugin {plugin!r}) built a {type(built).__name__} without "
            f"{', '.join(missing)}; a {kind} needs {', '.join(needs)} (see docs/plugins.md)"
        )


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in d.items():
        if isinstance(value, dict) and value and key != "params":
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _check_resume_config(saved: dict, current: dict, path: Path) -> None:
    a, b = _flatten(saved), _flatten(current)
    diffs = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k) and k not in RESUMABLE_CHANGES]
    if diffs:
        details = "; ".join(f"{k}: checkpoint {a.get(k)!r}, now {b.get(k)!r}" for k in diffs)
        raise CheckpointError(f"cannot resume from {path}: the config differs ({details})")


def _scheduler(optimizer, steps_per_epoch: int, config: Config):
    """Linear warmup from 1% then cosine decay to 0 at the last step of ``train.epochs``.

    The factor is a pure function of the step and the *current* plan, so a run resumed with a
    different ``train.epochs`` re-plans its cosine over the new total and still anneals to 0
    at its end (a stateful cosine would keep the old period and climb back up)."""
    total = max(1, steps_per_epoch * config.train.epochs)
    warmup = min(total - 1, round(config.train.warmup_epochs * steps_per_epoch))

    def factor(step: int) -> float:
        if step < warmup:
            return 0.01 + 0.99 * step / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@contextmanager
def _stop_on_signals():
    """Turn SIGINT/SIGTERM into a flag checked between steps."""
    received: list[str] = []
    handlers = {}

    def handler(signum, frame):
        received.append(signal.Signals(signum).name)

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            handlers[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread: leave signals alone
            pass
    try:
        yield received
    finally:
        for sig, previous in handlers.items():
            signal.signal(sig, previous)


@torch.no_grad()
def embed_cache(model: Embedder, cache: ImageCache, config: Config) -> tuple[np.ndarray, np.ndarray]:
    """(backbone features, head projections) of clean (unaugmented) cached captures."""
    model.eval()
    features, projections = [], []
    for images in clean_batches(
        cache.images, tuple(config.data.image_size), config.data.grayscale, config.train.eval_batch_size
    ):
        f, p = model(images)
        features.append(f.float().numpy())
        projections.append(p.float().numpy())
    return np.concatenate(features), np.concatenate(projections)


@torch.no_grad()
def recalibrate_batchnorm(model: Embedder, cache: ImageCache, config: Config, count: int) -> None:
    """Recompute BatchNorm running statistics on clean training captures (a cumulative
    average), so evaluation does not use statistics of augmented views lagging behind."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not norms or count <= 0:
        return
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
    model.train()
    for images in clean_batches(
        cache.images[:count], tuple(config.data.image_size), config.data.grayscale, config.train.eval_batch_size
    ):
        if len(images) > 1:
            model(images)
    for m, momentum in zip(norms, momenta):
        m.momentum = momentum


def evaluate(model: Embedder, val: Captures, val_cache: ImageCache, config: Config) -> dict:
    features, projections = embed_cache(model, val_cache, config)
    labels = np.asarray(val.labels)
    result = {}
    for name, x in (("backbone", features), ("head", projections)):
        recall = retrieval_metrics(x, labels, ks=(1, 5), with_map=False)
        result[name] = {"recall_at_1": recall["recall_at_1"], "recall_at_5": recall["recall_at_5"]}
    result["diagnostics"] = {
        name: embedding_diagnostics(x, labels) for name, x in (("backbone", features), ("head", projections))
    }
    return result


class RankBatches:
    """This rank's rows of each global batch (views keep the seeds of their global slots).

    A two-view batch ``[first captures of B; second captures of B]`` (row i and row B + i share
    an identity) gives each rank B/W identities with both captures, in the same layout; any
    other batch gives each rank a contiguous 1/W of its rows (multi-positive losses read labels,
    not positions)."""

    def __init__(self, batches: SeededBatches, labels: list[int], rank: int, world_size: int):
        self.batches, self.labels, self.rank, self.world_size = batches, labels, rank, world_size
        self.unique_identities = 0  # summed over the global batches handed out so far

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        from receipt_embed.distributed import identity_slice

        for batch in self.batches:
            self.unique_identities += len({self.labels[index] for index, _ in batch})
            half = len(batch) // 2
            if len(batch) % 2 == 0 and all(
                self.labels[batch[i][0]] == self.labels[batch[half + i][0]] for i in range(half)
            ):
                firsts = identity_slice(list(range(half)), self.rank, self.world_size)
                yield [batch[i] for i in firsts] + [batch[half + i] for i in firsts]
            else:
                yield identity_slice(batch, self.rank, self.world_size)


class Trainer:
    """Holds the pieces of one run; :meth:`run` trains to the configured epoch count.

    Under torchrun (WORLD_SIZE > 1) every rank draws the same global batches, embeds its share,
    and the loss runs on the gathered global batch (``receipt_embed.distributed``); rank 0
    evaluates, logs and writes the run dir."""

    def __init__(
        self,
        config: Config,
        data_dir,
        run_dir,
        registry,
        resume: bool = False,
        progress: bool = True,
        log=print,
        force: bool = False,
    ):
        from receipt_embed.distributed import init_from_env

        self.ctx = init_from_env()
        if not self.ctx.is_main:
            progress, log = False, (lambda message: None)
        self.config, self.registry, self.progress, self.log = config, registry, progress, log
        self.run_dir = Path(run_dir)
        self.config_dict = config.model_dump(mode="json")
        last = self.run_dir / LAST
        self.state = None
        if resume:
            self.state = load_checkpoint(last)
            _check_resume_config(self.state["config"], self.config_dict, last)
            saved_world = self.state.get("world_size", 1)
            if saved_world != self.ctx.world_size:
                raise CheckpointError(
                    f"{last} was written by a run over {saved_world} process(es); resume it with the same number "
                    f"(--nproc {saved_world}), not {self.ctx.world_size}: the global batches would differ"
                )
        elif last.exists() and not force:
            raise CheckpointError(
                f"{self.run_dir} already holds a run ({last}); pass --resume to continue it, --force to "
                "replace it, or choose another --out"
            )
        self.force, self.replacement = force and not resume, None

        train_cfg = config.train
        torch.manual_seed(train_cfg.seed)
        if train_cfg.deterministic:
            torch.use_deterministic_algorithms(True)

        self.data_record = dataset_record(data_dir)
        if resume:
            check_same_dataset(self.run_dir, self.data_record)
        rows = load_dataset_dir(data_dir)
        self.train_set = select_split(rows, "train")
        self.val_set = select_split(rows, "val")
        if len(self.train_set.identities) < 2:
            raise ValueError(
                f"{data_dir} has {len(self.train_set.identities)} training identities; at least 2 are needed"
            )
        size = cache_size(tuple(config.data.image_size), train_cfg.cache_margin)
        self.train_cache = cache_captures(self.train_set, size, config.ingest, progress=progress)
        self.val_cache = cache_captures(self.val_set, size, config.ingest, progress=progress)

        self.model = build_model(config, registry, from_checkpoint=self.state is not None)
        self.loss_fn = registry.create_with(
            "loss", config.loss.name, {"temperature": config.loss.temperature}, dict(config.loss.params)
        )
        if not isinstance(self.loss_fn, torch.nn.Module):
            raise ComponentError(
                f"loss {config.loss.name!r} (from plugin {registry.get('loss', config.loss.name).plugin!r}) "
                f"built a {type(self.loss_fn).__name__}, not a torch.nn.Module (see docs/plugins.md)"
            )
        batch_size = min(train_cfg.batch_size, len(self.train_set.identities))
        if batch_size < train_cfg.batch_size:
            log(
                f"train.batch_size {train_cfg.batch_size} > {len(self.train_set.identities)} training identities; using {batch_size}"
            )
        self.sampler = build_sampler(
            registry,
            config.sampler.name,
            self.train_set.labels,
            self.train_set.rows,
            batch_size,
            train_cfg.seed,
            config.sampler.params,
        )
        self.batches = SeededBatches(
            self.sampler,
            train_cfg.seed,
            len(self.train_set),
            f"sampler {config.sampler.name!r} (from plugin {registry.get('sampler', config.sampler.name).plugin!r})",
        )
        if self.ctx.distributed:
            if batch_size % self.ctx.world_size:
                raise ValueError(
                    f"train.batch_size {batch_size} does not split over {self.ctx.world_size} processes; "
                    "use a multiple of the process count"
                )
        _check_built(registry, "sampler", config.sampler.name, self.sampler, ("__len__", "__iter__", "set_epoch"))
        transform = registry.create_with(
            "augmentation",
            config.augment.preset,
            {"image_size": tuple(config.data.image_size)},
            dict(config.augment.params),
        )
        _check_built(registry, "augmentation", config.augment.preset, transform, ("__call__", "set_random_seed"))
        _check_built(registry, "loss", config.loss.name, self.loss_fn, ("__call__",))
        self.dataset = ViewDataset(
            self.train_cache,
            transform,
            config.data.grayscale,
            self.train_set.labels,
            image_size=tuple(config.data.image_size),
            source=f"augmentation {config.augment.preset!r}",
        )
        with plugin_errors(registry, "augmentation", config.augment.preset, "making a test view"):
            self.dataset[(0, 0)]  # a preset that breaks the view rules fails here, not in a loader worker
        self._check_encoder_output()
        self.key_model = None
        if getattr(self.loss_fn, "wants_momentum_keys", False):
            from receipt_embed.losses.moco import make_momentum_encoder

            self.key_model = make_momentum_encoder(self.model)
        self.forward_model = self.model
        if self.ctx.distributed:
            from torch.nn.parallel import DistributedDataParallel

            self.forward_model = DistributedDataParallel(self.model)
        params = list(self.model.parameters()) + list(self.loss_fn.parameters())
        self.optimizer = torch.optim.AdamW(params, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay)
        self.steps_per_epoch = len(self.sampler)
        self.scheduler = _scheduler(self.optimizer, self.steps_per_epoch, config)

        self.epoch, self.step = 0, 0
        self.sums = {"loss": 0.0, "steps": 0, "views": 0, "seconds": 0.0}
        self.best = None
        if self.state is not None:
            self._restore(self.state)

    @torch.no_grad()
    def _check_encoder_output(self) -> None:
        """One forward of two blank images: an encoder whose output does not match its
        feature_dim is named here, not in the head's matrix multiply mid-epoch."""
        name = self.config.model.encoder
        channels = 1 if self.config.data.grayscale else 3
        was_training = self.model.encoder.training
        self.model.encoder.eval()
        with plugin_errors(self.registry, "encoder", name, "embedding two test images"):
            out = self.model.encoder(torch.zeros(2, channels, *self.config.data.image_size))
        self.model.encoder.train(was_training)
        expected = (2, self.model.encoder.feature_dim)
        if not torch.is_tensor(out) or tuple(out.shape) != expected:
            got = tuple(out.shape) if torch.is_tensor(out) else type(out).__name__
            plugin = self.registry.get("encoder", name).plugin
            raise ComponentError(
                f"encoder {name!r} (from plugin {plugin!r}) returned {got} for 2 images of "
                f"{channels} x {self.config.data.image_size[0]} x {self.config.data.image_size[1]}; "
                f"expected (N, feature_dim) = {expected}"
            )

    def _restore(self, state: dict) -> None:
        path = self.run_dir / LAST
        check_resumable(state, path)
        load_weights(self.model, state["model"], path)
        if self.key_model is not None:
            if "momentum_model" not in state:
                raise CheckpointError(f"{path} lacks 'momentum_model', which the loss {self.config.loss.name!r} needs")
            load_weights(self.key_model, state["momentum_model"], path, "momentum_model")
        for key, target in (("loss", self.loss_fn), ("optimizer", self.optimizer), ("scheduler", self.scheduler)):
            try:
                target.load_state_dict(state[key])
            except (KeyError, IndexError, RuntimeError, TypeError, ValueError) as exc:
                raise CheckpointError(
                    f"{path}: {key} does not fit this run: {str(exc).strip().splitlines()[0]}"
                ) from None
        self.epoch, self.step = state["epoch"], state["step"]
        self.sums = dict(state["sums"])
        self.best = state.get("best")
        try:
            torch.set_rng_state(state["torch_rng"])
        except (RuntimeError, TypeError) as exc:
            raise CheckpointError(
                f"{path}: torch_rng is not a torch RNG state: {str(exc).strip().splitlines()[0]}"
            ) from None
        # metrics of epochs after the checkpoint were never confirmed: drop them
        metrics = self.run_dir / METRICS_FILE
        if metrics.exists() and self.ctx.is_main:  # rank 0 alone reads and writes the run's files
            rows, torn = read_jsonl_tail_tolerant(metrics)
            bad = [
                n for n, m in enumerate(rows, start=1) if not isinstance(m, dict) or not isinstance(m.get("epoch"), int)
            ]
            if bad:
                raise CheckpointError(f"{metrics}, line {bad[0]}: not an epoch record; move the file aside to resume")
            kept = [m for m in rows if m["epoch"] <= self.epoch]
            if torn or len(kept) < len(rows):
                atomic_write_jsonl(metrics, kept)
        self.log(f"resuming {self.run_dir} at epoch {self.epoch + 1}, step {self.step}")

    def _state(self) -> dict:
        return {
            "model": self.model.state_dict(),
            **({"momentum_model": self.key_model.state_dict()} if self.key_model is not None else {}),
            "loss": self.loss_fn.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "epoch": self.epoch,
            "step": self.step,
            "sums": dict(self.sums),
            "best": self.best,
            "torch_rng": torch.get_rng_state(),
            "config": self.config_dict,
            "world_size": self.ctx.world_size,
        }

    def _make_loader(self) -> DataLoader:
        """One loader for the run; persistent workers avoid a fork per epoch on small sets."""
        workers = self.config.train.num_workers
        self.rank_batches = (
            RankBatches(self.batches, self.train_set.labels, self.ctx.rank, self.ctx.world_size)
            if self.ctx.distributed
            else None
        )
        return DataLoader(
            self.dataset,
            batch_sampler=self.batches if self.rank_batches is None else self.rank_batches,
            num_workers=workers,
            persistent_workers=workers > 0,
            prefetch_factor=4 if workers else None,
        )

    def _train_step(self, views: torch.Tensor, labels: torch.Tensor) -> float:
        autocast = (
            torch.autocast("cpu", dtype=torch.bfloat16) if self.config.train.precision == "bf16" else nullcontext()
        )
        self.model.train()
        with autocast, plugin_errors(self.registry, "encoder", self.config.model.encoder, "embedding a batch"):
            _, projections = self.forward_model(views)
        if self.ctx.distributed:
            from receipt_embed.distributed import global_loss

            half = len(labels) // 2  # a two-view slice is [first views; second views] of its identities
            two_view = len(labels) % 2 == 0 and torch.equal(labels, labels.roll(half))
            keys = None if self.key_model is None else self._momentum_keys(views, labels)
            loss = global_loss(self.loss_fn, projections.float(), labels, two_view=two_view, local_keys=keys)
        elif self.key_model is None:
            with plugin_errors(self.registry, "loss", self.config.loss.name, "computing the loss"):
                loss = self.loss_fn(projections.float(), labels)
        else:
            loss = self.loss_fn(projections.float(), labels, keys=self._momentum_keys(views, labels))
        if not torch.is_tensor(loss) or loss.ndim != 0:
            plugin = self.registry.get("loss", self.config.loss.name).plugin
            shape = tuple(loss.shape) if torch.is_tensor(loss) else type(loss).__name__
            raise ComponentError(
                f"loss {self.config.loss.name!r} (from plugin {plugin!r}) returned {shape}, "
                "not a scalar tensor; reduce it (e.g. .mean()) inside the loss"
            )
        if not torch.isfinite(loss):
            last = self.run_dir / LAST
            kept = (
                f"the last good checkpoint is {last}"
                if last.exists()
                else "no checkpoint was written yet (it diverged in the first epoch)"
            )
            raise TrainingDiverged(
                f"loss became {loss.item()} at epoch {self.epoch + 1}, step {self.step + 1} "
                f"(loss {self.config.loss.name}, temperature {self.config.loss.temperature}); {kept}. "
                "Try a lower train.lr, or a higher loss.temperature for a temperature-scaled loss."
            )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.config.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.train.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        return loss.item()

    @torch.no_grad()
    def _momentum_keys(self, views: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Keys from the momentum encoder: row i's key is the *other* view of its receipt."""
        from receipt_embed.losses.moco import momentum_update

        half = len(views) // 2
        if len(views) % 2 or not torch.equal(labels, labels.roll(half)):
            raise ValueError(f"loss {self.config.loss.name!r} needs two-view batches; use sampler unique_identity")
        momentum_update(self.model, self.key_model, self.config.train.momentum)
        self.key_model.train()
        _, keys = self.key_model(views)
        return keys.float().roll(half, dims=0)

    def run(self) -> TrainResult:
        if self.ctx.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if self.force:  # the old run stays beside until the new one has a checkpoint
                from receipt_embed.training.rundir import Replacement

                self.replacement = Replacement(self.run_dir)
        try:
            return self._run()
        except BaseException:
            if self.replacement is not None:
                self.replacement.failed()
                self.log(f"the new run stopped before its first checkpoint: the previous run in {self.run_dir} is kept")
            raise

    def _save_last(self, state: dict) -> None:
        save_checkpoint(self.run_dir / LAST, state)
        if self.replacement is not None:
            self.replacement.checkpoint_written()
            self.replacement = None

    def _run(self) -> TrainResult:
        if self.ctx.is_main:
            save_config(self.config, self.run_dir / CONFIG_FILE)
            if self.state is None:  # a fresh run (also over the leftovers of one that never saved a checkpoint)
                atomic_write_json(self.run_dir / DATA_FILE, self.data_record)
                (self.run_dir / METRICS_FILE).unlink(missing_ok=True)
        result = TrainResult(self.run_dir)
        epochs = self.config.train.epochs
        loader = self._make_loader()
        with _stop_on_signals() as received:
            while self.epoch < epochs:
                self.batches.set_epoch(self.epoch, self.step)
                bar = tqdm(
                    total=self.steps_per_epoch,
                    initial=self.step,
                    desc=f"epoch {self.epoch + 1}/{epochs}",
                    unit="step",
                    disable=not self.progress,
                    leave=False,
                )
                started = time.perf_counter()
                for views, labels in loader:
                    loss = self._train_step(views, labels)
                    self.step += 1
                    self.sums["loss"] += loss
                    self.sums["steps"] += 1
                    self.sums["views"] += len(views) * self.ctx.world_size
                    stats = getattr(self.loss_fn, "last_stats", None)
                    if stats:  # kept in the checkpoint so a resumed epoch reports it too
                        self.sums["loss_stats"] = {k: (v.item() if torch.is_tensor(v) else v) for k, v in stats.items()}
                    elapsed = self.sums["seconds"] + time.perf_counter() - started
                    bar.set_postfix(loss=f"{loss:.4f}", views_s=f"{self.sums['views'] / max(elapsed, 1e-9):.0f}")
                    bar.update()
                    if self._any_rank(received):  # all ranks stop after the same step
                        self.sums["seconds"] = elapsed
                        if self.ctx.is_main:
                            self._save_last(self._state())
                        bar.close()
                        raise TrainingInterrupted(
                            f"{received[0] if received else 'a stop signal'} received: saved {self.run_dir / LAST} "
                            f"at epoch {self.epoch + 1}, step {self.step}; continue with --resume"
                        )
                bar.close()
                self.sums["seconds"] += time.perf_counter() - started
                line = self._end_epoch()
                result.metrics.append(line)
                self.log(self._describe(line))
                if self._any_rank(received) and self.epoch < epochs:  # arrived during evaluation: last.pt is saved
                    raise TrainingInterrupted(
                        f"{received[0] if received else 'a stop signal'} received: saved {self.run_dir / LAST} "
                        f"after epoch {self.epoch}; continue with --resume"
                    )
        result.best_epoch = self.best["epoch"] if self.best else None
        result.best_recall_at_1 = self.best["recall_at_1"] if self.best else None
        return result

    def _any_rank(self, received: list) -> bool:
        """Whether any rank got a stop signal (one tiny all-reduce per step when distributed),
        so that every rank stops after the same step instead of waiting on a gone peer."""
        if not self.ctx.distributed:
            return bool(received)
        import torch.distributed as dist

        flag = torch.tensor([1 if received else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _end_epoch(self) -> dict:
        sums = self.sums
        line = {
            "epoch": self.epoch + 1,
            "steps": sums["steps"],
            "loss": sums["loss"] / max(sums["steps"], 1),
            "lr": self.optimizer.param_groups[0]["lr"],
            "views_per_s": sums["views"] / max(sums["seconds"], 1e-9),
            "train_seconds": sums["seconds"],
            "sampler": dict(getattr(self.sampler, "stats", {})),
        }
        if "loss_stats" in sums:
            line["loss_stats"] = sums["loss_stats"]
        line["world_size"] = self.ctx.world_size
        if self.ctx.distributed:
            if self.rank_batches is not None and sums["steps"]:
                # the loader may run ahead of training by a few prefetched batches; the count
                # is per global batch drawn this epoch
                line["global_unique_identities_per_step"] = self.rank_batches.unique_identities / sums["steps"]
                self.rank_batches.unique_identities = 0
        if not self.ctx.is_main:  # rank 0 evaluates and writes; its BN statistics reach the others via DDP
            self.epoch += 1
            self.step = 0
            self.sums = {"loss": 0.0, "steps": 0, "views": 0, "seconds": 0.0}
            return line
        if len(self.val_set):
            recalibrate_batchnorm(self.model, self.train_cache, self.config, self.config.train.bn_recalibrate)
            line["val"] = evaluate(self.model, self.val_set, self.val_cache, self.config)
        append_line(self.run_dir / METRICS_FILE, json.dumps(line))  # one write + fsync: a crash tears at most this line
        self.epoch += 1
        self.step = 0
        self.sums = {"loss": 0.0, "steps": 0, "views": 0, "seconds": 0.0}
        selected = line.get("val", {}).get(self.config.train.select_on, {}).get("recall_at_1")
        # ties go to the later epoch: as good on val, and trained longer at a lower learning rate
        improved = selected is not None and (self.best is None or selected >= self.best["recall_at_1"])
        if improved:
            self.best = {"epoch": line["epoch"], "recall_at_1": selected}
        state = self._state()
        self._save_last(state)
        if improved or (not len(self.val_set) and self.epoch == self.config.train.epochs):
            save_checkpoint(self.run_dir / BEST, state)
        self._epoch_hooks(line)
        return line

    def _epoch_hooks(self, line: dict) -> None:
        """Plugins' ``on_epoch_end`` (trackers, checkpoint copies); one failing plugin only warns."""
        from receipt_embed.plugin_manager import call_hook, hook_implementations

        if not hook_implementations(self.registry, "on_epoch_end"):
            return
        self.model.eval()
        call_hook(
            self.registry,
            "on_epoch_end",
            where=f"epoch {line['epoch']}",
            run_dir=self.run_dir.resolve(),
            epoch=line["epoch"],
            metrics=json.loads(json.dumps(line)),
            model=self.model,
            config=self.config,
        )

    def _describe(self, line: dict) -> str:
        text = f"epoch {line['epoch']}: loss {line['loss']:.4f}, {line['views_per_s']:.0f} views/s"
        if "val" in line:
            v = line["val"]
            text += (
                f", val recall@1 backbone {v['backbone']['recall_at_1']:.3f} / head {v['head']['recall_at_1']:.3f}"
                f", eff. rank {v['diagnostics']['head']['effective_rank']:.1f}"
            )
        return text


def train(
    config: Config,
    data_dir,
    run_dir,
    registry,
    resume: bool = False,
    progress: bool = True,
    log=print,
    force: bool = False,
) -> TrainResult:
    """Train (or resume) a run; see :class:`Trainer`. The run dir's writer lock is held for the
    whole run (by rank 0 only under torchrun); ``force`` replaces an existing run, keeping it
    until the new run's first checkpoint."""
    import os

    from receipt_embed.locking import write_lock
    from receipt_embed.training.rundir import settle_leftovers

    main = int(os.environ.get("RANK", "0")) == 0
    with write_lock(run_dir) if main else nullcontext():
        if main:
            refuse_other_kinds(run_dir, data_dir)
            settle_leftovers(run_dir, log=None)
        trainer = Trainer(config, data_dir, run_dir, registry, resume=resume, progress=progress, log=log, force=force)
        return trainer.run()


def refuse_other_kinds(run_dir, data_dir=None) -> None:
    """A dataset, index, shard or report dir, a user's folder, or one holding the data the run reads, is
    never turned into a run dir."""
    from receipt_embed.outdir import WHAT, dir_kind
    from receipt_embed.training.rundir import check_run_out, refuse_dataset_inside

    kind = dir_kind(run_dir)
    if kind in ("dataset", "index", "shard", "audit"):
        raise ValueError(f"{run_dir} holds {WHAT[kind]}, not a run; train into another --out")
    check_run_out(run_dir)
    refuse_dataset_inside(run_dir, data_dir)
