"""Anonymous shared-memory segments that cannot leak.

A segment is a ``memfd`` (Linux) or a POSIX shared-memory object whose name is unlinked right
after creation (other POSIX systems).  Either way it has no name in ``/dev/shm`` while in use:
its memory lives exactly as long as some process holds its file descriptor or a mapping, so a
trainer or writer killed with SIGKILL leaves nothing behind.  The descriptor is handed to the
writer process over a Unix socket (``SCM_RIGHTS``).

A segment can also be a named file (:meth:`SharedSegment.create_file`): a staging arena of a
held-memory root whose file becomes a checkpoint's file by a hard link
(:mod:`ckptd.save.file_arena`).  Its creator holds a shared ``flock`` on it for as long as some
process keeps it open, and unlinks its own name when it closes it.

This module imports nothing heavy: the writer process uses it too.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import secrets
import stat

from ..errors import StorageError, WriterError

logger = logging.getLogger(__name__)

__all__ = ["SharedSegment", "remove_abandoned_files"]

_MEMFD = hasattr(os, "memfd_create")


class SharedSegment:
    """A mapped shared-memory segment of ``size`` bytes, owning its file descriptor."""

    def __init__(self, fd: int, size: int, path: str | None = None) -> None:
        self.fd = fd
        self.size = size
        self.path = path  # a named file this process created (create_file): unlinked at close
        self._creator = os.getpid()
        self.mmap: mmap.mmap | None = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)

    @classmethod
    def create(cls, size: int, *, label: str = "ckptd-arena") -> SharedSegment:
        """Create a new zero-filled segment of ``size`` bytes (at least one page)."""
        size = max(size, mmap.PAGESIZE)
        fd = _create_fd(label)
        try:
            _reserve(
                fd,
                size,
                f"shared memory ({label}) for a staging arena",
                "free memory or /dev/shm, raise the file-size limit (ulimit -f), or lower max_in_flight",
            )
            return cls(fd, size)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def create_file(cls, path: str, size: int) -> SharedSegment:
        """Create the file ``path`` (which must not exist; mode ``0600``) of exactly ``size``
        bytes, reserve its memory and map it.  Its creator holds a shared ``flock`` on it (so
        :func:`remove_abandoned_files` knows it is in use) and unlinks the name at :meth:`close`;
        hard links made meanwhile keep the bytes."""
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(path, flags, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            _reserve(fd, size, f"memory for the staging file {path}", "free memory or /dev/shm, or lower keep_last")
            return cls(fd, size, path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise

    def links(self) -> int:
        """How many names the segment's file has (a named file linked into a checkpoint: 2 or
        more; 0 once closed)."""
        return os.fstat(self.fd).st_nlink if self.fd >= 0 else 0

    @classmethod
    def attach(cls, fd: int, size: int) -> SharedSegment:
        """Map a segment received from another process (takes ownership of ``fd``)."""
        try:
            actual = os.fstat(fd).st_size
            if actual < size:
                raise WriterError(
                    f"the shared-memory segment received (fd {fd}) holds {actual} bytes, "
                    f"the sender announced {size}: the trainer and the writer disagree on a staging arena"
                )
            return cls(fd, size)
        except BaseException:
            os.close(fd)
            raise

    def view(self) -> memoryview:
        """A writable memoryview of the whole segment."""
        if self.mmap is None:
            raise WriterError(f"shared-memory segment of {self.size} bytes is closed; it has no view")
        return memoryview(self.mmap)

    def close(self) -> None:
        """Unmap and close; the memory is freed once no other process holds it."""
        if self.mmap is not None:
            try:
                self.mmap.close()
            except BufferError:
                # A view is still exported; the mapping goes when its last view is released.
                pass
            self.mmap = None
        if self.fd >= 0:
            if self.path is not None and os.getpid() == self._creator:  # never a fork()ed child
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
            os.close(self.fd)
            self.fd = -1


def remove_abandoned_files(directory: str) -> list[str]:
    """Unlink the files of ``directory`` (staging files of :meth:`SharedSegment.create_file`)
    that no live process holds: their creator died without closing them.  Returns the names.
    A checkpoint that links one keeps its bytes.  A ``directory`` that is a symlink is not
    followed (nothing is removed, with a warning): its files are not the root's."""
    removed: list[str] = []
    try:
        directory_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(directory):
            logger.warning("ckptd: %s is a symlink, not a staging directory of the root: left alone", directory)
        return removed
    try:
        names = os.listdir(directory_fd)
        for name in names:
            try:
                fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=directory_fd)
            except OSError:
                continue
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    continue
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # held: its creator (or the writer it handed it to) is alive
            else:
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=directory_fd)
                    removed.append(name)
            finally:
                os.close(fd)
    except OSError:
        pass
    finally:
        os.close(directory_fd)
    return removed


def _reserve(fd: int, size: int, what: str, advice: str) -> None:
    """Size ``fd`` to ``size`` bytes and reserve its memory now: a full /dev/shm is then a clear
    error here (naming ``what``, with ``advice``) instead of a SIGBUS at the first copy, and the
    first save page-faults much less."""
    try:
        os.ftruncate(fd, size)
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, size)
    except OSError as e:
        reason = os.strerror(e.errno) if e.errno else str(e)
        raise StorageError(
            e.errno or 0, f"cannot reserve {size} bytes of {what}: {reason}{_file_size_limit()}; {advice}"
        ) from e


def _create_fd(label: str) -> int:
    if _MEMFD:
        return os.memfd_create(label, os.MFD_CLOEXEC)
    import _posixshmem  # CPython's POSIX shm binding, present on every POSIX build

    name = f"/{label}-{os.getpid()}-{secrets.token_hex(6)}"
    fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    _posixshmem.shm_unlink(name)
    return fd


def _file_size_limit() -> str:
    """`` (file-size limit N bytes)`` when RLIMIT_FSIZE is set, else nothing."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    except (ImportError, OSError, ValueError):
        return ""
    return "" if soft == resource.RLIM_INFINITY else f" (file-size limit {soft} bytes)"
