"""Writing an output dir whole: staged beside the old one, then swapped in.

``replace_dir(OUT, kind)`` holds OUT's writer lock, has the caller write everything into a
staging sibling ``PARENT/.NAME.staging-PID``, syncs it, and swaps it in with one
``renameat2(RENAME_EXCHANGE)``: a reader, a kill or a full disk at any moment leaves either
the complete old dir or the complete new one. Where the exchange is not supported the old dir
is renamed aside (``.NAME.old-PID``) and the new one in; the next writer repairs a swap cut
short between the two renames. Leftovers of a killed writer are removed under the lock and
reported in one line; readers re-read a dir swapped under them (``consistent_read``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from glob import escape as glob_escape
from pathlib import Path

from receipt_embed.errors import BadInput
from receipt_embed.fileio import DiskFull, free_bytes, fsync_dir, is_disk_full
from receipt_embed.locking import end_if_a_forked_copy, pid_running, write_lock
from receipt_embed.outdir import MARKERS, PARTIAL, check_replaceable, dir_kind, is_mount_point
from receipt_embed.stops import forget_swapped_in, note_swapped_in, raise_if_stopped

RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def leftovers(out: str | os.PathLike) -> list[Path]:
    """Staging and set-aside copies of ``out`` that a killed writer left beside it: only real
    folders (not links) named ``.NAME.staging-PID`` / ``.NAME.old-PID`` for a PID no longer
    running, holding nothing but a dir of ours; a user's folder that merely has such a name is
    never touched."""
    out = Path(os.path.abspath(out))
    if not out.parent.is_dir():
        return []
    prefixes = (f".{out.name}.staging-", f".{out.name}.old-")
    found = []
    for path in out.parent.iterdir():
        if not path.name.startswith(prefixes):
            continue
        pid = path.name.rsplit("-", 1)[1]
        if not pid.isdigit() or pid_running(int(pid)) or path.is_symlink() or not path.is_dir():
            continue
        if dir_kind(path) in (None, *MARKERS) or _only_our_names(path):
            found.append(path)
    return sorted(found)


# every top-level name a dir of ours may hold; a staging copy killed part-way holds some of them
OUR_NAMES = {
    *(name.split("/")[0] for names in MARKERS.values() for name in names),
    *(name for names in PARTIAL.values() for name in names),
    "images",
    "audit",
}


def _only_our_names(path: Path) -> bool:
    return all(entry.name in OUR_NAMES or entry.name.startswith(".") for entry in path.iterdir())


def clean_leftovers(out: str | os.PathLike, log=None) -> list[Path]:
    """Under ``out``'s lock: finish a swap cut short (an old copy set aside and no new one in
    place goes back), remove the rest, and report it in one line."""
    out = Path(os.path.abspath(out))
    found = leftovers(out)
    restored = None
    if not out.exists() and not out.is_symlink():
        old = [p for p in found if ".old-" in p.name]
        if old:
            restored = old[-1]
            os.rename(restored, out)
    removed = [p for p in found if p != restored]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    parts = [f"restored {out} from {restored.name}, set aside by an interrupted write"] if restored else []
    if removed:
        parts.append(
            f"removed {len(removed)} leftover(s) of an interrupted write beside {out} "
            f"({', '.join(p.name for p in removed)})"
        )
    if parts:
        (log or warnings.warn)("; ".join(parts))
    return found


def clean_temporaries(path: str | os.PathLike, log=None) -> list[Path]:
    """Under ``path``'s lock: remove the temporary files (``.NAME.*.tmp``) of atomic writes of
    ``path`` that a killed writer left beside it, and say so in one line."""
    path = Path(os.path.abspath(path))
    found = sorted(
        p for p in path.parent.glob(f".{glob_escape(path.name)}.*.tmp") if p.is_file() and not p.is_symlink()
    )
    for leftover in found:
        leftover.unlink(missing_ok=True)
    if found:
        (log or warnings.warn)(
            f"removed {len(found)} temporary file(s) of an interrupted write of {path} ({', '.join(p.name for p in found)})"
        )
    return found


def _libc_renameat2():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        function = libc.renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_renameat2 = _libc_renameat2()


def exchange(a: Path, b: Path) -> bool:
    """Swap the names ``a`` and ``b`` in one atomic step; False where the system cannot."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)):
        return False
    raise OSError(code, f"cannot swap {b} for its new copy: {os.strerror(code)}")


def swap_in(staging: Path, out: Path) -> None:
    """Put the complete ``staging`` dir in place of ``out`` and remove the old copy."""
    if not out.exists():
        os.rename(staging, out)
        note_swapped_in(out)
    elif exchange(staging, out):
        note_swapped_in(out)
        fsync_dir(out.parent)
        shutil.rmtree(staging, ignore_errors=True)  # now the old copy
        return
    else:
        aside = out.parent / f".{out.name}.old-{os.getpid()}"
        os.rename(out, aside)
        try:
            os.rename(staging, out)  # a kill in between: the next writer's clean_leftovers restores `aside`
        except BaseException:
            os.rename(aside, out)
            raise
        note_swapped_in(out)
        fsync_dir(out.parent)
        shutil.rmtree(aside, ignore_errors=True)
    fsync_dir(out.parent)


def _sync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(folder)


@contextmanager
def replace_dir(out: str | os.PathLike, kind: str, force: bool = False, log=None) -> Iterator[Path]:
    """Lock ``out``, yield a fresh staging dir to write the new ``kind`` dir into, then swap it in.

    An exception (a full disk included) leaves ``out`` as it was and removes the staging dir;
    a full disk becomes a :class:`DiskFull` naming the file as it would have been in ``out``."""
    out = Path(os.path.abspath(out))
    if out.is_dir() and is_mount_point(out):  # the kernel refuses to rename a mount point (EBUSY)
        raise BadInput(
            f"{out} is a mount point, and a new {kind} dir cannot be swapped in for it; "
            f"write into a folder inside it instead (e.g. --out {out / kind})"
        )
    with write_lock(out, log=log):
        forget_swapped_in(out)
        clean_leftovers(out, log)
        check_replaceable(out, kind, force)
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = out.parent / f".{out.name}.staging-{os.getpid()}"
        try:
            staging.mkdir()
        except OSError as exc:
            if is_disk_full(exc):
                raise DiskFull(staging, free_bytes(out.parent)) from None
            raise
        try:  # a SIGTERM unwinds through here too (see locking.write_lock)
            yield staging
            end_if_a_forked_copy(out)
            raise_if_stopped()  # a stop a library swallowed while the new dir was written: keep the old one
            _sync_tree(staging)
            swap_in(staging, out)
        except BaseException as exc:
            end_if_a_forked_copy(out)  # the staging dir is the lock holder's to remove
            full = isinstance(exc, DiskFull) or is_disk_full(exc)
            free = exc.free_bytes if isinstance(exc, DiskFull) else free_bytes(out.parent) if full else None
            shutil.rmtree(staging, ignore_errors=True)
            if full:
                path = getattr(exc, "path", None) or getattr(exc, "filename", None) or staging
                shown = out / Path(path).relative_to(staging) if Path(path).is_relative_to(staging) else path
                raise DiskFull(shown, free) from None
            raise


def _dir_identity(path: Path):
    """Which copy of a dir a path names now (a swap by ``outdir.replace_dir`` changes it)."""
    try:
        info = path.stat()
    except OSError:
        return None
    return info.st_dev, info.st_ino


def consistent_read(read, path: str | Path, *args, attempts: int = 4, **kwargs):
    """``read(path, ...)`` that never returns a mix of two copies of a dir: when the dir was
    swapped for a new copy mid-read (or was briefly absent while a writer swapped it), read again."""
    import time

    path = Path(path)
    for _ in range(attempts - 1):
        before = _dir_identity(path)
        try:
            result = read(path, *args, **kwargs)
        except (OSError, ValueError):
            if _dir_identity(path) == before is not None:
                raise  # a real error, not a swap under our feet
            time.sleep(0.02)
            continue
        if _dir_identity(path) == before:
            return result
    return read(path, *args, **kwargs)
