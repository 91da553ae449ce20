"""One optimisation step of a run: embed the views, apply the loss, check it, update.

A mixin of :class:`~receipt_embed.training.trainer.Trainer`, kept apart so the loop reads as
its epochs; it uses the trainer's model, loss, optimizer, schedule and config.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext

import torch

from receipt_embed.batch_layout import TWO_VIEW
from receipt_embed.display import quoted
from receipt_embed.errors import ComponentError
from receipt_embed.losses.koleo import with_koleo
from receipt_embed.registry import plugin_errors
from receipt_embed.training.components import check_loss_value
from receipt_embed.training.rundir import LAST

MAX_SKIPPED_IN_A_ROW = 5  # steps with non-finite gradients in a row before a run counts as diverged


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
        clip = self.config.train.grad_clip if self.config.train.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        if torch.isfinite(norm):
            self.optimizer.step()
            self.updates_applied = getattr(self, "updates_applied", 0) + 1
            self.nonfinite_in_a_row = 0
            self.scheduler.step()
        else:
            self._skip_nonfinite_gradients()
            with warnings.catch_warnings():  # the schedule keeps its pace; torch warns of a step skipped
                warnings.simplefilter("ignore", UserWarning)
                self.scheduler.step()
        return loss.item()

    def _skip_nonfinite_gradients(self) -> None:
        """A finite loss whose gradients are not: the update is skipped, as mixed-precision training
        does for an overflow, instead of writing NaN into every weight (seen under bf16 on CPU: a
        convolution's backward now and then gives NaN for a finite loss). Many in a row is divergence."""
        self.optimizer.zero_grad(set_to_none=True)
        self.nonfinite_in_a_row = getattr(self, "nonfinite_in_a_row", 0) + 1
        self.log(
            f"warning: non-finite gradients at epoch {self.epoch + 1}, step {self.step + 1}: update skipped "
            f"({self.nonfinite_in_a_row} in a row)"
        )
        if self.nonfinite_in_a_row >= MAX_SKIPPED_IN_A_ROW:
            raise TrainingDiverged(
                f"the gradients were NaN or infinite for {self.nonfinite_in_a_row} steps in a row, up to epoch "
                f"{self.epoch + 1}, step {self.step + 1}; {self._kept()}. {self._advice(temperature=True)}"
            )

    def _loss_of(self, views: torch.Tensor, labels: torch.Tensor):
        """Embed the views and apply the loss (over the gathered global batch when distributed)."""
        bf16 = self.precision == "bf16"
        self.model.train()
        buffers = {k: v.clone() for k, v in self.model.named_buffers()} if bf16 else None
        with plugin_errors(self.registry, "encoder", self.config.model.encoder, "embedding a batch"):
            with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext():
                _, projections = self.forward_model(views)
            if bf16 and not bool(torch.isfinite(projections.detach()).all()) and self._weights_finite():
                _, projections = self._forward_in_fp32(views, buffers)
        loss_fn = self._guarded_loss(with_koleo(self.loss_fn, self.config.loss.koleo_weight))
        if self.ctx.distributed:
            from receipt_embed.distributed import global_loss

            two_view = self.batches.layout == TWO_VIEW  # each rank's slice keeps [first views; second views]
            keys = None if self.key_model is None else self._momentum_keys(views, labels)
            return global_loss(loss_fn, projections.float(), labels, two_view=two_view, local_keys=keys)
        if self.key_model is None:
            return loss_fn(projections.float(), labels)
        return loss_fn(projections.float(), labels, keys=self._momentum_keys(views, labels))

    def _weights_finite(self) -> bool:
        return all(bool(torch.isfinite(p.detach()).all()) for p in self.model.parameters())

    def _forward_in_fp32(self, views: torch.Tensor, buffers: dict):
        """A bf16 forward gave NaN from finite weights and images: oneDNN's bf16 convolution on CPU
        now and then does so for a stride-2 convolution of a 4x2 feature map (measured: about one
        call in four with torch 2.14.1). The batch-norm statistics it updated are put back and this
        step runs in fp32, so a kernel fault is neither divergence nor NaN written into the model."""
        with torch.no_grad():
            for name, buffer in self.model.named_buffers():
                buffer.copy_(buffers[name])
        self.log(
            f"warning: the bf16 forward at epoch {self.epoch + 1}, step {self.step + 1} gave NaN from finite "
            "weights (a bf16 kernel fault on this CPU); the step ran in fp32"
        )
        return self.forward_model(views)

    def _guarded_loss(self, loss_fn):
        """``loss_fn`` whose failures (an exit it raises too) name the loss plugin, on every path; the
        rows it gets (the gathered global batch when distributed, the same on every rank) are checked
        first: NaN embeddings are the run diverging, not bad input to the loss."""

        def guarded(embeddings, labels, **kwargs):
            for name, rows in (("embeddings", embeddings), ("momentum keys", kwargs.get("keys"))):
                if torch.is_tensor(rows) and not bool(torch.isfinite(rows.detach()).all()):
                    self._non_finite_rows(name, "NaN" if bool(torch.isnan(rows.detach()).any()) else "infinite")
            with plugin_errors(self.registry, "loss", self.config.loss.name, "computing the loss"):
                return loss_fn(embeddings, labels, **kwargs)

        return guarded

    def _non_finite_rows(self, name: str, kind: str) -> None:
        """NaN or infinite embeddings (or momentum keys) are the weights diverging only when the weights
        are not finite themselves. From finite weights before any update (the images are finite too)
        the encoder is at fault, not the learning rate; after updates, weights grown huge overflow too."""
        where = f"epoch {self.epoch + 1}, step {self.step + 1}"
        if not self._weights_finite():
            raise TrainingDiverged(
                f"the {name} became {kind} at {where}, before the loss (the model's weights diverged); "
                f"{self._kept()}. {self._advice(temperature=False)}"
            )
        encoder = self.config.model.encoder
        source = f"encoder {quoted(encoder)} (from plugin {quoted(self.registry.get('encoder', encoder).plugin)})"
        if getattr(self, "state", None) is None and not getattr(self, "updates_applied", 0):
            raise ComponentError(
                f"{source} returned {kind} {name} from finite weights at {where}, before any update: its "
                "forward is at fault, not the learning rate (check the encoder and its model.params)"
            )
        largest = max(float(p.detach().abs().max()) for p in self.model.parameters() if p.numel())
        raise TrainingDiverged(
            f"the {name} became {kind} at {where}, before the loss, from finite weights (the largest is "
            f"{largest:.3g} in magnitude): the weights grew too large, or {source} returned {kind} values "
            f"itself; {self._kept()}. {self._advice(temperature=False)}"
        )

    def _check_finite(self, loss: torch.Tensor) -> None:
        if torch.isfinite(loss):
            return
        if getattr(self, "state", None) is None and not getattr(self, "updates_applied", 0):
            raise TrainingDiverged(  # no update has been made: the learning rate played no part yet
                f"loss {self.config.loss.name} returned {loss.item()} at epoch {self.epoch + 1}, step {self.step + 1}, "
                f"before any update, from finite embeddings of the untrained model: the loss or its settings "
                f"are at fault, not the learning rate (temperature {self.config.loss.temperature:g}, loss.params "
                f"{dict(self.config.loss.params or {})}); {self._kept()}"
            )
        raise TrainingDiverged(
            f"loss became {loss.item()} at epoch {self.epoch + 1}, step {self.step + 1} "
            f"(loss {self.config.loss.name}, temperature {self.config.loss.temperature}); {self._kept()}. "
            f"{self._advice(temperature=True)}"
        )

    def _check_weights(self) -> None:
        """After an epoch: weights an update made NaN or infinite are the run diverging (evaluation
        would otherwise refuse the NaN embeddings as bad input)."""
        for name, weight in self.model.named_parameters():
            if not bool(torch.isfinite(weight.detach()).all()):
                raise TrainingDiverged(
                    f"the weight {name} became NaN or infinite in epoch {self.epoch + 1}; {self._kept()}. "
                    f"{self._advice(temperature=False)}"
                )

    def _kept(self) -> str:
        last = self.run_dir / LAST
        if last.exists():
            return f"the last good checkpoint is {last}"
        return "no checkpoint was written yet (it diverged in the first epoch)"

    def _advice(self, temperature: bool) -> str:
        """What to change, for the values this run has: a higher temperature only where it is low enough
        to matter (below 1 the logits grow as 1 / temperature), grad clipping only where it is off."""
        train = self.config.train
        tips = [f"a lower train.lr (now {train.lr:g})"]
        if train.grad_clip == 0:
            tips.append("train.grad_clip > 0 (now 0: off)")
        if self.precision == "bf16":
            tips.append("train.precision=fp32")
        if temperature and self.config.loss.temperature < 1:
            tips.append(
                f"a higher loss.temperature (now {self.config.loss.temperature:g}) for a temperature-scaled loss"
            )
        return "Try " + ", or ".join(tips) + "."

    @torch.no_grad()
    def _momentum_keys(self, views: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Keys from the momentum encoder: row i's key is the *other* view of its receipt."""
        from receipt_embed.losses.moco import momentum_update

        half = len(views) // 2  # a two-view batch, as build_components made sure the sampler declares
        momentum_update(self.model, self.key_model, self.config.train.momentum)
        self.key_model.train()
        with plugin_errors(self.registry, "encoder", self.config.model.encoder, "embedding momentum keys"):
            _, keys = self.key_model(views)
        return keys.float().roll(half, dims=0)
