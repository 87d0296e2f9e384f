"""How far a pipelined save's staging copy has got, as the writer sees it.

A pipelined :class:`~ckptd.writer.protocol.WriteFiles` request arrives while the trainer is still
copying tensors into the arena.  Its :class:`StagingGate` holds the arena offset below which the
bytes are staged (raised by :class:`~ckptd.writer.protocol.Staged` notices, or directly by the
in-process writer); the writing threads wait on it before they read a chunk, so a shard file is
written as soon as its bytes are in the arena, while the next file is still being copied.

This module imports nothing heavy: the writer process uses it too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ..errors import WriterError
from ..formats.checksum import CHECKSUM_CHUNK, crc32c
from ..storage import Stopped

__all__ = ["PendingWrite", "StagingGate", "chunk_gate", "gated_crc32c"]

_POLL_SECONDS = 0.25  # how often a waiting thread looks at should_stop() (the parent's death)


class StagingGate:
    """The staged watermark of one request; ``None`` at creation means everything is staged."""

    def __init__(self, staged: int | None) -> None:
        self._cond = threading.Condition()
        self._upto = -1 if staged is None else staged  # -1: complete
        self._error = ""
        self.waits = 0  # times a writing thread found its bytes not staged yet (tests, tuning)

    @property
    def complete(self) -> bool:
        return self._upto < 0

    def advance(self, upto: int, error: str = "") -> None:
        """Bytes below ``upto`` are staged (``upto < 0``: all of them); ``error``: staging failed."""
        with self._cond:
            if error:
                self._error = error
            elif not self.complete:
                self._upto = upto if upto < 0 else max(self._upto, upto)
            self._cond.notify_all()

    def wait(self, end: int, what: str, should_stop: Callable[[], bool]) -> None:
        """Block until the arena bytes below ``end`` are staged.

        Raises :class:`~ckptd.errors.WriterError` naming ``what`` (the file) if staging failed,
        and :class:`~ckptd.storage.Stopped` once ``should_stop()`` turns true.
        """
        with self._cond:
            if self._ready(end, what):
                return
            self.waits += 1
            while not self._ready(end, what):
                if should_stop():
                    raise Stopped(what)
                self._cond.wait(_POLL_SECONDS)

    def _ready(self, end: int, what: str) -> bool:
        if self._error:
            raise WriterError(f"{what} was not written: staging its bytes failed in the trainer ({self._error})")
        return self.complete or self._upto >= end


def chunk_gate(
    gate: StagingGate, start: int, size: int, chunk_size: int, what: str, should_stop: Callable[[], bool]
) -> Callable[[], bool]:
    """A ``should_stop`` for a storage that reads the view sequentially, polling before each chunk
    of ``chunk_size`` bytes (local files, see ``ObjectWriter.write_view``): the k-th call waits
    for chunk k (arena bytes ``start + k * chunk_size`` onwards) to be staged."""
    calls = 0

    def before_chunk() -> bool:
        nonlocal calls
        if should_stop():
            return True
        end = start + min(size, (calls + 1) * chunk_size)
        calls += 1
        gate.wait(end, what, should_stop)
        return False

    return before_chunk


class PendingWrite:
    """A pipelined write in flight: ``future`` resolves like the one ``write_files`` returns;
    :meth:`advance` tells the writer how far staging has got, :meth:`abort` that it failed."""

    def __init__(self, future: Future[Any], notify: Callable[[int, str], None], staged: int) -> None:
        self.future = future
        self.staged = staged  # what the writer has been told so far
        self._notify = notify

    def advance(self, upto: int) -> None:
        """The arena bytes below ``upto`` are staged."""
        self.staged = upto
        self._notify(upto, "")

    def abort(self, error: BaseException) -> None:
        """Staging failed: the writer abandons the request (removing the file it was writing)."""
        self._notify(-1, f"{type(error).__name__}: {error}")


def gated_crc32c(
    data: memoryview, gate: StagingGate, arena_offset: int, what: str, should_stop: Callable[[], bool]
) -> int:
    """CRC32C of ``data`` (at ``arena_offset`` of the arena), each chunk once it is staged."""
    value = 0
    for start in range(0, len(data), CHECKSUM_CHUNK):
        stop = min(len(data), start + CHECKSUM_CHUNK)
        gate.wait(arena_offset + stop, what, should_stop)
        value = crc32c(data[start:stop], value)
    return value
