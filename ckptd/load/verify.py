"""CRC32C of whole files, each file read in spans checksummed in parallel and combined in order.

A file's CRC32C is a chain: checksumming one large file from one thread leaves the other cores
idle while the largest shard is read.  Here a file of ``size`` bytes is cut into a first span
of ``size % SPAN`` bytes (or ``SPAN``) and then whole spans of :data:`SPAN` bytes; each span's
CRC32C is computed on its own, from the read pool, and the file's value is folded from them in
order with :func:`~ckptd.formats.checksum.crc32c_combine` (``crc(A + B)`` from ``crc(A)``,
``crc(B)`` and ``len(B)``).
"""

from __future__ import annotations

import itertools
import queue
from collections.abc import Callable, Sequence

from ..formats.checksum import crc32c, crc32c_combine
from ..storage import RangeReader
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

    def task(reader: RangeReader, out: list[int], index: int, start: int, end: int) -> Callable[[], None]:
        def run() -> None:
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
        for reader in readers:
            reader.close()
    values = []
    for out in spans:
        value = out[0] if out else 0
        for crc in out[1:]:
            value = crc32c_combine(value, crc, SPAN)
        values.append(value)
    return values
