"""Reading and decoding each candidate capture, bounded in bytes and pixels, in threads.

A file that cannot be read or decoded is a rejected row with a reason code; the rest carry
their sha256, size and dimensions into the manifest.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from tqdm import tqdm

from receipt_embed.config import IngestConfig
from receipt_embed.images import ImageRejected, decode_image
from receipt_embed.userfiles import UnusableFile, open_regular
from receipt_embed.workers import thread_pool


def _read_capture(candidate: dict, max_bytes: int) -> tuple[bytes, os.stat_result] | dict:
    """The bytes of one capture file and their size and mtime, or the rejection: only a
    regular file of at most ``max_bytes`` is opened (a FIFO, device or folder never is)."""
    path, line, named = Path(candidate["path"]), candidate["line"], candidate["manifest_path"]
    try:
        with open_regular(path, max_bytes) as handle:
            info = os.fstat(handle.fileno())
            data = handle.read(max_bytes + 1)
    except UnusableFile as exc:
        if exc.reason == "missing_file":
            return {"reason": "missing_file", "detail": f"line {line}: file not found: {named} ({path})"}
        return {"reason": exc.reason, "detail": f"line {line}: {named}: {exc.detail}"}
    except OSError as exc:  # a read error after a good open (an I/O error, a vanished network share)
        return {"reason": "unreadable", "detail": f"line {line}: cannot read {named} ({exc.strerror or exc})"}
    if len(data) > max_bytes:
        return {"reason": "too_large", "detail": f"line {line}: {named} grew past the limit of {max_bytes} bytes"}
    return data, info


def _inspect(candidate: dict, max_pixels: int, max_bytes: int) -> dict:
    """Read and fully decode one file; returns its checked facts or the rejection."""
    read = _read_capture(candidate, max_bytes)
    if isinstance(read, dict):
        return read
    data, info = read
    try:
        decoded = decode_image(data, max_pixels, name=f"line {candidate['line']}: {candidate['manifest_path']}")
    except ImageRejected as exc:
        return {"reason": exc.reason, "detail": exc.detail}
    width, height = decoded.image.size
    return {
        "sha256": hashlib.sha256(data).hexdigest(),
        "width": width,
        "height": height,
        "format": decoded.format,
        "mode": decoded.source_mode,
        "bytes": len(data),  # size and mtime: later commands detect a file replaced since ingest
        "mtime_ns": info.st_mtime_ns,
    }


def check_files(candidates: list[dict], settings: IngestConfig, rejected: list, progress: bool) -> list[dict]:
    workers = min(4, os.cpu_count() or 1)
    checked = []
    with thread_pool(workers) as pool:  # SIGTERM, Ctrl-C: stop at once, not after decoding the rest
        results = pool.map(lambda c: _inspect(c, settings.max_pixels, settings.max_bytes), candidates)
        for candidate, facts in tqdm(
            zip(candidates, results),
            total=len(candidates),
            desc="checking files",
            unit="file",
            disable=not progress,
        ):
            if "reason" in facts:
                rejected.append({"line": candidate["line"], "path": candidate["manifest_path"], **facts})
            else:
                checked.append({**candidate, **facts})
    return checked
