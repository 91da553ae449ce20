"""Augmented views for training and clean views for embedding.

A view is identified by (capture index, view seed); the seed comes from (run seed, epoch,
step, slot), so a view is the same whichever DataLoader worker makes it and whether or
not the run was interrupted and resumed.
"""

from __future__ import annotations

import contextlib
import hashlib
import operator
import random
from collections.abc import Iterator, Mapping

import cv2
import numpy as np
import torch
from albumentations.core.composition import BaseCompose
from torch.utils.data import Dataset

from receipt_embed.batch_layout import ANY, LAYOUTS, declared_layout, layout_problem
from receipt_embed.data.cache import ImageCache
from receipt_embed.display import shortened
from receipt_embed.errors import BadInput

# inputs are scaled to roughly zero mean, unit variance for paper-and-ink images
PIXEL_MEAN, PIXEL_STD = 0.5, 0.25
# input pixels per embedding batch: 128 captures at up to 256 x 128; at 2048 x 2048 one at a time
MAX_BATCH_PIXELS = 128 * 256 * 128
# batches one epoch may have, per training capture: the built-ins give about one per B receipts,
# so this only stops a sampler whose len() is broken (a huge epoch that never ends in practice)
MAX_BATCHES_PER_CAPTURE = 100


def view_seed(*parts: int) -> int:
    """A 32-bit seed from integers, stable across processes and platforms."""
    digest = hashlib.blake2b(np.asarray(parts, dtype=np.int64).tobytes(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def seed_view(transform, seed: int) -> None:
    """Make ``transform``'s next view the one of ``seed``. An albumentations pipeline gets one
    generator pair that all its steps draw from in turn: its own ``set_random_seed`` gives every
    step a generator seeded alike, so every step draws the same numbers, and steps with the same
    probability were always applied together or not at all (Perspective with Affine, colour
    with JPEG: a view was either barely or heavily changed, never a mix). One pair is also
    two generators to build per view instead of two per step. Other transforms: their own
    ``set_random_seed``."""
    if isinstance(transform, BaseCompose):
        transform.set_random_state(np.random.default_rng(seed), random.Random(seed))
    else:
        transform.set_random_seed(seed)


# ITU-R 601 luma, as one row of a colour transform
_LUMA = np.array([[0.299, 0.587, 0.114]], np.float32)


def to_tensor(image: np.ndarray, grayscale: bool) -> torch.Tensor:
    """uint8 H x W x 3 -> float (C, H, W), normalised; grayscale by ITU-R 601 luma. The luma is
    OpenCV's per-pixel transform in float: torch's matrix-vector product for it, one small call
    per view, cost more than the whole augmentation on two threads (its threads' start-up)."""
    if grayscale:
        luma = cv2.transform(np.asarray(image, np.float32), _LUMA)
        return torch.from_numpy(luma).div_(255.0).sub_(PIXEL_MEAN).div_(PIXEL_STD).unsqueeze(0)
    pixels = torch.from_numpy(np.ascontiguousarray(image)).float().div_(255.0)
    return pixels.permute(2, 0, 1).sub_(PIXEL_MEAN).div_(PIXEL_STD).contiguous()


class ViewDataset(Dataset):
    """``dataset[(capture_index, seed)]`` -> (augmented view as a tensor, identity label)."""

    def __init__(
        self,
        cache: ImageCache,
        transform,
        grayscale: bool,
        labels: list[int],
        image_size=None,
        source: str = "the augmentation",
        guard=None,
    ):
        self.cache, self.transform, self.grayscale, self.labels = cache, transform, grayscale, labels
        self.image_size, self.source = (tuple(image_size) if image_size else None), source
        self.guard = guard or contextlib.nullcontext  # around the transform's own code: names a plugin that fails

    def __len__(self) -> int:
        return len(self.cache)

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, int]:
        index, seed = key
        with self.guard():
            seed_view(self.transform, seed)
            result = self.transform(image=self.cache[index])
        if not isinstance(result, Mapping) or "image" not in result:  # checked here: the plugin's code has ended
            got = f"a {type(result).__name__}" + (
                f" with keys {shortened(', '.join(map(str, result)))}" if isinstance(result, Mapping) else ""
            )
            raise BadInput(
                f"{self.source} returned {got}; an augmentation is called as transform(image=...) and returns a "
                "dict holding the view under 'image', as an albumentations Compose does"
            )
        view = result["image"]
        if (
            self.image_size is not None
        ):  # a preset that skips the resize or returns floats would train on the wrong input
            if not isinstance(view, np.ndarray) or view.dtype != np.uint8 or view.shape != (*self.image_size, 3):
                got = f"{view.dtype} {view.shape}" if isinstance(view, np.ndarray) else type(view).__name__
                raise BadInput(
                    f"{self.source} returned a {got} view; views must be uint8 of "
                    f"{self.image_size[0]} x {self.image_size[1]} (data.image_size) x 3"
                )
        return to_tensor(view, self.grayscale), self.labels[index]


def _valid_index(index, n: int) -> bool:
    """An integer (int, numpy or 0-d tensor integer; not a bool) in 0..n-1."""
    if isinstance(index, (bool, np.bool_)):
        return False
    try:
        return 0 <= operator.index(index) < n
    except TypeError:
        return False


_END = object()


class SeededBatches:
    """Wraps a sampler's batches of capture indices into batches of (index, view seed),
    starting at ``start_step`` (to resume mid-epoch). Given the captures' ``labels``, each batch
    is checked against the layout the sampler declares (``receipt_embed.batch_layout``)."""

    def __init__(
        self, sampler, seed: int, n_captures: int | None = None, source: str = "the sampler", labels=None, guard=None
    ):
        self.sampler, self.seed, self.n_captures, self.source = sampler, seed, n_captures, source
        self.guard = guard or contextlib.nullcontext  # around the sampler's own code: names a plugin that fails
        self.labels, self.layout = labels, declared_layout(sampler) or ANY
        self.epoch, self.start_step = 0, 0

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        self.epoch, self.start_step = epoch, start_step
        with self.guard():
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.start_step)

    def _sampler_batches(self) -> Iterator:
        with self.guard():
            iterator = iter(self.sampler)
        while True:
            with self.guard():
                batch = next(iterator, _END)
            if batch is _END:
                return
            yield batch

    def declared_length(self) -> int:
        """``len(sampler)``, the batches of one epoch, at most MAX_BATCHES_PER_CAPTURE a capture."""
        with self.guard():
            declared = len(self.sampler)
        most = MAX_BATCHES_PER_CAPTURE * self.n_captures if self.n_captures is not None else None
        if most is not None and declared > most:
            raise BadInput(
                f"{self.source} declares {declared} batches an epoch (its len()), more than {most}: "
                f"{MAX_BATCHES_PER_CAPTURE} for each of the {self.n_captures} training captures"
            )
        return declared

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        """The epoch's batches; a sampler that yields none, or more than its len() declares (one
        that never ends would hang the run), is stopped with an error naming it."""
        declared, step = self.declared_length(), -1
        for step, batch in enumerate(self._sampler_batches()):
            if step >= declared:
                raise BadInput(
                    f"{self.source} yielded more than {declared} batches in one epoch (epoch {self.epoch + 1}), "
                    f"the {declared} its len() declares; a sampler's epoch must end after len(sampler) batches"
                )
            if step < self.start_step:
                continue
            if self.n_captures is not None:
                bad = [i for i in batch if not _valid_index(i, self.n_captures)]
                if bad:
                    raise BadInput(
                        f"{self.source} yielded {bad[0]!r} in batch {step + 1} of epoch {self.epoch + 1}; "
                        f"indices must be integers in 0..{self.n_captures - 1} (the training captures)"
                    )
            if self.labels is not None:
                problem = layout_problem(self.layout, [self.labels[int(i)] for i in batch])
                if problem:
                    raise BadInput(
                        f"{self.source} declares batch_layout {self.layout!r}, {LAYOUTS[self.layout]}, but batch "
                        f"{step + 1} of epoch {self.epoch + 1} is not: {problem}"
                    )
            yield [(int(index), view_seed(self.seed, self.epoch, step, slot)) for slot, index in enumerate(batch)]
        if step < 0:
            raise BadInput(
                f"{self.source} yielded no batch in epoch {self.epoch + 1} (its len() is {declared}); "
                "a sampler must yield at least one batch an epoch"
            )


def clean_batches(
    images: np.ndarray, image_size: tuple[int, int], grayscale: bool, batch_size: int
) -> Iterator[torch.Tensor]:
    """Cached captures (N, H', W', 3) resized to the model input, without augmentation, in order;
    batches hold at most MAX_BATCH_PIXELS input pixels, so a large input size embeds a few at a time."""
    height, width = image_size
    batch_size = max(1, min(batch_size, MAX_BATCH_PIXELS // (height * width)))
    for start in range(0, len(images), batch_size):
        batch = images[start : start + batch_size]
        yield torch.stack(
            [to_tensor(cv2.resize(image, (width, height), interpolation=cv2.INTER_AREA), grayscale) for image in batch]
        )
