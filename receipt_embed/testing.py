"""Contract checks for plugin authors: call them from your own tests.

    from receipt_embed.testing import check_loss
    def test_my_loss():
        check_loss(MyLoss(temperature=0.1))

Each check raises ``AssertionError`` with a message saying which rule a component broke.
The built-in components and the examples in ``plugins/`` pass the same checks
(``tests/test_contracts.py`` runs them over the whole registry).
"""

from __future__ import annotations

import numpy as np

from receipt_embed.kinds import KINDS


def _meets_its_kind(kind: str, component) -> None:
    """What ``receipt_embed.kinds`` says a built component of ``kind`` must have, as the trainer checks it."""
    spec = KINDS[kind]
    missing = [attr for attr in spec.needs if not hasattr(component, attr)]
    assert not missing, (
        f"a {kind} needs {', '.join(spec.needs)}; this {type(component).__name__} lacks {', '.join(missing)}"
    )
    problem = spec.check_values(component) if spec.check_values else None
    assert not problem, f"{type(component).__name__} breaks the {kind} contract: {problem.removeprefix('whose ')}"


def _two_view_batch(identities: int, dim: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    z = torch.randn(2 * identities, dim, generator=g, dtype=torch.float64)
    labels = torch.arange(identities).repeat(2)
    return z, labels


def check_loss(loss, *, identities: int = 8, dim: int = 16, label_aware: bool = True, seed: int = 0) -> None:
    """A loss called as ``loss(embeddings, labels)`` on two-view batches ``[first; second]``:
    returns a finite scalar; gradients reach the embeddings; invariant to the order of the
    identities in the batch; and (``label_aware``) reads the labels: a row of the same
    identity is never treated like another receipt's. A ``torch.nn.Module`` is put in eval mode
    first, so every call sees the same state."""
    import torch

    _meets_its_kind("loss", loss)
    if isinstance(loss, torch.nn.Module):
        loss.eval()  # stateful losses (a MoCo queue) leave their state alone in eval mode
    z, labels = _two_view_batch(identities, dim, seed)
    z.requires_grad_(True)
    value = loss(z, labels)
    assert torch.is_tensor(value) and value.dim() == 0, f"the loss must return a scalar tensor, got {value!r}"
    assert torch.isfinite(value), f"the loss is not finite: {value.item()}"
    try:
        (grad,) = torch.autograd.grad(value, z)
    except RuntimeError as exc:  # e.g. a constant or detached result
        raise AssertionError(
            f"no gradient reaches the embeddings: the loss is not computed from them ({exc})"
        ) from None
    assert torch.isfinite(grad).all(), "gradients with respect to the embeddings are not finite"
    assert grad.abs().sum() > 0, "no gradient reaches the embeddings"

    order = torch.randperm(identities, generator=torch.Generator().manual_seed(seed + 1))
    rows = torch.cat([order, order + identities])
    permuted = loss(z.detach()[rows], labels[rows])
    assert torch.allclose(permuted, value.detach(), rtol=1e-5, atol=1e-6), (
        f"the loss depends on the order of identities in the batch: {value.item()} vs {permuted.item()}"
    )

    if label_aware:
        # identities 0 and 1 become one receipt: a contrastive loss must stop counting them as negatives
        merged = labels.clone()
        merged[merged == 1] = 0
        merged_value = loss(z.detach(), merged)
        assert not torch.allclose(merged_value, value.detach(), rtol=1e-6, atol=1e-9), (
            "the loss ignores the identity labels: rows of one receipt are still treated as negatives"
        )


def check_encoder(encoder, *, image_size=(256, 128), in_channels: int = 1, batch: int = 2) -> None:
    """Images (N, C, H, W) -> finite features (N, encoder.feature_dim). Pass your
    ``data.image_size`` (default: the default config's 256 x 128) and ``in_channels`` (1 for
    grayscale, the default config; 3 for colour)."""
    import torch

    _meets_its_kind("encoder", encoder)
    assert isinstance(getattr(encoder, "feature_dim", None), int), "an encoder must expose an int feature_dim"
    encoder.eval()
    with torch.no_grad():
        out = encoder(torch.rand(batch, in_channels, *image_size))
    assert tuple(out.shape) == (batch, encoder.feature_dim), (
        f"expected features of shape {(batch, encoder.feature_dim)}, got {tuple(out.shape)}"
    )
    assert torch.isfinite(out).all(), "the encoder returned non-finite features"


def check_augmentation(transform, *, image_size=(256, 128), source_size=(180, 100), seed: int = 0) -> None:
    """uint8 H x W x 3 in, uint8 image_size x 3 out; the same seed gives the same view."""
    _meets_its_kind("augmentation", transform)
    rng = np.random.default_rng(seed)
    image = rng.integers(0, 256, size=(*source_size, 3), dtype=np.uint8)
    outputs = []
    for _ in range(2):
        from receipt_embed.data.views import seed_view

        seed_view(transform, seed)  # as training seeds each view
        outputs.append(transform(image=image)["image"])
    for out in outputs:
        assert isinstance(out, np.ndarray), f"views must be numpy arrays, got {type(out).__name__}"
        assert out.dtype == np.uint8, f"views must be uint8, got {out.dtype} (convert back before returning)"
        assert out.shape == (*image_size, 3), f"views must be {(*image_size, 3)}, got {out.shape}"
    assert np.array_equal(outputs[0], outputs[1]), "the same seed must give the same view (resumable runs need it)"


def check_sampler(sampler, labels, *, epochs: int = 2, two_view: bool = False) -> None:
    """Batches of valid capture indices, ``len(sampler)`` of them, the same for the same epoch,
    each laid out as the sampler's ``batch_layout`` declares (``receipt_embed.batch_layout``),
    which is always checked. With ``two_view`` (a sampler meant for the two-view losses: ntxent,
    moco, align_uniform, vicreg, ...) it must also declare ``two_view``. Returns None; a broken
    rule raises AssertionError saying which."""
    from receipt_embed.batch_layout import TWO_VIEW, layout_problem

    _meets_its_kind("sampler", sampler)
    layout = sampler.batch_layout
    assert not two_view or layout == TWO_VIEW, (
        f"a sampler for the two-view losses must declare batch_layout {TWO_VIEW!r}, this one declares {layout!r}"
    )
    n = len(labels)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        batches = [list(b) for b in sampler]
        assert len(batches) == len(sampler), f"len(sampler) is {len(sampler)} but it yielded {len(batches)} batches"
        assert batches and all(len(b) >= 2 for b in batches), "every batch needs at least 2 views"
        assert all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for b in batches for i in b), (
            "batches must hold integer capture indices"
        )
        assert all(0 <= int(i) < n for b in batches for i in b), "a batch holds an index outside the dataset"
        for batch in batches:
            problem = layout_problem(layout, [labels[int(i)] for i in batch])
            assert problem is None, (
                f"two-view batches must be [first views of B distinct receipts; second views, same order]: {problem}"
            )
        sampler.set_epoch(epoch)
        assert batches == [list(b) for b in sampler], "the same epoch must give the same batches (resumable runs)"


def check_audit_check(check, *, items: int = 60, dim: int = 16, seed: int = 0) -> None:
    """An audit check (what a ``register_audit_checks`` factory returns) on a small synthetic
    index of 20 receipts x 3 devices (columns path, receipt_id, device, merchant): returns a dict with a JSON-ready ``figures`` dict, an
    optional one-line ``summary``, a boolean ``flagged`` and a matplotlib ``plot``; and the
    same figures when run again (audit reports must be reproducible)."""
    _meets_its_kind("audit_check", check)
    import json
    from pathlib import Path

    from receipt_embed.audit.checks import AuditCheckError, AuditContext, _result

    rng = np.random.default_rng(seed)
    labels = np.arange(items) // 3
    x = rng.normal(size=(labels.max() + 1, dim))[labels] + 0.5 * rng.normal(size=(items, dim))
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    rows = [
        {"path": f"{i}.jpg", "receipt_id": f"r{label:03d}", "device": f"d{i % 3}", "merchant": f"m{label % 4}"}
        for i, label in enumerate(labels)
    ]
    import inspect

    try:
        takes_context = len(inspect.signature(check).parameters) >= 1
    except (TypeError, ValueError):
        takes_context = True
    assert takes_context, "pass the check (what the factory returns, called as check(context)), not the factory"

    def run():
        context = AuditContext(x.copy(), [dict(r) for r in rows], labels.copy(), ["device"], 10, Path("index"))
        try:
            result = _result("check", "plugin", check(context))
        except AuditCheckError as exc:
            raise AssertionError(f"the check's result breaks the contract: {exc}") from None
        assert "\n" not in result["summary"], "summary must be one line"
        if result["plot"] is not None:
            import matplotlib.pyplot as plt

            plt.close(result["plot"])
        return result

    first, second = run(), run()
    assert json.dumps(first["figures"], sort_keys=True) == json.dumps(second["figures"], sort_keys=True), (
        "the same index must give the same figures"
    )


def _synthetic_page(seed: int, size=(640, 360), printed: tuple[str, ...] = ()) -> np.ndarray:
    """A white portrait page with lines of random printed characters (uint8 RGB), one per seed,
    below the ``printed`` lines (its row's date and total, for verifiers that read them)."""
    import cv2

    rng = np.random.default_rng(seed)
    page = np.full((*size, 3), 255, np.uint8)
    alphabet = "ABCDEFGHJKLMNPQRSTUVWXYZ0123456789.:/-"
    for index, row in enumerate(range(24, size[0] - 10, 22)):
        line = "".join(rng.choice(list(alphabet), size=int(rng.integers(8, 22))))
        x = int(rng.integers(8, 40))
        if index < len(printed):
            line = printed[index]
        cv2.putText(page, line, (x, row), cv2.FONT_HERSHEY_SIMPLEX, 0.55, (0, 0, 0), 1)
    return page


def check_verifier(verifier, *, seed: int = 0) -> None:
    """A verifier on synthetic printed pages: ``extract`` returns a dict of named numpy arrays
    (no object dtype: they are stored in the index dir), the same for the same capture;
    ``score`` returns a dict whose ``score`` is a float in [0, 1] and whose other values are
    JSON-ready; the arrays give the same score after a save and load without pickle; and a
    page scores higher against a perspective-warped capture of itself (the same manifest row)
    than against another page (another row). Each page prints its row's date and total on its
    first two lines, so a verifier that reads them from the pixels (OCR) is checked too."""
    import io
    import json

    import cv2

    _meets_its_kind("verifier", verifier)
    needs_image = bool(getattr(verifier, "needs_image", True))
    row = {"path": "a.jpg", "receipt_id": "r1", "device": "d0", "merchant": "SHOP", "date": "25/12/2018",
           "total": "9.00", "receipt_number": "1001"}  # fmt: skip
    other_row = {**row, "path": "c.jpg", "receipt_id": "r2", "date": "26/12/2018", "total": "12.40",
                 "receipt_number": "1002"}  # fmt: skip
    page = _synthetic_page(seed, printed=(f"DATE {row['date']}", f"TOTAL {row['total']}"))
    other = _synthetic_page(seed + 1, printed=(f"DATE {other_row['date']}", f"TOTAL {other_row['total']}"))
    height, width = page.shape[:2]
    homography = np.array([[0.92, 0.06, 14.0], [-0.05, 0.97, 22.0], [4e-5, 3e-5, 1.0]])
    warped = cv2.warpPerspective(page, homography, (width, height), borderValue=(255, 255, 255))

    def extract(image, item):
        data = verifier.extract(image if needs_image else None, dict(item))
        assert isinstance(data, dict) and all(isinstance(k, str) for k in data), (
            f"extract must return a dict of named arrays, got {type(data).__name__}"
        )
        for key, value in data.items():
            assert isinstance(value, np.ndarray), f"extract's {key!r} must be a numpy array, got {type(value).__name__}"
            assert value.dtype != object, f"extract's {key!r} has object dtype: it cannot be stored without pickle"
        return data

    def score(query, candidate):
        result = verifier.score(query, candidate)
        assert isinstance(result, dict) and "score" in result, (
            f"score must return a dict with a 'score' key, got {result!r}"
        )
        value = result["score"]
        assert isinstance(value, (float, int, np.floating)) and not isinstance(value, bool), (
            f"'score' must be a number, got {type(value).__name__}"
        )
        assert 0.0 <= float(value) <= 1.0, f"'score' must be in [0, 1], got {value}"
        try:
            json.dumps({k: v for k, v in result.items() if k != "score"})
        except (TypeError, ValueError) as exc:
            raise AssertionError(f"score's other figures are not JSON-ready: {exc}") from None
        return float(value)

    first = extract(page, row)
    again = extract(page, row)
    assert first.keys() == again.keys() and all(np.array_equal(first[k], again[k]) for k in first), (
        "the same capture must give the same extracted data (an index must be reproducible)"
    )
    buffer = io.BytesIO()
    np.savez(buffer, **first)
    buffer.seek(0)
    with np.load(buffer, allow_pickle=False) as stored:
        reloaded = {key: stored[key] for key in stored.files}
    same = extract(warped, {**row, "path": "b.jpg", "device": "d1"})
    different = extract(other, other_row)
    as_extracted, as_stored = score(first, same), score(reloaded, same)
    assert as_extracted == as_stored, f"the stored arrays score {as_stored}, the extracted ones {as_extracted}"
    against_other = score(first, different)
    assert as_extracted > against_other, (
        f"a page must score higher against a warped capture of itself ({as_extracted}) than against "
        f"another page ({against_other})"
    )


def load_plugin(path):
    """Import a folder plugin file the way discovery does (as part of its folder's package,
    so its relative imports of ``_helpers`` work) and return the module, for your tests::

        plugin = load_plugin(Path(__file__).parents[1] / "plugins" / "my_loss.py")
        check_loss(plugin.build(margin=0.5))
    """
    import importlib.util
    import sys
    from pathlib import Path

    from receipt_embed.plugin_loader import _folder_package

    path = Path(path).resolve()
    name = f"{_folder_package(path.parent)}.{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
