"""Anonymous shared-memory segments that cannot leak.

A segment is a ``memfd`` (Linux) or a POSIX shared-memory object whose name is unlinked right
after creation (other POSIX systems).  Either way it has no name in ``/dev/shm`` while in use:
its memory lives exactly as long as some process holds its file descriptor or a mapping, so a
trainer or writer killed with SIGKILL leaves nothing behind.  The descriptor is handed to the
writer process over a Unix socket (``SCM_RIGHTS``).

This module imports nothing heavy: the writer process uses it too.
"""

from __future__ import annotations

import mmap
import os
import secrets

from ..errors import StorageError, WriterError

__all__ = ["SharedSegment"]

_MEMFD = hasattr(os, "memfd_create")


class SharedSegment:
    """A mapped shared-memory segment of ``size`` bytes, owning its file descriptor."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        self.mmap: mmap.mmap | None = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)

    @classmethod
    def create(cls, size: int, *, label: str = "ckptd-arena") -> SharedSegment:
        """Create a new zero-filled segment of ``size`` bytes (at least one page)."""
        size = max(size, mmap.PAGESIZE)
        fd = _create_fd(label)
        try:
            try:
                os.ftruncate(fd, size)
                if hasattr(os, "posix_fallocate"):
                    # Reserve the memory now: a full /dev/shm is a clear error here instead of a
                    # SIGBUS at the first copy, and the first save page-faults much less.
                    os.posix_fallocate(fd, 0, size)
            except OSError as e:
                reason = os.strerror(e.errno) if e.errno else str(e)
                raise StorageError(
                    e.errno or 0,
                    f"cannot reserve {size} bytes of shared memory ({label}) for a staging arena: {reason}"
                    f"{_file_size_limit()}; free memory or /dev/shm, raise the file-size limit (ulimit -f), "
                    "or lower max_in_flight",
                ) from e
            return cls(fd, size)
        except BaseException:
            os.close(fd)
            raise

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
            os.close(self.fd)
            self.fd = -1


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
