"""Atomic file writes: a crash mid-write never leaves a half-written output behind.

Each write goes to a temporary file in the same folder, is flushed to disk, and is then
renamed over the destination (an atomic operation on POSIX file systems); the folder is
synced too, so the rename itself survives a power cut. A full disk is a :class:`DiskFull`
naming the file and the space left, never a bare ``OSError``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from receipt_embed.errors import BadInput
from receipt_embed.userfiles import DEFAULT_MAX_BYTES, open_regular, read_regular

# a run's metrics, a dataset's manifest or an index's items: large, but bounded
MAX_JSONL_BYTES = DEFAULT_MAX_BYTES
# a record such as data.json or ingest_report.json
MAX_JSON_BYTES = 16 * 1024 * 1024


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _current_umask()
# a file-size limit (ulimit -f: EFBIG) stops a write as a full disk does, and is told the same way
_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EFBIG}


def _file_size_limit() -> int | None:
    """The largest file this process may write (``ulimit -f``), or None when unlimited."""
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    except (ImportError, OSError, ValueError):
        return None
    return None if limit == resource.RLIM_INFINITY else limit


class DiskFull(BadInput):
    """No space (or quota) left while writing ``path``; one line for the user, exit code 2. A file
    system can also run out of inodes (file entries) with gigabytes free: then the line says so."""

    def __init__(self, path, free_bytes: int | None):
        free = "unknown space" if free_bytes is None else f"{free_bytes / 2**20:.1f} MiB"
        limit = _file_size_limit()
        if limit is not None and (free_bytes is None or free_bytes > limit):
            most = f"{limit / 2**20:.1f} MiB" if limit >= 2**20 else f"{limit / 1024:.0f} KiB"
            message = (
                f"the file-size limit was reached writing {path}: this process may write files of at most "
                f"{most} (ulimit -f), with {free} free on that file system"
            )
        elif free_files(Path(path).parent) == 0:
            message = f"no space left on device writing {path} (no free inodes (file entries) left on that file system, though {free} free)"
        else:
            message = f"no space left on device writing {path} ({free} free on that file system)"
        super().__init__(message)
        self.path = str(path)
        self.free_bytes = free_bytes


def _file_system_facts(path: str | os.PathLike) -> os.statvfs_result | None:
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return os.statvfs(path)
    except OSError:
        return None


def free_bytes(path: str | os.PathLike) -> int | None:
    """Bytes an unprivileged writer may still use on the file system holding ``path``."""
    info = _file_system_facts(path)
    return None if info is None else info.f_bavail * info.f_frsize


def free_files(path: str | os.PathLike) -> int | None:
    """Inodes an unprivileged writer may still create there (None where the file system has no
    fixed count, as btrfs reports 0 of 0)."""
    info = _file_system_facts(path)
    return None if info is None or info.f_files == 0 else info.f_favail


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in _FULL


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or a new entry in ``path`` durable (best effort where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w") -> Iterator[IO]:
    """Open a temporary sibling of ``path``; on success it replaces ``path``."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        if is_disk_full(exc):
            raise DiskFull(path, free_bytes(path.parent)) from None
        raise OSError(exc.errno, f"cannot write {path}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; give the file the usual permissions
        os.replace(tmp, path)
    except BaseException as exc:
        free = free_bytes(path.parent) if is_disk_full(exc) else None  # before the partial file is removed
        Path(tmp).unlink(missing_ok=True)
        if is_disk_full(exc):
            raise DiskFull(path, free) from None
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_open(path, "w") as handle:
        handle.write(text)


def atomic_write_json(path: str | os.PathLike, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def atomic_write_jsonl(path: str | os.PathLike, rows: Iterable[dict]) -> None:
    with atomic_open(path, "w") as handle:
        for row in rows:
            handle.write(json.dumps(row, sort_keys=False) + "\n")


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append one line with a single write, then flush it to disk: a crash leaves at most a
    torn last line (see :func:`read_jsonl_tail_tolerant`), never a torn line mid-file."""
    data = (line.rstrip("\n") + "\n").encode("utf-8")
    try:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(path, flags, 0o666)
        try:
            written = os.write(fd, data)
            if written != len(data):  # only a full disk (or a signal) cuts a small append short
                os.ftruncate(fd, os.fstat(fd).st_size - written)
                raise OSError(errno.ENOSPC, "short write")
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        if is_disk_full(exc):
            raise DiskFull(path, free_bytes(path)) from None
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW: never append to a file a planted link points at
            raise BadInput(
                f"{path} is a symbolic link; a file receipt-embed appends to is never written through a link"
            ) from None
        raise


class RepeatedKey(ValueError):
    """A JSON object gives one key twice (``json`` would keep the last value without a word)."""


def _refuse_repeated_keys(pairs: list) -> dict:
    result = {}
    for key, value in pairs:
        if key in result:
            raise RepeatedKey(key)
        result[key] = value
    return result


def parse_json(text, unique_keys: bool = False):
    """``json.loads``, where nesting too deep for the parser (a few KB of ``[[[[``) is an ordinary
    JSONDecodeError that callers name the file for, not a RecursionError traceback. With
    ``unique_keys`` (files people write by hand), an object giving a key twice is such an error too."""
    try:
        return json.loads(text, object_pairs_hook=_refuse_repeated_keys) if unique_keys else json.loads(text)
    except RepeatedKey as exc:
        from receipt_embed.display import shortened

        raise json.JSONDecodeError(
            f"key {shortened(repr(exc.args[0]))} is given twice in one object",
            text if isinstance(text, str) else "",
            0,
        ) from None
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", text if isinstance(text, str) else "", 0) from None
    except json.JSONDecodeError:
        raise
    except ValueError:  # an integer of more digits than Python converts (4300): no file of ours has one
        doc = text if isinstance(text, str) else ""
        raise json.JSONDecodeError("a number of more than 4300 digits", doc, 0) from None


def lone_surrogate(value) -> str | None:
    """The first text in ``value`` (a str, or any key or value of a JSON object or list) that holds
    a lone UTF-16 surrogate, or None. JSON allows ``"\\ud800"`` and Python reads it into a str that
    UTF-8 cannot encode: such a value is refused where it is read, not left to fail in whatever
    writes it next (a manifest, a CSV, a plot)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return value
        return None
    if isinstance(value, dict):
        value = [text for pair in value.items() for text in pair]
    if isinstance(value, list):
        return next((found for item in value if (found := lone_surrogate(item)) is not None), None)
    return None


def lone_surrogate_detail(what: str, text: str, where: str = "the manifest") -> str:
    """Why ``text`` (as :func:`lone_surrogate` found it) is refused, naming ``what`` it is."""
    from receipt_embed.display import quoted, shortened

    code = next(ord(c) for c in text if 0xD800 <= ord(c) <= 0xDFFF)
    return (
        f"{what} {quoted(shortened(text, 60))} holds a lone UTF-16 surrogate (U+{code:04X}): not a character, "
        f"it cannot be stored as UTF-8 (fix that JSON escape in {where})"
    )


def read_jsonl_tail_tolerant(path: str | os.PathLike, warn=None) -> tuple[list[dict], bool]:
    """Rows of a JSON-lines file that is only ever appended to; a torn last line (no newline,
    or not valid JSON: a writer killed mid-append) is dropped with a warning naming the file
    and line. Returns (rows, whether a line was dropped); a bad line before the last is an
    error, as in :func:`read_jsonl`."""
    import warnings

    text = read_regular(path, MAX_JSONL_BYTES).decode("utf-8", errors="replace")
    lines = text.split("\n")
    complete, tail = lines[:-1], lines[-1]  # tail: what follows the last newline
    rows, dropped = [], None
    for number, line in enumerate(complete, start=1):
        if not line.strip():
            continue
        try:
            rows.append(parse_json(line))
        except json.JSONDecodeError as exc:
            if number == len(complete) and not tail.strip():
                dropped = number
                break
            raise BadInput(f"{path}, line {number}: invalid JSON ({exc.msg})") from None
    if tail.strip():
        dropped = len(complete) + 1
    if dropped is not None:
        (warn or warnings.warn)(f"{path}, line {dropped}: dropped a torn last line (a write cut short by a crash)")
    return rows, dropped is not None


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read a JSON-lines file; a bad line is an error naming the file and line number."""
    return parse_jsonl(read_regular(path, MAX_JSONL_BYTES), path)


def parse_jsonl(data: bytes, path: str | os.PathLike) -> list[dict]:
    """The rows of JSON-lines bytes already read from ``path`` (named in errors)."""
    rows = []
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadInput(f"{path}: not UTF-8 text (byte {exc.start})") from None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(parse_json(line))
        except json.JSONDecodeError as exc:
            raise BadInput(f"{path}, line {number}: invalid JSON ({exc.msg})") from None
    return rows


def json_safe(value):
    """NaN and infinities become null and numpy scalars plain numbers, so a JSON file we write
    (audit.json) is strict JSON that jq or JavaScript can read."""
    import math

    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if type(value).__module__ == "numpy" and hasattr(value, "item") and getattr(value, "shape", None) == ():
        return json_safe(value.item())
    return value


def sha256_file(path: str | Path, chunk: int = 1 << 22, max_bytes: int | None = None) -> str:
    """sha256 of a regular file (a FIFO or device raises UnusableFile instead of blocking; so does
    a file over ``max_bytes``, before any of it is read)."""
    digest = hashlib.sha256()
    with open_regular(path, max_bytes) as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def read_json(path: str | os.PathLike, max_bytes: int = MAX_JSON_BYTES):
    """A small JSON file (a marker, a record, a report) from a regular file of at most ``max_bytes``;
    a FIFO, a device or a huge file is an :class:`~receipt_embed.userfiles.UnusableFile`."""
    try:
        return parse_json(read_regular(path, max_bytes).decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise BadInput(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise BadInput(f"{path}: invalid JSON ({exc.msg}, line {exc.lineno})") from None
