"""One safetensors file's layout: write items, bucketing into shards, entry order and header.

Shared by the save planner (:mod:`ckptd.save.plan`) and by the synchronous writers of the
seed-compatible API and of ``consolidate``: items are cut, in state order, into shards of at most
``max_shard_size`` bytes, and ordered inside a file by decreasing item size (as the reference
safetensors writer does), which keeps every tensor naturally aligned.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from ..formats.safetensors import DTYPE_ITEMSIZE, header_bytes
from ..formats.torch_dtypes import dtype_name

__all__ = [
    "FileLayout",
    "WriteItem",
    "bucket_items",
    "buckets",
    "describe_tensors",
    "file_offsets",
    "file_order",
    "lay_out",
    "plan_file",
]

_T = TypeVar("_T")


@dataclass(frozen=True)
class WriteItem:
    """An entry of a shard file: its key in the file, dtype and shape."""

    component: str
    key: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]


def describe_tensors(component: str, tensors: dict[str, torch.Tensor]) -> list[WriteItem]:
    """Write items for whole tensors, in the state's order."""
    return [
        WriteItem(component, key, dtype_name(t.dtype, f"{component}.{key}"), tuple(t.shape))
        for key, t in tensors.items()
    ]


def bucket_items(items: Sequence[WriteItem], max_shard_size: int) -> list[list[WriteItem]]:
    """Split items, in order, into buckets of at most ``max_shard_size`` bytes (an item larger
    than the limit gets a bucket of its own, as HF does).  Always returns at least one bucket."""
    return buckets(items, [item.nbytes for item in items], max_shard_size)


def buckets(values: Sequence[_T], sizes: Sequence[int], limit: int) -> list[list[_T]]:
    """``values`` cut, in order, into runs whose ``sizes`` add up to at most ``limit`` (a value
    larger than the limit gets a run of its own); at least one run, possibly empty."""
    buckets: list[list[_T]] = [[]]
    filled = 0
    for value, size in zip(values, sizes, strict=True):
        if filled + size > limit and buckets[-1]:
            buckets.append([])
            filled = 0
        buckets[-1].append(value)
        filled += size
    return buckets


def file_order(itemsizes: Sequence[int]) -> list[int]:
    """Indices of a file's entries in file order: decreasing item size, state order within one
    item size (a stable sort, in C: no Python call per entry)."""
    return sorted(range(len(itemsizes)), key=itemsizes.__getitem__, reverse=True)


def file_offsets(
    keys: Sequence[str], dtypes: Sequence[str], shapes: Sequence[tuple[int, ...]], sizes: Sequence[int]
) -> tuple[bytes, list[int], int]:
    """The header, absolute start offsets and file size of entries already in file order
    (columns: the entries' keys, dtypes, shapes and byte counts).  One pass, no per-entry record."""
    ends = list(itertools.accumulate(sizes))
    begins = [0, *ends[:-1]] if ends else []
    header = header_bytes(zip(keys, dtypes, shapes, begins, ends, strict=True))
    data_start = len(header)
    return header, [data_start + begin for begin in begins], data_start + (ends[-1] if ends else 0)


@dataclass(frozen=True)
class FileLayout:
    """A safetensors file's header and the absolute offset of each entry (by entry key)."""

    component: str
    file_name: str
    header: bytes
    items: tuple[WriteItem, ...]
    starts: tuple[int, ...]
    size: int

    def item_file_offset(self, index: int) -> int:
        return self.starts[index]


def plan_file(component: str, file_name: str, items: Sequence[WriteItem]) -> FileLayout:
    """The layout of one safetensors file holding ``items`` (reordered for alignment)."""
    ordered, header, starts, size = lay_out(items)
    return FileLayout(component, file_name, header, tuple(ordered), starts, size)


def lay_out(items: Sequence[WriteItem]) -> tuple[list[WriteItem], bytes, tuple[int, ...], int]:
    """Order ``items`` for one file; their header, absolute start offsets and the file size."""
    order = file_order([DTYPE_ITEMSIZE[item.dtype] for item in items])
    ordered = [items[i] for i in order]
    header, starts, size = file_offsets(
        [item.key for item in ordered],
        [item.dtype for item in ordered],
        [item.shape for item in ordered],
        [item.nbytes for item in ordered],
    )
    return ordered, header, tuple(starts), size
