"""Opening files a user (or a file a user handed over) names, without hanging or flooding.

A FIFO blocks a plain ``open()`` until a writer appears; a device such as ``/dev/zero``
never ends; a directory, a socket or a symlink loop raises an ``OSError`` deep inside some
library. Every read of a user-named file goes through :func:`open_regular` or
:func:`read_regular`, which refuse anything but a regular file with a stable reason code,
and cap how many bytes are read.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
from typing import BinaryIO

from receipt_embed.errors import BadInput

# what a receipt photo, a manifest or an index file may weigh before it is refused unread
DEFAULT_MAX_BYTES = 256 * 1024 * 1024


class UnusableFile(BadInput):
    """A path that cannot be read as a regular file; ``reason`` is a stable code for reports.

    Codes: ``missing_file``, ``not_a_file`` (directory, FIFO, device, socket),
    ``unresolvable_path`` (symlink loop, NUL byte, name too long), ``permission_denied``,
    ``too_large``, ``unreadable`` (any other OS error)."""

    def __init__(self, reason: str, path, detail: str):
        super().__init__(f"{path}: {detail}")
        self.reason = reason
        self.path = str(path)
        self.detail = detail


def _kind(mode: int) -> str | None:
    """What a non-regular file is, in words (None for a regular file)."""
    if stat.S_ISREG(mode):
        return None
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _refuse_os_error(path, exc: OSError) -> UnusableFile:
    code = exc.errno
    if code == errno.ENOENT:
        return UnusableFile("missing_file", path, "file not found")
    if code in (errno.EACCES, errno.EPERM):
        return UnusableFile("permission_denied", path, "permission denied")
    if code == errno.ELOOP:
        return UnusableFile("unresolvable_path", path, "too many levels of symbolic links (a symlink loop?)")
    if code == errno.ENAMETOOLONG:
        return UnusableFile("unresolvable_path", path, "file name too long")
    if code == errno.ENOTDIR:
        return UnusableFile("unresolvable_path", path, "a component of the path is not a directory")
    if code == errno.EISDIR:
        return UnusableFile("not_a_file", path, "is a directory, not a file")
    if code == errno.ENXIO:  # opening a socket
        return UnusableFile("not_a_file", path, "is a socket or a device without a reader, not a file")
    return UnusableFile("unreadable", path, f"cannot be read ({exc.strerror or exc})")


def unnameable(exc: ValueError) -> str:
    """Why the OS was never asked about a path (``ValueError`` from ``os.stat``, ``open``,
    ``Path.resolve``): a NUL byte, or a character the file system encoding cannot write (a C
    locale with UTF-8 mode turned off, ``PYTHONUTF8=0``, makes it ASCII)."""
    if isinstance(exc, UnicodeEncodeError):
        return (
            f"contains a character this system's file name encoding ({sys.getfilesystemencoding()}) cannot "
            "write: run with a UTF-8 locale (LC_ALL=C.UTF-8) or PYTHONUTF8=1"
        )
    return "contains a NUL byte"


def check_regular(path: str | os.PathLike) -> os.stat_result:
    """``stat`` a path (following symlinks) and refuse anything but a regular file."""
    try:
        info = os.stat(path)
    except ValueError as exc:  # an embedded NUL byte, a name the file system encoding cannot write
        raise UnusableFile("unresolvable_path", repr(str(path)), f"path {unnameable(exc)}") from None
    except OSError as exc:
        raise _refuse_os_error(path, exc) from None
    kind = _kind(info.st_mode)
    if kind is not None:
        raise UnusableFile("not_a_file", path, f"is {kind}, not a regular file")
    return info


KERNEL_FILE_TREES = ("/proc/", "/sys/")  # e.g. /proc/kmsg: stat says regular, a read waits on the kernel


def open_regular(path: str | os.PathLike, max_bytes: int | None = DEFAULT_MAX_BYTES) -> BinaryIO:
    """A binary handle on a regular file of at most ``max_bytes`` (None: no cap).

    The file is checked before opening (so a device is never opened) and again on the open
    descriptor (so a file swapped for a FIFO in between is still refused); ``O_NONBLOCK``
    keeps even that race from blocking."""
    check_regular(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except ValueError as exc:
        raise UnusableFile("unresolvable_path", repr(str(path)), f"path {unnameable(exc)}") from None
    except OSError as exc:
        raise _refuse_os_error(path, exc) from None
    try:
        info = os.fstat(fd)
        kind = _kind(info.st_mode)
        if kind is not None:
            raise UnusableFile("not_a_file", path, f"is {kind}, not a regular file")
        if max_bytes is not None and info.st_size > max_bytes:
            raise UnusableFile("too_large", path, f"is {info.st_size} bytes, over the limit of {max_bytes}")
        if os.path.realpath(path).startswith(KERNEL_FILE_TREES):  # "regular" and empty, yet a read can block
            raise UnusableFile("not_a_file", path, "is a kernel file (under /proc or /sys), not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def read_regular(path: str | os.PathLike, max_bytes: int | None = DEFAULT_MAX_BYTES) -> bytes:
    """All bytes of a regular file of at most ``max_bytes`` (a file that grows past the cap
    while being read is refused too)."""
    with open_regular(path, max_bytes) as handle:
        try:
            data = handle.read() if max_bytes is None else handle.read(max_bytes + 1)
        except OSError as exc:
            raise _refuse_os_error(path, exc) from None
    if max_bytes is not None and len(data) > max_bytes:
        raise UnusableFile("too_large", path, f"grew past the limit of {max_bytes} bytes while being read")
    return data


def read_regular_text(
    path: str | os.PathLike, max_bytes: int | None = DEFAULT_MAX_BYTES, encoding: str = "utf-8"
) -> str:
    """A regular text file, decoded; a decoding error propagates (callers name the line)."""
    return read_regular(path, max_bytes).decode(encoding)


def is_regular(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a regular file (never raises, never blocks)."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


__all__ = [
    "DEFAULT_MAX_BYTES",
    "UnusableFile",
    "check_regular",
    "is_regular",
    "open_regular",
    "read_regular",
    "read_regular_text",
]
