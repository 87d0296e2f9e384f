"""The writer as a thread of the trainer process, for filesystems that exist only in it.

Same interface as :class:`~ckptd.writer.client.WriterClient` (``memory://`` roots, whose files a
separate writer process could not see).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from ..errors import WriterError
from . import protocol
from .gate import PendingWrite, StagingGate
from .protocol import Hello, Message, Pong, WriteFiles, WriteOrder
from .shm import SharedSegment
from .stream import write_files

__all__ = ["InProcessWriter"]


class InProcessWriter:
    """The writer as a thread of the trainer process, for filesystems that exist only in this
    process (``memory://``).  Same interface as :class:`WriterClient`."""

    def __init__(self) -> None:
        self._arenas: dict[int, SharedSegment] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptd-inprocess-writer")
        self._checksums = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ckptd-crc")
        self._busy = False
        self._bytes_written = 0
        self._stop = threading.Event()
        self.restarts = 0
        self.info = Hello(os.getpid(), protocol.PROTOCOL_VERSION, "", "torch" in sys.modules)

    @property
    def pid(self) -> int:
        return os.getpid()

    def alive(self) -> bool:
        return not self._stop.is_set()

    def ensure_running(self) -> None:
        if self._stop.is_set():
            raise WriterError("the in-process writer is closed")

    def attach_arena(self, arena_id: int, segment: SharedSegment) -> None:
        self._arenas[arena_id] = segment

    def detach_arena(self, arena_id: int) -> None:
        self._arenas.pop(arena_id, None)

    def write_files(self, order: WriteOrder) -> Future[Message]:
        self.ensure_running()
        return self._pool.submit(self._write, WriteFiles.of(order, 0))

    def write_pipelined(
        self, staged: int, order: WriteOrder, on_freed: Callable[[int], None] | None = None
    ) -> PendingWrite:
        """Like :meth:`write_files`, for an arena still being filled (see ``WriterClient``)."""
        self.ensure_running()
        gate = StagingGate(staged)
        request = WriteFiles.of(order, 0, staged)
        return PendingWrite(self._pool.submit(self._write, request, gate, on_freed), gate.advance, staged)

    def _write(
        self, request: WriteFiles, gate: StagingGate | None = None, on_freed: Callable[[int], None] | None = None
    ) -> Message:
        segment = self._arenas.get(request.arena_id)
        # Arena 0: only copies, or files that are attached segments of their own (adopt)
        if segment is None and (request.arena_id or any(f.adopt is None for f in request.files)):
            raise WriterError(
                f"write request names staging arena {request.arena_id}, which is not attached to the "
                f"in-process writer (attached: {sorted(self._arenas)})"
            )
        view = segment.view() if segment is not None else memoryview(b"")
        self._busy = True
        try:
            return write_files(
                request,
                view,
                checksums=self._checksums,
                should_stop=self._stop.is_set,
                on_progress=self._count,
                gate=gate,
                on_freed=on_freed,
                segments=self._arenas,
            )
        finally:
            self._busy = False
            view.release()

    def _count(self, written: int) -> None:
        self._bytes_written += written

    def throttle(self, action: str) -> None:
        """No throttle here: the in-process writer serves ``memory://``, which does no I/O."""

    def ping(self, timeout: float = 10.0) -> Pong:
        return Pong(0, self._busy, self._bytes_written)

    def close(self, timeout: float = 30.0) -> None:
        self._pool.shutdown(wait=True)
        self._stop.set()
        self._checksums.shutdown(wait=False)
        self._arenas.clear()

    @property
    def abandoned(self) -> bool:
        """:meth:`abandon` (or :meth:`kill`) was called."""
        return self._stop.is_set()

    def abandon(self) -> None:
        """Stop the write in flight at its next chunk and refuse new ones (see ``WriterClient``)."""
        self._stop.set()

    def kill(self) -> None:
        self._stop.set()
