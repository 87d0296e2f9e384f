"""CRC32C of whole files, each file read in spans checksummed in parallel and combined in order.

A file's CRC32C is a chain: checksumming one large file from one thread leaves the other cores
idle while the largest shard is read.  Here a file of ``size`` bytes is cut into a first span
of ``size % SPAN`` bytes (or ``SPAN``) and then whole spans of :data:`SPAN` bytes; each span's
CRC32C is computed on its own, from the read pool, and the file's value is folded from them in
order: ``crc(A + B) = shift(crc(A), len(B)) ^ crc(B)``, where ``shift`` by ``SPAN`` bytes is one
32x32 GF(2) matrix, built once (the zlib ``crc32_combine`` method, with the matrix kept).
"""

from __future__ import annotations

import itertools
import queue
from collections.abc import Callable, Sequence
from functools import lru_cache

from ..formats.checksum import crc32c
from ..storage import RangeReader
from .direct import run_tasks

__all__ = ["SPAN", "file_crcs", "shift_operator"]

SPAN = 16 * 1024 * 1024
"""Bytes checksummed by one task."""

_POLY = 0x82F63B78  # CRC32C, reflected

Matrix = tuple[int, ...]


def _times(matrix: Matrix, vector: int) -> int:
    total, row = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[row]
        vector >>= 1
        row += 1
    return total


def _compose(outer: Matrix, inner: Matrix) -> Matrix:
    """The operator ``outer(inner(x))``."""
    return tuple(_times(outer, column) for column in inner)


@lru_cache(maxsize=8)
def shift_operator(length: int) -> Matrix:
    """The GF(2) operator that appends ``length`` zero bytes to a CRC32C register."""
    power: Matrix = (_POLY, *(1 << n for n in range(31)))  # one zero bit
    for _ in range(3):  # eight zero bits: one byte
        power = _compose(power, power)
    result: Matrix = tuple(1 << n for n in range(32))  # the identity
    while length:
        if length & 1:
            result = _compose(power, result)
        length >>= 1
        if length:
            power = _compose(power, power)
    return result


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
    shift = shift_operator(SPAN)
    values = []
    for out in spans:
        value = out[0] if out else 0
        for crc in out[1:]:
            value = _times(shift, value) ^ crc
        values.append(value)
    return values
