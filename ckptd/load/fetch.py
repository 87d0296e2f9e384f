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
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ..dist.sharding import Box, ShardedTensor, describe_dtensor, intersect, is_dtensor, paired_runs
from ..errors import CorruptCheckpointError, KeyMismatchError, StorageError
from ..formats.manifest import TensorRecord
from ..formats.safetensors import DTYPE_ITEMSIZE
from ..formats.torch_dtypes import TORCH_DTYPES, dtype_from_name, dtype_name
from ..storage import RangeReader
from .direct import read_local

DEFAULT_REMOTE_CONCURRENCY = 8
"""Remote files read at once (each with its own ranged GETs in flight)."""

__all__ = [
    "DEFAULT_REMOTE_CONCURRENCY",
    "Destination",
    "fetch_bin",
    "plan_requests",
    "preview",
    "read_requests",
    "tensor_memoryview",
]


def tensor_memoryview(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (the tensor must stay alive)."""
    if tensor.numel() == 0:
        return memoryview(bytearray(0))
    buffer = (ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr())
    return memoryview(buffer).cast("B")


@dataclass
class Destination:
    """Where one tensor's bytes land: ``buffer`` (contiguous, CPU, stored dtype, ``box`` shape),
    then copied into ``target`` when that is not the buffer itself; ``result`` is what the read
    returns for the key."""

    key: str
    box: Box
    buffer: torch.Tensor
    target: torch.Tensor | None
    result: Any

    @classmethod
    def make(cls, key: str, record: TensorRecord, target: Any, where: str) -> Destination:
        dtype = TORCH_DTYPES.get(record.dtype) or dtype_from_name(record.dtype, f" for tensor {key!r} in {where}")
        if type(target) is torch.Tensor or type(target) is torch.nn.Parameter:
            # The common case first (a module's or a state dict's own tensor), without the checks
            # for sharded targets below.
            if tuple(target.shape) != tuple(record.shape):
                _target_region(target, record, key, where)  # raises the size mismatch
            if target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous():
                return cls(key, Box((0,) * target.dim(), tuple(target.shape)), target, None, target)
        if target is None:
            buffer = torch.empty(record.shape, dtype=dtype)
            return cls(key, Box((0,) * len(record.shape), record.shape), buffer, None, buffer)
        local, box, result = _target_region(target, record, key, where)
        direct = local.device.type == "cpu" and local.dtype == dtype and local.is_contiguous()
        buffer = local if direct else torch.empty(box.shape, dtype=dtype)
        return cls(key, box, buffer, None if direct else local, result)

    def finish(self) -> Any:
        if self.target is not None:
            with torch.no_grad():
                self.target.copy_(self.buffer)
        return self.result


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
) -> dict[str, list[tuple[int, memoryview]]]:
    """``{file: [(offset, buffer), ...]}``: for every destination, the byte runs of each stored
    chunk overlapping it (``where`` names the checkpoint in errors)."""
    requests: dict[str, list[tuple[int, memoryview]]] = {}
    for key, destination in destinations.items():
        record = records[key]
        itemsize = DTYPE_ITEMSIZE[record.dtype]
        view = tensor_memoryview(destination.buffer)
        covered = 0
        if record.is_whole and destination.box.shape == record.shape:
            # The common case: the whole stored tensor into a whole destination, one run.
            if record.nbytes:
                chunk = record.chunks[0]
                requests.setdefault(chunk.file, []).append((chunk.start, view[: record.nbytes]))
            continue
        for chunk in record.chunks:
            chunk_box = Box(chunk.offset, chunk.shape)
            overlap = intersect(chunk_box, destination.box)
            if overlap is None or overlap.numel == 0:
                continue
            covered += overlap.numel
            for src, dst, length in paired_runs(chunk_box, destination.box, overlap):
                requests.setdefault(chunk.file, []).append(
                    (chunk.start + src * itemsize, view[dst * itemsize : (dst + length) * itemsize])
                )
        if covered != destination.box.numel:
            raise CorruptCheckpointError(
                f"{where}: the stored pieces of {key!r} cover {covered} of the "
                f"{destination.box.numel} elements asked for"
            )
    return requests


def read_requests(
    requests: Mapping[str, list[tuple[int, memoryview]]],
    open_file: Callable[[str], RangeReader],
    path_of: Callable[[str], str],
    *,
    local: bool,
    concurrency: int = DEFAULT_REMOTE_CONCURRENCY,
) -> None:
    """Fill ``{file: [(offset, buffer), ...]}`` requests (several components' at once).

    Every file is opened with ``open_file`` first, and its size checked against the furthest
    byte asked for.  Local files are then read by :func:`~ckptd.load.direct.read_local`
    (positional reads from the read pool, ``O_DIRECT`` for what is not in the page cache);
    remote files are read ``concurrency`` at once, each reader coalescing and parallelising its
    own ranges.
    """
    readers: dict[str, RangeReader] = {}
    try:
        for file_name, wanted in sorted(requests.items()):
            reader = readers[file_name] = open_file(file_name)
            end = max((offset + len(buffer) for offset, buffer in wanted), default=0)
            if end > reader.size:
                raise CorruptCheckpointError(
                    f"{path_of(file_name)}: file is truncated: {end} bytes needed, the file has {reader.size}"
                )
        if local:
            for reader in readers.values():
                reader.close()
            jobs = [(path_of(file_name), wanted) for file_name, wanted in sorted(requests.items())]
            try:
                read_local(jobs)
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
