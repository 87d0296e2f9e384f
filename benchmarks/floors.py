"""Fair floors for ckptd's benchmarks: the least this machine needs to copy, write and read a state.

Every floor is measured in the same run (and the same process) as the ckptd numbers it is
compared with, and the benchmark scripts interleave them with ckptd's repeats (floor, ours,
floor, ours) so that a noisy machine moves both sides of each pair together.

* **Copy floor** (:class:`CopyFloor`): ``dst.copy_(src)`` of every tensor into views of one
  pre-faulted buffer, at 64-byte aligned offsets, in the order of the tensors' addresses (both the
  reads and the writes then move forward through memory), for two kinds of memory: a ``memfd`` mapped
  ``MAP_SHARED`` (the kind of memory ckptd's staging arena is; ``posix_fallocate`` +
  ``MAP_POPULATE``) and anonymous private memory (``MAP_POPULATE``).  The floor is the faster.
* **Write floor** (:class:`WriteFloor`): the state's bytes, laid out back to back in one
  page-aligned buffer (the anonymous buffer of the copy floor), written to one new file in 16 MiB
  ``pwrite`` calls and ``fsync``-ed: buffered, then twice with ``O_DIRECT`` (the file is truncated
  to the exact size before the ``fsync``).  The floor is the fastest of the three.  The second
  ``O_DIRECT`` write follows an ``O_DIRECT`` write, as the save timed after the floors does: a
  write right after the buffered one ran 1.2-1.3x slower here even after the settle below
  (ckptd / floor 1.43x with the buffered write last before the save, 1.14x with an ``O_DIRECT``
  one last, 6 rounds each).
* **Read floor** (:class:`ReadFloor`): ``os.preadv`` of each safetensors file's data section
  straight into the preallocated target tensors, with one thread (consecutive tensors in one
  call) and with 4 threads over 32 MiB slices (several I/Os in flight: ckptd's loader reads
  with several threads, and a one-thread floor was beaten on cold reads); cold reads also try
  ``O_DIRECT`` (aligned 8 MiB blocks into page-aligned buffers, 4 threads, copied into the
  targets: they cannot take ``O_DIRECT`` reads themselves, their addresses and the tensors'
  file offsets differ within a page).  The floor is the fastest method.  Warm (page cache hot)
  and cold (``posix_fadvise(DONTNEED)`` on every file first; the bytes really read from the
  disk are taken from ``read_bytes`` in ``/proc/self/io``).

Before every timed copy and write, the floor's and ckptd's alike, the benchmarks call
:func:`settle_machine`: on this machine a write that starts right after another one (and after the
``discard`` of the file it deleted) pays for the host's work on that one, and the first 0.1 s of
copying after a pause or a disk-bound phase runs about 25% slower than the next (1 GiB copied into
either kind of memory: 0.100-0.102 s first, 0.079 s right after); the order of the measurements
must not decide which side pays.  The read benchmark gives every timed load the same untimed load
before it, for the same reason.

One-line descriptions of each method are in :data:`METHODS` (``run_all.py`` prints them).
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

__all__ = [
    "METHODS",
    "CopyFloor",
    "ReadFloor",
    "WriteFloor",
    "drop_from_page_cache",
    "proc_io",
    "settle_machine",
    "warm_cpu",
]

PAGE = mmap.PAGESIZE
TENSOR_ALIGNMENT = 64
WRITE_CHUNK = 16 * 1024**2
DIRECT_ALIGNMENT = 4096
IOV_MAX = 1024
READ_SLICE = 32 * 1024**2
READ_THREADS = 4
DIRECT_BLOCK = 8 * 1024**2

METHODS = {
    "copy": (
        "copy_ of every tensor, in address order, into views of one pre-faulted buffer, the faster of a memfd "
        "MAP_SHARED mapping (fallocated + MAP_POPULATE, the arena's kind of memory) and anonymous MAP_POPULATE memory; "
        "sync + a settle pause + 0.1 s of matmuls before each timed copy, the floor's and ckptd's alike"
    ),
    "write": (
        "all bytes in one page-aligned buffer, 16 MiB pwrites to one new file + fsync, the fastest of buffered "
        "then O_DIRECT twice (the last write before a timed save is an O_DIRECT one, as before the floor's "
        "second); sync + a settle pause + 0.1 s of matmuls before each timed write, the floor's and ckptd's alike"
    ),
    "read": (
        "os.preadv of each safetensors data section straight into the preallocated targets, the fastest of one "
        "thread, 4 threads over 32 MiB slices and (cold only) O_DIRECT 8 MiB blocks copied into the targets by 4 "
        "threads; cold = posix_fadvise(DONTNEED) first, checked with read_bytes of /proc/self/io"
    ),
}


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes."""
    return tensor.reshape(-1).view(torch.uint8)


def proc_io() -> dict[str, int]:
    """``/proc/self/io`` as ``{field: value}`` (``rchar``, ``read_bytes``, ...)."""
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


def settle_machine(seconds: float) -> None:
    """Flush every dirty page (``sync``), wait ``seconds``, then :func:`warm_cpu`.

    The flush and the pause keep the disk work of the previous measurement (its writeback, the
    ``discard`` of the files it deleted, the host's own work behind the virtual disk, which the
    guest cannot see) off the next one; ``seconds <= 0`` skips them.  The warm-up always runs: a
    save follows a training step, not an idle CPU, and the timed work must not start cold.
    Called before every timed copy and write, floors and ckptd alike."""
    if seconds > 0:
        os.sync()
        time.sleep(seconds)
    warm_cpu()


WARM_CPU_SECONDS = 0.1
_WARM_SIDE = 512


def warm_cpu(seconds: float = WARM_CPU_SECONDS) -> None:
    """``seconds`` of 512x512 fp32 matrix products on torch's threads (a small training step).

    On this VM the first 0.1 s of copying after a pause or a disk-bound phase ran about 25% slower
    than the copy right after it (1 GiB: 0.100-0.102 s against 0.079 s, shared and anonymous
    memory alike); after this warm-up the first copy ran at the second's speed (0.078 s)."""
    matrix = torch.ones(_WARM_SIDE, _WARM_SIDE)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        torch.mm(matrix, matrix)


def drop_from_page_cache(paths: Iterable[str]) -> None:
    """``posix_fadvise(DONTNEED)`` on every file (clean pages leave the page cache)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages would stay cached
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# ---- copy ------------------------------------------------------------------------------------


def _shared_mapping(size: int) -> tuple[int, mmap.mmap]:
    """A populated ``MAP_SHARED`` mapping of a fallocated memfd (like ckptd's arena)."""
    fd = os.memfd_create("ckptd-bench-floor", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    os.posix_fallocate(fd, 0, size)
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return fd, mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _anonymous_mapping(size: int) -> mmap.mmap:
    """A populated private anonymous mapping (page-aligned)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(-1, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


class CopyFloor:
    """``copy_`` of every tensor into a pre-faulted shared (memfd) buffer and an anonymous one.

    After :meth:`measure`, :attr:`anonymous` holds the state's bytes (at 64-byte aligned offsets),
    page-aligned: :class:`WriteFloor` writes from it.
    """

    def __init__(self, tensors: Iterable[torch.Tensor], settle: float = 0.0) -> None:
        self.settle = settle  # seconds of settle_machine() before each timed copy
        # Address order: the copy then reads the sources and writes the buffer front to back (in a
        # state's own order the reads jump between tensors allocated in another order; ckptd's
        # arena order can happen to match the addresses, and the floor must not lose to it).
        self.sources = sorted((_byte_view(t.contiguous()) for t in tensors), key=lambda t: t.data_ptr())
        offsets, size = [], 0
        for src in self.sources:
            size = _round_up(size, TENSOR_ALIGNMENT)
            offsets.append(size)
            size += src.numel()
        self.nbytes = size
        self.capacity = _round_up(max(size, 1), DIRECT_ALIGNMENT)
        self._fd, self._shared = _shared_mapping(self.capacity)
        self.anonymous = _anonymous_mapping(self.capacity)
        self._targets: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for kind, mapping in (("shared", self._shared), ("anonymous", self.anonymous)):
            whole = torch.frombuffer(mapping, dtype=torch.uint8)
            self._targets[kind] = [
                (src, whole[o : o + src.numel()]) for src, o in zip(self.sources, offsets, strict=True)
            ]

    def copy(self, kind: str) -> float:
        """Seconds to copy every tensor into the ``kind`` buffer (``shared`` or ``anonymous``),
        after :func:`settle_machine` (untimed), as ckptd's timed save comes after one."""
        pairs = self._targets[kind]
        settle_machine(self.settle)
        started = time.perf_counter()
        for src, dst in pairs:
            dst.copy_(src)
        return time.perf_counter() - started

    def measure(self) -> dict[str, float]:
        """One copy into each kind of memory: ``{"shared": s, "anonymous": s, "floor": min}``."""
        out = {kind: self.copy(kind) for kind in ("shared", "anonymous")}
        out["floor"] = min(out.values())
        return out

    def close(self) -> None:
        """Unmap both buffers (views into them must be gone)."""
        self._targets.clear()
        self.sources.clear()
        for mapping in (self._shared, self.anonymous):
            try:
                mapping.close()
            except BufferError:  # a tensor view still exists; the mapping goes with it
                pass
        os.close(self._fd)


def cold_copy(tensors: Iterable[torch.Tensor], settle: float = 0.0) -> float:
    """Seconds to ``copy_`` every tensor into freshly mapped memory (private anonymous, not
    populated: every page is faulted in by the copy), after :func:`settle_machine`.

    With the write floor, the **cold floor** of a process's first save: a first save cannot reuse
    memory a previous save faulted in, and on this VM new memory costs 0.45-1.0 s per GiB however
    it is obtained."""
    sources = [_byte_view(t.contiguous()) for t in tensors]
    size = _round_up(max(sum(s.numel() for s in sources), 1), DIRECT_ALIGNMENT)
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    settle_machine(settle)
    started = time.perf_counter()
    offset = 0
    for src in sources:
        whole[offset : offset + src.numel()].copy_(src)
        offset += src.numel()
    seconds = time.perf_counter() - started
    del whole
    mapping.close()
    return seconds


# ---- write -----------------------------------------------------------------------------------


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done


class WriteFloor:
    """Writes ``nbytes`` of a page-aligned ``buffer`` to one new file + ``fsync``, O_DIRECT and buffered."""

    def __init__(
        self, buffer: mmap.mmap, nbytes: int, directory: str, settle: float = 0.0, source_bytes: int | None = None
    ) -> None:
        if len(buffer) % DIRECT_ALIGNMENT:
            raise ValueError("the write floor's buffer must be a multiple of 4096 bytes long")
        if source_bytes is not None and (source_bytes % WRITE_CHUNK or source_bytes > len(buffer)):
            raise ValueError("source_bytes must be a multiple of 16 MiB within the buffer")
        self.buffer = buffer
        self.nbytes = nbytes
        # ``source_bytes``: the file's bytes come from the first ``source_bytes`` of the buffer,
        # over and over: the floor of a save streamed through a ring of that size (raw O_DIRECT
        # writes of 2 GiB from a 256 MiB buffer once ran 1.3-1.45x slower than from 2 GiB on the
        # 2-core VM; within bench_staging_budget.py the two floors came out alike).
        self.source_bytes = source_bytes
        self.path = os.path.join(directory, "write-floor.bin")
        self.direct_ok = hasattr(os, "O_DIRECT")
        self.settle = settle  # seconds of settle_machine() before each timed write

    def write(self, direct: bool) -> float:
        """Seconds to create the file, write every byte, (truncate,) fsync and close it (after
        :func:`settle_machine`, untimed)."""
        settle_machine(self.settle)
        view = memoryview(self.buffer)
        length = _round_up(self.nbytes, DIRECT_ALIGNMENT) if direct else self.nbytes
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
        started = time.perf_counter()
        fd = os.open(self.path, flags, 0o644)
        try:
            for start in range(0, length, WRITE_CHUNK):
                size = min(WRITE_CHUNK, length - start)
                place = start % self.source_bytes if self.source_bytes else start
                _pwrite_all(fd, view[place : place + size], start)
            if length != self.nbytes:
                os.ftruncate(fd, self.nbytes)
            os.fsync(fd)
        finally:
            os.close(fd)
        seconds = time.perf_counter() - started
        view.release()
        os.remove(self.path)
        return seconds

    def measure(self) -> dict[str, float]:
        """A buffered write, then two ``O_DIRECT`` ones: ``{"buffered": s, "o_direct": the faster
        O_DIRECT, "floor": min}``.  The buffered write goes first: a write right after it is
        slower on this machine, and the caller times a save right after this call, so the last
        write before that save (and before the second ``O_DIRECT`` one) is an ``O_DIRECT`` one."""
        out: dict[str, float] = {"buffered": self.write(False)}
        if self.direct_ok:
            try:
                out["o_direct"] = min(self.write(True), self.write(True))
            except OSError:  # this filesystem has no O_DIRECT
                self.direct_ok = False
        out["floor"] = min(out.values())
        return out


# ---- read ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Extent:
    """One tensor's bytes in a file and the target tensor they go to."""

    offset: int
    target: torch.Tensor


def _safetensors_extents(path: str, targets: Mapping[str, torch.Tensor]) -> list[_Extent]:
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    base = 8 + header_len
    extents = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        target = _byte_view(targets[key])
        if target.numel() != end - begin:
            raise ValueError(f"{path}: {key} has {end - begin} bytes, its target {target.numel()}")
        extents.append(_Extent(base + begin, target))
    return sorted(extents, key=lambda e: e.offset)


class ReadFloor:
    """``preadv`` of safetensors files into preallocated target tensors, one thread or several.

    ``files`` maps each component to its shard paths; ``targets`` maps each component to
    ``{key: tensor}``.  The targets must be contiguous and of the stored dtypes and shapes.
    :meth:`read` uses one thread and one ``preadv`` per run of consecutive tensors; with
    ``threads > 1`` the tensors are cut into 32 MiB slices read by that many threads (several
    I/Os in flight, which a cold disk rewards).
    """

    def __init__(self, files: Mapping[str, list[str]], targets: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        self.plan: list[tuple[str, list[_Extent]]] = [
            (path, _safetensors_extents(path, targets[component]))
            for component, paths in files.items()
            for path in paths
        ]
        self.paths = [path for path, _ in self.plan]
        self.nbytes = sum(e.target.numel() for _, extents in self.plan for e in extents)
        self.slices: list[tuple[str, int, torch.Tensor]] = [
            (path, e.offset + start, e.target[start : start + READ_SLICE])
            for path, extents in self.plan
            for e in extents
            for start in range(0, e.target.numel(), READ_SLICE)
        ]

    def read(self, threads: int = 1) -> None:
        """Fill every target from its file."""
        if threads > 1:
            self._read_threaded(threads)
            return
        for path, extents in self.plan:
            fd = os.open(path, os.O_RDONLY)
            try:
                i = 0
                while i < len(extents):
                    # Consecutive tensors (no gap in the file) go in one preadv call.
                    j, end = i + 1, extents[i].offset + extents[i].target.numel()
                    while j < len(extents) and j - i < IOV_MAX and extents[j].offset == end:
                        end += extents[j].target.numel()
                        j += 1
                    _preadv_all(fd, [memoryview(e.target.numpy()) for e in extents[i:j]], extents[i].offset, path)
                    i = j
            finally:
                os.close(fd)

    def read_direct(self, threads: int = READ_THREADS) -> None:
        """Fill every target with ``O_DIRECT`` reads: each file's data section in aligned 8 MiB
        blocks into per-thread page-aligned buffers, ``threads`` blocks in flight, the bytes of
        each block then copied into the targets it overlaps (``memmove``)."""
        blocks = [
            (path, start, extents)
            for path, extents in self.plan
            if extents
            for start in range(
                extents[0].offset // DIRECT_ALIGNMENT * DIRECT_ALIGNMENT,
                extents[-1].offset + extents[-1].target.numel(),
                DIRECT_BLOCK,
            )
        ]
        fds = {path: os.open(path, os.O_RDONLY | os.O_DIRECT) for path in self.paths}
        local = threading.local()

        def read_block(path: str, start: int, extents: list[_Extent]) -> None:
            buffer = getattr(local, "buffer", None)
            if buffer is None:
                buffer = local.buffer = _anonymous_mapping(DIRECT_BLOCK)
                local.address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
            got = os.preadv(fds[path], [memoryview(buffer)], start)
            end = start + got
            for e in extents:  # the extents overlapping [start, end)
                lo, hi = max(e.offset, start), min(e.offset + e.target.numel(), end)
                if lo < hi:
                    ctypes.memmove(e.target.data_ptr() + lo - e.offset, local.address + lo - start, hi - lo)

        try:
            with ThreadPoolExecutor(threads, thread_name_prefix="read-floor-direct") as pool:
                for future in [pool.submit(read_block, *block) for block in blocks]:
                    future.result()
        finally:
            for fd in fds.values():
                os.close(fd)

    def read_shares(self, threads: int = READ_THREADS) -> None:
        """Fill every target with ``threads`` threads, each reading one contiguous share of the
        bytes (an equal part of the total, cut at share boundaries, at least 32 MiB) as one chain
        of ``preadv`` calls over consecutive tensors: as many I/O streams as threads, each one long
        and sequential (the kernel's readahead streams it), instead of many 32 MiB slices."""
        share = max(READ_SLICE, -(-self.nbytes // threads))
        shares: list[list[tuple[str, int, torch.Tensor]]] = [[]]
        filled = 0
        for path, extents in self.plan:
            for e in extents:
                start = 0
                while start < e.target.numel():
                    if filled >= share:
                        shares.append([])
                        filled = 0
                    piece = e.target[start : start + share - filled]
                    shares[-1].append((path, e.offset + start, piece))
                    filled += piece.numel()
                    start += piece.numel()
        fds = {path: os.open(path, os.O_RDONLY) for path in self.paths}

        def read_share(pieces: list[tuple[str, int, torch.Tensor]]) -> None:
            i = 0
            while i < len(pieces):  # consecutive pieces of one file in one preadv call
                path, offset, piece = pieces[i]
                buffers, end, j = [memoryview(piece.numpy())], offset + piece.numel(), i + 1
                while j < len(pieces) and j - i < IOV_MAX and pieces[j][0] == path and pieces[j][1] == end:
                    buffers.append(memoryview(pieces[j][2].numpy()))
                    end += pieces[j][2].numel()
                    j += 1
                _preadv_all(fds[path], buffers, offset, path)
                i = j

        try:
            with ThreadPoolExecutor(threads, thread_name_prefix="read-floor-shares") as pool:
                for future in [pool.submit(read_share, pieces) for pieces in shares]:
                    future.result()
        finally:
            for fd in fds.values():
                os.close(fd)

    def _read_threaded(self, threads: int) -> None:
        fds = {path: os.open(path, os.O_RDONLY) for path in self.paths}
        try:
            with ThreadPoolExecutor(threads, thread_name_prefix="read-floor") as pool:
                futures = [
                    pool.submit(_preadv_all, fds[path], [memoryview(piece.numpy())], offset, path)
                    for path, offset, piece in self.slices
                ]
                for future in futures:
                    future.result()
        finally:
            for fd in fds.values():
                os.close(fd)

    def measure(self, cold: bool, threads: int = 1, direct: bool = False) -> tuple[float, int]:
        """Seconds of one :meth:`read` (:meth:`read_direct` with ``direct``) and the bytes
        ``/proc/self/io`` says came from the disk."""
        if cold:
            drop_from_page_cache(self.paths)
        before = proc_io()["read_bytes"]
        started = time.perf_counter()
        if direct:
            self.read_direct(threads)
        else:
            self.read(threads)
        seconds = time.perf_counter() - started
        return seconds, proc_io()["read_bytes"] - before


def _preadv_all(fd: int, buffers: list[memoryview], offset: int, path: str) -> None:
    """``preadv`` until every buffer is full."""
    while buffers:
        done = os.preadv(fd, buffers, offset)
        if done <= 0:
            raise OSError(f"{path}: unexpected end of file at {offset}")
        offset += done
        while buffers and done >= len(buffers[0]):
            done -= len(buffers[0])
            buffers.pop(0)
        if done:
            buffers[0] = buffers[0][done:]
