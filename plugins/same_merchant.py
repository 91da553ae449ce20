"""A sampler that fills each batch with receipts sharing a metadata value (merchant by default).

Receipts of one merchant share a logo, a layout and often most of their text, so they are
the hardest negatives a receipt has. Random batches rarely hold two of them; this sampler
lays the receipts out merchant by merchant (merchants and receipts in a seeded random order)
and cuts that order into batches, so most negatives in a batch come from the same merchant.
The batch layout is the two-view one of ``unique_identity`` (``[first views; second views]``,
two different captures when a receipt has them), so it works with every two-view loss; with
``k`` it is the ``pk`` one instead (K captures of each receipt, extra views of a receipt
with fewer), for SupCon.

    receipt-embed train --data DATASET_DIR --set sampler.name=same_merchant
    receipt-embed train --data DATASET_DIR --set sampler.name=same_merchant --set "sampler.params={column: store_id}"
    receipt-embed train --data DATASET_DIR --set sampler.name=same_merchant --set "sampler.params={k: 3}"

Any receipt-level column of the manifest works (``column``). Receipts with an empty value
are each a group of their own (counted in ``stats['ungrouped']``). A column that varies
within one receipt (``device``, say) is an error: it does not describe the receipt.
``stats['same_group_negatives']`` is the share of negative receipt pairs in the epoch's
batches that share the column's value (with random batches it is about the share among all
pairs, ``stats['same_group_negatives_random']``).

The factory declares ``metadata``, so ``train`` passes it the manifest rows (one per capture).
"""

from __future__ import annotations

import difflib

import numpy as np

from receipt_embed.batch_layout import ANY
from receipt_embed.display import quoted
from receipt_embed.hookspecs import hookimpl
from receipt_embed.sampling.samplers import MAX_K, k_view_batch, two_view_batch

__version__ = "1.0"


def _shown(value: str | None) -> str:
    return "empty" if value is None else quoted(value)


def receipt_groups(identities, metadata, column: str) -> dict[int, str | None]:
    """The column's value for each receipt label; errors name the row or the receipt (values quoted
    as they are: the command line escapes control characters once when it shows the message)."""
    if len(metadata) != len(identities):
        raise ValueError(f"sampler got {len(metadata)} metadata rows for {len(identities)} captures")
    values: dict[int, str | None] = {}
    for row_number, (label, row) in enumerate(zip(identities, metadata), start=1):
        if column not in row:
            close = difflib.get_close_matches(column, list(row), n=1)
            hint = f" (did you mean {quoted(close[0])}?)" if close else ""
            raise ValueError(
                f"sampler column {quoted(column)} is missing from manifest row {row_number} "
                f"({row.get('path', '?')}){hint}; columns: {', '.join(sorted(row))}"
            )
        raw = row[column]
        value = None if raw is None or str(raw).strip() == "" else str(raw)
        label = int(label)
        if label in values and values[label] != value:
            raise ValueError(
                f"sampler column {quoted(column)} varies within receipt {quoted(row.get('receipt_id', label))} "
                f"({_shown(values[label])} and {_shown(value)}); group by a column that describes the receipt"
            )
        values[label] = value
    return values


class SameGroupSampler:
    """B distinct receipts per batch, two views each, drawn group by group."""

    batch_layout = "two_view"  # [first views; second views], as unique_identity

    def __init__(
        self,
        identities,
        batch_size: int,
        seed: int,
        metadata,
        column: str = "merchant",
        tail: str = "fill",
        k: int | None = None,
    ):
        if tail not in ("fill", "drop"):
            raise ValueError(f"tail must be fill or drop, got {tail!r}")
        if k is not None and k < 2:
            raise ValueError(f"k must be at least 2 captures per receipt, got {k}")
        if k is not None and k > MAX_K:  # a batch of k rows per receipt is built in memory
            raise ValueError(f"sampler.params.k must be at most {MAX_K} captures per receipt, got {k}")
        self.k = k
        if k is not None:
            self.batch_layout = ANY  # K rows per receipt, in receipt order
        self.captures: dict[int, list[int]] = {}
        for index, label in enumerate(identities):
            self.captures.setdefault(int(label), []).append(index)
        if batch_size < 2 or batch_size > len(self.captures):
            raise ValueError(f"batch_size must be between 2 and the {len(self.captures)} receipts, got {batch_size}")
        self.group_of = receipt_groups(identities, metadata, column)
        self.groups: dict[str, list[int]] = {}
        for label in sorted(self.captures):
            key = self.group_of[label] if self.group_of[label] is not None else f"\0ungrouped-{label}"
            self.groups.setdefault(key, []).append(label)
        self.batch_size, self.seed, self.tail, self.column = batch_size, seed, tail, column
        self.epoch = 0
        self.stats: dict = {}

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        full, rest = divmod(len(self.captures), self.batch_size)
        return full + (1 if rest and self.tail == "fill" else 0)

    def _receipt_batches(self, rng: np.random.Generator) -> list[list[int]]:
        keys = sorted(self.groups)
        order = []
        for g in rng.permutation(len(keys)):
            members = self.groups[keys[g]]
            order.extend(members[i] for i in rng.permutation(len(members)))
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        self.stats = {
            "tail_dropped": 0,
            "tail_filled": 0,
            "ungrouped": sum(1 for v in self.group_of.values() if v is None),
        }
        if len(batches[-1]) < self.batch_size:
            short = batches.pop()
            if self.tail == "fill":
                in_short = set(short)
                pool = [r for r in order if r not in in_short]
                fill = [pool[i] for i in rng.choice(len(pool), self.batch_size - len(short), replace=False)]
                batches.append(short + fill)
                self.stats["tail_filled"] = len(fill)
            else:
                self.stats["tail_dropped"] = len(short)
        return [batches[i] for i in rng.permutation(len(batches))]

    def _same_group_share(self, batches: list[list[int]]) -> tuple[float, float]:
        def share_of(receipts):
            values = [self.group_of[r] for r in receipts]
            pairs = len(values) * (len(values) - 1) / 2
            same = sum(
                c * (c - 1) / 2 for v, c in zip(*np.unique([v for v in values if v is not None], return_counts=True))
            )
            return same, pairs

        same = pairs = 0.0
        for batch in batches:
            s, p = share_of(batch)
            same, pairs = same + s, pairs + p
        s_all, p_all = share_of(list(self.captures))
        return same / max(pairs, 1.0), s_all / max(p_all, 1.0)

    def __iter__(self):
        rng = np.random.default_rng([self.seed, self.epoch])
        batches = self._receipt_batches(rng)
        share, random_share = self._same_group_share(batches)
        self.stats.update(
            same_group_negatives=round(float(share), 4),
            same_group_negatives_random=round(float(random_share), 4),
            same_capture_pairs=0,
        )
        self.stats["extra_views"] = 0
        for receipts in batches:
            if self.k is not None:
                yield self._k_views(receipts, rng)
                continue
            batch, same = two_view_batch(receipts, self.captures, rng)  # the unique_identity layout
            self.stats["same_capture_pairs"] += same
            yield batch

    def _k_views(self, receipts: list[int], rng: np.random.Generator) -> list[int]:
        """K distinct captures of each receipt; one with fewer repeats its own (extra views)."""
        batch, extra = k_view_batch(receipts, self.captures, self.k, rng)
        self.stats["extra_views"] += extra
        return batch


def build(identities, batch_size, seed, metadata, column: str = "merchant", tail: str = "fill", k: int | None = None):
    return SameGroupSampler(identities, batch_size, seed, metadata, column=column, tail=tail, k=k)


@hookimpl
def register_samplers(register):
    register(
        "same_merchant",
        build,
        description="batches of same-merchant receipts (param column; k: K captures each) for hard negatives",
    )
