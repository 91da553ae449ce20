"""Every registered component (built-ins and the plugins/ examples) passes the contract
checks that receipt_embed.testing offers plugin authors; the checks themselves catch
broken components."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import registry_with_examples

from receipt_embed.testing import (
    check_audit_check,
    check_augmentation,
    check_encoder,
    check_loss,
    check_sampler,
    check_verifier,
)

NOT_LABEL_AWARE = {"vicreg", "align_uniform"}  # non-contrastive: no negatives to mask


REGISTRY = registry_with_examples()


def _names(kind):
    return sorted(REGISTRY.names(kind))


@pytest.mark.parametrize("name", _names("loss"))
def test_losses_keep_the_contract(name):
    # MoCo reads labels where the batch meets itself: with in-batch negatives on
    params = {"dim": 16, "queue_size": 32, "in_batch_negatives": True} if name == "moco" else {}
    check_loss(REGISTRY.create("loss", name, temperature=0.2, **params), label_aware=name not in NOT_LABEL_AWARE)


@pytest.mark.parametrize("name", _names("encoder"))
def test_encoders_keep_the_contract(name):
    encoder = REGISTRY.create("encoder", name, pretrained=None, in_channels=1, pooling="grid", grid=(4, 2))
    check_encoder(encoder, image_size=(96, 64), in_channels=1)


@pytest.mark.parametrize("name", _names("augmentation"))
def test_augmentations_keep_the_contract(name):
    check_augmentation(REGISTRY.create("augmentation", name, image_size=(64, 32)), image_size=(64, 32))
    check_augmentation(REGISTRY.create("augmentation", name, image_size=(256, 128)))  # the default size


@pytest.mark.parametrize("name", _names("sampler"))
def test_samplers_keep_the_contract(name):
    from receipt_embed.sampling import build_sampler

    labels = np.repeat(np.arange(20), 3).tolist()
    rows = [
        {"path": f"{i}.jpg", "receipt_id": f"r{label}", "device": f"d{i % 3}", "merchant": f"m{label % 4}"}
        for i, label in enumerate(labels)
    ]
    check_sampler(
        build_sampler(REGISTRY, name, labels, rows, 4, 0, {}),
        labels,
        two_view=name in {"unique_identity", "same_merchant"},
    )


@pytest.mark.parametrize("name", _names("audit_check"))
def test_audit_checks_keep_the_contract(name):
    check_audit_check(REGISTRY.create("audit_check", name))


@pytest.mark.parametrize("name", _names("verifier"))
def test_verifiers_keep_the_contract(name):
    check_verifier(REGISTRY.create("verifier", name))


def test_the_verifier_check_catches_broken_verifiers():
    from receipt_embed.verification.geometric import GeometricVerifier

    geometric = GeometricVerifier()

    class Wrapped:
        needs_image = True

        def extract(self, image, item):
            return geometric.extract(image, item)

        def score(self, query, candidate):
            return geometric.score(query, candidate)

    class ObjectArrays(Wrapped):
        def extract(self, image, item):
            return {"fields": np.array([item], dtype=object)}

    class OutOfRange(Wrapped):
        def score(self, query, candidate):
            return {"score": 1.0 + geometric.score(query, candidate)["score"]}

    class NotJson(Wrapped):
        def score(self, query, candidate):
            return {**geometric.score(query, candidate), "homography": np.eye(3)}

    class Blind(Wrapped):  # reads neither the pixels nor the row
        def score(self, query, candidate):
            return {"score": 0.5}

    class Forgetful(Wrapped):  # a different draw each time
        calls = 0

        def extract(self, image, item):
            Forgetful.calls += 1
            return {"draw": np.array([Forgetful.calls])}

    class NoScore:
        def extract(self, image, item):
            return {}

    check_verifier(Wrapped())
    with pytest.raises(AssertionError, match="'fields' has object dtype"):
        check_verifier(ObjectArrays())
    with pytest.raises(AssertionError, match=r"'score' must be in \[0, 1\], got 1\.\d"):
        check_verifier(OutOfRange())
    with pytest.raises(AssertionError, match="not JSON-ready"):
        check_verifier(NotJson())
    with pytest.raises(AssertionError, match=r"must score higher against a warped capture of itself \(0\.5\)"):
        check_verifier(Blind())
    with pytest.raises(AssertionError, match="the same capture must give the same extracted data"):
        check_verifier(Forgetful())
    with pytest.raises(AssertionError, match="a verifier needs extract, score; this NoScore lacks score"):
        check_verifier(NoScore())


def test_the_checks_catch_broken_components():
    class IgnoresLabels(torch.nn.Module):
        def forward(self, z, labels):
            return (z**2).mean()

    class OrderDependent(torch.nn.Module):
        def forward(self, z, labels):
            return z[0].sum() ** 2

    class NoGradient(torch.nn.Module):
        def forward(self, z, labels):
            return torch.tensor(1.0)

    with pytest.raises(AssertionError, match="ignores the identity labels"):
        check_loss(IgnoresLabels())
    with pytest.raises(AssertionError, match="order of identities"):
        check_loss(OrderDependent(), label_aware=False)
    with pytest.raises((AssertionError, RuntimeError)):
        check_loss(NoGradient(), label_aware=False)

    class WrongDim(torch.nn.Module):
        feature_dim = 10

        def forward(self, x):
            return x.flatten(1)[:, :5]

    with pytest.raises(AssertionError, match="expected features of shape"):
        check_encoder(WrongDim())

    import albumentations as A

    with pytest.raises(AssertionError, match="must be"):
        check_augmentation(A.Compose([A.Resize(10, 10)]), image_size=(64, 32))

    with pytest.raises(AssertionError, match="returned a dict with no 'figures' key"):
        check_audit_check(lambda context: {"skewness": 1.0})
    with pytest.raises(AssertionError, match="not JSON-ready"):
        check_audit_check(lambda context: {"figures": {"a": object()}})
    with pytest.raises(AssertionError, match="'flagged' must be True or False"):
        check_audit_check(lambda context: {"figures": {}, "flagged": "yes"})

    class Interleaved:  # [a1, a2, b1, b2, ...]: fine for supcon, wrong for the two-view losses
        batch_layout = "any"

        def __init__(self):
            self.epoch = 0

        def set_epoch(self, epoch):
            self.epoch = epoch

        def __len__(self):
            return 1

        def __iter__(self):
            return iter([[0, 1, 3, 4]])

    labels = np.repeat(np.arange(4), 3).tolist()
    check_sampler(Interleaved(), labels)
    with pytest.raises(AssertionError, match="must declare batch_layout 'two_view', this one declares 'any'"):
        check_sampler(Interleaved(), labels, two_view=True)
    Interleaved.batch_layout = "two_view"  # declared, but not what it yields
    with pytest.raises(AssertionError, match="two-view batches must be .*: row 0 and row 2 are different"):
        check_sampler(Interleaved(), labels)
    del Interleaved.batch_layout
    with pytest.raises(AssertionError, match="a sampler needs __len__, __iter__, set_epoch, batch_layout; .* lacks"):
        check_sampler(Interleaved(), labels)
    counter = iter(range(10))
    with pytest.raises(AssertionError, match="same figures"):
        check_audit_check(lambda context: {"figures": {"calls": next(counter)}})
