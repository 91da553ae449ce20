"""Masking the same-label entries of a similarity block: the rule that a capture of the
query's own receipt is never a negative, applied tile by tile for :mod:`.engine`.

Few same-label pairs (the usual two views per receipt) are kept as a sparse list sorted by
block; many (large identity groups) are found by comparing the labels of each block.
"""

from __future__ import annotations

import torch


def label_matches(q_labels, k_labels):
    """For each query, the range of key positions (in label-sorted order) sharing its label."""
    k_sorted, order = torch.sort(k_labels, stable=True)
    lo = torch.searchsorted(k_sorted, q_labels, right=False)
    hi = torch.searchsorted(k_sorted, q_labels, right=True)
    return lo, hi - lo, order


def pairs_by_tile(lo, counts, order, tile, n, m):
    """All (row, col) same-label pairs, sorted by block, plus each block's slice bounds."""
    total = int(counts.sum())
    rows = torch.repeat_interleave(torch.arange(n, device=lo.device), counts)
    starts = torch.repeat_interleave(lo - (torch.cumsum(counts, 0) - counts), counts)
    cols = order[torch.arange(total, device=lo.device) + starts]
    n_col_tiles = -(-m // tile)
    key = (rows // tile) * n_col_tiles + cols // tile
    key, perm = torch.sort(key, stable=True)
    n_row_tiles = -(-n // tile)
    bounds = torch.searchsorted(key, torch.arange(n_row_tiles * n_col_tiles + 1, device=lo.device))
    return rows[perm], cols[perm], bounds.tolist(), n_col_tiles


class TileMask:
    """Fills the same-label entries of one block with -inf, from a pair list or by comparing."""

    def __init__(self, pairs, q_labels, k_labels, tile):
        self.pairs, self.q_labels, self.k_labels, self.tile = pairs, q_labels, k_labels, tile

    def apply(self, block, r0, c0):
        t = self.tile
        if self.pairs is None:
            rl = self.q_labels[r0 : r0 + block.shape[0]]
            cl = self.k_labels[c0 : c0 + block.shape[1]]
            block.masked_fill_(rl[:, None] == cl[None, :], float("-inf"))
            return
        rows, cols, bounds, n_col_tiles = self.pairs
        b = (r0 // t) * n_col_tiles + c0 // t
        lo, hi = bounds[b], bounds[b + 1]
        if hi > lo:
            block[rows[lo:hi] - r0, cols[lo:hi] - c0] = float("-inf")
