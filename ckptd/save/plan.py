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

import contextlib
import gc
import math
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ..dist.sharding import Box, ChunkInfo, validate_sharding
from ..errors import ShardingError
from ..formats.manifest import ChunkRecord, TensorRecord
from ..formats.names import shard_file_name
from ..formats.safetensors import DTYPE_ITEMSIZE
from .layout import WriteItem, bucket_items, buckets, describe_tensors, lay_out, plan_file

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
]

ARENA_ALIGNMENT = 4096


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


# ---- the global plan ----------------------------------------------------------------------------


class _Logical:
    """A logical tensor and every rank's piece of it (mutable scratch of one planning run)."""

    __slots__ = ("component", "dtype", "holder_ranks", "holders", "key", "layout", "owner", "shape")

    def __init__(self, component: str, key: str, dtype: str, shape: tuple[int, ...]) -> None:
        self.component = component
        self.key = key
        self.dtype = dtype
        self.shape = shape
        self.holders: list[LocalTensor] = []
        self.holder_ranks: list[int] = []
        self.layout = ""  # "whole", "rows" (row blocks of one file entry) or "chunks" (one entry per piece)
        self.owner = -1  # the rank that writes a whole tensor

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]


class _Entry(NamedTuple):
    """A file entry to write, and who writes which bytes of it (a named tuple: there is one per
    tensor, and planning 100,000 tensors must stay well under a second)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    writers: tuple[tuple[int, int, int, LocalTensor], ...]  # (rank, byte offset in entry, nbytes, piece)
    chunk_of: str | None  # the logical tensor, when this entry is one stored chunk of it


# A rank's byte range of a file: (file name, file offset, byte count, header bytes or the local
# tensor whose bytes go there, file size).
_Part = tuple[str, int, int, "bytes | LocalTensor", int]


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
    Time is O(n log n) in the number of tensors (the sorts); everything else is linear.
    """
    with _cyclic_gc_paused():
        return _plan_save(locals_by_rank, max_shard_size, shared_files, separate_frozen)


@contextlib.contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (reference counting still frees everything).

    Planning allocates a few records per tensor and none of them forms a reference cycle, but
    each allocation counts towards the collector's thresholds: with 100,000 tensors its passes
    over the growing heap took as long as the planning itself.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _plan_save(
    locals_by_rank: Sequence[Sequence[LocalTensor]],
    max_shard_size: int,
    shared_files: bool,
    separate_frozen: bool,
) -> SavePlan:
    world = len(locals_by_rank)
    logical = _logical_tensors(locals_by_rank)
    _validate(logical)
    loads = [0] * world
    whole: list[_Logical] = []
    chunked: list[_Logical] = []
    for tensor in logical:
        holders = tensor.holders
        if len(holders) == 1 and not holders[0].sharded:
            tensor.layout = "whole"  # the common case, decided without the general tests below
            whole.append(tensor)
            continue
        mains = [t for t in holders if t.main]
        if not any(t.sharded for t in holders) or (len(mains) == 1 and mains[0].is_whole):
            tensor.layout = "whole"
            whole.append(tensor)
        elif shared_files and all(t.shape[1:] == tensor.shape[1:] for t in mains) and tensor.shape:
            tensor.layout = "rows"
        else:
            tensor.layout = "chunks"
            chunked.append(tensor)
        for rank, piece in zip(tensor.holder_ranks, holders, strict=True):
            if piece.sharded and piece.main and not (len(mains) == 1 and piece.is_whole):
                loads[rank] += piece.nbytes
    _assign_whole(whole, loads, world)

    # Entries, in state order, per component.
    entries_by_component: dict[str, list[_Entry]] = {}
    for tensor in logical:
        bucket = entries_by_component.get(tensor.component)
        if bucket is None:
            bucket = entries_by_component[tensor.component] = []
        if tensor.layout == "chunks":
            for rank, piece in zip(tensor.holder_ranks, tensor.holders, strict=True):
                if piece.main:
                    chunk_key = f"{tensor.key}@{','.join(map(str, piece.offset))}"
                    nbytes = piece.nbytes
                    writers = ((rank, 0, nbytes, piece),)
                    bucket.append(_Entry(chunk_key, tensor.dtype, piece.shape, nbytes, writers, tensor.key))
        elif tensor.layout == "rows":
            row = math.prod(tensor.shape[1:]) * DTYPE_ITEMSIZE[tensor.dtype]
            writers = tuple(
                (rank, piece.offset[0] * row, piece.nbytes, piece)
                for rank, piece in zip(tensor.holder_ranks, tensor.holders, strict=True)
                if piece.main
            )
            bucket.append(_Entry(tensor.key, tensor.dtype, tensor.shape, tensor.nbytes, writers, None))
        else:
            rank = tensor.owner
            piece = tensor.holders[0] if world == 1 else tensor.holders[tensor.holder_ranks.index(rank)]
            nbytes = tensor.nbytes
            bucket.append(_Entry(tensor.key, tensor.dtype, tensor.shape, nbytes, ((rank, 0, nbytes, piece),), None))

    # Files: per component, entries bucketed into shards (frozen tensors apart when asked).
    frozen_keys = (
        {(t.component, t.key) for t in logical if all(h.frozen for h in t.holders)} if separate_frozen else set()
    )
    files: list[FilePlan] = []
    parts_by_rank: list[list[_Part]] = [[] for _ in range(world)]
    tensors: dict[str, dict[str, TensorRecord]] = {}
    chunk_records: dict[tuple[str, str], list[ChunkRecord]] = {}
    for component, entries in entries_by_component.items():
        groups: list[tuple[list[_Entry], bool]] = []
        if separate_frozen:
            for frozen_group in (False, True):
                members = [e for e in entries if ((component, e.chunk_of or e.key) in frozen_keys) == frozen_group]
                groups.extend((g, frozen_group) for g in _group_entries(members, max_shard_size, shared_files))
        else:
            groups.extend((g, False) for g in _group_entries(entries, max_shard_size, shared_files))
        records = tensors.setdefault(component, {})
        for number, (group, frozen_file) in enumerate(groups, start=1):
            file_name = shard_file_name(component, number, len(groups))
            ordered, header, starts, file_size = lay_out(group)
            files.append(FilePlan(component, file_name, file_size, frozen_file))
            first_writer = ordered[0].writers[0][0] if ordered else 0
            parts_by_rank[first_writer].append((file_name, 0, len(header), header, file_size))
            for entry, start in zip(ordered, starts, strict=True):
                for rank, offset, nbytes, piece in entry.writers:
                    parts_by_rank[rank].append((file_name, start + offset, nbytes, piece, file_size))
                end = start + entry.nbytes
                if entry.chunk_of is not None:
                    piece = entry.writers[0][3]
                    chunk_records.setdefault((component, entry.chunk_of), []).append(
                        ChunkRecord(file_name, start, end, piece.offset, piece.shape)
                    )
                else:
                    records[entry.key] = TensorRecord.whole(entry.dtype, entry.shape, file_name, start, end)
    for tensor in chunked:
        chunks = sorted(chunk_records[(tensor.component, tensor.key)], key=lambda c: c.offset)
        tensors[tensor.component][tensor.key] = TensorRecord(tensor.dtype, tensor.shape, tuple(chunks))
    ordered_tensors: dict[str, dict[str, TensorRecord]] = {component: {} for component in entries_by_component}
    for tensor in logical:
        ordered_tensors[tensor.component][tensor.key] = tensors[tensor.component][tensor.key]
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
        if len(tensor.holders) == 1 and not tensor.holders[0].sharded:
            continue  # one plain tensor on one rank: nothing to compare
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


def _assign_whole(whole: Sequence[_Logical], loads: list[int], world: int) -> None:
    """Pick one writer (``owner``) per replicated tensor: contiguous runs per rank, balancing
    total bytes."""
    if world == 1:
        for tensor in whole:
            tensor.owner = 0
        return
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
        tensor.owner = rank
        assigned[rank] += tensor.nbytes


def _group_entries(entries: Sequence[_Entry], max_shard_size: int, shared_files: bool) -> list[list[_Entry]]:
    """Bucket entries into files: in state order when files may be shared, else per writer rank."""
    if shared_files:
        runs = [list(entries)]
    else:
        by_rank: dict[int, list[_Entry]] = {}
        for entry in entries:
            by_rank.setdefault(entry.writers[0][0], []).append(entry)
        runs = [by_rank[rank] for rank in sorted(by_rank)]
    return [g for run in runs for g in buckets(run, [e.nbytes for e in run], max_shard_size) if g]


def _rank_plan(rank: int, parts: list[_Part]) -> RankPlan:
    """Merge a rank's parts into contiguous pieces and lay them out in its arena."""
    parts = sorted(parts, key=operator.itemgetter(0, 1))  # by file, then offset (stable)
    pieces: list[Piece] = []
    cursor = 0
    first = 0
    for index in range(1, len(parts) + 1):
        if index < len(parts):
            previous, part = parts[index - 1], parts[index]
            if part[0] == previous[0] and part[1] == previous[1] + previous[2]:
                continue
        run = parts[first:index]
        first = index
        file_name, start, _, _, file_size = run[0]
        end = run[-1][1] + run[-1][2]
        arena_offset = -(-cursor // ARENA_ALIGNMENT) * ARENA_ALIGNMENT + start % ARENA_ALIGNMENT
        pieces.append(
            Piece(
                file_name,
                start,
                end - start,
                arena_offset,
                tuple([_piece_part(offset - start, nbytes, what) for _, offset, nbytes, what, _ in run]),
                start == 0 and end == file_size,
            )
        )
        cursor = arena_offset + end - start
    # The parts (header bytes, component, key, dtype, shape) belong to the signature: an arena laid
    # out for other key names of the same sizes must be laid out again, or it stages stale keys.
    signature = tuple((p.file_name, p.file_offset, p.size, p.arena_offset, p.parts) for p in pieces)
    return RankPlan(rank, tuple(pieces), max(cursor, ARENA_ALIGNMENT), signature)


def _piece_part(offset: int, nbytes: int, what: bytes | LocalTensor) -> PiecePart:
    if isinstance(what, bytes):
        return PiecePart(offset, nbytes, what)
    return PiecePart(offset, nbytes, b"", what.component, what.key, what.dtype, what.shape)
