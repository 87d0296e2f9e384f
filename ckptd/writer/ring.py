"""A streamed save's arena, as the writer reads it: a ring.

A save larger than the staging budget (``staging_memory``) is staged through one arena used as a
ring: the byte at logical arena offset ``x`` (its offset in the rank's plan, as if the arena held
the whole save) lives at ``x % size``.  Two watermarks keep the copy and the writer apart:

* the copy's (the request's :class:`~ckptd.writer.gate.StagingGate`): the writer reads a byte
  only once the trainer has staged it;
* the writer's (``on_freed``, sent to the trainer as :class:`~ckptd.writer.protocol.Freed`): the
  trainer overwrites the place of logical byte ``x`` with byte ``x + size`` only once every
  reader of the writer is past ``x``.

Every file of the request has its readers (the storage's write, the CRC32C, the SHA-256 when
asked), all registered when the request starts, each at its file's first byte: the lowest
position of any reader not finished is what the writer still needs.  A reader hands out
``memoryview`` slices like the arena's own view would (``len()``, slicing, ``bytes()``), so the
storage backends write from it unchanged:

* a *sequential* reader (local files: one slice at a time, each used before the next is asked
  for) gets views into the ring, and asking for a slice frees what lies before it; a slice that
  crosses the ring's end is put together in a page-aligned bounce buffer of the reader's own
  (``O_DIRECT`` still applies);
* a *copying* reader (object stores, whose uploads ask for several parts at once) gets a copy of
  each slice, freed at once; its position is the end of the slices copied without a gap.

This module imports nothing heavy: the writer process uses it too.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable, Iterator

from ..errors import WriterError
from .gate import StagingGate

__all__ = ["RingArena", "RingReader"]


class RingArena:
    """The ring of one streamed request: its readers, and what they no longer need."""

    def __init__(
        self,
        view: memoryview,
        gate: StagingGate | None,
        *,
        should_stop: Callable[[], bool],
        on_freed: Callable[[int], None],
        notice_bytes: int,
    ) -> None:
        self.view = view
        self.size = len(view)
        self._gate = gate
        self._should_stop = should_stop
        self._on_freed = on_freed
        self._notice_bytes = max(1, notice_bytes)
        self._lock = threading.Lock()
        self._open: set[RingReader] = set()
        self._end = 0  # the highest logical byte any reader reads, plus one
        self._told = 0  # the last position sent to the trainer

    def reader(self, start: int, size: int, what: str, *, copying: bool) -> RingReader:
        """Register a reader of the logical bytes ``[start, start + size)`` (file ``what``)."""
        reader = RingReader(self, start, size, what, copying)
        with self._lock:
            self._open.add(reader)
            self._end = max(self._end, start + size)
        return reader

    def wait_staged(self, end: int, what: str) -> None:
        """Block until the trainer has staged the logical bytes below ``end``."""
        if self._gate is not None:
            self._gate.wait(end, what, self._should_stop)

    def read(self, start: int, stop: int, into: memoryview | None = None) -> memoryview:
        """The logical bytes ``[start, stop)`` (at most the ring's size): a view of the ring, or,
        where they cross its end, a copy in ``into`` (or in new memory)."""
        length = stop - start
        if length > self.size:
            raise WriterError(f"cannot read {length} bytes at once from a staging ring of {self.size} bytes")
        place = start % self.size
        if place + length <= self.size and into is None:
            return self.view[place : place + length]
        out = into[:length] if into is not None else memoryview(bytearray(length))
        head = min(length, self.size - place)
        out[:head] = self.view[place : place + head]
        if head < length:
            out[head:] = self.view[: length - head]
        return out

    def moved(self) -> None:
        """A reader moved: tell the trainer once what is freed has grown by ``notice_bytes``
        (or every reader is done)."""
        with self._lock:
            freed = min((r.position for r in self._open), default=self._end)
            if freed <= self._told or (self._open and freed - self._told < self._notice_bytes):
                return
            self._told = freed
        self._on_freed(freed)  # the trainer keeps the highest it was told: order does not matter

    def finished(self, reader: RingReader) -> None:
        with self._lock:
            self._open.discard(reader)
        self.moved()


class RingReader:
    """One reader of one file's bytes in the ring (see the module's docstring)."""

    def __init__(self, ring: RingArena, start: int, size: int, what: str, copying: bool) -> None:
        self._ring = ring
        self.start = start
        self.size = size
        self.what = what
        self.copying = copying
        self.position = start  # the logical byte below which this reader needs nothing
        self._copied: dict[int, int] = {}  # copying: slices copied past a gap, start -> end
        self._bounce: mmap.mmap | None = None

    def __len__(self) -> int:
        return self.size

    def __bytes__(self) -> bytes:
        return bytes(self[0 : self.size])

    def __getitem__(self, index: slice) -> memoryview:
        if not isinstance(index, slice):
            raise TypeError(f"a ring reader is read by slices, not {type(index).__name__}")
        first, last, step = index.indices(self.size)
        if step != 1:
            raise ValueError("a ring reader reads contiguous slices only")
        start, stop = self.start + first, self.start + max(first, last)
        if not self.copying:
            # The slice before this one is used: free it before waiting for this one's bytes,
            # which the copy may need that room to stage.
            self.position = max(self.position, start)
            self._ring.moved()
        self._ring.wait_staged(stop, self.what)
        if self.copying:
            data = self._ring.read(start, stop, memoryview(bytearray(stop - start)))
            self._copied_range(start, stop)
            return data
        return self._ring.read(start, stop, self._bounce_for(start, stop))

    def spans(self, chunk: int) -> Iterator[memoryview]:
        """The file's bytes in order, in views of at most ``chunk`` bytes that never cross the
        ring's end (no copy); each view is used before the next is asked for."""
        done = 0
        while done < self.size:
            place = (self.start + done) % self._ring.size
            length = min(chunk, self.size - done, self._ring.size - place)
            yield self[done : done + length]
            done += length

    def close(self) -> None:
        """This reader is done (or gave up): it holds nothing back any more."""
        self.position = self.start + self.size
        self._bounce = None  # unmapped once the last view of it is gone
        self._ring.finished(self)

    def _copied_range(self, start: int, stop: int) -> None:
        with self._ring._lock:  # several upload threads copy parts of one file at once
            self._copied[start] = stop
            while self.position in self._copied:
                self.position = self._copied.pop(self.position)
        self._ring.moved()

    def _bounce_for(self, start: int, stop: int) -> memoryview | None:
        """A page-aligned buffer for a slice that crosses the ring's end (``None`` otherwise)."""
        place = start % self._ring.size
        length = stop - start
        if place + length <= self._ring.size:
            return None
        if self._bounce is None or len(self._bounce) < length:
            self._bounce = mmap.mmap(-1, length)  # page-aligned; the old one goes with its last view
        return memoryview(self._bounce)
