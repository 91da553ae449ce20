"""Samplers: distinct identities, cross-capture positives, explicit tail, determinism."""

from __future__ import annotations

from collections import Counter

import pytest
from conftest import builtin_registry

from receipt_embed.sampling.samplers import PKSampler, UniqueIdentitySampler

# 10 identities: 0-5 with 3 captures, 6-8 with 2, 9 with 1
LABELS = [i for i in range(6) for _ in range(3)] + [i for i in range(6, 9) for _ in range(2)] + [9]


def test_unique_identity_layout_and_cross_capture_positives():
    sampler = UniqueIdentitySampler(LABELS, batch_size=4, seed=0)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 3
    seen = set()
    for batch in batches:
        first, second = batch[:4], batch[4:]
        ids = [LABELS[i] for i in first]
        assert len(set(ids)) == 4, "identities in a batch must be distinct"
        assert ids == [LABELS[i] for i in second], "row i and row i+B share an identity"
        for a, b in zip(first, second):
            assert a != b or LABELS.count(LABELS[a]) == 1, "two captures whenever there are two"
        seen |= set(ids)
    assert seen == set(range(10)), "fill tail: the epoch covers every identity"
    assert sampler.stats == {
        "tail_dropped": 0,
        "tail_filled": 2,
        "same_capture_pairs": sampler.stats["same_capture_pairs"],
    }
    assert sampler.stats["same_capture_pairs"] >= 1  # identity 9 appears at least once


def test_drop_tail_is_counted():
    sampler = UniqueIdentitySampler(LABELS, batch_size=4, seed=0, tail="drop")
    batches = list(sampler)
    assert len(batches) == len(sampler) == 2
    assert sampler.stats["tail_dropped"] == 2


def test_deterministic_per_epoch_and_different_across_epochs():
    a, b = UniqueIdentitySampler(LABELS, 4, seed=3), UniqueIdentitySampler(LABELS, 4, seed=3)
    assert list(a) == list(b)
    a.set_epoch(1)
    b.set_epoch(1)
    epoch1 = list(a)
    assert epoch1 == list(b)
    a.set_epoch(0)
    assert list(a) != epoch1


def test_pk_views_and_extra_views_counted():
    sampler = PKSampler(LABELS, batch_size=5, seed=1, k=3)
    batches = list(sampler)
    extra = 0
    for batch in batches:
        assert len(batch) == 15
        counts = Counter(LABELS[i] for i in batch)
        assert set(counts.values()) == {3} and len(counts) == 5
        for identity in counts:
            views = [i for i in batch if LABELS[i] == identity]
            captures = LABELS.count(identity)
            assert len(set(views)) == min(3, captures), "all distinct captures are used before repeating"
            extra += 3 - min(3, captures)
    assert sampler.stats["extra_views"] == extra > 0


def test_errors_are_clear():
    with pytest.raises(ValueError, match="batch_size 20 needs at least 20 identities, the data has 10"):
        UniqueIdentitySampler(LABELS, 20, 0)
    with pytest.raises(ValueError, match="tail must be one of fill, drop"):
        UniqueIdentitySampler(LABELS, 4, 0, tail="pad")
    with pytest.raises(ValueError, match="k must be at least 2"):
        PKSampler(LABELS, 4, 0, k=1)


def test_registered_as_plugins():
    registry = builtin_registry()
    assert {"unique_identity", "pk"} <= set(registry.names("sampler"))
    sampler = registry.create("sampler", "pk", identities=LABELS, batch_size=2, seed=0, k=2)
    assert isinstance(sampler, PKSampler) and all(len(b) == 4 for b in sampler)


def test_a_k_in_the_millions_is_refused_before_any_batch_is_built():
    """Attack round 17 G1: `sampler.params={k: 100000000}` built batches of 10^8 rows per receipt
    until the machine ran out of memory; k is at most MAX_K, and the error names the key."""
    from receipt_embed.sampling import build_sampler
    from receipt_embed.sampling.samplers import MAX_K

    registry = builtin_registry()
    assert len(next(iter(PKSampler(LABELS, 2, 0, k=MAX_K)))) == 2 * MAX_K
    with pytest.raises(ValueError) as info:
        build_sampler(registry, "pk", LABELS, [{} for _ in LABELS], 4, 0, {"k": 100_000_000})
    assert str(info.value) == (
        "sampler 'pk' (from plugin 'builtin.samplers'): sampler.params.k must be at most 64 views per identity, "
        "got 100000000"
    )
