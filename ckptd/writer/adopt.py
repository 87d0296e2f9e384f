"""Making a shard file from a staging file the trainer staged it in: checksum, then link.

A held-memory root's save stages each shard into a file of its own
(:mod:`ckptd.save.file_arena`); the writer has it attached as a segment
(:class:`~ckptd.writer.shm.SharedSegment`) and makes the shard file by a hard link instead of a
copy.  Torch-free (the writer process uses it).
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Executor

from ..errors import StorageError
from ..formats.checksum import crc32c_of_view, sha256_of_view
from ..storage import Stopped, Storage
from ..storage.local import LocalStorage
from .gate import StagingGate, gated_crc32c
from .protocol import HOW_WRITTEN, FileResult, FileSpec, WriteFiles
from .shm import SharedSegment

__all__ = ["adopt_file"]

logger = logging.getLogger(__name__)

# Why a staging file cannot be linked: another filesystem, links refused or not supported, no
# /proc, the file lost its name (a sweep took a file being created): then it is written.
_CANNOT_LINK = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOENT, errno.EOPNOTSUPP, errno.ENOSYS, errno.EACCES}


def adopt_file(
    storage: Storage,
    request: WriteFiles,
    spec: FileSpec,
    segment: SharedSegment | None,
    checksums: Executor,
    should_stop: Callable[[], bool],
    on_progress: Callable[[int], None],
    gate: StagingGate | None,
) -> FileResult:
    """Make ``spec.name`` the staging file ``segment`` (its first ``spec.size`` bytes are the
    file): checksum it (chunk by chunk as it is staged, with a ``gate``), then hard-link it into
    the directory.  Nothing is copied; where the link fails (another filesystem, no ``/proc``)
    the bytes are written from the segment instead."""
    started = time.perf_counter()
    path = storage.join(request.directory, spec.name)
    if segment is None or segment.mmap is None or segment.size < spec.size:
        raise StorageError(0, f"cannot make {path}: staging file {spec.adopt} is not attached to the writer")
    with segment.view() as whole:
        data = whole[: spec.size]
        try:
            if gate is not None and not gate.complete:
                crc = gated_crc32c(data, gate, spec.arena_offset, path, should_stop)
            else:
                crc = checksums.submit(crc32c_of_view, data).result()
            digest = sha256_of_view(data) if spec.digest else None
            if should_stop():
                raise Stopped(path)
            how = _link_segment(storage, segment, path, data, request, should_stop)
            on_progress(spec.size)
        finally:
            data.release()
    seconds = time.perf_counter() - started
    return FileResult(spec.name, spec.size, crc, seconds, spec.file_offset, digest=digest, how=how)


def _link_segment(
    storage: Storage,
    segment: SharedSegment,
    path: str,
    data: memoryview,
    request: WriteFiles,
    should_stop: Callable[[], bool],
) -> str:
    """Link the segment's file to ``path``; where that cannot be done, write ``data`` there."""
    if isinstance(storage, LocalStorage):
        directory, name = os.path.split(path)
        try:
            # linkat(AT_SYMLINK_FOLLOW) of the descriptor's /proc link: the file itself, whatever
            # its name.  A dst_dir_fd makes CPython call linkat (plain link() follows nothing).
            parent = os.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.link(f"/proc/self/fd/{segment.fd}", name, dst_dir_fd=parent, follow_symlinks=True)
            finally:
                os.close(parent)
            return HOW_WRITTEN
        except OSError as e:
            if e.errno not in _CANNOT_LINK:
                raise StorageError(e.errno or 0, f"cannot link its staging file to {path}: {e.strerror}") from e
            logger.debug("ckptd writer: cannot link a staging file to %s (%s); writing it", path, e)
    storage.write_view(
        path, data, fsync=request.fsync, chunk_size=request.chunk_size, should_stop=should_stop, on_progress=_ignore
    )
    return HOW_WRITTEN


def _ignore(_: int) -> None:
    pass
