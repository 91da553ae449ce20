"""Where retrieval fails: across devices, against same-shop siblings, for some queries only.

recall@1 over all queries hides the two failures that matter for duplicate receipts: a
capture finds its receipt only when the other capture came from the same device (the space
clusters by device), or it finds another receipt of the same shop (same printed template,
different items, date and total). These figures separate them. All are exact (a dense
similarity pass in chunks), leave-one-out, over items whose receipt has another capture.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from receipt_embed.evaluation.retrieval import l2_normalise

CHUNK = 512  # query rows per similarity block: 512 x 100,000 float32 is 200 MB


def _similarity_blocks(x: np.ndarray, rows: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(query rows, their similarities to every item) with each query's own column at -inf."""
    for start in range(0, len(rows), CHUNK):
        block = rows[start : start + CHUNK]
        sims = x[block] @ x.T
        sims[np.arange(len(block)), block] = -np.inf
        yield block, sims


def _queries(labels: np.ndarray, wanted: np.ndarray | None) -> np.ndarray:
    counts = dict(zip(*np.unique(labels, return_counts=True)))
    has_positive = np.array([counts[label] > 1 for label in labels.tolist()], dtype=bool)
    return np.flatnonzero(has_positive if wanted is None else has_positive & wanted)


def recall_at_1_of(embeddings: np.ndarray, labels, queries: np.ndarray | None = None) -> float | None:
    """recall@1 of the queries ``queries`` (a boolean mask; None: all) against every item, so a
    subset (the captures of a device no training capture came from) is scored on the same
    gallery as the rest. None when no selected item has another capture of its receipt."""
    x, labels = l2_normalise(embeddings), np.asarray(labels)
    rows = _queries(labels, queries)
    if not len(rows):
        return None
    hits = 0
    for block, sims in _similarity_blocks(x, rows):
        hits += int((labels[sims.argmax(axis=1)] == labels[block]).sum())
    return hits / len(rows)


def cross_device_recall_at_1(embeddings: np.ndarray, labels, devices) -> float | None:
    """recall@1 with the gallery cut to captures from *other* devices than the query's: can a
    phone photo find the scan of the same receipt? Queries: items whose receipt has a capture
    from another device. None when there is none."""
    x, labels, devices = l2_normalise(embeddings), np.asarray(labels), np.asarray(devices)
    other_device_positive = np.zeros(len(labels), dtype=bool)
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        if len(np.unique(devices[members])) > 1:
            other_device_positive[members] = True
    rows = np.flatnonzero(other_device_positive)
    if not len(rows):
        return None
    hits = 0
    for block, sims in _similarity_blocks(x, rows):
        sims[devices[None, :] == devices[block, None]] = -np.inf
        hits += int((labels[sims.argmax(axis=1)] == labels[block]).sum())
    return hits / len(rows)


def sibling_figures(embeddings: np.ndarray, labels, groups) -> dict:
    """How often another receipt of the same group (``merchant``: a shop's printed template)
    beats the true captures. ``sibling_above_true``: the share of queries where some sibling
    scores above every other capture of the query's receipt; ``sibling_share_of_misses``: of
    the queries whose nearest item is another receipt, the share where that item is a sibling
    (None without misses). Items whose group is empty count as a group of their own."""
    x, labels = l2_normalise(embeddings), np.asarray(labels)
    groups = np.array(["" if g is None else str(g) for g in groups], dtype=object)
    rows = _queries(labels, None)
    above = misses = sibling_misses = 0
    for block, sims in _similarity_blocks(x, rows):
        same_label = labels[None, :] == labels[block, None]
        same_group = (groups[None, :] == groups[block, None]) & (groups[block, None] != "")
        best_true = np.where(same_label, sims, -np.inf).max(axis=1)
        best_sibling = np.where(same_group & ~same_label, sims, -np.inf).max(axis=1)
        above += int((best_sibling > best_true).sum())
        nearest = sims.argmax(axis=1)
        missed = labels[nearest] != labels[block]
        misses += int(missed.sum())
        sibling_misses += int((missed & (groups[nearest] == groups[block]) & (groups[block] != "")).sum())
    return {
        "queries": int(len(rows)),
        "sibling_above_true": above / len(rows) if len(rows) else None,
        "misses": misses,
        "sibling_share_of_misses": sibling_misses / misses if misses else None,
    }
