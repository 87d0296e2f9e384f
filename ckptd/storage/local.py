"""Local POSIX storage: fsync on write, atomic rename on publish, ``pread`` straight into memory."""

from __future__ import annotations

import ctypes
import errno as errno_codes
import fcntl
import logging
import os
import platform
import secrets
import shutil
from collections.abc import Callable, Iterable, Sequence

from ..errors import CheckpointExistsError, StorageError
from .base import Stopped, StorageTuning, storage_error

__all__ = ["LocalStorage", "exchange_paths"]

logger = logging.getLogger(__name__)

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_RENAMEAT2_SYSCALL = {"x86_64": 316, "amd64": 316, "aarch64": 276, "arm64": 276}
# Errors meaning "this kernel or filesystem cannot exchange": fall back to two renames.
_NO_EXCHANGE = {errno_codes.ENOSYS, errno_codes.EINVAL, errno_codes.ENOTSUP, errno_codes.EOPNOTSUPP}
_renameat2: Callable[[bytes, bytes], int] | None = None
_renameat2_loaded = False


def _load_renameat2() -> Callable[[bytes, bytes], int] | None:
    """``renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE)`` through libc, or the raw system
    call where libc lacks the wrapper (glibc < 2.28); ``None`` where neither exists."""
    global _renameat2, _renameat2_loaded
    if _renameat2_loaded:
        return _renameat2
    _renameat2_loaded = True
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    function = getattr(libc, "renameat2", None)
    if function is not None:
        function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        function.restype = ctypes.c_int
        _renameat2 = lambda a, b: function(_AT_FDCWD, a, _AT_FDCWD, b, _RENAME_EXCHANGE)  # noqa: E731
        return _renameat2
    number = _RENAMEAT2_SYSCALL.get(platform.machine().lower())
    syscall = getattr(libc, "syscall", None)
    if number is None or syscall is None:
        return None
    syscall.restype = ctypes.c_long

    def raw(a: bytes, b: bytes) -> int:
        return int(
            syscall(
                ctypes.c_long(number),
                ctypes.c_int(_AT_FDCWD),
                ctypes.c_char_p(a),
                ctypes.c_int(_AT_FDCWD),
                ctypes.c_char_p(b),
                ctypes.c_uint(_RENAME_EXCHANGE),
            )
        )

    _renameat2 = raw
    return _renameat2


def exchange_paths(a: str, b: str) -> bool:
    """Swap two existing paths atomically (``renameat2`` with ``RENAME_EXCHANGE``).

    Returns False, having changed nothing, where the platform, kernel or filesystem cannot do it;
    raises :class:`StorageError` for any other failure.
    """
    function = _load_renameat2()
    if function is None:
        return False
    if function(os.fsencode(a), os.fsencode(b)) == 0:
        return True
    code = ctypes.get_errno()
    if code in _NO_EXCHANGE:
        logger.debug("ckptd: cannot exchange %s and %s atomically (%s); using two renames", a, b, os.strerror(code))
        return False
    raise storage_error("exchange with", b, OSError(code, os.strerror(code)), code)


class _Reader:
    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            self.size = os.fstat(self.fd).st_size
        except OSError as e:
            raise storage_error("open", path, e) from e

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


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        written = os.write(fd, data)
        data = data[written:]


def _buffered(fd: int) -> bool:
    """Clear ``O_DIRECT`` on an open file; returns False (the new value of "direct")."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
    return False


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data = data[written:]
        offset += written


_DIRECT_ALIGNMENT = 4096


class LocalStorage:
    """Local files (plain paths and ``file://``): :class:`~ckptd.storage.Storage` with
    ``write_at`` (several ranks write one file at their offsets with ``pwrite``)."""

    local = True
    supports_write_at = True

    def __init__(self, tuning: StorageTuning | None = None) -> None:
        self.tuning = tuning or StorageTuning()

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def check_access(self, path: str) -> None:
        self.makedirs(path)
        if not os.access(path, os.W_OK | os.X_OK):
            raise StorageError(errno_codes.EACCES, f"cannot write checkpoints into {path}: permission denied")

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def list_names(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as e:
            raise storage_error("list", path, e) from e

    def sizes(self, path: str) -> dict[str, int]:
        out = {}
        try:
            with os.scandir(path) as entries:
                for entry in entries:
                    if entry.is_file():
                        out[entry.name] = entry.stat().st_size
        except FileNotFoundError:
            return {}
        except OSError as e:
            raise storage_error("list", path, e) from e
        return out

    def makedirs(self, path: str) -> None:
        """Create ``path`` and missing parents; each new directory is fsynced into its parent."""
        missing = []
        current = os.path.abspath(path)
        while not os.path.isdir(current):
            missing.append(current)
            parent = os.path.dirname(current)
            if parent == current:
                break
            current = parent
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise storage_error("create directory", path, e) from e
        for created in reversed(missing):
            self.fsync_directory(os.path.dirname(created))

    def write_view(
        self,
        path: str,
        view: memoryview,
        *,
        fsync: bool,
        chunk_size: int,
        should_stop: Callable[[], bool],
        on_progress: Callable[[int], None],
    ) -> None:
        """Write ``view`` as the whole file at ``path`` (the partial file is removed on failure)."""
        try:
            self._write(path, 0, view, True, fsync, chunk_size, should_stop, on_progress)
        except BaseException:
            self.remove(path)
            raise

    def write_at(
        self,
        path: str,
        offset: int,
        view: memoryview,
        *,
        fsync: bool,
        chunk_size: int,
        should_stop: Callable[[], bool],
        on_progress: Callable[[int], None],
    ) -> None:
        """Write ``view`` at ``offset`` of a file that other writers fill in too (no truncation)."""
        self._write(path, offset, view, False, fsync, chunk_size, should_stop, on_progress)

    def _write(
        self,
        path: str,
        offset: int,
        view: memoryview,
        whole: bool,
        fsync: bool,
        chunk_size: int,
        should_stop: Callable[[], bool],
        on_progress: Callable[[int], None],
    ) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (os.O_TRUNC if whole else 0)
        direct = self.tuning.direct_io and whole and hasattr(os, "O_DIRECT") and chunk_size % _DIRECT_ALIGNMENT == 0
        try:
            fd = os.open(path, flags | (os.O_DIRECT if direct else 0), 0o644)
        except OSError as e:
            if not direct or e.errno != errno_codes.EINVAL:
                raise storage_error("create", path, e) from e
            direct = False  # this filesystem has no O_DIRECT
            fd = os.open(path, flags, 0o644)
        try:
            for start in range(0, len(view), chunk_size):
                if should_stop():
                    raise Stopped(path)
                chunk = view[start : start + chunk_size]
                if direct and len(chunk) % _DIRECT_ALIGNMENT:
                    direct = _buffered(fd)  # the unaligned tail
                try:
                    _pwrite_all(fd, chunk, offset + start)
                except OSError as e:
                    if not (direct and e.errno == errno_codes.EINVAL):
                        raise
                    direct = _buffered(fd)  # the device wants another alignment: go on buffered
                    _pwrite_all(fd, chunk, offset + start)
                on_progress(len(chunk))
            if fsync:
                os.fsync(fd)
            if self.tuning.drop_cache and fsync and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, offset, len(view), os.POSIX_FADV_DONTNEED)
        except OSError as e:
            if isinstance(e, StorageError):
                raise
            raise storage_error("write", path, e) from e
        finally:
            os.close(fd)

    def sync_file(self, path: str) -> None:
        """Make a file written with ``fsync=False`` durable: the deferred half of a write (then,
        with ``drop_cache``, drop it from the page cache).  Linux reports a write-back error to
        this new descriptor if no other descriptor saw it first."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise storage_error("open", path, e) from e
        try:
            os.fsync(fd)
            if self.tuning.drop_cache and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError as e:
            raise storage_error("fsync", path, e) from e
        finally:
            os.close(fd)

    def open_reader(self, path: str) -> _Reader:
        return _Reader(path)

    def write_bytes(self, path: str, data: bytes, *, fsync: bool = True, create_only: bool = False) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (os.O_EXCL if create_only else os.O_TRUNC)
        try:
            fd = os.open(path, flags, 0o644)
        except FileExistsError as e:
            raise CheckpointExistsError(f"{path} already exists") from e
        except OSError as e:
            raise storage_error("create", path, e) from e
        try:
            _write_all(fd, memoryview(data))
            if fsync:
                os.fsync(fd)
        except OSError as e:
            os.close(fd)
            self.remove(path)
            raise storage_error("write", path, e) from e
        os.close(fd)

    def write_stream(self, path: str, pieces: Iterable[memoryview]) -> int:
        """Write ``pieces`` to a temporary file, fsync, and rename it to ``path`` (atomic)."""
        tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{secrets.token_hex(4)}")
        total = 0
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                for piece in pieces:
                    _write_all(fd, piece)
                    total += len(piece)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            self.fsync_directory(os.path.dirname(path) or ".")
        except OSError as e:
            self.remove(tmp)
            if isinstance(e, StorageError):
                raise
            raise storage_error("write", path, e) from e
        except BaseException:
            self.remove(tmp)
            raise
        return total

    def read_bytes(self, path: str) -> bytes:
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise storage_error("read", path, e) from e

    def size(self, path: str) -> int:
        try:
            return os.stat(path).st_size
        except OSError as e:
            raise storage_error("stat", path, e) from e

    def remove(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise storage_error("remove", path, e) from e

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def discard(self, path: str) -> None:
        self.remove_tree(path)

    def fsync_directory(self, path: str) -> None:
        """Make a directory's entries durable (after creating or renaming files in it)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise storage_error("open directory", path, e) from e
        try:
            os.fsync(fd)
        except OSError as e:
            raise storage_error("fsync directory", path, e) from e
        finally:
            os.close(fd)

    def _fsync_directories(self, staging: str) -> None:
        """fsync the subdirectories of ``staging`` (files of the ``spread`` key layout), then it."""
        try:
            with os.scandir(staging) as entries:
                subdirectories = [e.path for e in entries if e.is_dir(follow_symlinks=False)]
        except OSError as e:
            raise storage_error("list", staging, e) from e
        for path in subdirectories:
            self.fsync_directory(path)
        self.fsync_directory(staging)

    def publish_directory(self, staging: str, final: str) -> None:
        """fsync ``staging`` (and its subdirectories), rename it to ``final`` and fsync the parent:
        the local commit point."""
        self._fsync_directories(staging)
        try:
            self.rename_directory(staging, final)
        except CheckpointExistsError as e:
            raise CheckpointExistsError(f"checkpoint {final} already exists") from e.__cause__

    def rename_directory(self, source: str, target: str) -> None:
        """Rename ``source`` to a ``target`` that does not exist, and fsync the parent."""
        try:
            os.rename(source, target)
        except OSError as e:
            if e.errno in (errno_codes.ENOTEMPTY, errno_codes.EEXIST, errno_codes.EISDIR):
                raise CheckpointExistsError(f"{target} already exists") from e
            raise storage_error("rename to", target, e) from e
        self.fsync_directory(os.path.dirname(target) or ".")

    def exchange_directories(self, staging: str, final: str) -> bool:
        """Atomically swap ``staging`` (fsynced first) with the existing ``final``, then fsync
        the parent: ``final`` is the new directory and ``staging`` holds the old one.  Returns
        False, having changed nothing, where the filesystem cannot exchange."""
        self._fsync_directories(staging)
        if not exchange_paths(staging, final):
            return False
        self.fsync_directory(os.path.dirname(final) or ".")
        return True
