"""Reading local files: byte ranges with ``preadv`` (no seek, so one reader serves many threads),
and :class:`PinnedDirectory`, a checkpoint directory opened once so that a load reads one version
of it.  Torch-free.

Why pinning: an overwrite swaps a new directory in for the old one (``RENAME_EXCHANGE``, or a
rename aside and a rename), then deletes the old one.  A load that opened the manifest and then
its other files by path could read the old manifest and some of the new shards.  A pinned
directory opens every file relative to its handle (``openat``), so every file comes from the
directory the manifest came from; a file that is gone because that directory was replaced and
deleted is :class:`~ckptd.errors.CheckpointReplacedError`, never a file of the new version.
"""

from __future__ import annotations

import errno as errno_codes
import os
import stat
import threading
from collections.abc import Sequence

from ..errors import CheckpointReplacedError, CorruptCheckpointError, StorageError, UnsafeCheckpointError
from .base import missing_file, storage_error

__all__ = ["LocalReader", "PinnedDirectory"]

_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK  # O_NONBLOCK: a FIFO cannot block the open
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECTORY
_IOV_MAX = 1024  # buffers per preadv call (Linux UIO_MAXIOV)


class LocalReader:
    """An open local file serving byte ranges with ``preadv`` (the storage contract's
    ``RangeReader``).  ``fd``: an already open descriptor of ``path`` (the reader owns it)."""

    def __init__(self, path: str, fd: int | None = None) -> None:
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC) if fd is None else fd
            self.size = os.fstat(self.fd).st_size
        except OSError as e:
            if fd is not None:
                os.close(fd)
            raise storage_error("open", path, e) from e

    def reopen(self, flags: int) -> int:
        """A new descriptor of this very file (not of whatever its path names now) with
        ``flags`` (``O_DIRECT``), through ``/proc/self/fd``; -1 where that cannot be had."""
        try:
            return os.open(f"/proc/self/fd/{self.fd}", flags | os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return -1

    def read_into(self, offset: int, buffer: memoryview) -> None:
        buffer = buffer.cast("B") if buffer.format != "B" else buffer
        try:
            while buffer:
                got = os.preadv(self.fd, [buffer], offset)
                if got == 0:
                    raise StorageError(errno_codes.EIO, f"unexpected end of file in {self.path} at byte {offset}")
                buffer = buffer[got:]
                offset += got
        except StorageError:
            raise
        except OSError as e:
            raise storage_error("read", self.path, e) from e

    def read_vector(self, offset: int, buffers: Sequence[memoryview]) -> None:
        """Fill ``buffers`` (byte views that follow each other in the file from ``offset``) with
        ``preadv``, as few calls as the kernel allows."""
        pending = [b for b in buffers if b.nbytes]
        try:
            while pending:
                got = os.preadv(self.fd, pending[:_IOV_MAX], offset)
                if got == 0:
                    raise StorageError(errno_codes.EIO, f"unexpected end of file in {self.path} at byte {offset}")
                offset += got
                while pending and got >= pending[0].nbytes:
                    got -= pending.pop(0).nbytes
                if got:
                    pending[0] = pending[0][got:]
        except StorageError:
            raise
        except OSError as e:
            raise storage_error("read", self.path, e) from e

    def read_many(self, requests: Sequence[tuple[int, memoryview]]) -> None:
        for offset, buffer in requests:
            self.read_into(offset, buffer)

    def read(self, offset: int, length: int) -> bytes:
        out = bytearray(length)
        self.read_into(offset, memoryview(out))
        return bytes(out)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _identity(info: os.stat_result) -> tuple[int, int]:
    return info.st_dev, info.st_ino


class PinnedDirectory:
    """A local directory opened once (``O_DIRECTORY``); its files are opened relative to that
    handle, whatever happens to ``path`` meanwhile.

    Names are a file name or ``subdirectory/file name`` (the ``spread`` key layout; each
    subdirectory is opened once, ``O_NOFOLLOW``, relative to the handle).  Opens refuse what is
    not a regular file, and a symlink that leads outside the directory (or, with
    ``follow_symlinks=False``, any symlink).  A missing file raises
    :class:`~ckptd.errors.CheckpointReplacedError` when ``path`` no longer leads to this
    directory (:meth:`replaced`), else :class:`~ckptd.errors.MissingFileError`.  Thread-safe.
    A missing or unreadable directory raises :class:`~ckptd.errors.StorageError`
    (:class:`~ckptd.errors.MissingFileError` when it does not exist).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self.fd = os.open(path, _DIRECTORY_FLAGS)
        except OSError as e:
            raise storage_error("open directory", path, e) from e
        self._identity = _identity(os.fstat(self.fd))
        self._subdirectories: dict[str, int] = {}
        self._lock = threading.Lock()
        # Listing a directory by descriptor reads it through a duplicate that shares the read
        # position: two threads listing it at once would each see part of it.
        self._scan_lock = threading.Lock()

    # ---- the directory -----------------------------------------------------------------------

    def replaced(self) -> bool:
        """True when ``path`` no longer leads to this directory: it was exchanged with another,
        renamed away or deleted (a directory, once pinned, cannot come back with a new name's
        identity: its inode stays in use while the handle is open)."""
        try:
            return _identity(os.stat(self.path)) != self._identity or os.fstat(self.fd).st_nlink == 0
        except OSError:
            return True

    def names(self) -> list[str]:
        """The sorted names in the directory (files and subdirectories)."""
        try:
            with self._scan_lock:
                return sorted(os.listdir(self.fd))
        except OSError as e:
            raise storage_error("list", self.path, e) from e

    def sizes(self, subdirectory: str = "") -> dict[str, int]:
        """``{name: size}`` of the regular files (symlinks followed) in the directory or in one
        of its subdirectories (empty where that subdirectory does not exist)."""
        where = os.path.join(self.path, subdirectory) if subdirectory else self.path
        try:
            fd = self._subdirectory(subdirectory) if subdirectory else self.fd
        except FileNotFoundError:
            return {}
        out = {}
        try:
            with self._scan_lock, os.scandir(fd) as entries:
                for entry in entries:
                    if entry.is_file():
                        out[entry.name] = entry.stat().st_size
        except OSError as e:
            raise storage_error("list", where, e) from e
        return out

    def close(self) -> None:
        with self._lock:
            for fd in [*self._subdirectories.values(), self.fd]:
                if fd >= 0:
                    os.close(fd)
            self._subdirectories.clear()
            self.fd = -1

    # ---- its files ---------------------------------------------------------------------------

    def open(self, name: str, *, follow_symlinks: bool = True) -> int:
        """A read-only descriptor of the regular file ``name`` of this directory (the caller
        closes it)."""
        path = os.path.join(self.path, name)
        subdirectory, _, base = name.rpartition("/")
        try:
            try:
                parent = self._subdirectory(subdirectory) if subdirectory else self.fd
                fd = os.open(base, _READ_FLAGS | os.O_NOFOLLOW, dir_fd=parent)
            except OSError as e:
                if e.errno not in (errno_codes.ELOOP, errno_codes.ENOTDIR):
                    raise
                fd = self._open_through_symlink(name, path, follow_symlinks)
        except FileNotFoundError as e:
            if self.replaced():
                raise CheckpointReplacedError(
                    f"{path}: gone: the checkpoint directory {self.path} was replaced (overwritten or deleted) "
                    "while it was read; nothing of the new version was read: load it again"
                ) from e
            raise missing_file("open", path) from e
        except (StorageError, UnsafeCheckpointError, CheckpointReplacedError):
            raise
        except OSError as e:
            raise storage_error("open", path, e) from e
        try:
            mode = os.fstat(fd).st_mode
        except OSError as e:
            os.close(fd)
            raise storage_error("stat", path, e) from e
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise CorruptCheckpointError(
                f"{path} is not a regular file (a FIFO, device or directory): refusing to read it"
            )
        return fd

    def reader(self, name: str, *, follow_symlinks: bool = True) -> LocalReader:
        """A :class:`LocalReader` on the file ``name`` of this directory."""
        return LocalReader(os.path.join(self.path, name), self.open(name, follow_symlinks=follow_symlinks))

    def read_small(self, name: str, limit: int, *, follow_symlinks: bool = True) -> bytes | None:
        """The bytes of ``name``, or ``None`` when it holds more than ``limit`` bytes (its size
        is checked before a byte is read, and the read stops at ``limit + 1`` bytes)."""
        fd = self.open(name, follow_symlinks=follow_symlinks)
        try:
            if os.fstat(fd).st_size > limit:
                return None
            chunks: list[bytes] = []
            total = 0
            while True:
                chunk = os.read(fd, min(1 << 20, limit + 1 - total))
                if not chunk:
                    return b"".join(chunks)
                chunks.append(chunk)
                total += len(chunk)
                if total > limit:  # grew while it was read
                    return None
        except OSError as e:
            raise storage_error("read", os.path.join(self.path, name), e) from e
        finally:
            os.close(fd)

    def same_file(self, name: str, path: str) -> bool:
        """Whether ``path`` now names the very file ``name`` of this directory (for readers that
        can only open by path: check before and after)."""
        fd = self.open(name)
        try:
            return _identity(os.fstat(fd)) == _identity(os.stat(path))
        except OSError:
            return False
        finally:
            os.close(fd)

    def _subdirectory(self, name: str) -> int:
        """The handle of a subdirectory (opened once, never through a symlink)."""
        with self._lock:
            fd = self._subdirectories.get(name)
            if fd is None:
                if "/" in name or name in ("", ".", ".."):
                    raise UnsafeCheckpointError(f"{self.path}: {name!r} is not a subdirectory name")
                fd = self._subdirectories[name] = os.open(name, _DIRECTORY_FLAGS | os.O_NOFOLLOW, dir_fd=self.fd)
            return fd

    def _open_through_symlink(self, name: str, path: str, follow_symlinks: bool) -> int:
        """Open ``name`` where a symlink is on the way: allowed (unless ``follow_symlinks`` is
        false) when it resolves inside the directory, checked against the file then opened."""
        if not follow_symlinks:
            raise UnsafeCheckpointError(f"{path} is a symlink; ckptd never writes one there: refusing to follow it")
        real_dir = os.path.realpath(self.path)
        real = os.path.realpath(path)
        if os.path.commonpath([real_dir, real]) != real_dir:
            raise UnsafeCheckpointError(f"{path} resolves to {real}, outside the checkpoint directory {real_dir}")
        fd = os.open(name, _READ_FLAGS, dir_fd=self.fd)
        try:
            same = _identity(os.fstat(fd)) == _identity(os.stat(real))
        except OSError:
            same = False
        if not same:  # the symlink or the directory changed between the check and the open
            os.close(fd)
            if self.replaced():
                raise CheckpointReplacedError(f"{path}: the checkpoint directory {self.path} was replaced while read")
            raise UnsafeCheckpointError(f"{path}: its symlink changed while it was opened: refusing to read it")
        return fd
