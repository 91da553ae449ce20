"""receipt_embed.userfiles: every kind of non-regular path is refused with its reason, never read."""

from __future__ import annotations

import os
import socket

import pytest

from receipt_embed.userfiles import UnusableFile, is_regular, open_regular, read_regular


def reason_of(path, **kwargs) -> UnusableFile:
    with pytest.raises(UnusableFile) as caught:
        read_regular(path, **kwargs)
    return caught.value


def test_regular_file_is_read(tmp_path):
    path = tmp_path / "a.bin"
    path.write_bytes(b"abc")
    assert read_regular(path) == b"abc"
    with open_regular(path) as handle:
        assert handle.read() == b"abc"
    assert is_regular(path)


def test_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe.jpg"
    os.mkfifo(fifo)
    error = reason_of(fifo)
    assert error.reason == "not_a_file" and "FIFO" in str(error) and str(fifo) in str(error)
    assert not is_regular(fifo)


def test_character_device_is_refused():
    error = reason_of("/dev/zero")
    assert error.reason == "not_a_file" and "character device" in str(error)


def test_directory_and_socket_are_refused(tmp_path):
    assert "directory" in str(reason_of(tmp_path))
    sock_path = tmp_path / "s.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(sock_path))
    try:
        error = reason_of(sock_path)
        assert error.reason == "not_a_file" and "socket" in str(error)
    finally:
        server.close()


def test_unresolvable_paths_have_reasons(tmp_path):
    loop = tmp_path / "loop.jpg"
    os.symlink(loop, loop)
    assert reason_of(loop).reason == "unresolvable_path"
    assert reason_of(str(tmp_path / "a\x00b.jpg")).reason == "unresolvable_path"
    assert reason_of(tmp_path / ("x" * 300)).reason == "unresolvable_path"
    assert reason_of(tmp_path / "missing.jpg").reason == "missing_file"
    (tmp_path / "file").write_bytes(b"x")
    assert reason_of(tmp_path / "file" / "below").reason == "unresolvable_path"


def test_byte_cap(tmp_path):
    path = tmp_path / "big.bin"
    path.write_bytes(b"x" * 101)
    error = reason_of(path, max_bytes=100)
    assert error.reason == "too_large" and "101 bytes" in str(error)
    assert read_regular(path, max_bytes=101) == b"x" * 101


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_permission_denied(tmp_path):
    path = tmp_path / "secret.jpg"
    path.write_bytes(b"x")
    path.chmod(0)
    assert reason_of(path).reason == "permission_denied"


def test_kernel_files_are_refused_though_stat_calls_them_regular(tmp_path):
    """Attack round 7: /proc/kmsg is a "regular" empty file whose read waits on the kernel: a config,
    manifest, query, checkpoint or plugin file linked to it hung the command."""
    import os

    from receipt_embed.userfiles import UnusableFile, read_regular

    target = "/proc/self/status"  # any kernel file: readable, but refused by where it lives
    os.symlink(target, tmp_path / "q.jpg")
    for path in (target, tmp_path / "q.jpg"):
        with pytest.raises(UnusableFile, match=r"is a kernel file \(under /proc or /sys\), not a regular file"):
            read_regular(path)
