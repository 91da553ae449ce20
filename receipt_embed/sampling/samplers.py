"""Identity-aware batch samplers.

A sampler yields batches as lists of capture indices, one per view, in the order the loss
expects; the identity label of each view is its capture's label. Batches depend only on
(seed, epoch), so a resumed run can skip to the step it stopped at and see the same data.

- :class:`UniqueIdentitySampler`: B distinct identities, two views each, rows
  ``[first views of B identities; second views]`` (the two-view NT-Xent layout). The two
  views are two *different* captures whenever the identity has two or more, which is what
  teaches device invariance; otherwise the same capture twice (two augmentations).
- :class:`PKSampler`: P identities x K views, for multi-positive losses (``supcon``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence

import numpy as np

from receipt_embed.batch_layout import ANY, TWO_VIEW
from receipt_embed.errors import BadInput

TAIL_POLICIES = ("fill", "drop")
# views per identity in a P x K batch: a receipt has a handful of captures, and a K in the
# millions would build batches of that many rows (memory) before anything could say so
MAX_K = 64


def _group(labels: Sequence[int]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = defaultdict(list)
    for index, label in enumerate(labels):
        groups[int(label)].append(index)
    return dict(groups)


def two_view_batch(
    identities: Sequence[int], captures: dict[int, list[int]], rng: np.random.Generator
) -> tuple[list[int], int]:
    """``[first views; second views]`` of ``identities``: two different captures of each when
    it has two or more, else its one capture twice. Returns (batch, how many were the same
    capture twice). Public for sampler plugins that choose identities their own way."""
    first, second, same = [], [], 0
    for identity in identities:
        own = captures[identity]
        if len(own) >= 2:
            a, b = rng.choice(len(own), 2, replace=False)
        else:
            a = b = 0
            same += 1
        first.append(own[a])
        second.append(own[b])
    return first + second, same


def k_view_batch(
    identities: Sequence[int], captures: dict[int, list[int]], k: int, rng: np.random.Generator
) -> tuple[list[int], int]:
    """``k`` distinct captures of each identity in turn; one with fewer than ``k`` repeats its
    own. Returns (batch, how many extra views were repeats). Public for sampler plugins that
    choose identities their own way and want the P x K layout."""
    batch, extra = [], 0
    for identity in identities:
        own = captures[identity]
        if len(own) >= k:
            batch.extend(own[i] for i in rng.choice(len(own), k, replace=False))
        else:
            order = [own[i] for i in rng.permutation(len(own))]
            extra += k - len(own)
            batch.extend(order[i % len(order)] for i in range(k))
    return batch, extra


class _IdentityBatches:
    """Shared epoch logic: a permutation of identities cut into batches, tail handled."""

    def __init__(self, labels: Sequence[int], batch_size: int, seed: int, tail: str = "fill"):
        if tail not in TAIL_POLICIES:
            raise BadInput(f"tail must be one of {', '.join(TAIL_POLICIES)}, got {tail!r}")
        self.groups = _group(labels)
        self.identities = sorted(self.groups)
        if batch_size < 2:
            raise BadInput(f"batch_size must be at least 2 identities, got {batch_size}")
        if len(self.identities) < batch_size:
            raise BadInput(
                f"batch_size {batch_size} needs at least {batch_size} identities, the data has {len(self.identities)}"
            )
        self.batch_size, self.seed, self.tail = batch_size, seed, tail
        self.epoch = 0
        self.stats: dict[str, int] = {}

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        full, rest = divmod(len(self.identities), self.batch_size)
        return full + (1 if rest and self.tail == "fill" else 0)

    def _rng(self) -> np.random.Generator:
        return np.random.default_rng([self.seed, self.epoch])

    def _identity_batches(self, rng: np.random.Generator) -> list[list[int]]:
        order = [self.identities[i] for i in rng.permutation(len(self.identities))]
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        self.stats = {"tail_dropped": 0, "tail_filled": 0}
        if len(batches[-1]) < self.batch_size:
            short = batches[-1]
            if self.tail == "drop":
                self.stats["tail_dropped"] = len(short)
                batches.pop()
            else:
                in_batch = set(short)
                pool = [i for i in order[: len(order) - len(short)] if i not in in_batch]
                fill = [pool[i] for i in rng.choice(len(pool), self.batch_size - len(short), replace=False)]
                self.stats["tail_filled"] = len(fill)
                batches[-1] = short + fill
        return batches


class UniqueIdentitySampler(_IdentityBatches):
    """B distinct identities per batch, two views each: ``[first views; second views]``."""

    batch_layout = TWO_VIEW

    def __iter__(self) -> Iterator[list[int]]:
        rng = self._rng()
        batches = self._identity_batches(rng)
        self.stats["same_capture_pairs"] = 0
        for identities in batches:
            batch, same = two_view_batch(identities, self.groups, rng)
            self.stats["same_capture_pairs"] += same
            yield batch


class PKSampler(_IdentityBatches):
    """P identities x K views per batch; identities with fewer than K captures get extra
    augmented views of their captures (counted in ``stats['extra_views']``)."""

    batch_layout = ANY

    def __init__(self, labels: Sequence[int], batch_size: int, seed: int, k: int = 3, tail: str = "fill"):
        super().__init__(labels, batch_size, seed, tail)
        if k < 2:
            raise BadInput(f"k must be at least 2 views per identity, got {k}")
        if k > MAX_K:
            raise BadInput(f"sampler.params.k must be at most {MAX_K} views per identity, got {k}")
        self.k = k

    def __iter__(self) -> Iterator[list[int]]:
        rng = self._rng()
        batches = self._identity_batches(rng)
        self.stats["extra_views"] = 0
        for identities in batches:
            batch, extra = k_view_batch(identities, self.groups, self.k, rng)
            self.stats["extra_views"] += extra
            yield batch
