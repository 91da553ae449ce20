"""One optimisation step of a run: embed the views, apply the loss, check it, update.

A mixin of :class:`~receipt_embed.training.trainer.Trainer`, kept apart so the loop reads as
its epochs; it uses the trainer's model, loss, optimizer, schedule and config.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from receipt_embed.batch_layout import TWO_VIEW
from receipt_embed.losses.koleo import with_koleo
from receipt_embed.registry import plugin_errors
from receipt_embed.training.components import check_loss_value
from receipt_embed.training.rundir import LAST


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the last good checkpoint is left intact."""


class TrainingStep:
    """The step methods of a Trainer."""

    def _train_step(self, views: torch.Tensor, labels: torch.Tensor) -> float:
        loss = self._loss_of(views, labels)
        check_loss_value(loss, self.config, self.registry)
        self._check_finite(loss)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.config.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.train.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        return loss.item()

    def _loss_of(self, views: torch.Tensor, labels: torch.Tensor):
        """Embed the views and apply the loss (over the gathered global batch when distributed)."""
        bf16 = self.config.train.precision == "bf16"
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
        self.model.train()
        with autocast, plugin_errors(self.registry, "encoder", self.config.model.encoder, "embedding a batch"):
            _, projections = self.forward_model(views)
        loss_fn = with_koleo(self.loss_fn, self.config.loss.koleo_weight)
        if self.ctx.distributed:
            from receipt_embed.distributed import global_loss

            two_view = self.batches.layout == TWO_VIEW  # each rank's slice keeps [first views; second views]
            keys = None if self.key_model is None else self._momentum_keys(views, labels)
            return global_loss(loss_fn, projections.float(), labels, two_view=two_view, local_keys=keys)
        if self.key_model is None:
            with plugin_errors(self.registry, "loss", self.config.loss.name, "computing the loss"):
                return loss_fn(projections.float(), labels)
        return loss_fn(projections.float(), labels, keys=self._momentum_keys(views, labels))

    def _check_finite(self, loss: torch.Tensor) -> None:
        if torch.isfinite(loss):
            return
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

    @torch.no_grad()
    def _momentum_keys(self, views: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Keys from the momentum encoder: row i's key is the *other* view of its receipt."""
        from receipt_embed.losses.moco import momentum_update

        half = len(views) // 2  # a two-view batch, as build_components made sure the sampler declares
        momentum_update(self.model, self.key_model, self.config.train.momentum)
        self.key_model.train()
        _, keys = self.key_model(views)
        return keys.float().roll(half, dims=0)
