"""The index dir: ``index.faiss``, ``items.jsonl``, ``embeddings.npy`` and ``index.json``.

- ``items.jsonl``: row i of the index -> path, receipt_id, device, split and other metadata.
- ``embeddings.npy``: the L2-normalised vectors, row-aligned with the items. An approximate
  index stores lossy codes; audits and the all-pairs sweep read these exact vectors.
- ``verifier-NAME.npz`` (with ``index --verify NAME``): each verifier's per-item data
  (receipt_embed.indexing.verifier_data), so queries never re-read the gallery's images.
- ``index.json``: count, dim, metric, factory, search parameters and measured recall, the
  source (checkpoint fingerprint or external embeddings), the verifiers and a sha256 of every file.

Every file is written atomically and ``index.json`` last, so it only ever describes files
that were completely written; loading re-checks sizes and checksums, so a truncated or
edited file, or items that do not belong to the index, is an error naming the file.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from receipt_embed.display import quoted, shortened
from receipt_embed.errors import BadInput
from receipt_embed.fileio import atomic_open, atomic_write_json, atomic_write_jsonl, parse_json, read_jsonl, sha256_file
from receipt_embed.indexing.contents import (
    check_embeddings,
    check_index_holds_rows,
    check_index_structure,
    check_items,
    check_items_match_dataset,
    check_meta_types,
)
from receipt_embed.npyfile import BadNpyFile, load_npy
from receipt_embed.userfiles import UnusableFile, open_regular, read_regular_text
from receipt_embed.version import __version__

INDEX_FILE, ITEMS_FILE, EMBEDDINGS_FILE, META_FILE = "index.faiss", "items.jsonl", "embeddings.npy", "index.json"
FORMAT_VERSION = 1
# the keys of index.json at this format version; another key means a hand edit or a newer writer
META_KEYS = frozenset(
    ("format_version", "count", "dim", "metric", "normalised", "factory", "exact", "search_params", "recall_at_10",
     "recall_queries", "train_size", "build_seconds", "tune_seconds", "features", "source", "files", "created",
     "receipt_embed_version", "verifiers", "calibration")
)  # fmt: skip
# index.json is a page of metadata; anything far larger is not one
MAX_META_BYTES = 16 * 1024 * 1024


class IndexDirError(BadInput):
    """An index dir that is missing, incomplete or does not match its index.json."""


@dataclass
class IndexDir:
    path: Path
    index: object  # faiss.Index, search parameters applied
    items: list[dict]
    embeddings: np.ndarray  # (count, dim) float32, L2-normalised
    meta: dict
    verifiers: dict = field(default_factory=dict)  # name -> VerifierData, for those index --verify stored

    @property
    def count(self) -> int:
        return len(self.items)


def _write_faiss(index, path: Path) -> None:
    """Stream the index into an atomic write (no second in-memory copy of a large index)."""
    import faiss

    with atomic_open(path, "wb") as handle:
        failures: list[OSError] = []

        def write(data):
            try:
                return handle.write(data)
            except OSError as exc:  # FAISS reports only "py err"; keep the real error
                failures.append(exc)
                raise

        try:
            writer = faiss.PyCallbackIOWriter(write)
            faiss.write_index(index, writer)
            del writer  # flushes FAISS's buffer into the handle
        except RuntimeError:
            if failures:  # a full disk becomes atomic_open's DiskFull naming index.faiss
                raise failures[0] from None
            raise


class _PythonWrites:
    """A file object numpy writes to with ``write()`` instead of C ``fwrite``: its ``tofile`` reports a
    full disk as a bare "7680 requested and 992 written"; a Python write raises ENOSPC (a DiskFull)."""

    def __init__(self, handle):
        self.write = handle.write


def save_npy(path: Path, vectors: np.ndarray) -> None:
    """``path`` (float32 .npy) written atomically; a full disk is a DiskFull naming it."""
    with atomic_open(path, "wb") as handle:
        np.save(_PythonWrites(handle), np.ascontiguousarray(vectors, dtype=np.float32), allow_pickle=False)


def write_index_dir(
    out: str | Path,
    built,
    embeddings: np.ndarray,
    items: list[dict],
    source: dict,
    features: str | None,
    force: bool = False,
    verifiers: dict | None = None,
) -> dict:
    """Write the four files of an index dir (and a ``verifier-NAME.npz`` per entry of
    ``verifiers``: name -> (VerifierData, its index.json record)); returns the index.json written.

    The files go to a staging sibling that replaces ``out`` in one swap (``staging.replace_dir``),
    under ``out``'s writer lock: a reader, a kill or a full disk sees the old index or the new
    one. An existing index dir is replaced only with ``force``."""
    from receipt_embed.staging import replace_dir

    if len(items) != len(embeddings) or built.index.ntotal != len(embeddings):
        raise BadInput(
            f"{len(items)} items, {len(embeddings)} embeddings and {built.index.ntotal} indexed vectors differ"
        )
    for name, (data, _) in (verifiers or {}).items():
        if data.count != len(items):
            raise BadInput(f"verifier {quoted(name)} holds data of {data.count} items, the index {len(items)}")
    with replace_dir(out, "index", force) as staging:
        return _write_index_files(staging, built, embeddings, items, source, features, verifiers or {})


def _write_index_files(
    out: Path, built, embeddings: np.ndarray, items: list[dict], source: dict, features: str | None, verifiers: dict
) -> dict:
    from receipt_embed.indexing.verifier_data import verifier_file, write_verifier_file

    _write_faiss(built.index, out / INDEX_FILE)
    atomic_write_jsonl(out / ITEMS_FILE, items)
    save_npy(out / EMBEDDINGS_FILE, embeddings)
    for name, (data, _) in verifiers.items():
        write_verifier_file(out / verifier_file(name), data)
    written = (INDEX_FILE, ITEMS_FILE, EMBEDDINGS_FILE, *(verifier_file(name) for name in verifiers))
    files = {name: {"sha256": sha256_file(out / name), "bytes": (out / name).stat().st_size} for name in written}
    meta = {
        "format_version": FORMAT_VERSION,
        "count": len(items),
        "dim": int(embeddings.shape[1]),
        "metric": "inner_product",
        "normalised": True,
        "factory": built.factory,
        "exact": built.exact,
        "search_params": built.search_params,
        "recall_at_10": built.recall_at_10,
        "recall_queries": built.recall_queries,
        "train_size": built.train_size,
        "build_seconds": built.build_seconds,
        "tune_seconds": built.tune_seconds,
        "features": features,
        "source": source,
        "files": files,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "receipt_embed_version": __version__,
    }
    if verifiers:
        meta["verifiers"] = {name: {**record, "file": verifier_file(name)} for name, (_, record) in verifiers.items()}
    atomic_write_json(out / META_FILE, meta)
    return meta


def write_calibration(path: str | Path, record: dict, calibrated: dict | None = None) -> dict:
    """Store ``record`` as index.json's ``calibration``, under the dir's writer lock and atomically
    (the other files, and so their checksums, are untouched); returns the index.json written.
    ``calibrated``: the index.json the record was computed from; if the dir now holds another index
    (``index --force`` swapped one in meanwhile), nothing is written: its thresholds would be another
    index's."""
    from receipt_embed.locking import write_lock

    path = Path(path)
    with write_lock(path):
        meta = read_meta(path, check_calibration=False)  # a malformed block is what this replaces
        if calibrated is not None and _identity(meta) != _identity(calibrated):
            raise IndexDirError(
                f"{path} was replaced while it was being calibrated (its index.json changed): nothing was "
                "written; run `receipt-embed calibrate` again"
            )
        meta["calibration"] = record
        atomic_write_json(path / META_FILE, meta)
    return meta


def _identity(meta: dict) -> dict:
    """index.json without its calibration: what says which index a dir holds."""
    return {key: value for key, value in meta.items() if key != "calibration"}


def read_meta(path: str | Path, check_calibration: bool = True) -> dict:
    """index.json, checked (``check_calibration`` false: all but the calibration block, for
    ``calibrate``, which replaces it)."""
    path = Path(path)
    meta_path = path / META_FILE
    if not path.exists():
        raise IndexDirError(f"index dir {path} does not exist; build one with `receipt-embed index`")
    if not path.is_dir():
        raise IndexDirError(f"{path} is not a directory; an index dir is what `receipt-embed index --out` writes")
    try:
        meta = parse_json(read_regular_text(meta_path, MAX_META_BYTES))
    except UnusableFile as exc:
        if exc.reason == "missing_file":
            if (path / "checkpoints").is_dir() and (path / "config.yaml").is_file():
                raise IndexDirError(
                    f"{path} is a training run, not an index dir: index with its checkpoint first, "
                    f"`receipt-embed index --checkpoint {path / 'checkpoints' / 'best.pt'} --data DATASET_DIR --out INDEX_DIR`"
                ) from None
            raise IndexDirError(
                f"{meta_path} not found: {path} is not a complete index dir (was `receipt-embed index` interrupted?)"
            ) from None
        raise IndexDirError(_not_usable(exc)) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise IndexDirError(f"{meta_path} is not valid JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise IndexDirError(
            f"{meta_path} holds a JSON {type(meta).__name__}, not the object `receipt-embed index` writes"
        )
    if isinstance(meta.get("format_version"), int) and meta["format_version"] > FORMAT_VERSION:
        raise IndexDirError(
            f"{meta_path} has format version {meta['format_version']}, newer than this receipt-embed "
            f"reads ({FORMAT_VERSION}); upgrade receipt-embed"
        )
    unknown = sorted(set(meta) - META_KEYS)
    if unknown:
        raise IndexDirError(
            f"{meta_path} has keys that format version {FORMAT_VERSION} does not have "
            f"({shortened(', '.join(map(quoted, unknown)))}): it was edited, or written by another receipt-embed; "
            "rebuild the index with `receipt-embed index`"
        )
    missing = [key for key in ("count", "dim", "factory", "features", "files", "source") if key not in meta]
    if "source" in meta and not isinstance(meta["source"], dict):
        raise IndexDirError(
            f"{meta_path}: source is {type(meta['source']).__name__}, not an object: rebuild the "
            "index with `receipt-embed index`"
        )
    source = meta.get("source") or {}
    kind = source.get("kind") if isinstance(source.get("kind"), str) else None
    wanted = {"checkpoint": ("checkpoint", "checkpoint_sha256"), "embeddings": ("embeddings", "embeddings_sha256")}
    missing += [f"source.{key}" for key in wanted.get(kind, ("kind",)) if key not in source]
    if missing:
        raise IndexDirError(f"{meta_path} lacks {', '.join(missing)}: rebuild the index with `receipt-embed index`")
    check_meta_types(meta, meta_path, IndexDirError, check_calibration)
    return meta


def _not_usable(exc: UnusableFile) -> str:
    return f"{exc}: an index dir holds only the regular files `receipt-embed index` writes"


def _open_member(path: Path):
    """A handle on one file of an index dir; anything but a regular file is an IndexDirError."""
    try:
        return open_regular(path, None)
    except UnusableFile as exc:
        raise IndexDirError(f"{path} is missing" if exc.reason == "missing_file" else _not_usable(exc)) from None


def _read_faiss(path: Path):
    """``faiss.read_index`` fed from a checked handle (given a path, FAISS would block on a FIFO)."""
    import faiss

    with _open_member(path) as handle:
        reader = faiss.PyCallbackIOReader(handle.read)
        try:
            return faiss.read_index(reader)
        except RuntimeError as exc:
            raise IndexDirError(f"{path} cannot be read by FAISS: {str(exc).strip().splitlines()[-1]}") from None
        finally:
            del reader


def _check_file(path: Path, expected: dict) -> None:
    with _open_member(path) as handle:
        size = os.fstat(handle.fileno()).st_size
    if size != expected["bytes"]:
        raise IndexDirError(f"{path} has {size} bytes, index.json records {expected['bytes']}: truncated or replaced")
    if sha256_file(path) != expected["sha256"]:
        raise IndexDirError(f"{path} does not match the sha256 in index.json: the file was edited or corrupted")


def load_index_dir(path: str | Path, verify: bool = True, check_calibration: bool = True) -> IndexDir:
    """Load an index dir, checking every file against index.json (``verify``; ``check_calibration``
    false: all but index.json's calibration block, which ``calibrate`` is about to replace)."""
    from receipt_embed.indexing.factory import nlist_of, search_candidates, set_search_params

    path = Path(path)
    meta = read_meta(path, check_calibration)
    files = meta["files"]
    for name in (INDEX_FILE, ITEMS_FILE, EMBEDDINGS_FILE):
        if name not in files:
            raise IndexDirError(f"{path / META_FILE} has no entry for {name}")
        if verify:
            _check_file(path / name, files[name])
    index = _read_faiss(path / INDEX_FILE)
    _open_member(path / ITEMS_FILE).close()
    try:
        items = read_jsonl(path / ITEMS_FILE)
    except ValueError as exc:
        raise IndexDirError(str(exc)) from None
    try:
        _open_member(path / EMBEDDINGS_FILE).close()
        embeddings = load_npy(path / EMBEDDINGS_FILE)  # header checked against the size first
    except BadNpyFile as exc:
        raise IndexDirError(str(exc)) from None
    except ValueError as exc:
        raise IndexDirError(f"{path / EMBEDDINGS_FILE} cannot be read: {exc}") from None
    check_items(items, path / ITEMS_FILE, IndexDirError)
    check_embeddings(embeddings, path / EMBEDDINGS_FILE, IndexDirError)
    if nlist_of(index) == 0:  # an IVF index of no lists (an older release wrote one): FAISS fails searching it
        raise IndexDirError(f"{path / INDEX_FILE} is an IVF index with no lists; build it again with IVF1 or more")
    count, dim = meta["count"], meta["dim"]
    problems = []
    if index.ntotal != count or index.d != dim:
        problems.append(f"{INDEX_FILE} holds {index.ntotal} vectors of dim {index.d}")
    if len(items) != count:
        problems.append(f"{ITEMS_FILE} has {len(items)} rows")
    if embeddings.shape != (count, dim):
        problems.append(f"{EMBEDDINGS_FILE} has shape {embeddings.shape}")
    if problems:
        raise IndexDirError(f"{path}: index.json records {count} items of dim {dim}, but " + "; ".join(problems))
    check_index_structure(index, meta, path / INDEX_FILE, IndexDirError)
    check_items_match_dataset(items, meta["source"], path / ITEMS_FILE, IndexDirError)
    params = meta.get("search_params") or ""
    # only a setting `index` itself tunes over: faiss takes any number, and efSearch=-1 drops
    # neighbours silently while efSearch=2000000000 allocates without end
    settings = [setting for group in search_candidates(index) for setting in group]
    if params not in settings:
        written = ", ".join(repr(setting) for setting in settings[:6] if setting) or "none"
        raise IndexDirError(
            f"{path / META_FILE}: search_params {shortened(repr(params))} do not apply to a {meta['factory']} index "
            f"(`receipt-embed index` writes one of the settings it tunes: {written}{', ...' if len(settings) > 6 else ''})"
        )
    set_search_params(index, params)
    check_index_holds_rows(index, embeddings, meta, path / INDEX_FILE, IndexDirError)
    return IndexDir(path, index, items, embeddings, meta, _load_verifiers(path, meta, verify))


def _load_verifiers(path: Path, meta: dict, verify: bool) -> dict:
    """The verifier files index.json records, checked like the other files."""
    from receipt_embed.indexing.verifier_data import read_verifier_file

    loaded = {}
    for name, record in (meta.get("verifiers") or {}).items():
        file = record["file"]
        if file not in meta["files"]:
            raise IndexDirError(f"{path / META_FILE} has no entry for {file} (verifier {quoted(name)})")
        if verify:
            _check_file(path / file, meta["files"][file])
        with _open_member(path / file):
            pass
        loaded[name] = read_verifier_file(path / file, name, meta["count"], IndexDirError)
    return loaded


_load_index_dir_once = load_index_dir  # the checks live there; this wrapper only adds the swap-safe read


def load_index_dir(path: str | Path, *args, **kwargs) -> IndexDir:  # noqa: F811
    """Load an index dir, checking every file against index.json (``verify``); a dir swapped
    for a new copy while it was read is read again, so the result is one copy, never a mix."""
    from receipt_embed.staging import consistent_read

    return consistent_read(_load_index_dir_once, path, *args, **kwargs)
