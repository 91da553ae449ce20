"""Loading a ``.npy`` array only after its header agrees with the file.

A ``.npy`` header states dtype and shape; ``numpy.load`` allocates what it states before
reading a byte of data, so a 1 KB file claiming (9999999999, 8) asks for 298 GiB. The
header is read and checked first: a plain numeric dtype (no objects, no structured
records), and shape x itemsize equal to the bytes after the header.
"""

from __future__ import annotations

import math
import os

import numpy as np
from numpy.lib import format as npy_format

from receipt_embed.errors import BadInput
from receipt_embed.userfiles import open_regular


class BadNpyFile(BadInput):
    """A ``.npy`` file whose header is unreadable, or disagrees with its size or kind."""


def _read_header(handle, path):
    try:
        version = npy_format.read_magic(handle)
        if version == (1, 0):
            return npy_format.read_array_header_1_0(handle, max_header_size=10_000)
        if version in ((2, 0), (3, 0)):
            return npy_format.read_array_header_2_0(handle, max_header_size=10_000)
    except (ValueError, SyntaxError, EOFError) as exc:
        raise BadNpyFile(
            f"{path}: not a readable .npy file ({str(exc).splitlines()[0] if str(exc) else 'bad header'})"
        ) from None
    raise BadNpyFile(f"{path}: unsupported .npy format version {version}")


def load_npy(path: str | os.PathLike) -> np.ndarray:
    """The array in a regular ``.npy`` file whose header matches its size (a
    :class:`BadNpyFile` or :class:`~receipt_embed.userfiles.UnusableFile` otherwise)."""
    with open_regular(path, None) as handle:
        shape, fortran_order, dtype = _read_header(handle, path)
        if dtype.hasobject:
            raise BadNpyFile(f"{path} cannot be read: it holds Python objects, not numbers")
        if dtype.fields is not None or dtype.subdtype is not None:
            raise BadNpyFile(f"{path} holds structured values (dtype {dtype.str}), not plain numbers")
        data_bytes = os.fstat(handle.fileno()).st_size - handle.tell()
        expected = math.prod(shape) * dtype.itemsize
        if expected != data_bytes:
            raise BadNpyFile(
                f"{path}: its header says shape {shape} of {dtype} ({expected} bytes), "
                f"but the file holds {data_bytes} bytes of data"
            )
        handle.seek(0)
        return np.load(handle, allow_pickle=False)


def load_npz(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """The arrays of a regular ``.npz`` file (what ``numpy.savez`` writes: members stored, not
    compressed), each only after its header matches the member's size, so neither a member
    claiming a huge shape nor a compressed one that inflates without end is ever allocated."""
    import zipfile

    with open_regular(path, None) as handle:
        try:
            archive = zipfile.ZipFile(handle)
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            raise BadNpyFile(f"{path}: not a readable .npz file ({exc})") from None
        arrays = {}
        with archive:
            for member in archive.infolist():
                where = f"{path} member {member.filename!r}"
                if not member.filename.endswith(".npy") or member.compress_type != zipfile.ZIP_STORED:
                    raise BadNpyFile(f"{where}: an .npz of receipt-embed holds stored .npy members only")
                try:
                    with archive.open(member) as stream:
                        shape, _, dtype = _read_header(stream, where)
                        header_bytes = stream.tell()
                        if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
                            raise BadNpyFile(f"{where} holds dtype {dtype.str}, not plain numbers or text")
                        expected = math.prod(shape) * dtype.itemsize
                        if expected != member.file_size - header_bytes:
                            raise BadNpyFile(
                                f"{where}: its header says shape {shape} of {dtype} ({expected} bytes), but it "
                                f"holds {member.file_size - header_bytes} bytes of data"
                            )
                    with archive.open(member) as stream:
                        arrays[member.filename[: -len(".npy")]] = npy_format.read_array(stream, allow_pickle=False)
                except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
                    if isinstance(exc, BadNpyFile):
                        raise
                    raise BadNpyFile(f"{where} cannot be read: {exc}") from None
        return arrays


__all__ = ["BadNpyFile", "load_npy", "load_npz"]
