"""One writer per output dir: an exclusive ``flock`` on a lock file beside the dir.

The lock file is ``PARENT/.NAME.lock`` (beside the dir, so it survives the dir being swapped
for a new copy) and holds JSON naming its holder: pid, host, command line and start time.
The kernel releases a ``flock`` when its holder dies, so a lock file whose lock is free was
left by a writer that was killed: it is taken over with a warning naming that writer.
Readers take no lock; they rely on writes being atomic (``receipt_embed.outdir``). While
the lock is held, SIGTERM unwinds the writer (``SystemExit(143)``) so it cleans up after itself.

Under ``--nproc`` the launcher holds the lock and names it in ``HELD_LOCKS_ENV`` for its
ranks, so rank 0 does not wait on its own parent; rank 0 checks before each write that the
launcher is still its ancestor (a launcher killed with kill -9 releases the lock).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from receipt_embed.display import shortened
from receipt_embed.errors import BadInput
from receipt_embed.fileio import parse_json
from receipt_embed.plugin_watch import end_a_copy_forked_from
from receipt_embed.stops import StoppedBySignal, as_stop, signal_name, signals_stop_the_command, sigterm_unwinds

HELD_LOCKS_ENV = "RECEIPT_EMBED_HELD_LOCKS"  # os.pathsep-separated lock files a parent process holds
_held: dict[str, int] = {}  # lock file -> how many nested holds this process has on it


class DirLocked(BadInput):
    """Another live process is writing the dir; the message names it (one line)."""


class UnusableLockFile(BadInput):
    """The lock file is a link, FIFO, device or folder (or has other names): never written through."""


MAX_DIR_NAME_BYTES = 200  # a dir a command writes keeps siblings .NAME.lock and .NAME.staging-PID (255 at most)


class NameTooLong(BadInput):
    """An output dir's name leaves no room for the lock and staging names beside it."""


def lock_path(out: str | os.PathLike) -> Path:
    """``PARENT/.NAME.lock`` for the dir ``out`` (resolved, so two spellings share one lock: a
    symlink to a dir locks the dir it leads to, as its writers and readers write there)."""
    out = Path(os.path.abspath(out))
    if out.is_symlink():
        out = Path(os.path.realpath(out))
    if len(os.fsencode(out.name)) > MAX_DIR_NAME_BYTES:
        raise NameTooLong(
            f"--out {shortened(str(out))}: the name is {len(os.fsencode(out.name))} bytes; an output dir's name "
            f"may have at most {MAX_DIR_NAME_BYTES}, to leave room beside it for .NAME.lock and .NAME.staging-PID"
        )
    parent = out.parent.resolve() if out.parent.exists() else out.parent
    return parent / f".{out.name}.lock"


def _describe(holder: dict, unrecorded: str) -> str:
    """``pid 12 on host a (`receipt-embed train ...`, since 2026-...)`` from a lock record, saying
    only what it holds; ``unrecorded`` when it names no process at all."""
    pid, host, command, since = (holder.get(key) for key in ("pid", "host", "command", "since"))
    known = lambda value: isinstance(value, str) and bool(value.strip())  # noqa: E731
    if not (isinstance(pid, int) and not isinstance(pid, bool)) and not known(host) and not known(command):
        return unrecorded
    who = f"pid {pid}" if isinstance(pid, int) and not isinstance(pid, bool) else "a process of unrecorded pid"
    details = [f"`{command}`"] if known(command) else []
    details += [f"since {since}"] if known(since) else []
    return who + (f" on host {host}" if known(host) else "") + (f" ({', '.join(details)})" if details else "")


def _took_over(out, stale: dict) -> str:
    """The warning for a lock taken over: its flock was free, which proves the writer gone only when
    it ran on this host (a flock taken on another host may not be seen here on a network file system)."""
    here, host = socket.gethostname(), stale.get("host")
    left_by = _describe(stale, "a writer that left no record of itself")
    if isinstance(host, str) and host.strip() and host != here:
        return (
            f"took over the lock on {out} left by {left_by}: its lock is free here, but a writer on another "
            f"host cannot be seen from {here}; if it may still be writing, stop this command"
        )
    pid = stale.get("pid")
    if isinstance(pid, int) and not isinstance(pid, bool) and pid_running(pid):
        return (
            f"took over the lock on {out} left by {left_by}: a process {pid} is running, but it does not hold "
            "the lock (its pid was reused by another process, or it no longer writes there)"
        )
    return f"took over the lock on {out} left by {left_by}, which is no longer running"


def pid_running(pid: int) -> bool:
    """Whether a process ``pid`` may be running on this host. Only a pid the OS says has no
    process (or a pid beyond the OS's range) is not running; another user's process counts as
    running, so a caller that removes a dead writer's files never removes a live one's."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True
    return True


def _read_holder(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 65536).decode("utf-8", "replace")
        holder = parse_json(text) if text.strip() else {}
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _is_ours(fd: int) -> bool:
    """Empty (a writer killed before its record) or a holder record: a lock file receipt-embed wrote.
    Anything else is a user's file that happens to have the name, and is never overwritten."""
    try:
        if os.fstat(fd).st_size == 0:
            return True
    except OSError:
        return False
    holder = _read_holder(fd)
    return isinstance(holder.get("pid"), int) and "host" in holder


def _open_locked(path: Path, out) -> int:
    """A descriptor on ``path`` holding its flock; raises DirLocked while another holds it."""
    while True:
        fd = _open_lock_file(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_holder(fd)
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            writer = _describe(holder, "another process (which has not written its record yet)")
            message = f"{out} is being written by {writer}: wait for it to finish or stop it"
            raise DirLocked(message) from None
        try:
            same = os.lstat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:  # else the holder removed the file between our open and flock: try the new one
            return fd
        os.close(fd)


_OPEN_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _unusable(path: Path, what: str) -> UnusableLockFile:
    return UnusableLockFile(
        f"the lock file {path} is {what}, not a regular file receipt-embed wrote; it is never "
        "written through: remove it and try again"
    )


def _open_lock_file(path: Path) -> int:
    """A descriptor on the regular lock file ``path`` (created if absent); never follows a link, never
    blocks on a FIFO, and refuses anything that is not a plain file of one name."""
    from receipt_embed.fileio import DiskFull, free_bytes, is_disk_full

    try:
        fd = os.open(path, _OPEN_FLAGS, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _unusable(path, "a symbolic link") from None
        if exc.errno == errno.EISDIR:
            raise _unusable(path, "a folder") from None
        if is_disk_full(exc):
            raise DiskFull(path, free_bytes(path.parent)) from None
        raise UnusableLockFile(f"cannot open the lock file {path}: {exc.strerror}") from None
    info = os.fstat(fd)
    what = next((name for test, name in _KINDS if test(info.st_mode)), None)
    if what is None and info.st_nlink > 1:
        what = f"a file with {info.st_nlink} names (hard links)"
    if what is not None:
        os.close(fd)
        raise _unusable(path, what)
    os.set_blocking(fd, True)
    return fd


def _write_holder(fd: int, path: Path, record: dict) -> None:
    from receipt_embed.fileio import DiskFull, free_bytes, is_disk_full

    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode("utf-8"), 0)
    except OSError as exc:
        if is_disk_full(exc):
            raise DiskFull(path, free_bytes(path.parent)) from None
        raise


_descriptors: dict[str, int] = {}  # lock path -> the descriptor holding its flock, in this process
_owners: dict[str, int] = {}  # lock path -> the pid that took it (a forked copy of this process is not it)
_inherited: dict[str, tuple[int, int]] = {}  # lock path -> (pid, lock file inode) of the ancestor holding it


class LockLost(BadInput):
    """The lock file of a dir this process writes was removed or replaced while it held it."""


def check_still_held(out: str | os.PathLike) -> None:
    """Before a long-running writer writes again: refuse to go on when its lock file was deleted or
    replaced meanwhile (another writer could then have taken a new lock on the same dir), or, for a
    lock its launcher holds (a ``--nproc`` rank), when that launcher is gone: the kernel released the
    lock with it, so another writer may have the dir now."""
    end_if_a_forked_copy(out)  # a child a plugin forked has this process's lock and dicts, not its place
    path = lock_path(out)
    fd = _descriptors.get(str(path))
    inherited = _inherited.get(str(path))
    if fd is None and inherited is None:  # not held by this process or a launcher above it: nothing to compare
        return
    try:
        same = os.stat(path).st_ino == (os.fstat(fd).st_ino if fd is not None else inherited[1])
    except FileNotFoundError:
        same = False
    if not same:
        raise LockLost(
            f"the lock file {path} of {out} was removed or replaced while this process was writing there; "
            "another writer may be using the dir now, so this one stops without writing more "
            "(check the dir, then start again)"
        )
    if inherited is not None and inherited[0] not in _ancestors():
        raise LockLost(
            f"the launcher that held the lock of {out} for this process (pid {inherited[0]}) is gone; without it "
            "another writer may take the dir, so this one stops without writing more "
            "(check the dir, then continue it with --resume or start again)"
        )


def end_if_a_forked_copy(out: str | os.PathLike) -> None:
    """A child a plugin forked while this process held ``out``'s lock ends here, before it touches
    the dir (writes, swaps or removes a staging dir) as a second writer."""
    key = str(lock_path(out))
    if key in _owners:
        end_a_copy_forked_from(_owners[key], str(out))


def held_descriptor(out: str | os.PathLike) -> int | None:
    """The descriptor holding the flock of ``out``'s lock in this process (None when it holds none):
    a child given it keeps the lock held for as long as it runs, even after this process is gone."""
    return _descriptors.get(str(lock_path(out)))


@contextmanager
def write_lock(out: str | os.PathLike, log=None) -> Iterator[Path]:
    """Hold the exclusive writer lock of dir ``out`` (reentrant within a process).

    Raises :class:`DirLocked` at once (no waiting) when a live process holds it; a stale lock
    left by a killed writer is taken over with a warning (or ``log``) naming that writer."""
    path = lock_path(out)
    key = str(path)
    holder = None if key in _held else _held_by_an_ancestor(path)
    if key in _held or holder is not None:
        if holder is not None:
            _inherited[key] = holder
        _held[key] = _held.get(key, 0) + 1
        try:
            yield path
        finally:
            _held[key] -= 1
            if not _held[key]:
                del _held[key]
                _inherited.pop(key, None)
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # a file where a folder above --out should be
        above = next((p for p in [path.parent, *path.parent.parents] if p.exists()), path.parent)
        raise BadInput(f"--out {out}: {above} is a file, not a folder, so nothing can be written below it") from None
    fd = _open_locked(path, out)
    if not _is_ours(fd):
        os.close(fd)
        raise UnusableLockFile(
            f"{path} is where receipt-embed keeps the writer lock of {out}, but it holds something else "
            "(not a lock record receipt-embed wrote); it is never overwritten: move it away and try again"
        )
    try:
        stale = _read_holder(fd)
        if stale:
            (log or warnings.warn)(_took_over(out, stale))
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": _command_line(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        _held[key] = 1
        _descriptors[key] = fd
        _owners[key] = os.getpid()
        try:
            with sigterm_unwinds():  # before the record: a holder that is named also cleans up on SIGTERM
                _write_holder(fd, path, record)
                yield path
        except BaseException as exc:
            stop = as_stop(exc, out)
            if stop is None or stop is exc:
                raise
            raise stop from None
        finally:
            end_a_copy_forked_from(_owners.pop(key), str(out))  # never a forked copy unlinking the lock
            del _held[key]
            _descriptors.pop(key, None)
            try:  # only our own lock file: one that replaced it (after a deletion) is another writer's
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    path.unlink(missing_ok=True)  # under the flock: a waiting opener re-checks the inode
            except FileNotFoundError:
                pass
    finally:
        os.close(fd)


def _held_by_an_ancestor(path: Path) -> tuple[int, int] | None:
    """(the holder's pid, the lock file's inode) when ``HELD_LOCKS_ENV`` names ``path`` and the live
    holder its record names is one of this process's ancestors (the ``--nproc`` launcher of a rank),
    else None: an inherited or hand-set variable is not trusted."""
    if str(path) not in os.environ.get(HELD_LOCKS_ENV, "").split(os.pathsep):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        holder, inode = _read_holder(fd).get("pid"), os.fstat(fd).st_ino
    finally:
        os.close(fd)
    return (holder, inode) if isinstance(holder, int) and holder in _ancestors() else None


def _ancestors() -> set[int]:
    """The pids above this process (from /proc; the parent alone where there is none)."""
    found, pid = set(), os.getppid()
    while pid > 1 and pid not in found:
        found.add(pid)
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat_file:
                pid = int(stat_file.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return found


def _command_line() -> str:
    import shlex

    args = list(sys.argv)
    if args and args[0].endswith(("__main__.py", "receipt-embed")):
        args[0] = "receipt-embed"
    return shlex.join(args)[:300]


def held_locks_env(*outs) -> dict[str, str]:
    """The environment entry that tells child processes this process holds ``outs``' locks."""
    held = [p for p in os.environ.get(HELD_LOCKS_ENV, "").split(os.pathsep) if p]
    return {HELD_LOCKS_ENV: os.pathsep.join([*held, *(str(lock_path(o)) for o in outs)])}


__all__ = [
    "DirLocked",
    "HELD_LOCKS_ENV",
    "LockLost",
    "StoppedBySignal",
    "UnusableLockFile",
    "held_descriptor",
    "held_locks_env",
    "signal_name",
    "signals_stop_the_command",
    "lock_path",
    "write_lock",
]
