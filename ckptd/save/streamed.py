"""Staging a save larger than the staging budget: the copy streams through one arena as a ring.

With ``staging_memory`` set, a rank whose plan needs a larger arena than the budget stages into
an arena of the budget's size.  Every byte keeps its logical arena offset ``x`` from the plan and
lives at ``x % size`` (:mod:`ckptd.writer.ring` is the writer's side).  The staging thread copies
the planned parts (file headers, then tensors, in arena order) chunk by chunk; before a chunk
that would overwrite bytes the writer has not finished with, it publishes how far it has got
(so the writer can go on) and waits in :class:`RingRoom` until the writer's
:class:`~ckptd.writer.protocol.Freed` notices say the room is free.  So the memory stays at the
budget whatever the state's size, and the save is still whole or invisible: the writer writes and
checksums each byte exactly as staged, and the commit happens only after every file is written.

What the caller waits for: ``async_save`` with ``"blocking"`` or ``"pipelined"`` staging returns
once the copy is over, that is once all but the last ``size`` bytes are written; with
``"background"`` it returns at once and the next optimizer step waits instead.  A tensor that is
not contiguous is made contiguous first (a transient copy of that tensor).  CUDA tensors are
copied chunk by chunk on the arena's side stream and synchronised before their bytes are
published.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CkptdError, WriterError
from .plan import RankPlan

__all__ = ["RingRoom", "StreamPart", "copy_streamed", "stream_parts"]

_WAIT_SECONDS = 0.25  # how often a waiting copy looks again (a closed pool, a lost notice)


class RingRoom:
    """How far the writer has freed the ring of one streamed save (the trainer's side).

    ``free(upto)`` is called with the writer's notices; ``fail(error)`` when the write ends
    without reading everything (it failed, or never started), which wakes the copy with that
    error instead of leaving it waiting forever.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.freed = 0
        self.waits = 0  # times the copy found the ring full (tests, tuning)
        self._error: BaseException | None = None
        self._cond = threading.Condition()

    def free(self, upto: int) -> None:
        with self._cond:
            if upto > self.freed:
                self.freed = upto
                self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    def has_room(self, end: int) -> bool:
        """Whether the logical bytes below ``end`` fit in the ring now."""
        return end - self.freed <= self.capacity and self._error is None

    def wait_room(self, end: int) -> None:
        """Block until the logical bytes below ``end`` fit; raise the error of a failed write."""
        with self._cond:
            if end - self.freed > self.capacity:
                self.waits += 1
            while end - self.freed > self.capacity and self._error is None:
                self._cond.wait(_WAIT_SECONDS)
            error = self._error
        if error is None:
            return
        if isinstance(error, CkptdError):
            raise error
        raise WriterError(f"the writer stopped reading the staging ring ({type(error).__name__}: {error})") from error


@dataclass(frozen=True)
class StreamPart:
    """One part of a streamed save, in arena order: a file header (``header``) or the bytes of
    local tensor ``component``/``key``, at logical arena offset ``start``."""

    start: int
    nbytes: int
    file_name: str
    header: bytes = b""
    component: str = ""
    key: str = ""


def stream_parts(plan: RankPlan) -> list[StreamPart]:
    """The parts of ``plan`` in arena order (the order the writer reads them in)."""
    parts = [
        StreamPart(
            piece.arena_offset + part.offset, part.nbytes, piece.file_name, part.header, part.component, part.key
        )
        for piece in plan.pieces
        for part in piece.parts
    ]
    parts.sort(key=lambda p: p.start)
    return parts


def copy_streamed(
    ring: torch.Tensor,
    parts: list[StreamPart],
    tensors: Mapping[str, Mapping[str, torch.Tensor]],
    *,
    skip_files: frozenset[str],
    room: RingRoom,
    publish: Callable[[int], None],
    chunk: int,
    publish_bytes: int,
    cuda_stream: Callable[[torch.device], Any],
    pinned: bool,
    after_copy: Callable[[str, str], None] | None = None,
) -> None:
    """Copy ``parts`` into ``ring`` (uint8, the arena) chunk by chunk, waiting for room.

    ``publish(upto)``: the logical bytes below ``upto`` are staged (every ``publish_bytes``, and
    before each wait for room: the writer may need them to free it).  ``cuda_stream(device)``:
    the side stream for copies from that device.
    """
    size = ring.numel()
    published = 0
    streams: dict[torch.device, Any] = {}
    for part in parts:
        if part.file_name in skip_files or part.nbytes == 0:
            continue
        source = _source_bytes(part, tensors)
        stream = None
        if source.is_cuda:
            stream = streams.get(source.device)
            if stream is None:
                stream = streams[source.device] = cuda_stream(source.device)
                stream.wait_stream(torch.cuda.current_stream(source.device))  # after the caller's work
        for offset in range(0, part.nbytes, chunk):
            start = part.start + offset
            stop = min(part.start + part.nbytes, start + chunk)
            if not room.has_room(stop):
                if start > published:
                    publish(start)
                    published = start
                room.wait_room(stop)
            _copy_into_ring(ring, size, start, source[offset : offset + stop - start], stream, pinned)
            if stop - published >= publish_bytes:
                publish(stop)
                published = stop
        if part.component and after_copy is not None:
            after_copy(part.component, part.key)


def _source_bytes(part: StreamPart, tensors: Mapping[str, Mapping[str, torch.Tensor]]) -> torch.Tensor:
    """The bytes to stage for ``part``, as a flat uint8 tensor on the source's device."""
    if part.header:
        return torch.frombuffer(bytearray(part.header), dtype=torch.uint8)
    tensor = tensors[part.component][part.key].detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    flat = tensor.reshape(-1).view(torch.uint8)
    if flat.numel() != part.nbytes:
        raise WriterError(
            f"{part.component}/{part.key} holds {flat.numel()} bytes but its plan has {part.nbytes}: "
            "the tensor changed between planning and staging"
        )
    return flat


def _copy_into_ring(ring: torch.Tensor, size: int, start: int, source: torch.Tensor, stream: Any, pinned: bool) -> None:
    """Copy ``source`` to logical offset ``start`` (wrapping at the ring's end); CUDA copies run
    on ``stream`` and are complete on return."""
    place = start % size
    head = min(source.numel(), size - place)
    if stream is None:
        ring[place : place + head].copy_(source[:head])
        if head < source.numel():
            ring[: source.numel() - head].copy_(source[head:])
        return
    with torch.cuda.stream(stream):
        ring[place : place + head].copy_(source[:head], non_blocking=pinned)
        if head < source.numel():
            ring[: source.numel() - head].copy_(source[head:], non_blocking=pinned)
    stream.synchronize()  # the bytes are in place before they are published (and reused)
