"""Save planning: what every rank holds → shard files → the pieces each rank writes.

Input: each rank's :class:`LocalTensor` descriptions (whole tensors, and pieces of sharded
tensors with their global offsets).  Output: a :class:`SavePlan`, the same on every rank because
it is a pure function of all ranks' descriptions:

* **files**: safetensors shards per component (``model-00001-of-00004.safetensors``), tensors in
  state order, bucketed to at most ``max_shard_size`` bytes.  Within a file, tensors are ordered
  by decreasing item size (as the reference safetensors writer does), which keeps every tensor
  naturally aligned.
* **who writes what**: a replicated tensor is written once, by one of the ranks holding it,
  chosen to balance bytes (contiguous runs, so a rank's writes stay sequential).  The main replica
  of each sharded piece is written by its rank.  When files may be shared (local/POSIX storage)
  and a tensor is sharded by rows only (FSDP's layout), the whole tensor goes into the file and
  each rank writes its row block at its offset (``pwrite``): the result is HF-compatible with no
  consolidation.  Otherwise a piece is stored as its own entry, recorded as a chunk.
* **pieces**: per rank, maximal contiguous byte ranges of files it writes, laid out back to back
  in its staging arena (congruent with the file offset modulo 4096, so typed views stay aligned).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ..dist.sharding import Box, ChunkInfo, validate_sharding
from ..errors import ShardingError
from ..formats.manifest import ChunkRecord, TensorRecord
from ..formats.safetensors import DTYPE_ITEMSIZE, TensorEntry, build_header, dtype_name

__all__ = [
    "ARENA_ALIGNMENT",
    "FilePlan",
    "LocalTensor",
    "Piece",
    "PiecePart",
    "RankPlan",
    "SavePlan",
    "WriteItem",
    "bucket_items",
    "describe_tensors",
    "plan_file",
    "plan_save",
    "shard_file_name",
]

ARENA_ALIGNMENT = 4096


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


@dataclass(frozen=True)
class LocalTensor:
    """What one rank holds of a logical tensor (descriptions only: no data).

    ``offset``/``shape`` place the local piece in the global tensor; ``sharded`` is True for
    pieces of sharded tensors (DTensor / :class:`~ckptd.ShardedTensor`), ``main`` False for
    replicas that must not be written.
    """

    component: str
    key: str
    dtype: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    sharded: bool = False
    main: bool = True
    frozen: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]

    @property
    def is_whole(self) -> bool:
        return self.shape == self.global_shape


@dataclass(frozen=True)
class PiecePart:
    """Part of a piece: the file header, or a rank's local tensor (``component``, ``key``)."""

    offset: int
    nbytes: int
    header: bytes = b""
    component: str = ""
    key: str = ""
    dtype: str = ""
    shape: tuple[int, ...] = ()


@dataclass(frozen=True)
class Piece:
    """A contiguous byte range ``[file_offset, file_offset + size)`` of one file, written by one
    rank from ``arena[arena_offset : arena_offset + size]``."""

    file_name: str
    file_offset: int
    size: int
    arena_offset: int
    parts: tuple[PiecePart, ...]
    whole_file: bool


@dataclass(frozen=True)
class RankPlan:
    """What one rank stages and writes."""

    rank: int
    pieces: tuple[Piece, ...]
    arena_size: int
    signature: tuple[object, ...]

    @property
    def bytes(self) -> int:
        return sum(p.size for p in self.pieces)


@dataclass(frozen=True)
class FilePlan:
    """A shard file: its component, name and size; ``frozen`` when it holds only tensors
    declared unchanged since the previous save (incremental saves may reuse it)."""

    component: str
    file_name: str
    size: int
    frozen: bool = False


@dataclass(frozen=True)
class SavePlan:
    """The plan of one save across all ranks."""

    world_size: int
    files: tuple[FilePlan, ...]
    ranks: tuple[RankPlan, ...]
    tensors: dict[str, dict[str, TensorRecord]] = field(default_factory=dict)
    signature: tuple[object, ...] = ()


def describe_tensors(component: str, tensors: dict[str, torch.Tensor]) -> list[WriteItem]:
    """Write items for whole tensors, in the state's order."""
    return [
        WriteItem(component, key, dtype_name(t.dtype, f"{component}.{key}"), tuple(t.shape))
        for key, t in tensors.items()
    ]


def shard_file_name(component: str, index: int, count: int, extension: str = "safetensors") -> str:
    """HF-style shard name: ``model-00001-of-00003.safetensors``."""
    return f"{component}-{index:05d}-of-{count:05d}.{extension}"


def bucket_items(items: Sequence[WriteItem], max_shard_size: int) -> list[list[WriteItem]]:
    """Split items, in order, into buckets of at most ``max_shard_size`` bytes (an item larger
    than the limit gets a bucket of its own, as HF does).  Always returns at least one bucket."""
    buckets: list[list[WriteItem]] = [[]]
    filled = 0
    for item in items:
        if buckets[-1] and filled + item.nbytes > max_shard_size:
            buckets.append([])
            filled = 0
        buckets[-1].append(item)
        filled += item.nbytes
    return buckets


def _file_order(items: Iterable[WriteItem]) -> list[WriteItem]:
    indexed = list(enumerate(items))
    indexed.sort(key=lambda pair: (-DTYPE_ITEMSIZE[pair[1].dtype], pair[0]))
    return [item for _, item in indexed]


@dataclass(frozen=True)
class FileLayout:
    """A safetensors file's header and the absolute offset of each entry (by entry key)."""

    component: str
    file_name: str
    header: bytes
    items: tuple[WriteItem, ...]
    starts: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.header) + sum(i.nbytes for i in self.items)

    def item_file_offset(self, index: int) -> int:
        return self.starts[index]


def plan_file(component: str, file_name: str, items: Sequence[WriteItem]) -> FileLayout:
    """The layout of one safetensors file holding ``items`` (reordered for alignment)."""
    ordered = _file_order(items)
    entries: list[TensorEntry] = []
    position = 0
    for item in ordered:
        entries.append(TensorEntry(item.key, item.dtype, item.shape, position, position + item.nbytes))
        position += item.nbytes
    header = build_header(entries)
    starts = tuple(len(header) + e.start for e in entries)
    return FileLayout(component, file_name, header, tuple(ordered), starts)


# ---- the global plan ----------------------------------------------------------------------------


@dataclass
class _Logical:
    component: str
    key: str
    dtype: str
    shape: tuple[int, ...]
    holders: list[LocalTensor] = field(default_factory=list)
    holder_ranks: list[int] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class _Entry:
    """A file entry to write: the item, and who writes which bytes of it."""

    item: WriteItem
    writers: tuple[tuple[int, int, int, LocalTensor], ...]  # (rank, byte offset in entry, nbytes, piece)
    chunk_of: str | None = None  # the logical tensor, when this entry is one stored chunk of it


def plan_save(
    locals_by_rank: Sequence[Sequence[LocalTensor]],
    max_shard_size: int,
    *,
    shared_files: bool = True,
    separate_frozen: bool = False,
) -> SavePlan:
    """Plan a save of every rank's tensors (``locals_by_rank[r]`` is rank ``r``'s list).

    ``shared_files`` allows several ranks to write one file (local storage); without it, every
    file has one writer and row-sharded tensors are stored as chunks.  ``separate_frozen`` puts
    frozen tensors in files of their own (after the others), so incremental saves can reuse them.
    """
    world = len(locals_by_rank)
    logical = _logical_tensors(locals_by_rank)
    _validate(logical)
    loads = [0] * world
    whole: list[_Logical] = []
    row_sharded: list[_Logical] = []
    chunked: list[_Logical] = []
    for tensor in logical:
        mains = [t for t in tensor.holders if t.main]
        if not any(t.sharded for t in tensor.holders) or (len(mains) == 1 and mains[0].is_whole):
            whole.append(tensor)
        elif shared_files and all(t.shape[1:] == tensor.shape[1:] for t in mains) and tensor.shape:
            row_sharded.append(tensor)
        else:
            chunked.append(tensor)
        for rank, piece in zip(tensor.holder_ranks, tensor.holders, strict=False):
            if piece.sharded and piece.main and not (len(mains) == 1 and piece.is_whole):
                loads[rank] += piece.nbytes
    owners = _assign_whole(whole, loads, world)

    # Entries, in state order, per component.
    entries_by_component: dict[str, list[_Entry]] = {}
    for tensor in logical:
        bucket = entries_by_component.setdefault(tensor.component, [])
        item = WriteItem(tensor.component, tensor.key, tensor.dtype, tensor.shape)
        if tensor in chunked:
            for rank, piece in zip(tensor.holder_ranks, tensor.holders, strict=False):
                if piece.main:
                    chunk_key = f"{tensor.key}@{','.join(map(str, piece.offset))}"
                    chunk_item = WriteItem(tensor.component, chunk_key, tensor.dtype, piece.shape)
                    bucket.append(_Entry(chunk_item, ((rank, 0, piece.nbytes, piece),), tensor.key))
        elif tensor in row_sharded:
            row = math.prod(tensor.shape[1:]) * DTYPE_ITEMSIZE[tensor.dtype]
            writers = tuple(
                (rank, piece.offset[0] * row, piece.nbytes, piece)
                for rank, piece in zip(tensor.holder_ranks, tensor.holders, strict=False)
                if piece.main
            )
            bucket.append(_Entry(item, writers))
        else:
            rank = owners[(tensor.component, tensor.key)]
            piece = tensor.holders[tensor.holder_ranks.index(rank)]
            bucket.append(_Entry(item, ((rank, 0, item.nbytes, piece),)))

    frozen_keys = {(t.component, t.key) for t in logical if all(h.frozen for h in t.holders)}
    layouts: list[tuple[FileLayout, dict[str, _Entry], bool]] = []
    for component, entries in entries_by_component.items():

        def is_frozen(entry: _Entry, component: str = component) -> bool:
            return (component, entry.chunk_of or entry.item.key) in frozen_keys

        groups: list[tuple[list[_Entry], bool]] = []
        for frozen_group in (False, True) if separate_frozen else (None,):
            members = [e for e in entries if frozen_group is None or is_frozen(e) == frozen_group]
            groups.extend((g, frozen_group is True) for g in _group_entries(members, max_shard_size, shared_files))
        for number, (group, frozen_file) in enumerate(groups, start=1):
            name = shard_file_name(component, number, len(groups))
            layout = plan_file(component, name, [e.item for e in group])
            layouts.append((layout, {e.item.key: e for e in group}, frozen_file))

    parts_by_rank: list[list[tuple[str, int, PiecePart, int]]] = [[] for _ in range(world)]
    tensors: dict[str, dict[str, TensorRecord]] = {}
    files: list[FilePlan] = []
    chunk_records: dict[tuple[str, str], list[ChunkRecord]] = {}
    for layout, by_key, frozen_file in layouts:
        files.append(FilePlan(layout.component, layout.file_name, layout.size, frozen_file))
        first_writer = by_key[layout.items[0].key].writers[0][0] if layout.items else 0
        parts_by_rank[first_writer].append(
            (layout.file_name, 0, PiecePart(0, len(layout.header), header=layout.header), layout.size)
        )
        for index, item in enumerate(layout.items):
            start = layout.item_file_offset(index)
            entry = by_key[item.key]
            for rank, offset, nbytes, piece in entry.writers:
                part = PiecePart(
                    0, nbytes, component=piece.component, key=piece.key, dtype=piece.dtype, shape=piece.shape
                )
                parts_by_rank[rank].append((layout.file_name, start + offset, part, layout.size))
            if entry.chunk_of is not None:
                piece = entry.writers[0][3]
                chunk_records.setdefault((item.component, entry.chunk_of), []).append(
                    ChunkRecord(layout.file_name, start, start + item.nbytes, piece.offset, piece.shape)
                )
            else:
                tensors.setdefault(item.component, {})[item.key] = TensorRecord.whole(
                    item.dtype, item.shape, layout.file_name, start, start + item.nbytes
                )
    for tensor in chunked:
        chunks = sorted(chunk_records[(tensor.component, tensor.key)], key=lambda c: c.offset)
        tensors.setdefault(tensor.component, {})[tensor.key] = TensorRecord(tensor.dtype, tensor.shape, tuple(chunks))
    ordered_tensors = {
        component: {t.key: tensors[component][t.key] for t in logical if t.component == component}
        for component in entries_by_component
    }
    rank_plans = tuple(_rank_plan(rank, parts) for rank, parts in enumerate(parts_by_rank))
    signature = (max_shard_size, shared_files, separate_frozen, tuple(tuple(local) for local in locals_by_rank))
    return SavePlan(world, tuple(files), rank_plans, ordered_tensors, signature)


def _logical_tensors(locals_by_rank: Sequence[Sequence[LocalTensor]]) -> list[_Logical]:
    found: dict[tuple[str, str], _Logical] = {}
    for rank, local in enumerate(locals_by_rank):
        for tensor in local:
            entry = found.get((tensor.component, tensor.key))
            if entry is None:
                entry = _Logical(tensor.component, tensor.key, tensor.dtype, tensor.global_shape)
                found[(tensor.component, tensor.key)] = entry
            entry.holders.append(tensor)
            entry.holder_ranks.append(rank)
    return list(found.values())


def _validate(logical: Sequence[_Logical]) -> None:
    chunks: list[ChunkInfo] = []
    for tensor in logical:
        sharded = any(t.sharded for t in tensor.holders)
        for rank, piece in zip(tensor.holder_ranks, tensor.holders, strict=False):
            if not sharded:
                if (piece.dtype, piece.global_shape) != (tensor.dtype, tensor.shape):
                    raise ShardingError(
                        f"tensor {tensor.component}.{tensor.key!r} is replicated but rank {rank} holds "
                        f"{piece.dtype}{list(piece.global_shape)} while rank {tensor.holder_ranks[0]} holds "
                        f"{tensor.dtype}{list(tensor.shape)}"
                    )
                continue
            if not piece.sharded:
                raise ShardingError(
                    f"tensor {tensor.component}.{tensor.key!r} is sharded on some ranks "
                    f"but a plain tensor on rank {rank}"
                )
            name = f"{tensor.component}.{tensor.key}"
            box = Box(piece.offset, piece.shape)
            chunks.append(ChunkInfo(rank, name, piece.dtype, piece.global_shape, box, piece.main))
    validate_sharding(chunks)


def _assign_whole(whole: Sequence[_Logical], loads: list[int], world: int) -> dict[tuple[str, str], int]:
    """Pick one writer per replicated tensor: contiguous runs per rank, balancing total bytes."""
    owners: dict[tuple[str, str], int] = {}
    if world == 1:
        return {(t.component, t.key): 0 for t in whole}
    total = sum(t.nbytes for t in whole) + sum(loads)
    targets = [max(0, total // world - load) for load in loads]
    assigned = [0] * world
    current = 0
    for tensor in whole:
        holders = sorted(set(tensor.holder_ranks))
        if current in holders and (assigned[current] < targets[current] or current == world - 1):
            rank = current
        elif len(holders) == world:
            while current < world - 1 and assigned[current] >= targets[current]:
                current += 1
            rank = current
        else:
            rank = min(holders, key=lambda r: (loads[r] + assigned[r], r))
        owners[(tensor.component, tensor.key)] = rank
        assigned[rank] += tensor.nbytes
    return owners


def _group_entries(entries: Sequence[_Entry], max_shard_size: int, shared_files: bool) -> list[list[_Entry]]:
    """Bucket entries into files: in state order when files may be shared, else per writer rank."""
    if shared_files:
        groups: list[list[_Entry]] = []
        for bucket in bucket_items([e.item for e in entries], max_shard_size):
            by_key = {e.item.key: e for e in entries}
            groups.append([by_key[i.key] for i in bucket])
        return [g for g in groups if g] or []
    by_rank: dict[int, list[_Entry]] = {}
    for entry in entries:
        by_rank.setdefault(entry.writers[0][0], []).append(entry)
    groups = []
    for rank in sorted(by_rank):
        by_key = {e.item.key: e for e in by_rank[rank]}
        for bucket in bucket_items([e.item for e in by_rank[rank]], max_shard_size):
            groups.append([by_key[i.key] for i in bucket])
    return [g for g in groups if g]


def _rank_plan(rank: int, parts: list[tuple[str, int, PiecePart, int]]) -> RankPlan:
    """Merge a rank's parts into contiguous pieces and lay them out in its arena."""
    parts = sorted(parts, key=lambda p: (p[0], p[1]))
    pieces: list[Piece] = []
    cursor = 0
    run: list[tuple[str, int, PiecePart, int]] = []

    def flush() -> None:
        nonlocal cursor
        if not run:
            return
        file_name, start, _, file_size = run[0]
        end = run[-1][1] + run[-1][2].nbytes
        arena_offset = -(-cursor // ARENA_ALIGNMENT) * ARENA_ALIGNMENT + start % ARENA_ALIGNMENT
        members = tuple(
            PiecePart(offset - start, part.nbytes, part.header, part.component, part.key, part.dtype, part.shape)
            for _, offset, part, _ in run
        )
        pieces.append(Piece(file_name, start, end - start, arena_offset, members, start == 0 and end == file_size))
        cursor = arena_offset + end - start
        run.clear()

    for part in parts:
        if run and (part[0] != run[-1][0] or part[1] != run[-1][1] + run[-1][2].nbytes):
            flush()
        run.append(part)
    flush()
    # The parts (header bytes, component, key, dtype, shape) belong to the signature: an arena laid
    # out for other key names of the same sizes must be laid out again, or it stages stale keys.
    signature = tuple((p.file_name, p.file_offset, p.size, p.arena_offset, p.parts) for p in pieces)
    return RankPlan(rank, tuple(pieces), max(cursor, ARENA_ALIGNMENT), signature)
