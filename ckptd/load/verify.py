"""CRC32C of whole files, each file read in spans checksummed in parallel and combined in order.

A file's CRC32C is a chain: checksumming one large file from one thread leaves the other cores
idle while the largest shard is read.  Here a file of ``size`` bytes is cut into a first span
of ``size % SPAN`` bytes (or ``SPAN``) and then whole spans of :data:`SPAN` bytes; each span's
CRC32C is computed on its own, from the read pool, and the file's value is folded from them in
order with :func:`~ckptd.formats.checksum.crc32c_combine` (``crc(A + B)`` from ``crc(A)``,
``crc(B)`` and ``len(B)``).

Files of a held-memory root (``shm://``: tmpfs pages, :mod:`ckptd.storage.held`) are mapped and
checksummed where they lie instead of being copied into a buffer first: half the memory traffic of
a restore's verification.  Other files are read (a mapping of a file that another process
truncates meanwhile would kill the process with SIGBUS instead of raising).
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import queue
from collections.abc import Callable, Sequence

from ..formats.checksum import crc32c, crc32c_concat
from ..storage import RangeReader
from ..storage.held import in_held_memory
from .direct import run_tasks

__all__ = ["SPAN", "file_crcs"]

SPAN = 16 * 1024 * 1024
"""Bytes checksummed by one task."""


def file_crcs(files: Sequence[tuple[Callable[[], RangeReader], int]]) -> list[int]:
    """CRC32C of the first ``size`` bytes of each ``(open, size)`` file (``open()`` gives a
    range reader, closed here), all files' spans in parallel."""
    readers: list[RangeReader] = []
    spans: list[list[int]] = []
    tasks: list[Callable[[], None]] = []
    free: queue.SimpleQueue[memoryview] = queue.SimpleQueue()  # span buffers, one per thread at most

    mappings: dict[int, tuple[memoryview, mmap.mmap]] = {}  # by id() of a reader in ``readers``

    def task(reader: RangeReader, out: list[int], index: int, start: int, end: int) -> Callable[[], None]:
        mapped = _mapped(reader, mappings)

        def run() -> None:
            if mapped is not None:
                out[index] = crc32c(mapped[start:end])
                return
            try:
                buffer = free.get_nowait()
            except queue.Empty:
                buffer = memoryview(bytearray(max(SPAN, end - start)))
            try:
                view = buffer[: end - start]
                reader.read_into(start, view)
                out[index] = crc32c(view)
            finally:
                free.put(buffer)

        return run

    try:
        for open_file, size in files:
            reader = open_file()
            readers.append(reader)
            first = size % SPAN or min(size, SPAN)
            bounds = [0, *range(first, size + 1, SPAN)] if size else [0]
            out = [0] * (len(bounds) - 1)
            spans.append(out)
            tasks.extend(task(reader, out, i, a, b) for i, (a, b) in enumerate(itertools.pairwise(bounds)))
        run_tasks(tasks)
    finally:
        for view, mapping in mappings.values():
            view.release()
            with contextlib.suppress(BufferError):
                mapping.close()
        for reader in readers:
            reader.close()
    return [crc32c_concat((crc, SPAN) for crc in out) for out in spans]


def _mapped(reader: RangeReader, mappings: dict[int, tuple[memoryview, mmap.mmap]]) -> memoryview | None:
    """A read-only mapping of ``reader``'s file when it is held memory (mapped once per file,
    kept in ``mappings``), else ``None``."""
    if id(reader) in mappings:
        return mappings[id(reader)][0]
    fd, path = getattr(reader, "fd", None), getattr(reader, "path", None)
    if not isinstance(fd, int) or not isinstance(path, str) or not reader.size or not in_held_memory(path):
        return None
    try:
        mapping = mmap.mmap(fd, reader.size, prot=mmap.PROT_READ)
    except (OSError, ValueError):
        return None
    view = memoryview(mapping)
    mappings[id(reader)] = (view, mapping)
    return view
