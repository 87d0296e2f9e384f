"""Local POSIX storage: fsync on write, atomic rename on publish, ``pread`` straight into memory."""

from __future__ import annotations

import errno as errno_codes
import logging
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterable

from ..errors import CheckpointExistsError, StorageError
from .base import Stopped, StorageTuning, missing_file, storage_error
from .liveness import lock_new_file
from .local_read import LocalReader
from .local_write import DIRECT_ALIGNMENT, copy_range, create_new, write_all, write_piece
from .rename import exchange_paths

__all__ = ["LocalStorage", "exchange_paths", "open_recycled"]

logger = logging.getLogger(__name__)


# link() errors meaning "no hard link here" (another device, a filesystem or a policy that refuses
# them, too many links): the file is copied instead.
_NO_LINK = {
    errno_codes.EXDEV,
    errno_codes.EPERM,
    errno_codes.EMLINK,
    errno_codes.ENOTSUP,
    errno_codes.EOPNOTSUPP,
    errno_codes.EACCES,
    errno_codes.ENOSYS,
}


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
        recycle: str | None = None,
    ) -> None:
        """Write ``view`` as the whole file at ``path`` (the partial file is removed on failure).

        ``recycle``: a file no larger than ``view`` whose pages to reuse (a held-memory root's
        spare): renamed to ``path`` and overwritten in place; if it is gone (another writer took
        it), the file is created as usual."""
        try:
            self._write(path, 0, view, True, fsync, chunk_size, should_stop, on_progress, recycle)
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
        recycle: str | None = None,
    ) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC
        direct = self.tuning.direct_io and whole and hasattr(os, "O_DIRECT") and chunk_size % DIRECT_ALIGNMENT == 0
        try:
            fd = open_recycled(recycle, path, len(view)) if recycle is not None and whole else None
            if fd is not None:
                direct = False  # a tmpfs: no O_DIRECT there
            elif whole:
                fd = create_new(path, flags | (os.O_DIRECT if direct else 0))
            else:
                fd = os.open(path, flags, 0o644)
        except OSError as e:
            if not direct or e.errno != errno_codes.EINVAL:
                raise storage_error("create", path, e) from e
            direct = False  # this filesystem has no O_DIRECT
            fd = create_new(path, flags)
        try:
            for start in range(0, len(view), chunk_size):
                if should_stop():
                    raise Stopped(path)
                chunk = view[start : start + chunk_size]
                direct = write_piece(fd, chunk, offset + start, direct, aligned=True)
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

    def copy_file(self, source: str, target: str, *, fsync: bool = True) -> str:
        """Make the new file ``target`` hold the bytes of ``source``: a hard link (the same inode:
        no byte is read or written), or where the filesystem refuses links (another device,
        ``protected_hardlinks``, FUSE, too many links) a copy in the kernel, fsynced.  A
        ``source`` that is a symlink is linked as the symlink (never followed) and refused by the
        copy.  Returns ``"link"`` or ``"copy"``."""
        try:
            os.link(source, target, follow_symlinks=False)
            return "link"
        except FileNotFoundError as e:
            if not os.path.lexists(source):
                raise missing_file("link", source) from e
            raise storage_error("link to", target, e) from e
        except OSError as e:
            if e.errno not in _NO_LINK:
                raise storage_error("link to", target, e) from e
            logger.debug("ckptd: cannot hard-link %s (%s); copying it", source, os.strerror(e.errno or 0))
        self._copy(source, target, fsync)
        return "copy"

    def _copy(self, source: str, target: str, fsync: bool) -> None:
        try:
            source_fd = os.open(source, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError as e:
            raise missing_file("copy", source) from e
        except OSError as e:
            raise storage_error("open", source, e) from e
        try:
            try:
                target_fd = create_new(target, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC)
            except OSError as e:
                raise storage_error("create", target, e) from e
            try:
                copy_range(source_fd, target_fd, os.fstat(source_fd).st_size, source)
                if fsync:
                    os.fsync(target_fd)
                    if self.tuning.drop_cache and hasattr(os, "posix_fadvise"):
                        os.posix_fadvise(target_fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError as e:
                os.close(target_fd)
                self.remove(target)
                if isinstance(e, StorageError):
                    raise
                raise storage_error("copy to", target, e) from e
            os.close(target_fd)
        finally:
            os.close(source_fd)

    def open_reader(self, path: str) -> LocalReader:
        return LocalReader(path)

    def write_bytes(self, path: str, data: bytes, *, fsync: bool = True, create_only: bool = False) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC
        try:
            fd = os.open(path, flags | os.O_EXCL, 0o644) if create_only else create_new(path, flags)
        except FileExistsError as e:
            raise CheckpointExistsError(f"{path} already exists") from e
        except OSError as e:
            raise storage_error("create", path, e) from e
        try:
            write_all(fd, memoryview(data))
            if fsync:
                os.fsync(fd)
        except OSError as e:
            os.close(fd)
            self.remove(path)
            raise storage_error("write", path, e) from e
        os.close(fd)

    def write_stream(self, path: str, pieces: Iterable[memoryview]) -> int:
        """Write ``pieces`` to a temporary file, fsync, and rename it to ``path`` (atomic).

        With ``direct_io``, pieces at page-aligned addresses whose lengths are multiples of 4 KiB
        go with ``O_DIRECT`` (the first other piece, normally the tail, and the rest buffered);
        with ``drop_cache`` the file leaves the page cache once durable."""
        tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{secrets.token_hex(4)}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        direct = self.tuning.direct_io and hasattr(os, "O_DIRECT")
        total = 0
        try:
            try:
                fd = os.open(tmp, flags | (os.O_DIRECT if direct else 0), 0o644)
            except OSError as e:
                if not direct or e.errno != errno_codes.EINVAL:
                    raise
                direct = False  # this filesystem has no O_DIRECT
                fd = os.open(tmp, flags, 0o644)
            try:
                lock_new_file(fd)  # gc leaves a temporary file its writer holds (storage.liveness)
                for piece in pieces:
                    direct = write_piece(fd, piece, total, direct)
                    total += len(piece)
                os.fsync(fd)
                if self.tuning.drop_cache and hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, total, os.POSIX_FADV_DONTNEED)
                os.replace(tmp, path)  # before the close, which lets the lock go
            finally:
                os.close(fd)
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

    def version(self, path: str) -> str | None:
        """Device, inode, modification time and size of the file now at ``path`` (loads pin a
        local checkpoint by opening its directory instead: :class:`.local_read.PinnedDirectory`)."""
        try:
            info = os.stat(path)
        except OSError as e:
            raise storage_error("stat", path, e) from e
        return f"{info.st_dev}:{info.st_ino}:{info.st_mtime_ns}:{info.st_size}"

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
        the local commit point.  A ``staging`` that is now a symlink (swapped in while the save
        wrote) is not published: the checkpoint would be what it leads to."""
        _check_not_linked(staging, final)
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
        _check_not_linked(staging, final)
        self._fsync_directories(staging)
        if not exchange_paths(staging, final):
            return False
        self.fsync_directory(os.path.dirname(final) or ".")
        return True


def _check_not_linked(staging: str, final: str) -> None:
    """Refuse to publish a staging directory that became a symlink while the save wrote into it
    (the checkpoint would be whatever it leads to)."""
    if os.path.islink(staging.rstrip(os.sep)):
        raise StorageError(f"{staging}: the staging directory was replaced by a symlink; not published as {final}")


def open_recycled(spare: str, path: str, size: int) -> int | None:
    """``spare`` renamed to ``path`` (which must not exist) and opened for writing, grown to
    ``size``; ``None`` if it is gone, larger than ``size`` (a file never shrinks under a reader
    that may have it mapped: that would be SIGBUS there) or linked elsewhere too."""
    if os.path.islink(os.path.dirname(spare)):
        return None  # the spare directory is a symlink: not the root's files
    try:
        info = os.lstat(spare)
        # A file with other links is shared with a kept checkpoint (an incremental save linked it)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1 or info.st_size > size or os.path.lexists(path):
            return None
        os.rename(spare, path)
    except FileNotFoundError:
        return None
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd
