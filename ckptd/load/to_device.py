"""Loads onto a GPU: file bytes into CUDA tensors through a small page-locked staging buffer.

A tensor whose load target lives on a CUDA device (a module's parameter with ``into=``, a DTensor
shard, a fresh tensor with ``device="cuda"``) is not read into pageable host memory and copied
from there: the pageable copy runs at a fraction of the link's speed, one tensor at a time, and
needs host memory for the whole state.  Instead its byte runs are read, in waves of up to
:data:`WAVE_BYTES`, into one half of a page-locked staging buffer (:data:`2 * WAVE_BYTES`,
allocated on first use and kept for the process), by the same read pool as host loads; each
wave is then copied to its targets with ``non_blocking`` copies on a side stream per device,
while the next wave is read into the other half.  The side stream first waits for the work
already queued on each device's current stream (a kernel still using a target finishes before
its bytes are replaced), and every copy is done when :func:`read_into_device` returns.

One load at a time uses the staging buffer (a lock); a second waits for it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..storage import RangeReader
from .direct import READ_THREADS

__all__ = ["WAVE_BYTES", "DeviceRequest", "read_into_device"]

WAVE_BYTES = 128 * 1024 * 1024
"""Bytes read into one half of the page-locked staging buffer before they are copied to the
device (each half is read by the whole read pool, a share of it per read thread: WAVE_BATCH)."""

WAVE_BATCH = max(4 * 1024 * 1024, WAVE_BYTES // READ_THREADS)
"""Bytes of one read task of a wave: every read thread reads a share of it."""

DeviceRequest = tuple[int, torch.Tensor]
"""``(offset in the file, CUDA uint8 tensor)``: a byte run of a file and the device bytes it fills."""

HostRequest = tuple[int, memoryview]
ReadHost = Callable[..., None]
"""``read_local``: reads ``[(reader, [(offset, host bytes), ...]), ...]``, tasks of ``batch`` bytes."""

_lock = threading.Lock()
_staging: tuple[int, torch.Tensor, memoryview] | None = None  # pid, page-locked bytes, their view


def _staging_buffer() -> tuple[torch.Tensor, memoryview]:
    """The process's page-locked staging buffer (a fork child makes its own)."""
    global _staging
    if _staging is None or _staging[0] != os.getpid():
        from .fetch import tensor_memoryview  # fetch imports this module

        host = torch.empty(2 * WAVE_BYTES, dtype=torch.uint8, pin_memory=True)
        _staging = (os.getpid(), host, tensor_memoryview(host))
    return _staging[1], _staging[2]


def _pieces(jobs: Sequence[tuple[RangeReader, Sequence[DeviceRequest]]]) -> list[tuple[RangeReader, int, torch.Tensor]]:
    """Every request cut to at most :data:`WAVE_BYTES`, in file order."""
    pieces = []
    for reader, spans in jobs:
        for offset, span in sorted(spans, key=lambda s: s[0]):
            size = span.numel()
            for start in range(0, size, WAVE_BYTES):
                pieces.append((reader, offset + start, span[start : start + WAVE_BYTES]))
    return pieces


def _waves(pieces: list[tuple[RangeReader, int, torch.Tensor]]) -> list[list[tuple[RangeReader, int, torch.Tensor]]]:
    """Consecutive pieces grouped into waves of at most :data:`WAVE_BYTES`."""
    waves: list[list[tuple[RangeReader, int, torch.Tensor]]] = []
    current: list[tuple[RangeReader, int, torch.Tensor]] = []
    filled = 0
    for piece in pieces:
        size = piece[2].numel()
        if current and filled + size > WAVE_BYTES:
            waves.append(current)
            current, filled = [], 0
        current.append(piece)
        filled += size
    if current:
        waves.append(current)
    return waves


def read_into_device(jobs: Sequence[tuple[RangeReader, Sequence[DeviceRequest]]], read_host: ReadHost) -> None:
    """Fill every ``(offset, CUDA bytes)`` request of each ``(reader, requests)`` job from its
    file, reading through ``read_host`` (``read_local``: the shared read pool) into page-locked
    memory and copying to the device on side streams; returns once every copy is done."""
    pieces = [p for p in _pieces(jobs) if p[2].numel()]
    if not pieces:
        return
    with _lock:
        host, view = _staging_buffer()
        streams: dict[torch.device, Any] = {}
        in_flight: list[list[Any]] = [[], []]  # the events of the copies out of each half
        try:
            for index, wave in enumerate(_waves(pieces)):
                half = index % 2
                for event in in_flight[half]:
                    event.synchronize()  # that half's last copies are done: it may be read into
                in_flight[half] = []
                by_reader: dict[int, tuple[RangeReader, list[HostRequest]]] = {}
                copies: list[tuple[torch.Tensor, torch.Tensor]] = []
                position = half * WAVE_BYTES
                for reader, offset, span in wave:
                    size = span.numel()
                    by_reader.setdefault(id(reader), (reader, []))[1].append((offset, view[position : position + size]))
                    copies.append((host[position : position + size], span))
                    position += size
                read_host(list(by_reader.values()), batch=WAVE_BATCH)
                used: dict[torch.device, Any] = {}
                for source, span in copies:
                    stream = streams.get(span.device)
                    if stream is None:
                        stream = streams[span.device] = torch.cuda.Stream(device=span.device)
                        stream.wait_stream(torch.cuda.current_stream(span.device))
                    with torch.cuda.stream(stream):
                        span.copy_(source, non_blocking=True)
                    used[span.device] = stream
                in_flight[half] = [stream.record_event() for stream in used.values()]
        finally:
            for stream in streams.values():
                stream.synchronize()  # also on an error: no copy may still read the staging buffer
