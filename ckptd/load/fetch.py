"""Fetching tensor bytes: from byte ranges of stored chunks straight into destination memory.

Given where each tensor's pieces live (:class:`~ckptd.formats.manifest.TensorRecord`) and where
each requested tensor goes (:class:`Destination`: a fresh tensor, or the caller's tensor, DTensor
or :class:`~ckptd.ShardedTensor`), :func:`plan_requests` computes the byte runs that overlap
each destination and :func:`read_requests` reads them, every component's at once -- local files
through :mod:`.direct` (positional reads from a shared pool, ``O_DIRECT`` for what is not
cached), remote files through their reader's batched, coalesced range requests.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ..dist.sharding import Box, ShardedTensor, describe_dtensor, intersect, is_dtensor, paired_runs
from ..errors import AllocationError, CorruptCheckpointError, KeyMismatchError, StorageError
from ..formats.manifest import TensorRecord
from ..formats.safetensors import DTYPE_ITEMSIZE, MAX_TENSOR_BYTES, shape_fits
from ..formats.torch_dtypes import TORCH_DTYPES, dtype_from_name, dtype_name
from ..storage import RangeReader
from .direct import read_local
from .inline_verify import InlineFile, read_verified
from .to_device import DeviceRequest, read_into_device

DEFAULT_REMOTE_CONCURRENCY = 8
"""Remote files read at once (each with its own ranged GETs in flight)."""

__all__ = [
    "DEFAULT_REMOTE_CONCURRENCY",
    "Destination",
    "empty_tensor",
    "fetch_bin",
    "make_destinations",
    "new_device_tensor",
    "plan_requests",
    "preview",
    "read_requests",
    "tensor_memoryview",
]


def empty_tensor(shape: tuple[int, ...], dtype: torch.dtype, what: str | Callable[[], str]) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` on the CPU for a tensor being loaded, failing as ckptd
    errors naming ``what`` (the tensor and its file; or a function making that text, called only
    for an error): :class:`CorruptCheckpointError` for a shape
    torch cannot describe (:func:`~ckptd.formats.safetensors.shape_fits`), :class:`AllocationError`
    for more bytes than this machine has (RAM and swap: every byte is written by the load, so it
    could never succeed; checked first, because with overcommit an allocation can succeed and the
    kernel kill the process once the bytes arrive) or that the allocator refuses."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > MAX_TENSOR_BYTES or (nbytes == 0 and not shape_fits(shape, dtype.itemsize)):
        raise CorruptCheckpointError(f"{_text(what)}: shape {list(shape)} is beyond any tensor")
    _check_memory(nbytes, what)
    try:
        return torch.empty(shape, dtype=dtype)
    except (RuntimeError, MemoryError) as e:
        raise AllocationError(f"{_text(what)}: cannot allocate {nbytes} bytes for shape {list(shape)} ({e})") from e


def new_device_tensor(key: str, record: TensorRecord, device: torch.device, where: str) -> torch.Tensor:
    """An empty tensor of ``record``'s shape and dtype on a CUDA ``device``, for a load that
    fills it there; errors as :func:`empty_tensor` (an out-of-memory device: ``AllocationError``)."""
    dtype = TORCH_DTYPES.get(record.dtype) or dtype_from_name(record.dtype, f" for tensor {key!r} in {where}")
    nbytes = math.prod(record.shape) * dtype.itemsize
    if nbytes > MAX_TENSOR_BYTES or (nbytes == 0 and not shape_fits(record.shape, dtype.itemsize)):
        what = _describe(key, record, where)
        raise CorruptCheckpointError(f"{what}: shape {list(record.shape)} is beyond any tensor")
    try:
        return torch.empty(record.shape, dtype=dtype, device=device)
    except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        raise AllocationError(
            f"{_describe(key, record, where)}: cannot allocate {nbytes} bytes on {device} for shape "
            f"{list(record.shape)} ({e})"
        ) from e


def _text(what: str | Callable[[], str]) -> str:
    return what if isinstance(what, str) else what()


@functools.cache
def _memory_bytes() -> int | None:
    """RAM plus swap of this machine (``None`` where unknown: then only the allocator decides)."""
    try:
        with open("/proc/meminfo", "rb") as f:
            fields = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
        return sum(int(fields[name].split()[0]) * 1024 for name in (b"MemTotal", b"SwapTotal"))
    except (OSError, KeyError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


_memory_bytes()  # read now, at import: a load opens the checkpoint's files and nothing else


def _check_memory(nbytes: int, what: str | Callable[[], str]) -> None:
    limit = _memory_bytes()
    if limit is not None and nbytes > limit:
        raise AllocationError(
            f"{_text(what)}: loading needs {nbytes} bytes of new memory, more than this machine has ({limit} bytes "
            "of RAM and swap); load fewer keys at once, or into existing tensors"
        )


def make_destinations(
    keys: Iterable[str],
    records: Mapping[str, TensorRecord],
    targets: Mapping[str, Any],
    where: str,
    device_reads: bool = False,
) -> dict[str, Destination]:
    """:meth:`Destination.make` for each key, after checking that the fresh tensors (keys
    without a target) fit this machine together: each one fitting alone is not enough."""
    keys = list(keys)
    if _memory_bytes() is not None:
        sizes = {
            k: math.prod(records[k].shape) * DTYPE_ITEMSIZE.get(records[k].dtype, 1)
            for k in keys
            if targets.get(k) is None
        }
        if len(sizes) > 1:  # (one alone is checked as it is allocated)
            largest = max(sizes, key=sizes.__getitem__)
            _check_memory(sizes[largest], lambda: _describe(largest, records[largest], where))
            _check_memory(sum(sizes.values()), f"{where}: {len(sizes)} tensors (the largest {largest!r})")
    return {key: Destination.make(key, records[key], targets.get(key), where, device_reads) for key in keys}


def tensor_memoryview(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (the tensor must stay alive)."""
    if tensor.numel() == 0:
        return memoryview(bytearray(0))
    buffer = (ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr())
    return memoryview(buffer).cast("B")


@dataclass
class Destination:
    """Where one tensor's bytes land: ``buffer`` (contiguous, stored dtype, ``box`` shape), then
    copied into ``target`` when that is not the buffer itself; ``result`` is what the read
    returns for the key.  ``buffer`` is in host memory, except with ``on_device``: then it is
    the caller's CUDA tensor itself, filled through :mod:`.to_device`."""

    key: str
    box: Box
    buffer: torch.Tensor
    target: torch.Tensor | None
    result: Any
    on_device: bool = False

    @classmethod
    def make(cls, key: str, record: TensorRecord, target: Any, where: str, device_reads: bool = False) -> Destination:
        """``device_reads``: a contiguous CUDA target of the stored dtype is filled in place from
        page-locked memory (the reader reads local files), instead of through a host copy."""
        dtype = TORCH_DTYPES.get(record.dtype) or dtype_from_name(record.dtype, f" for tensor {key!r} in {where}")
        if type(target) is torch.Tensor or type(target) is torch.nn.Parameter:
            # The common case first (a module's or a state dict's own tensor), without the checks
            # for sharded targets below.
            if tuple(target.shape) != tuple(record.shape):
                _target_region(target, record, key, where)  # raises the size mismatch
            if target.dtype == dtype and target.is_contiguous():
                box = Box((0,) * target.dim(), tuple(target.shape))
                if target.device.type == "cpu":
                    return cls(key, box, target, None, target)
                if device_reads and target.device.type == "cuda":
                    return cls(key, box, target, None, target, on_device=True)
        if target is None:
            buffer = empty_tensor(record.shape, dtype, lambda: _describe(key, record, where))
            return cls(key, Box((0,) * len(record.shape), record.shape), buffer, None, buffer)
        local, box, result = _target_region(target, record, key, where)
        if device_reads and local.device.type == "cuda" and local.dtype == dtype and local.is_contiguous():
            return cls(key, box, local, None, result, on_device=True)
        direct = local.device.type == "cpu" and local.dtype == dtype and local.is_contiguous()
        buffer = local if direct else empty_tensor(box.shape, dtype, lambda: _describe(key, record, where))
        return cls(key, box, buffer, None if direct else local, result)

    def finish(self) -> Any:
        if self.target is not None:
            with torch.no_grad():
                self.target.copy_(self.buffer)
        return self.result


def _describe(key: str, record: TensorRecord, where: str) -> str:
    """``<where>: tensor 'key' (file)`` for messages."""
    files = sorted(record.files)
    return f"{where}: tensor {key!r} ({files[0] if len(files) == 1 else f'{len(files)} files'})"


def _target_region(target: Any, record: TensorRecord, key: str, where: str) -> tuple[torch.Tensor, Box, Any]:
    """``(local tensor, its box in the global tensor, value to return)`` of a load target."""
    result: Any = target
    if isinstance(target, ShardedTensor):
        if target.data is None:
            raise KeyMismatchError(f"sharded target {key!r} has no data to load into")
        local, global_shape, offset = target.local_view(), target.global_shape, target.box.offset
    elif is_dtensor(target):
        local, global_shape, offset, _ = describe_dtensor(target)
    elif isinstance(target, torch.Tensor):
        local, global_shape, offset = target, tuple(target.shape), (0,) * target.dim()
    else:
        raise KeyMismatchError(f"cannot load {key!r} into a {type(target).__name__}")
    if tuple(global_shape) != tuple(record.shape):
        raise KeyMismatchError(
            f"size mismatch for {key!r}: checkpoint {where} has shape {tuple(record.shape)}, "
            f"the target has {tuple(global_shape)}"
        )
    return local, Box(tuple(offset), tuple(local.shape)), result


def plan_requests(
    records: Mapping[str, TensorRecord], destinations: Mapping[str, Destination], where: str
) -> tuple[dict[str, list[tuple[int, memoryview]]], dict[str, list[DeviceRequest]]]:
    """``({file: [(offset, buffer), ...]}, {file: [(offset, device bytes), ...]})``: for every
    destination, the byte runs of each stored chunk overlapping it, into host memory, or into
    the CUDA tensor of an ``on_device`` destination (``where`` names the checkpoint in errors)."""
    requests: dict[str, list[tuple[int, memoryview]]] = {}
    device_requests: dict[str, list[DeviceRequest]] = {}
    for key, destination in destinations.items():
        if destination.on_device:
            flat = destination.buffer.detach().reshape(-1).view(torch.uint8)
            for file_name, offset, start, size in _byte_runs(records[key], destination, key, where):
                device_requests.setdefault(file_name, []).append((offset, flat[start : start + size]))
            continue
        view = tensor_memoryview(destination.buffer)
        for file_name, offset, start, size in _byte_runs(records[key], destination, key, where):
            requests.setdefault(file_name, []).append((offset, view[start : start + size]))
    return requests, device_requests


def _byte_runs(
    record: TensorRecord, destination: Destination, key: str, where: str
) -> Iterable[tuple[str, int, int, int]]:
    """``(file, offset in it, offset in the destination's bytes, bytes)`` of every stored run
    that lands in ``destination``."""
    if record.is_whole and destination.box.shape == record.shape:
        # The common case: the whole stored tensor into a whole destination, one run.
        if record.nbytes:
            chunk = record.chunks[0]
            yield chunk.file, chunk.start, 0, record.nbytes
        return
    itemsize = DTYPE_ITEMSIZE[record.dtype]
    covered = 0
    for chunk in record.chunks:
        chunk_box = Box(chunk.offset, chunk.shape)
        overlap = intersect(chunk_box, destination.box)
        if overlap is None or overlap.numel == 0:
            continue
        covered += overlap.numel
        for src, dst, length in paired_runs(chunk_box, destination.box, overlap):
            yield chunk.file, chunk.start + src * itemsize, dst * itemsize, length * itemsize
    if covered != destination.box.numel:
        raise CorruptCheckpointError(
            f"{where}: the stored pieces of {key!r} cover {covered} of the {destination.box.numel} elements asked for"
        )


def read_requests(
    requests: Mapping[str, list[tuple[int, memoryview]]],
    open_file: Callable[[str], RangeReader],
    path_of: Callable[[str], str],
    *,
    local: bool,
    concurrency: int = DEFAULT_REMOTE_CONCURRENCY,
    opened: Callable[[], None] | None = None,
    device_requests: Mapping[str, list[DeviceRequest]] | None = None,
    inline: Mapping[str, tuple[int, str]] | None = None,
) -> None:
    """Fill ``{file: [(offset, buffer), ...]}`` requests (several components' at once), and
    ``device_requests`` (``{file: [(offset, CUDA byte tensor), ...]}``; local files only) through
    :func:`~ckptd.load.to_device.read_into_device`.

    Every file is opened with ``open_file`` first, and its size checked against the furthest
    byte asked for; then ``opened()`` is called, before a byte is read (a reader checks there
    that the files it opened are of the version it began with: it raises if not, and no byte
    lands in a target).  Local files are then read by :func:`~ckptd.load.direct.read_local`
    (positional reads from the read pool, ``O_DIRECT`` for what is not in the page cache);
    remote files are read ``concurrency`` at once, each reader coalescing and parallelising its
    own ranges.  ``inline``: ``{file: (size, CRC32C)}`` of local files with host requests to read
    whole and check as they are read (:func:`~ckptd.load.inline_verify.read_verified`).
    """
    device_requests = device_requests or {}
    if device_requests and not local:
        raise ValueError("reads straight into CUDA tensors are planned for local files only")
    ends: dict[str, int] = {}
    for file_name, wanted in requests.items():
        ends[file_name] = max((offset + len(buffer) for offset, buffer in wanted), default=0)
    for file_name, spans in device_requests.items():
        end = max((offset + span.numel() for offset, span in spans), default=0)
        ends[file_name] = max(ends.get(file_name, 0), end)
    readers: dict[str, RangeReader] = {}
    try:
        for file_name, end in sorted(ends.items()):
            reader = readers[file_name] = open_file(file_name)
            if end > reader.size:
                raise CorruptCheckpointError(
                    f"{path_of(file_name)}: file is truncated: {end} bytes needed, the file has {reader.size}"
                )
        if opened is not None:
            opened()
        if local:
            # Through the descriptors opened above (in the checkpoint directory the load pinned),
            # never by name again: every byte comes from the version whose sizes were checked.
            inline = inline or {}
            jobs = [(readers[name], wanted) for name, wanted in sorted(requests.items()) if name not in inline]
            checked = [
                InlineFile(readers[name], size, crc, path_of(name), requests[name])
                for name, (size, crc) in sorted(inline.items())
            ]
            device_jobs = [(readers[file_name], spans) for file_name, spans in sorted(device_requests.items())]
            try:
                read_local(jobs)
                read_verified(checked)
                if device_jobs:
                    read_into_device(device_jobs, read_local)
            except StorageError as e:
                raise CorruptCheckpointError(f"cannot read tensors: {e}") from e
            return

        def task(file_name: str, wanted: list[tuple[int, memoryview]]) -> Callable[[], None]:
            def run() -> None:
                try:
                    readers[file_name].read_many(wanted)
                except StorageError as e:
                    raise CorruptCheckpointError(f"{path_of(file_name)}: cannot read tensors: {e}") from e

            return run

        # Remote files: one task per file, several files at once; each reader coalesces its
        # ranges into ranged GETs of up to 64 MiB, fetched concurrently.  (Cutting them into
        # 16 MiB GETs, 8 in flight, as boto3's parallel downloads do, was 1.4-1.7x slower
        # against the loopback server of benchmarks/bench_s3.py: more requests, same bytes.)
        tasks = [task(file_name, wanted) for file_name, wanted in sorted(requests.items())]
        if len(tasks) <= 1 or concurrency <= 1:
            for run in tasks:
                run()
        else:
            with ThreadPoolExecutor(min(concurrency, len(tasks)), thread_name_prefix="ckptd-get") as pool:
                futures = [pool.submit(run) for run in tasks]
                errors = [f.exception() for f in futures]
            first = next((e for e in errors if e is not None), None)
            if first is not None:
                raise first
    finally:
        for reader in readers.values():
            reader.close()


def fetch_bin(
    files: list[str],
    keys: list[str],
    targets: Mapping[str, Any],
    load: Callable[[str], dict[str, torch.Tensor]],
    *,
    where: str,
) -> dict[str, Destination]:
    """Destinations for ``keys`` filled from PyTorch ``.bin`` shards (``load(name)`` reads one
    whole; ``.bin`` files have no byte ranges to fetch)."""
    out: dict[str, Destination] = {}
    wanted = set(keys)
    for file_name in files:
        for key, tensor in load(file_name).items():
            if key not in wanted:
                continue
            record = TensorRecord.whole(dtype_name(tensor.dtype, key), tuple(tensor.shape), file_name, 0, 0)
            destination = Destination.make(key, record, targets.get(key), where)
            with torch.no_grad():
                destination.buffer.copy_(tensor[destination.box.slices()])
            out[key] = destination
    absent = wanted - set(out)
    if absent:
        raise CorruptCheckpointError(f"{where}: index lists {preview(sorted(absent))} but the shards lack them")
    return out


def preview(keys: list[str], limit: int = 5) -> str:
    """``'a', 'b' and 3 more`` for error messages (``none`` for no keys)."""
    if not keys:
        return "none"
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")
