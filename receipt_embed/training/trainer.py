"""The training loop: identity-aware batches of augmented views -> encoder + head -> loss.

One epoch = one pass of the sampler over the training identities. After each epoch the
model is evaluated on the identity-disjoint val split (retrieval through FAISS plus
collapse diagnostics), a line goes to ``metrics.jsonl``, ``checkpoints/last.pt`` is
replaced atomically, and ``checkpoints/best.pt`` follows the best val recall@1 (never the
loss). SIGINT/SIGTERM finish the current step, save ``last.pt`` and stop; ``resume``
continues from it and reproduces the uninterrupted run (exactly, in deterministic mode).

The pieces live next door: the run dir's files and checks (``rundir``, ``resume``,
``replacement``), the plugin components (``components``), the learning-rate schedule
(``schedule``), checkpoints (``checkpoint``), evaluation (``evaluation.validation``),
model building (``models.build``) and rank bookkeeping (``distributed``).
"""

from __future__ import annotations

import json
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from receipt_embed.batch_layout import TWO_VIEW
from receipt_embed.config import Config, cache_size, save_config
from receipt_embed.data.dataset_dir import Captures, cache_captures, load_dataset_dir, select_split
from receipt_embed.distributed import RankBatches, agree_after_step, any_rank, init_from_env
from receipt_embed.errors import BadInput
from receipt_embed.evaluation.validation import evaluate, recalibrate_batchnorm
from receipt_embed.fileio import append_line, atomic_write_json, atomic_write_jsonl
from receipt_embed.locking import check_still_held
from receipt_embed.registry import plugin_errors
from receipt_embed.stops import (
    SaysWhatTheStopLeft,
    StoppedBySignal,
    raise_if_stopped,
    signal_name,
    stop_of,
    stopped_while,
)
from receipt_embed.training.budget import TimeBudget, budget_spent, nothing_to_train
from receipt_embed.training.checkpoint import save_checkpoint
from receipt_embed.training.components import build_components
from receipt_embed.training.hooks import call_epoch_hooks
from receipt_embed.training.metrics import describe_epoch, epoch_line, fresh_sums
from receipt_embed.training.precision import describe_precision, resolve_precision
from receipt_embed.training.resume import check_same_dataset, dataset_record, open_run
from receipt_embed.training.rundir import BEST, CONFIG_FILE, DATA_FILE, LAST, METRICS_FILE
from receipt_embed.training.schedule import AUTO_VIEWS, lr_schedule, planned_epochs
from receipt_embed.training.signals import stop_on_signals
from receipt_embed.training.state import restore_state, run_state
from receipt_embed.training.step import TrainingDiverged, TrainingStep
from receipt_embed.training.whitening import fit_run_whitening

__all__ = ["TrainResult", "Trainer", "TrainingDiverged", "TrainingInterrupted", "train"]


class TrainingInterrupted(SaysWhatTheStopLeft, RuntimeError):
    """SIGINT or SIGTERM arrived; a checkpoint was saved to resume from. ``code`` is the exit code
    a shell expects of that signal (130 for SIGINT, 143 for SIGTERM)."""

    def __init__(self, message: str, signal_name: str | None = None, complete: bool = False):
        super().__init__(message)
        import signal

        self.code = 128 + (signal.Signals[signal_name] if signal_name else signal.SIGINT)
        self.complete = complete  # it came after the last epoch was saved: nothing is left to train


@dataclass
class TrainResult:
    run_dir: Path
    metrics: list[dict] = field(default_factory=list)
    best_epoch: int | None = None
    best_recall_at_1: float | None = None

    def best_said(self) -> str:
        """``best val recall@1 0.917 at epoch 12``, or why there is none (best.pt is then the last epoch's)."""
        if self.best_epoch is None or self.best_recall_at_1 is None:
            return "no val figures to choose by, so best.pt is the last epoch's"
        return f"best val recall@1 {self.best_recall_at_1:.3f} at epoch {self.best_epoch}"


class Trainer(TrainingStep):
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
        self.ctx = init_from_env()
        if not self.ctx.is_main:
            progress, log = False, (lambda message: None)
        self.config, self.registry, self.progress, self.log = config, registry, progress, log
        self.run_dir = Path(run_dir)
        self.config_dict = config.model_dump(mode="json")
        self.state = open_run(self.run_dir, resume, force, self.ctx.world_size, self.config_dict)
        self.force, self.replacement = force and not resume, None
        self.waiting_for = "the step to end"  # what a second stop signal cuts short: said in its line
        self.said_kept = False  # whether a line already said a --force run kept the previous run
        self.confirmed_metrics: list[dict] | None = None  # a resumed run's metrics, rewritten at its first epoch
        self.precision = resolve_precision(config.train.precision)
        torch.manual_seed(config.train.seed)
        if config.train.deterministic:
            torch.use_deterministic_algorithms(True)
        self._load_data(data_dir, resume)
        self._build_components()
        params = list(self.model.parameters()) + list(self.loss_fn.parameters())
        # fused: one kernel for all parameters, 3x faster than the per-tensor loop on CPU (profile_step.py)
        self.optimizer = torch.optim.AdamW(
            params, lr=config.train.lr, weight_decay=config.train.weight_decay, fused=True
        )
        # batches depend only on (seed, epoch): looking at one changes nothing, and a sampler that
        # yields none is named here, before the run dir is written
        self.steps_per_epoch = self.batches.declared_length()
        views_per_step = len(next(iter(self.batches)))
        self.epochs = planned_epochs(config.train.epochs, self.steps_per_epoch, views_per_step)
        self.budget, self.budget_spent = TimeBudget(config.train.max_minutes), 0.0
        time_spent = (lambda: self.budget_spent) if config.train.max_minutes is not None else None
        self.scheduler = lr_schedule(self.optimizer, self.steps_per_epoch, self.epochs, config, time_spent)
        self.epoch, self.step, self.sums, self.best = 0, 0, fresh_sums(), None
        self.stop_flag: list[str] = []  # the stop signals training's handler noted (receipt_embed.training.signals)
        if self.state is not None:
            self._restore(self.state)

    # -- setting up ------------------------------------------------------------------------------

    def _load_data(self, data_dir, resume: bool) -> None:
        """The dataset's train and val splits, decoded once into image caches."""
        self.data_record = dataset_record(data_dir)
        if resume:
            check_same_dataset(self.run_dir, self.data_record, self.state, self.run_dir / LAST)
        rows = load_dataset_dir(data_dir)
        self.train_set = select_split(rows, "train")
        self.val_set = self._usable_val(select_split(rows, "val"), data_dir)
        if len(self.train_set.identities) < 2:
            raise BadInput(
                f"{data_dir} has {len(self.train_set.identities)} training identities; at least 2 are needed"
            )
        size = cache_size(tuple(self.config.data.image_size), self.config.train.cache_margin)
        crop = self.config.data.page_crop
        self.train_cache = cache_captures(self.train_set, size, self.config.ingest, self.progress, crop_page=crop)
        self.val_cache = cache_captures(self.val_set, size, self.config.ingest, self.progress, crop_page=crop)

    def _usable_val(self, val: Captures, data_dir) -> Captures:
        """The val split to select ``best.pt`` on, said when it cannot tell epochs apart: one receipt's
        captures can only find each other (recall@1 1.000 whatever the model), so it is not evaluated."""
        receipts = len(val.identities)
        advice = (
            "put more receipts in val: mark them val in the manifest's split column, or, without that column, "
            "`ingest --set 'ingest.split_ratios=[0.7,0.15,0.15]'`"
        )
        if receipts >= 5:
            return val
        if receipts >= 2:
            self.log(
                f"{data_dir} has only {receipts} val receipts: val recall@1 is a coarse guide to best.pt; {advice}"
            )
            return val
        said = "no val receipts" if receipts == 0 else "1 val receipt, whose recall@1 is 1.000 whatever the model"
        self.log(f"{data_dir} has {said}: nothing is evaluated and best.pt is the last epoch's; {advice}")
        return Captures([], [], [])

    def _build_components(self) -> None:
        """Model, loss, sampler and augmentation from their plugins, each checked before the first step."""
        parts = build_components(
            self.config, self.registry, self.train_set, self.train_cache, self.ctx, self.state is not None, self.log
        )
        self.model, self.forward_model, self.key_model = parts.model, parts.forward_model, parts.key_model
        self.loss_fn, self.sampler, self.batches, self.dataset = parts.loss, parts.sampler, parts.batches, parts.views

    def _restore(self, state: dict) -> None:
        restore_state(self, state, self.run_dir / LAST)
        if self.model.whitening is not None:  # fitted for the features of the run as it ended: refitted at its end
            self.model.whitening.reset()
        self.budget.spent_before = state.get("spent_seconds", 0.0)
        if self.epoch < self.epochs and self.budget.progress() < 1.0:  # a finished run says "nothing to train"
            self.log(f"resuming {self.run_dir} at epoch {self.epoch + 1}, step {self.step}")

    def _state(self) -> dict:
        return run_state(self)

    def _make_loader(self) -> DataLoader:
        """One loader for the run; persistent workers avoid a fork per epoch on small sets."""
        workers = self.config.train.num_workers
        self.rank_batches = (
            RankBatches(
                self.batches, self.train_set.labels, self.ctx.rank, self.ctx.world_size, self.batches.layout == TWO_VIEW
            )
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

    # -- the run ------------------------------------------------------------------------------

    def run(self) -> TrainResult:
        if self.ctx.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if self.force:  # the old run stays beside until the new one has a checkpoint
                from receipt_embed.training.replacement import Replacement

                self.replacement = Replacement(self.run_dir)
        try:
            return self._run()
        except BaseException:
            if self.replacement is not None and self.replacement.failed() and not self.said_kept:
                self.log(f"the new run stopped before its first checkpoint: the previous run in {self.run_dir} is kept")
            raise

    def _run(self) -> TrainResult:
        if self.ctx.is_main:
            save_config(self.config, self.run_dir / CONFIG_FILE)
            if self.state is None:  # a fresh run (also over the leftovers of one that never saved a checkpoint)
                atomic_write_json(self.run_dir / DATA_FILE, self.data_record)
                (self.run_dir / METRICS_FILE).unlink(missing_ok=True)
        result = TrainResult(self.run_dir)
        epochs = self.epochs
        loader = self._make_loader()
        self.budget.start()
        self.budget_spent = self.budget.progress()
        if self.config.train.epochs == "auto" and self.ctx.is_main and self.epoch == 0 and self.step == 0:
            steps = f"{self.steps_per_epoch} step" + ("" if self.steps_per_epoch == 1 else "s")
            budget = self.config.train.max_minutes
            bound = "" if budget is None else f", or fewer: train.max_minutes={budget:g} stops the run when spent"
            self.log(f"train.epochs auto: {epochs} epochs of {steps}, about {AUTO_VIEWS:,} views{bound}")
        if self.config.train.precision == "auto" and self.ctx.is_main and self.epoch == 0 and self.step == 0:
            self.log(describe_precision(self.config.train.precision, self.precision))
        if self.epoch >= epochs or self.out_of_time:
            self.log(nothing_to_train(self.run_dir, self.epoch, epochs, self.config.train.max_minutes))
        raise_if_stopped()  # a stop before training whose exception a library swallowed
        with stop_on_signals() as received:
            self.stop_flag = received
            try:
                while self.epoch < epochs and not self.out_of_time:
                    self._train_epoch(loader, received)
                    line = self._end_epoch()
                    result.metrics.append(line)
                    self.log(describe_epoch(line))
                    if (
                        any_rank(self.ctx, received) and self.epoch < epochs and not self.out_of_time
                    ):  # during evaluation
                        raise TrainingInterrupted(
                            f"{received[0] if received else 'a stop signal'} received: saved {self.run_dir / LAST} "
                            f"after epoch {self.epoch}; continue with --resume",
                            received[0] if received else None,
                        )
                if self.out_of_time and result.metrics:  # said before the whitening fit, which follows it
                    self.log(budget_spent(self.config.train.max_minutes, result.metrics[-1], self.steps_per_epoch))
                if self.config.model.whiten and self.ctx.is_main:
                    self._whiten()
                    if received:  # a stop while fitting: it ran to its end (seconds), and the run is complete
                        raise TrainingInterrupted(
                            f"{received[0]} received while whitening: the run is complete, its checkpoints whitened",
                            received[0],
                            True,
                        )
            except StoppedBySignal as stop:  # a second stop signal: it did not wait for the step to end
                raise self._stopped_at_once(stop) from None
        result.best_epoch = self.best["epoch"] if self.best else None
        result.best_recall_at_1 = self.best["recall_at_1"] if self.best else None
        return result

    def _whiten(self) -> None:
        """Fit model.whiten for best.pt and last.pt, which ``index`` and a later run read."""
        checkpoints = [self.run_dir / name for name in (BEST, LAST) if (self.run_dir / name).is_file()]
        if checkpoints:
            self.waiting_for = "the whitening fit to end"
            fit_run_whitening(self, checkpoints)

    def _stopped_at_once(self, stop: StoppedBySignal) -> TrainingInterrupted:
        last = self.run_dir / LAST
        if self.replacement is not None and self.replacement.aside is not None:  # put back on the way out
            kept = f"the new run had saved no checkpoint, so the previous run in {self.run_dir} is kept"
            self.said_kept = True  # the stop's own line says it: run() does not say it again
        elif last.is_file():
            kept = f"{last} is as it was last saved; continue with --resume"
        else:
            kept = "no checkpoint had been saved yet"
        return TrainingInterrupted(
            f"{signal_name(stop)} received after an earlier stop signal{stopped_while()}: stopped at once in epoch "
            f"{self.epoch + 1}, "
            f"without waiting for {self.waiting_for}; {kept}",
            signal_name(stop),
        )

    @property
    def out_of_time(self) -> bool:
        return self.config.train.max_minutes is not None and self.budget_spent >= 1.0

    def _train_epoch(self, loader: DataLoader, received: list) -> None:
        """The steps of one epoch (from ``self.step`` when resumed mid-epoch), with a progress bar;
        a stop signal saves ``last.pt`` after the current step and raises TrainingInterrupted."""
        self.batches.set_epoch(self.epoch, self.step)
        bar = tqdm(
            total=self.steps_per_epoch,
            initial=self.step,
            desc=f"epoch {self.epoch + 1}/{self.epochs}",
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
            with plugin_errors(self.registry, "loss", self.config.loss.name, "reading last_stats"):
                stats = getattr(self.loss_fn, "last_stats", None)
            if stats:  # kept in the checkpoint so a resumed epoch reports it too
                self.sums["loss_stats"] = {k: (v.item() if torch.is_tensor(v) else v) for k, v in stats.items()}
            elapsed = self.sums["seconds"] + time.perf_counter() - started
            bar.set_postfix(loss=f"{loss:.4f}", views_s=f"{self.sums['views'] / max(elapsed, 1e-9):.0f}")
            bar.update()
            stop, self.budget_spent = agree_after_step(self.ctx, received, self.budget.progress())
            if self.out_of_time:  # the schedule has reached 0: evaluate and save this partial epoch
                break
            if stop:  # all ranks stop after the same step
                self.sums["seconds"] = elapsed
                if self.ctx.is_main:
                    self._save_last(self._state())
                bar.close()
                raise TrainingInterrupted(
                    f"{received[0] if received else 'a stop signal'} received: saved {self.run_dir / LAST} "
                    f"at epoch {self.epoch + 1}, step {self.step}; continue with --resume",
                    received[0] if received else None,
                )
        bar.close()
        self.sums["seconds"] += time.perf_counter() - started

    def _end_epoch(self) -> dict:
        """Evaluate, log the epoch's line, save last.pt (and best.pt), call the epoch hooks."""
        self.waiting_for = "the evaluation to end"  # what a second stop signal cuts short, while it runs
        line = self._evaluate_and_save()
        self.waiting_for = "the step to end"
        return line

    def _evaluate_and_save(self) -> dict:
        line = self._epoch_line()
        self._check_weights()  # on every rank: their weights are the same
        if not self.ctx.is_main:  # rank 0 evaluates and writes; its BN statistics reach the others via DDP
            self._next_epoch()
            return line
        if len(self.val_set):
            with plugin_errors(self.registry, "encoder", self.config.model.encoder, "evaluating", exits_only=True):
                recalibrate_batchnorm(self.model, self.train_cache, self.config, self.config.train.bn_recalibrate)
                line["val"] = evaluate(self.model, self.val_set, self.val_cache, self.config)
        check_still_held(self.run_dir)  # never two writers in one run dir, even if its lock file was deleted
        if self.confirmed_metrics is not None:  # lines --resume dropped: gone only once the run goes on
            atomic_write_jsonl(self.run_dir / METRICS_FILE, self.confirmed_metrics)
            self.confirmed_metrics = None
        append_line(self.run_dir / METRICS_FILE, json.dumps(line))  # one write + fsync: a crash tears at most this line
        self._next_epoch()
        self._save_checkpoints(line)
        complete = self.epoch >= self.epochs or self.out_of_time
        then = "that was the last epoch, so the run is complete" if complete else "continue with --resume"
        if self.stop_flag and not self.ctx.distributed:
            # a stop during evaluation or saving: the hooks could run on and never return (the signal
            # that stops a hook at once came before it); ranks agree on stops after the epoch instead
            raise TrainingInterrupted(
                f"{self.stop_flag[0]} received: saved {self.run_dir / LAST} after epoch {self.epoch} (its epoch "
                f"hooks were not called); {then}",
                self.stop_flag[0],
                complete,
            )
        try:  # a hook may hang: a stop signal raises inside it at once (receipt_embed.plugin_watch)
            call_epoch_hooks(self.registry, self.run_dir, line, self.model, self.config)
        except BaseException as exc:
            stop = stop_of(exc)
            if stop is None:
                raise
            raise TrainingInterrupted(
                f"{signal_name(stop)} received{stopped_while()}: saved {self.run_dir / LAST} after epoch "
                f"{self.epoch}; {then}",
                signal_name(stop),
                complete,
            ) from None
        return line

    def _epoch_line(self) -> dict:
        """The epoch's training figures (``val`` is added by evaluation)."""
        line = epoch_line(self.epoch, self.sums, self.optimizer, self.sampler, self.ctx, self.rank_batches)
        if self.config.train.max_minutes is not None:
            line["budget_spent"] = self.budget_spent  # share of train.max_minutes, 1.0 when it ran out
        return line

    def _next_epoch(self) -> None:
        self.epoch += 1
        self.step = 0
        self.sums = fresh_sums()

    def _save_checkpoints(self, line: dict) -> None:
        """``last.pt`` always; ``best.pt`` when val recall@1 is as good as the best so far (ties go to
        the later epoch: as good on val, and trained longer at a lower learning rate)."""
        selected = line.get("val", {}).get(self.config.train.select_on, {}).get("recall_at_1")
        improved = selected is not None and (self.best is None or selected >= self.best["recall_at_1"])
        if improved:
            self.best = {"epoch": line["epoch"], "recall_at_1": selected}
        state = self._state()
        self._save_last(state)
        last_epoch = self.epoch == self.epochs or self.out_of_time
        if improved or (selected is None and last_epoch):  # no val figure to choose by: the last epoch
            check_still_held(self.run_dir)
            save_checkpoint(self.run_dir / BEST, state)

    def _save_last(self, state: dict) -> None:
        check_still_held(self.run_dir)
        save_checkpoint(self.run_dir / LAST, state)
        if self.replacement is not None:
            self.replacement.checkpoint_written()
            self.replacement = None


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

    from receipt_embed.distributed import env_context
    from receipt_embed.locking import write_lock
    from receipt_embed.training.replacement import settle_leftovers
    from receipt_embed.training.rundir import refuse_other_kinds

    main = env_context().is_main
    with write_lock(run_dir) if main else nullcontext():
        if main:
            refuse_other_kinds(run_dir, data_dir)
            settle_leftovers(run_dir, log=None)
        trainer = Trainer(config, data_dir, run_dir, registry, resume=resume, progress=progress, log=log, force=force)
        return trainer.run()
