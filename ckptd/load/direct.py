"""Local reads of tensor bytes at the speed of the disk or the page cache, straight into targets.

:func:`read_local` fills ``(offset, buffer)`` requests of local files from a small thread pool
that lives as long as the process (recreated after a fork), so a load starts no threads.
Ranges are cut at multiples of :data:`DIRECT_RUN` and read with ``preadv`` straight into the
buffers, consecutive ranges of one file in one call, in one task per read thread (an equal share
of the bytes, at least 32 MiB; a task ends at the end of its file).

``O_DIRECT`` (``direct=True``, or ``CKPTD_DIRECT_READS=1``; off by default): ranges whose pages
are not all in the page cache (``cachestat(2)``, else ``mincore(2)`` of one page per MiB; nothing
is read to find out) are read with ``O_DIRECT`` into a page-aligned per-thread bounce buffer, in
aligned runs of up to :data:`DIRECT_RUN` bytes covering neighbouring ranges (at most 4 KiB more
on each side), then copied out with ``memmove``.  Targets cannot take ``O_DIRECT`` reads
themselves: torch's allocations and safetensors offsets are 64-byte aligned, and their offsets
within a page differ.  Measured on the 2-core VM of ``docs/benchmarks.md``, that copy (memory
copies at about 2 GiB/s there) made cold loads 2.4x slower than page-cache reads, which copy
once too but overlap the copy with the disk's readahead; hence off by default.  A file system
that refuses ``O_DIRECT`` (tmpfs, some FUSE and network file systems) is read through the page
cache, per file (at ``open``) or per run (``EINVAL`` at read time).

Each requested byte is read once.  Errors are :class:`~ckptd.errors.StorageError` naming the file.
"""

from __future__ import annotations

import ctypes
import errno as errno_codes
import functools
import logging
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from ..errors import StorageError
from ..storage import RangeReader, storage_error
from ..storage.local_read import LocalReader

__all__ = [
    "DEFAULT_DIRECT_READS",
    "DIRECT_RUN",
    "READ_THREADS",
    "cut_pieces",
    "direct_reads",
    "read_local",
    "run_tasks",
]

logger = logging.getLogger(__name__)

READ_THREADS = max(4, min(16, os.cpu_count() or 4))
"""Threads reading local files (and remote files, one file per task): 4 on small machines (chosen
on the 2-core VM of ``docs/benchmarks.md``), one per core up to 16 on larger ones, whose
page-cache reads scale with the cores (a GPU host: docs/benchmarks.md, "GPU")."""
DIRECT_RUN = 8 * 1024 * 1024
"""Bytes of one ``O_DIRECT`` read (the bounce buffer of each thread holds one run)."""
DEFAULT_DIRECT_READS = False
"""Read what is not in the page cache with ``O_DIRECT``; ``CKPTD_DIRECT_READS=1`` (or ``0``) overrides."""
_CACHED_BATCH = 32 * 1024 * 1024
_ALIGN = 4096
_IOV_MAX = 1024

Request = tuple[int, memoryview]


# ---- the shared pool -------------------------------------------------------------------------

_pool_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor] | None = None


def _executor() -> ThreadPoolExecutor:
    """The process's read pool (a fork child gets its own: the parent's threads are not in it)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(READ_THREADS, thread_name_prefix="ckptd-read"))
        return _pool[1]


def run_tasks(tasks: Sequence[Callable[[], None]]) -> None:
    """Run ``tasks`` on the read pool (inline when there is one); raises the first failure after
    every task has finished, so no task still writes into a buffer the caller frees."""
    if len(tasks) <= 1:
        for task in tasks:
            task()
        return
    futures: list[Future[None]] = [_executor().submit(task) for task in tasks]
    first: BaseException | None = None
    for future in futures:
        error = future.exception()
        if error is not None and first is None:
            first = error
    if first is not None:
        raise first


# ---- page cache residency --------------------------------------------------------------------

_CACHESTAT = 451  # the syscall number on every architecture (Linux >= 6.5)
_SAMPLE = 1024 * 1024  # without cachestat: one page per MiB is asked with mincore


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    ]


_libc: ctypes.CDLL | None = None
_have_cachestat = True


def _load_libc() -> ctypes.CDLL | None:
    global _libc
    if _libc is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)  # the loaded libc (find_library would run ldconfig)
            libc.mmap.restype = ctypes.c_void_p
            c_int = ctypes.c_int
            libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, c_int, c_int, c_int, ctypes.c_long]
            libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
            libc.syscall.restype = ctypes.c_long
            _libc = libc
        except (OSError, AttributeError):  # no usable libc: every page counts as cached
            return None
    return _libc


class _Residency:
    """Which byte ranges of one open file are wholly in the page cache (nothing is read to
    find out): ``cachestat(2)`` counts a range's cached pages in one call; older kernels get
    ``mincore(2)`` of one page per MiB on a read-only mapping.  When neither works every range
    counts as cached (then everything is read through the page cache, as before)."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size
        self.libc = _load_libc() if size > 0 else None
        self.address: int | None = None

    def cached(self, start: int, end: int) -> bool:
        global _have_cachestat
        libc = self.libc
        if libc is None or end <= start:
            return True
        first, last = start // mmap.PAGESIZE, -(-end // mmap.PAGESIZE)
        if _have_cachestat:
            span = _CachestatRange(first * mmap.PAGESIZE, (last - first) * mmap.PAGESIZE)
            stat = _Cachestat()
            if libc.syscall(_CACHESTAT, self.fd, ctypes.byref(span), ctypes.byref(stat), 0) == 0:
                return stat.nr_cache >= last - first
            if ctypes.get_errno() != errno_codes.ENOSYS:
                return True
            _have_cachestat = False
        return self._mincore(first, last)

    def _mincore(self, first: int, last: int) -> bool:
        libc = self.libc
        if libc is None:
            return True
        if self.address is None:
            address = libc.mmap(None, self.size, mmap.PROT_READ, mmap.MAP_SHARED, self.fd, 0)
            if address in (None, ctypes.c_void_p(-1).value):
                self.libc = None
                return True
            self.address = address
        vector = ctypes.create_string_buffer(1)
        step = max(1, _SAMPLE // mmap.PAGESIZE)
        for page in sorted({*range(first, last, step), last - 1}):
            if libc.mincore(self.address + page * mmap.PAGESIZE, mmap.PAGESIZE, vector) != 0:
                return True
            if not vector.raw[0] & 1:
                return False
        return True

    def close(self) -> None:
        if self.address is not None and self.libc is not None:
            self.libc.munmap(self.address, self.size)
        self.address = None


# ---- planning ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Run:
    """One aligned ``O_DIRECT`` read ``[start, end)`` and the ranges it fills."""

    start: int
    end: int
    members: tuple[Request, ...]


def cut_pieces(requests: Sequence[Request], size: int) -> list[Request]:
    """The requests sorted by offset (as byte views), each cut where it crosses a multiple of
    ``size`` in the file."""
    out: list[Request] = []
    for offset, buffer in sorted(requests, key=lambda r: r[0]):
        view = buffer.cast("B") if buffer.format != "B" else buffer
        done = 0
        while done < len(view):
            position = offset + done
            cut = min(len(view) - done, (position // size + 1) * size - position)
            out.append((position, view[done : done + cut]))
            done += cut
    return out


def _runs(pieces: Sequence[Request]) -> list[_Run]:
    """Neighbouring pieces grouped into aligned reads that fit a bounce buffer."""
    runs: list[_Run] = []
    start = end = -1
    members: list[Request] = []
    for offset, view in pieces:
        lo = offset // _ALIGN * _ALIGN
        hi = -(-(offset + len(view)) // _ALIGN) * _ALIGN
        if members and lo <= end and max(hi, end) - start <= _bounce_size():
            members.append((offset, view))
            end = max(end, hi)
            continue
        if members:
            runs.append(_Run(start, end, tuple(members)))
        start, end, members = lo, hi, [(offset, view)]
    if members:
        runs.append(_Run(start, end, tuple(members)))
    return runs


def _batch_bytes(total: int) -> int:
    """Bytes of one page-cache read task when ``total`` bytes are to be read: an equal share of
    the read threads, at least :data:`_CACHED_BATCH`.  Fewer, longer ``preadv`` chains read cold
    files faster (measured on the 2-core VM of ``docs/benchmarks.md``: a cold 1 GiB load in
    0.27 s with four 256 MiB tasks, 0.39 s with 32 MiB ones), and warm ones as fast."""
    return max(_CACHED_BATCH, -(-total // READ_THREADS))


def _batches(pieces: Sequence[Request], size: int = _CACHED_BATCH) -> list[list[Request]]:
    """Consecutive pieces in batches of about ``size`` bytes (one task each)."""
    batches: list[list[Request]] = []
    filled = size
    for piece in pieces:
        if filled >= size:
            batches.append([])
            filled = 0
        batches[-1].append(piece)
        filled += len(piece[1])
    return batches


# ---- reading -----------------------------------------------------------------------------------


class _File:
    """The descriptors of one file being read: buffered, and ``O_DIRECT`` when allowed.

    ``source`` is a path (opened here, by name) or an open :class:`~ckptd.storage.local_read.
    LocalReader` (a file of a pinned checkpoint directory: read through its descriptor, never
    opened by name again; its ``O_DIRECT`` descriptor is a reopening of that very file)."""

    def __init__(self, source: str | LocalReader) -> None:
        self.reader = source if isinstance(source, LocalReader) else None
        self.path = source if isinstance(source, str) else source.path
        if self.reader is not None:
            self.fd = self.reader.fd
        else:
            try:
                self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                raise storage_error("open", self.path, e) from e
        self.direct_fd = -1

    def open_direct(self) -> bool:
        if self.direct_fd < 0 and hasattr(os, "O_DIRECT"):
            if self.reader is not None:
                self.direct_fd = self.reader.reopen(os.O_DIRECT)
                if self.direct_fd < 0:
                    logger.debug("%s: cannot reopen with O_DIRECT; reading through the page cache", self.path)
                return self.direct_fd >= 0
            try:
                self.direct_fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
            except OSError as e:  # EINVAL: this file system has no O_DIRECT
                logger.debug("%s: no O_DIRECT (%s); reading through the page cache", self.path, e)
        return self.direct_fd >= 0

    def close(self) -> None:
        """Close the descriptors opened here (a reader's own descriptor stays its reader's)."""
        for fd in (self.fd if self.reader is None else -1, self.direct_fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.direct_fd = -1


def _preadv_into(fd: int, path: str, buffers: list[memoryview], offset: int) -> None:
    """``preadv`` until every buffer is full."""
    while buffers:
        try:
            got = os.preadv(fd, buffers[:_IOV_MAX], offset)
        except OSError as e:
            raise storage_error("read", path, e) from e
        if got <= 0:
            raise StorageError(errno_codes.EIO, f"unexpected end of file in {path} at byte {offset}")
        offset += got
        while buffers and got >= len(buffers[0]):
            got -= len(buffers[0])
            buffers.pop(0)
        if got:
            buffers[0] = buffers[0][got:]


def _read_cached(file: _File, pieces: list[Request]) -> None:
    """``preadv`` straight into the buffers; pieces that follow each other in the file share a call."""
    i = 0
    while i < len(pieces):
        offset, view = pieces[i]
        buffers, end = [view], offset + len(view)
        i += 1
        while i < len(pieces) and pieces[i][0] == end:
            buffers.append(pieces[i][1])
            end += len(pieces[i][1])
            i += 1
        _preadv_into(file.fd, file.path, buffers, offset)


_bounce = threading.local()


def _bounce_size() -> int:
    return DIRECT_RUN + 2 * _ALIGN


def _bounce_buffer() -> tuple[mmap.mmap, int]:
    """This thread's page-aligned bounce buffer (kept for the thread's life) and its address."""
    buffer = getattr(_bounce, "buffer", None)
    if buffer is None or len(buffer) < _bounce_size():
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        buffer = mmap.mmap(-1, _bounce_size(), flags=flags)
        _bounce.buffer = buffer
        _bounce.address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    return buffer, _bounce.address


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _read_direct(file: _File, run: _Run) -> None:
    """One aligned ``O_DIRECT`` read into the bounce buffer, copied out to the run's buffers."""
    buffer, base = _bounce_buffer()
    needed = max(offset + len(view) for offset, view in run.members) - run.start
    whole = memoryview(buffer)
    try:
        got = 0
        while got < needed:
            try:
                n = os.preadv(file.direct_fd, [whole[got : run.end - run.start]], run.start + got)
            except OSError as e:
                if e.errno == errno_codes.EINVAL and got == 0:  # refused at read time: use the page cache
                    _read_cached(file, list(run.members))
                    return
                raise storage_error("read", file.path, e) from e
            if n <= 0 or (n % _ALIGN and got + n < needed):
                where = run.start + got + max(n, 0)
                raise StorageError(errno_codes.EIO, f"unexpected end of file in {file.path} at byte {where}")
            got += n
        for offset, view in run.members:
            if len(view):
                ctypes.memmove(_address(view), base + offset - run.start, len(view))
    finally:
        whole.release()


def direct_reads() -> bool:
    """Whether loads read uncached ranges with ``O_DIRECT``: ``CKPTD_DIRECT_READS`` (``1`` or
    ``0``) if set, else :data:`DEFAULT_DIRECT_READS`."""
    text = os.environ.get("CKPTD_DIRECT_READS", "").strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    return DEFAULT_DIRECT_READS


def read_local(
    jobs: Sequence[tuple[str | RangeReader, Sequence[Request]]],
    *,
    direct: bool | None = None,
    every_range: bool = False,
    batch: int | None = None,
) -> None:
    """Fill every ``(offset, buffer)`` request of each ``(file, requests)`` job from its file: a
    path, or an open :class:`~ckptd.storage.local_read.LocalReader` (read through its
    descriptor, which stays open: a file of a pinned checkpoint directory is never opened by
    name again, so every byte comes from the version the load opened).  Another range reader
    (not a local file's) is read through its own ``read_many``.

    ``direct`` (default :func:`direct_reads`) reads ranges not in the page cache with
    ``O_DIRECT``; ``every_range=True`` reads every range that way, cached or not (to measure
    the ``O_DIRECT`` path).  ``batch``: bytes of one page-cache read task (default: an equal
    share of the read threads, at least 32 MiB).  Requests of one file must not overlap.  The caller checks sizes
    first; a short file raises :class:`StorageError`.
    """
    if direct is None:
        direct = direct_reads() or every_range
    files: list[_File] = []
    tasks: list[Callable[[], None]] = []
    cached_jobs: list[tuple[_File, list[Request]]] = []
    try:
        for source, requests in jobs:
            if not isinstance(source, (str, LocalReader)):
                tasks.append(functools.partial(source.read_many, requests))
                continue
            file = _File(source)
            files.append(file)
            pieces = cut_pieces(requests, DIRECT_RUN)
            if not pieces:
                continue
            cold: list[Request] = []
            cached: list[Request] = []
            if direct and every_range:
                cold = pieces
            elif direct:
                residency = _Residency(file.fd, os.fstat(file.fd).st_size)
                try:
                    for piece in pieces:
                        (cached if residency.cached(piece[0], piece[0] + len(piece[1])) else cold).append(piece)
                finally:
                    residency.close()
            else:
                cached = pieces
            if cold and not file.open_direct():
                cached = sorted(cached + cold, key=lambda r: r[0])
                cold = []
            cached_jobs.append((file, cached))
            tasks.extend(functools.partial(_read_direct, file, run) for run in _runs(cold))
        size = batch or _batch_bytes(sum(len(view) for _, cached in cached_jobs for _, view in cached))
        for file, cached in cached_jobs:
            tasks.extend(functools.partial(_read_cached, file, batch) for batch in _batches(cached, size))
        run_tasks(tasks)
    finally:
        for file in files:
            file.close()
