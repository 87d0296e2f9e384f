"""Low-level writes of local files: exclusive creation, whole writes, ``O_DIRECT`` with its
buffered fallback, and in-kernel copies.  :class:`~ckptd.storage.local.LocalStorage` uses them."""

from __future__ import annotations

import ctypes
import errno as errno_codes
import fcntl
import os

from ..errors import StorageError

__all__ = ["DIRECT_ALIGNMENT", "buffered", "copy_range", "create_new", "pwrite_all", "write_all", "write_piece"]


def create_new(path: str, flags: int) -> int:
    """Open ``path`` as a new, empty file (``O_EXCL``).  An existing file of that name is unlinked
    first, never truncated: it may be a hard link another checkpoint shares (incremental saves),
    whose bytes must not change."""
    try:
        return os.open(path, flags | os.O_EXCL, 0o644)
    except FileExistsError:
        os.unlink(path)
        return os.open(path, flags | os.O_EXCL, 0o644)


def copy_range(source_fd: int, target_fd: int, size: int, source: str) -> None:
    """Copy ``size`` bytes between two open files in the kernel (``copy_file_range``, which can
    share extents on filesystems that support it), falling back to ``sendfile``."""
    copied = 0
    use_range = hasattr(os, "copy_file_range")
    while copied < size:
        count = min(size - copied, 1 << 30)
        if use_range:
            try:
                done = os.copy_file_range(source_fd, target_fd, count, copied, copied)
            except OSError as e:
                if e.errno not in (errno_codes.EXDEV, errno_codes.ENOSYS, errno_codes.EINVAL, errno_codes.EOPNOTSUPP):
                    raise
                use_range = False
                continue
        else:
            os.lseek(target_fd, copied, os.SEEK_SET)
            done = os.sendfile(target_fd, source_fd, copied, count)
        if done == 0:
            raise StorageError(errno_codes.EIO, f"{source} ended at byte {copied}, expected {size} bytes")
        copied += done


def write_all(fd: int, data: memoryview) -> None:
    while data:
        written = os.write(fd, data)
        data = data[written:]


def buffered(fd: int) -> bool:
    """Clear ``O_DIRECT`` on an open file; returns False (the new value of "direct")."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
    return False


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data = data[written:]
        offset += written


DIRECT_ALIGNMENT = 4096


def write_piece(fd: int, piece: memoryview, offset: int, direct: bool, aligned: bool = False) -> bool:
    """``pwrite`` all of ``piece`` at ``offset``; with ``direct`` (the file is open ``O_DIRECT``)
    a piece that cannot go direct, or that the device refuses (EINVAL), clears ``O_DIRECT`` and
    goes buffered, and so does the rest of the file.  ``aligned``: the caller knows the address
    is page-aligned (arena views), so only the length is checked.  Returns whether the file is
    still direct."""
    if direct and (len(piece) % DIRECT_ALIGNMENT if aligned else not _direct_ready(piece)):
        direct = buffered(fd)
    try:
        pwrite_all(fd, piece, offset)
    except OSError as e:
        if not (direct and e.errno == errno_codes.EINVAL):
            raise
        direct = buffered(fd)  # the device wants another alignment: go on buffered
        pwrite_all(fd, piece, offset)
    return direct


def _direct_ready(piece: memoryview) -> bool:
    """Whether ``piece`` can be written with ``O_DIRECT``: a page-aligned address and a length
    that is a multiple of 4 KiB (a read-only buffer, whose address is not at hand, cannot)."""
    if len(piece) % DIRECT_ALIGNMENT or not piece.contiguous:
        return False
    try:
        address = ctypes.addressof(ctypes.c_char.from_buffer(piece))
    except (TypeError, ValueError):
        return False
    return address % DIRECT_ALIGNMENT == 0
