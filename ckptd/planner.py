"""Save planning: tensors → shard files → one contiguous arena layout.

The plan is a pure function of the tensors' keys, dtypes and shapes and the shard size limit, so
two saves of the same state layout produce equal plans (and reuse the same staging arena).

Within a file, tensors are ordered by decreasing item size (then by their order in the state), as
the reference safetensors writer does; with the data section starting on an 8-byte boundary this
keeps every tensor naturally aligned, so the arena slot of each tensor is a typed view.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from .formats.safetensors import DTYPE_ITEMSIZE, TensorEntry, build_header, dtype_name

__all__ = [
    "ARENA_FILE_ALIGNMENT",
    "SavePlan",
    "ShardPlan",
    "WriteItem",
    "bucket_items",
    "describe_tensors",
    "layout_signature",
    "plan_file",
    "plan_save",
    "shard_file_name",
]

ARENA_FILE_ALIGNMENT = 4096  # each file starts on a page boundary (O_DIRECT-ready)


@dataclass(frozen=True)
class WriteItem:
    """One tensor to write: where it belongs and what it looks like."""

    component: str
    key: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class ShardPlan:
    """One shard file: its header and items, and where its bytes live in the staging arena.

    ``data_offsets[i]`` is where ``items[i]`` starts in the file's data section; the whole file
    (header included) occupies ``arena[arena_offset : arena_offset + size]``.
    """

    component: str
    file_name: str
    header: bytes
    items: tuple[WriteItem, ...]
    data_offsets: tuple[int, ...]
    arena_offset: int

    @property
    def data_size(self) -> int:
        return sum(item.nbytes for item in self.items)

    @property
    def size(self) -> int:
        return len(self.header) + self.data_size

    def item_arena_offset(self, index: int) -> int:
        """Arena offset of the first byte of ``items[index]``."""
        return self.arena_offset + len(self.header) + self.data_offsets[index]

    def item_file_offset(self, index: int) -> int:
        """File offset of the first byte of ``items[index]``."""
        return len(self.header) + self.data_offsets[index]


@dataclass(frozen=True)
class SavePlan:
    """Every shard of one save, laid out back to back in an arena of ``arena_size`` bytes."""

    shards: tuple[ShardPlan, ...]
    arena_size: int
    signature: tuple[object, ...]

    @property
    def total_bytes(self) -> int:
        return sum(shard.size for shard in self.shards)


def describe_tensors(component: str, tensors: dict[str, torch.Tensor]) -> list[WriteItem]:
    """Write items for a component's tensors, in the state's order."""
    return [
        WriteItem(component, key, dtype_name(t.dtype, f"{component}.{key}"), tuple(t.shape))
        for key, t in tensors.items()
    ]


def shard_file_name(component: str, index: int, count: int, extension: str = "safetensors") -> str:
    """HF-style shard name: ``model-00001-of-00003.safetensors``."""
    return f"{component}-{index:05d}-of-{count:05d}.{extension}"


def bucket_items(items: Sequence[WriteItem], max_shard_size: int) -> list[list[WriteItem]]:
    """Split items, in order, into buckets of at most ``max_shard_size`` bytes.

    A tensor larger than the limit gets a bucket of its own (as HF does).  Always returns at
    least one bucket, so a component without tensors still gets an (empty) shard list entry.
    """
    buckets: list[list[WriteItem]] = [[]]
    filled = 0
    for item in items:
        if buckets[-1] and filled + item.nbytes > max_shard_size:
            buckets.append([])
            filled = 0
        buckets[-1].append(item)
        filled += item.nbytes
    return buckets


def _align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def _file_order(items: Iterable[WriteItem]) -> list[WriteItem]:
    indexed = list(enumerate(items))
    indexed.sort(key=lambda pair: (-DTYPE_ITEMSIZE[pair[1].dtype], pair[0]))
    return [item for _, item in indexed]


def plan_file(component: str, file_name: str, items: Sequence[WriteItem], arena_offset: int = 0) -> ShardPlan:
    """The layout of one safetensors file holding ``items`` (reordered for alignment)."""
    ordered = _file_order(items)
    offsets: list[int] = []
    entries: list[TensorEntry] = []
    position = 0
    for item in ordered:
        offsets.append(position)
        entries.append(TensorEntry(item.key, item.dtype, item.shape, position, position + item.nbytes))
        position += item.nbytes
    return ShardPlan(
        component=component,
        file_name=file_name,
        header=build_header(entries),
        items=tuple(ordered),
        data_offsets=tuple(offsets),
        arena_offset=arena_offset,
    )


def layout_signature(components: Sequence[tuple[str, Sequence[WriteItem]]], max_shard_size: int) -> tuple[object, ...]:
    """What determines a plan: equal signatures give equal plans (and reuse the same arena)."""
    return (max_shard_size, *((name, tuple((i.key, i.dtype, i.shape) for i in items)) for name, items in components))


def plan_save(components: Sequence[tuple[str, Sequence[WriteItem]]], max_shard_size: int) -> SavePlan:
    """Plan the shard files of every component and their layout in the staging arena.

    Components without tensors produce no shard.  Shard names count per component.
    """
    shards: list[ShardPlan] = []
    arena_offset = 0
    for component, items in components:
        if not items:
            continue
        buckets = bucket_items(items, max_shard_size)
        for number, bucket in enumerate(buckets, start=1):
            shard = plan_file(component, shard_file_name(component, number, len(buckets)), bucket, arena_offset)
            shards.append(shard)
            arena_offset = _align(arena_offset + shard.size, ARENA_FILE_ALIGNMENT)
    return SavePlan(
        shards=tuple(shards),
        arena_size=max(arena_offset, ARENA_FILE_ALIGNMENT),
        signature=layout_signature(components, max_shard_size),
    )
