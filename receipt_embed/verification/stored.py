"""Checks of a verifier's stored per-capture data against what its ``extract`` gives.

index.json's checksums prove the files match index.json, not that ``verifier-NAME.npz`` holds
what the verifier (built with the params index.json records) reads: a file edited by hand, or
params changed without re-extracting, would fail deep inside ``score`` (a KeyError, or one
column's value compared with another's). A verifier's optional ``check_data(data)`` raises
BadInput saying what is wrong; :func:`receipt_embed.indexing.verification.verifiers_of` names the
file and says how to rebuild it.
"""

from __future__ import annotations

import numpy as np

from receipt_embed.errors import BadInput


def check_keys(data, keys) -> None:
    """The data's arrays are exactly ``keys``."""
    if set(data.arrays) != set(keys):
        raise BadInput(f"it holds the arrays {sorted(data.arrays)}, where extract gives {sorted(keys)}")


def per_item_counts(data, key: str) -> np.ndarray:
    """How many rows of ``key`` each capture has."""
    return np.diff(data.offsets[key])
