"""Verifiers' per-item data in an index dir: ``verifier-NAME.npz``, one file per verifier.

``index --verify NAME`` runs the verifier's ``extract`` on every indexed capture once, so a query
is checked against its shortlist without re-reading the gallery's images. Each verifier returns
a dict of named arrays per item; the file holds, for each name ``key``, every item's array
concatenated along its first axis (``key``) and where each item's rows start (``key@offsets``,
count + 1 int64), written without pickle and loaded with ``allow_pickle=False``. index.json
records the verifier's name, parameters and plugin under ``verifiers`` and the file's sha256 and
size under ``files``, like the other files of the dir.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from receipt_embed.display import quoted, shortened
from receipt_embed.errors import BadInput
from receipt_embed.fileio import atomic_open

FILE_PATTERN = "verifier-{name}.npz"
OFFSETS = "@offsets"
KEY_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


def verifier_file(name: str) -> str:
    return FILE_PATTERN.format(name=name)


@dataclass
class VerifierData:
    """One verifier's arrays for every item of an index; ``item(i)`` is what ``extract`` gave row i."""

    name: str
    arrays: dict[str, np.ndarray]
    offsets: dict[str, np.ndarray]

    @property
    def count(self) -> int:
        return len(next(iter(self.offsets.values()))) - 1 if self.offsets else 0

    def item(self, row: int) -> dict[str, np.ndarray]:
        return {key: values[self.offsets[key][row] : self.offsets[key][row + 1]] for key, values in self.arrays.items()}

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values()) + sum(o.nbytes for o in self.offsets.values())


def check_extracted(name: str, data, where: str) -> dict[str, np.ndarray]:
    """One item's ``extract`` result, checked: a dict of named numpy arrays without object dtype."""
    if not isinstance(data, dict):
        raise BadInput(f"verifier {quoted(name)} returned a {type(data).__name__} for {where}, not a dict of arrays")
    checked = {}
    for key, value in data.items():
        if not isinstance(key, str) or not KEY_PATTERN.match(key):
            raise BadInput(
                f"verifier {quoted(name)} returned the key {shortened(repr(key))} for {where}: keys are names "
                "of letters, digits and _ (at most 64)"
            )
        if not isinstance(value, np.ndarray) or value.dtype.hasobject:
            raise BadInput(
                f"verifier {quoted(name)} returned {key!r} for {where} as a {type(value).__name__}"
                f"{' of object dtype' if isinstance(value, np.ndarray) else ''}, not a numpy array of numbers or text"
            )
        checked[key] = value.reshape(1) if value.ndim == 0 else value
    return checked


def pack(name: str, per_item: list[dict[str, np.ndarray]], where: Callable[[int], str]) -> VerifierData:
    """Items' arrays -> one concatenated array and its offsets per key; every item must give the
    same keys, and each key the same dtype kind and trailing shape (``where(i)`` names item i)."""
    keys = list(per_item[0]) if per_item else []
    arrays, offsets = {}, {}
    for key in keys:
        first = per_item[0][key]
        parts = []
        for row, data in enumerate(per_item):
            if set(data) != set(keys):
                raise BadInput(
                    f"verifier {quoted(name)} gave {where(row)} the keys {sorted(data)}, but {where(0)} {sorted(keys)}: "
                    "every capture must get the same keys"
                )
            value = data[key]
            if value.shape[1:] != first.shape[1:] or value.dtype.kind != first.dtype.kind:
                raise BadInput(
                    f"verifier {quoted(name)} gave {key!r} of {where(row)} as {value.dtype} {value.shape}, but "
                    f"{where(0)} as {first.dtype} {first.shape}: rows of one key must share dtype and trailing shape"
                )
            parts.append(value)
        lengths = np.array([len(part) for part in parts], dtype=np.int64)
        offsets[key] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        arrays[key] = np.concatenate(parts) if parts else first[:0]
    if not keys:
        offsets[""] = np.zeros(len(per_item) + 1, dtype=np.int64)  # the count, for a verifier storing nothing
    return VerifierData(name, arrays, offsets)


def extract_items(
    verifier,
    name: str,
    paths: list[str],
    rows: list[dict],
    limits: tuple[int, int],
    progress: bool = False,
    errors=None,
) -> tuple[VerifierData, float]:
    """``verifier.extract`` of every capture (decoded once each, within the pixel and byte
    ``limits``; a capture whose bytes differ from its row's ``sha256`` is refused), packed;
    returns it and the seconds it took. ``errors(path)``: a context manager around each
    ``extract`` call (a plugin's failure named as its own)."""
    import contextlib
    import hashlib
    import sys

    from tqdm import tqdm

    from receipt_embed.data.cache import REINGEST, CaptureChanged
    from receipt_embed.images import decode_image
    from receipt_embed.userfiles import read_regular

    needs_image = bool(getattr(verifier, "needs_image", True))
    started = time.perf_counter()
    per_item = []
    with tqdm(total=len(paths), desc=f"verifier {name}", unit="img", disable=not progress, file=sys.stderr) as bar:
        for path, row in zip(paths, rows, strict=True):
            image = None
            if needs_image:
                data = read_regular(path, limits[1])
                if row.get("sha256") and hashlib.sha256(data).hexdigest() != row["sha256"]:
                    raise CaptureChanged(
                        f"{path} changed since ingest: its content (sha256) differs from manifest.jsonl; {REINGEST}"
                    )
                image = np.asarray(decode_image(data, limits[0], name=str(path)).image)
            with errors(path) if errors is not None else contextlib.nullcontext():
                extracted = verifier.extract(image, dict(row))
            per_item.append(check_extracted(name, extracted, str(path)))
            bar.update(1)
    packed = pack(name, per_item, lambda row: paths[row])
    return packed, time.perf_counter() - started


def write_verifier_file(path: Path, data: VerifierData) -> None:
    contents = {**data.arrays, **{key + OFFSETS: offsets for key, offsets in data.offsets.items()}}
    with atomic_open(path, "wb") as handle:
        np.savez(handle, **contents)  # zipfile writes through the handle: a full disk is atomic_open's DiskFull


def read_verifier_file(path: Path, name: str, count: int, error) -> VerifierData:
    """The arrays of ``verifier-NAME.npz`` (its sha256 already checked against index.json), with
    offsets that fit them and the index's ``count``; anything else is ``error`` naming the file."""
    from receipt_embed.npyfile import BadNpyFile, load_npz

    try:
        contents = load_npz(path)
    except BadNpyFile as exc:
        raise error(f"{exc} (the data of verifier {quoted(name)})") from None
    offsets = {key[: -len(OFFSETS)]: value for key, value in contents.items() if key.endswith(OFFSETS)}
    arrays = {key: value for key, value in contents.items() if not key.endswith(OFFSETS)}
    if set(arrays) != set(offsets) - {""}:
        raise error(f"{path}: arrays {sorted(arrays)} and offsets {sorted(offsets)} do not pair up")
    for key, starts in offsets.items():
        length = len(arrays[key]) if key else 0
        if (
            starts.dtype != np.int64
            or starts.shape != (count + 1,)
            or starts[0] != 0
            or starts[-1] != length
            or np.any(np.diff(starts) < 0)
        ):
            raise error(f"{path}: the offsets of {key!r} do not describe {count} items of its {length} rows")
    return VerifierData(name, arrays, offsets)
