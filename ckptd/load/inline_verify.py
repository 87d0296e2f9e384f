"""Local reads that check each file's CRC32C while its bytes land: one pass over the bytes.

A ``verify=True`` load checks a file before any of its bytes reach a target (:mod:`.verify`), so
the bytes are read twice: once to checksum, once into the targets.  From memory (a held root)
or the page cache the second pass costs as much as the first.  When the destinations are not the
caller's live tensors (fresh tensors, handed out only if the load succeeds) or the caller asked
for it (``verify="inline"``), :func:`read_verified` instead reads every byte of the file once,
straight into its destination (or, for bytes no destination wants, into a scratch buffer), and
checksums each piece right after it landed, while it is still in the CPU cache.

A file is cut into spans of :data:`~ckptd.load.verify.SPAN` bytes, one task each on the read pool;
a task reads its span in windows of :data:`WINDOW` bytes (one ``preadv`` each) and folds the
CRC32C of every piece in file order; the spans' values are combined in order as
:func:`~ckptd.load.verify.file_crcs` does.  A mismatch raises
:class:`~ckptd.errors.CorruptCheckpointError` after every task ended: the destinations of that
file then hold bytes that did not verify, which is why live targets take this path only when
asked.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError, CorruptCheckpointError
from ..formats.checksum import crc32c, crc32c_concat, format_crc
from ..storage import RangeReader
from ..storage.local_read import LocalReader
from .direct import cut_pieces, run_tasks
from .verify import SPAN

__all__ = ["WINDOW", "InlineFile", "VerifyMode", "read_verified", "verify_mode"]

VerifyMode = bool | Literal["inline"]
"""``verify=`` of a load: ``False``, ``True`` (files checked before their bytes reach live
targets) or ``"inline"`` (checked as they land, live targets included)."""

WINDOW = 1024 * 1024
"""Bytes read by one ``preadv`` and checksummed right after (they are still in the CPU cache)."""

Piece = tuple[int, memoryview | None, int]  # (offset, destination or None: scratch, length)


def verify_mode(verify: object) -> VerifyMode:
    """``verify`` checked: ``True``, ``False`` or ``"inline"``."""
    if isinstance(verify, bool):
        return verify
    if verify == "inline":
        return "inline"
    raise ConfigError(f"verify must be True, False or 'inline', not {verify!r}")


@dataclass(frozen=True)
class InlineFile:
    """One file to read whole and check: its reader, size, the manifest's CRC32C (eight hex
    digits), its path (for errors) and the ``(offset, buffer)`` requests that want its bytes."""

    reader: RangeReader
    size: int
    crc32c: str
    path: str
    requests: Sequence[tuple[int, memoryview]]


def cover(requests: Sequence[tuple[int, memoryview]], size: int) -> list[Piece] | None:
    """The file's ``size`` bytes as pieces in file order, each within one :data:`WINDOW`: the
    requests' buffers, and scratch pieces for the bytes between them; ``None`` if requests
    overlap or reach past ``size``."""
    pieces: list[Piece] = []
    position = 0

    def gap(end: int) -> None:
        nonlocal position
        while position < end:
            length = min(end - position, (position // WINDOW + 1) * WINDOW - position)
            pieces.append((position, None, length))
            position += length

    for offset, view in cut_pieces(requests, WINDOW):
        if offset < position or offset + len(view) > size:
            return None
        gap(offset)
        pieces.append((offset, view, len(view)))
        position = offset + len(view)
    gap(size)
    return pieces


_scratch = threading.local()


def _scratch_window() -> memoryview:
    """This thread's buffer for the bytes no destination wants (one window, kept)."""
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None:
        buffer = _scratch.buffer = memoryview(bytearray(WINDOW))
    return buffer


def _span_task(file: InlineFile, pieces: list[Piece], out: list[int], index: int) -> Callable[[], None]:
    def run() -> None:
        scratch = _scratch_window()
        value, i = 0, 0
        while i < len(pieces):
            window = pieces[i][0] // WINDOW
            start = i
            while i < len(pieces) and pieces[i][0] // WINDOW == window:
                i += 1
            views = [v if v is not None else scratch[o % WINDOW : o % WINDOW + n] for o, v, n in pieces[start:i]]
            if isinstance(file.reader, LocalReader):
                file.reader.read_vector(pieces[start][0], views)
            else:
                for (offset, _, _), view in zip(pieces[start:i], views, strict=True):
                    file.reader.read_into(offset, view)
            for view in views:
                value = crc32c(view, value)
        out[index] = value

    return run


def read_verified(files: Sequence[InlineFile]) -> None:
    """Read each file whole, its requests' bytes into their buffers, checking its CRC32C.

    Raises :class:`~ckptd.errors.CorruptCheckpointError` naming a file whose bytes do not match
    (or :class:`~ckptd.errors.StorageError` if one cannot be read), after every read ended.
    Requests must not overlap (:func:`cover`)."""
    tasks: list[Callable[[], None]] = []
    spans: list[tuple[list[int], list[int]]] = []  # per file: each span's CRC32C and length
    for file in files:
        pieces = cover(file.requests, file.size)
        if pieces is None:
            raise ValueError(f"{file.path}: overlapping requests cannot be verified inline")
        grouped: list[list[Piece]] = [[] for _ in range(-(-file.size // SPAN))]
        for piece in pieces:
            grouped[piece[0] // SPAN].append(piece)
        values = [0] * len(grouped)
        tasks.extend(_span_task(file, group, values, i) for i, group in enumerate(grouped))
        spans.append((values, [sum(n for _, _, n in group) for group in grouped]))
    run_tasks(tasks)
    for file, (values, lengths) in zip(files, spans, strict=True):
        value = crc32c_concat(zip(values, lengths, strict=True))
        if format_crc(value) != file.crc32c:
            raise CorruptCheckpointError(
                f"{file.path}: CRC32C mismatch (manifest {file.crc32c}, file {format_crc(value)}): the file is "
                "corrupt (checked while it was read)"
            )
