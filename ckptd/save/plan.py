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

This module is longer than 450 lines on purpose: planning runs before the first save returns, once
per tensor, so plain tensors take a fast path of parallel lists and plain tuples; the sharded path,
the records both produce and the passes they share are kept together so the two cannot drift.
"""

from __future__ import annotations

import contextlib
import gc
import math
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, NamedTuple

from ..dist.coverage import ChunkInfo, validate_sharding
from ..dist.grid import Grid
from ..dist.sharding import Box
from ..errors import ConfigError, ShardingError
from ..formats.manifest import ChunkRecord, TensorRecord, zero_offset
from ..formats.names import shard_file_name, spread_file_name
from ..formats.safetensors import DTYPE_ITEMSIZE
from ..options import KEY_LAYOUTS
from .layout import WriteItem, bucket_items, buckets, describe_tensors, file_offsets, plan_file

if TYPE_CHECKING:
    from .plan_unique import ClassPlan

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
    replicas that must not be written.  ``grid`` (DTensors on shared-file storage) says the
    tensor's layout on every rank of its mesh: the description is then the same on all of them
    but for ``offset``/``shape``/``main``, which stay this rank's own and are left out of the
    layout digest (see :mod:`~ckptd.save.exchange`).
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
    grid: Grid | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]

    @property
    def is_whole(self) -> bool:
        return self.shape == self.global_shape

    @classmethod
    def whole(cls, component: str, key: str, dtype: str, shape: tuple[int, ...], frozen: bool) -> LocalTensor:
        """``LocalTensor(component, key, dtype, shape, (0,) * len(shape), shape, frozen=frozen)``,
        the description of an unsharded tensor.  There is one per tensor (a warm save reuses
        them), so its fields are filled in at once: 0.7 µs per call here, against 1.6 µs with an
        ``object.__setattr__`` per field and 1.8 µs through the frozen ``__init__``."""
        record = _new_record(cls)
        vars(record).update(
            component=component,
            key=key,
            dtype=dtype,
            global_shape=shape,
            offset=zero_offset(len(shape)),
            shape=shape,
            sharded=False,
            main=True,
            frozen=frozen,
            grid=None,
        )
        return record


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
    """The plan of one save across all ranks.

    ``class_plans[r]``, when set, is the :class:`~ckptd.save.plan_unique.ClassPlan` rank ``r``
    derives its own plan from (symbolic grid descriptions); ``ranks[r]`` is then only a stand-in
    listing the pieces of its class.  Empty when every rank's plan is in ``ranks``.
    """

    world_size: int
    files: tuple[FilePlan, ...]
    ranks: tuple[RankPlan, ...]
    tensors: dict[str, dict[str, TensorRecord]] = field(default_factory=dict)
    signature: tuple[object, ...] = ()
    class_plans: tuple[ClassPlan | None, ...] = ()


# ---- the global plan ----------------------------------------------------------------------------
#
# Planning runs before the first ``async_save`` returns, once per tensor of every rank: 100,000
# tensors must plan in well under a second.  So the common case (a plain tensor, held whole by
# one or more ranks) is carried by the index of its first holder into a few parallel lists, and
# file entries and a rank's parts are plain tuples; only tensors with sharded pieces get a
# :class:`_Logical` with every piece.  Each step is one pass in logical order; the sorts (file
# order, a rank's parts by offset) are C sorts.


class _Logical:
    """A sharded tensor and every rank's piece of it (mutable scratch of one planning run)."""

    __slots__ = ("component", "dtype", "holder_ranks", "holders", "key", "layout", "shape")

    def __init__(self, first: LocalTensor, rank: int) -> None:
        self.component = first.component
        self.key = first.key
        self.dtype = first.dtype
        self.shape = first.global_shape
        self.holders: list[LocalTensor] = [first]
        self.holder_ranks: list[int] = [rank]
        self.layout = ""  # "whole", "rows" (row blocks of one file entry) or "chunks" (one entry per piece)


class _Gathered(NamedTuple):
    """Every rank's tensors by logical tensor (index ``i``: first appearance, rank by rank)."""

    firsts: list[LocalTensor]  # the first holder of each logical tensor
    masks: list[int]  # bit r set when rank r holds a piece
    frozen: list[bool]  # every holder declared it frozen
    general: dict[int, _Logical]  # tensors with sharded pieces, with all of them
    problems: dict[int, str]  # replicas that disagree: the error to raise
    odd_pieces: dict[int, dict[int, LocalTensor]]  # plain replicas whose local shape differs


# A file entry: (key, dtype, shape, nbytes, item size, first writer's rank, the piece written at
# offset 0 by that one writer (or None), all writers (rank, offset in entry, nbytes, piece) when
# there are several (or None), the logical tensor's index, the logical key when this entry is
# one stored chunk of it (or None)).  Plain tuples: there is one per tensor.
_Writers = tuple[tuple[int, int, int, LocalTensor], ...]
_Entry = tuple[str, str, tuple[int, ...], int, int, int, "LocalTensor | None", "_Writers | None", int, "str | None"]
_NBYTES: Final = 3
_ITEMSIZE: Final = 4
_WRITER: Final = 5
_INDEX: Final = 8
_CHUNK_OF: Final = 9

# A rank's parts of one file: (file size, [(file offset, byte count, header bytes or the local
# tensor whose bytes go there)]).
_FileParts = tuple[int, list[tuple[int, int, "bytes | LocalTensor"]]]


def plan_save(
    locals_by_rank: Sequence[Sequence[LocalTensor]],
    max_shard_size: int,
    *,
    shared_files: bool = True,
    separate_frozen: bool = False,
    key_layout: str = "flat",
) -> SavePlan:
    """Plan a save of every rank's tensors (``locals_by_rank[r]`` is rank ``r``'s list).

    ``shared_files`` allows several ranks to write one file (local storage); without it, every
    file has one writer and row-sharded tensors are stored as chunks.  ``separate_frozen`` puts
    frozen tensors in files of their own (after the others), so incremental saves can reuse them.
    ``key_layout="spread"`` names each file ``<2 hex digits>/<shard name>`` (see
    :func:`~ckptd.formats.names.spread_file_name`) instead of ``<shard name>``.
    Time is O(n log n) in the number of tensors (the sorts); everything else is linear.
    """
    if key_layout not in KEY_LAYOUTS:
        raise ConfigError(f"key_layout must be one of {', '.join(map(repr, KEY_LAYOUTS))}, got {key_layout!r}")
    with _cyclic_gc_paused():
        return _plan_save(locals_by_rank, max_shard_size, shared_files, separate_frozen, key_layout == "spread")


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
    spread: bool = False,
) -> SavePlan:
    world = len(locals_by_rank)
    gathered = _gather(locals_by_rank)
    firsts, masks, general = gathered.firsts, gathered.masks, gathered.general
    _validate(gathered)
    itemsize = DTYPE_ITEMSIZE
    prod = math.prod
    sizes = [prod(t.global_shape) * itemsize[t.dtype] for t in firsts]
    loads = [0] * world
    for tensor in general.values():
        _choose_layout(tensor, shared_files, loads)
    whole = range(len(firsts))
    if general:
        whole = [i for i in whole if i not in general or general[i].layout == "whole"]  # type: ignore[assignment]
    owners = _assign_whole(whole, sizes, masks, loads, world)

    # Entries, in state order, per component.
    entries_by_component: dict[str, list[_Entry]] = {}
    component = None
    bucket: list[_Entry] = []
    odd = gathered.odd_pieces
    for i, first in enumerate(firsts):
        if first.component != component:
            component = first.component
            bucket = entries_by_component.setdefault(component, [])
        if general and i in general:
            bucket.extend(_general_entries(general[i], i, sizes[i], owners, world))
            continue
        owner = owners[i] if owners else 0
        piece = odd[i].get(owner, first) if odd and i in odd else first
        bucket.append(
            (first.key, first.dtype, first.global_shape, sizes[i], itemsize[first.dtype], owner, piece, None, i, None)
        )

    # Files: per component, entries bucketed into shards (frozen tensors apart when asked).
    files: list[FilePlan] = []
    parts_by_rank: list[dict[str, _FileParts]] = [{} for _ in range(world)]
    records: list[TensorRecord | None] = [None] * len(firsts)
    chunk_records: dict[int, list[ChunkRecord]] = {}
    frozen = gathered.frozen
    for component, entries in entries_by_component.items():
        groups: list[tuple[list[_Entry], bool]] = []
        if separate_frozen:
            for frozen_group in (False, True):
                members = [e for e in entries if frozen[e[_INDEX]] == frozen_group]
                groups.extend((g, frozen_group) for g in _group_entries(members, max_shard_size, shared_files))
        else:
            groups.extend((g, False) for g in _group_entries(entries, max_shard_size, shared_files))
        for number, (group, frozen_file) in enumerate(groups, start=1):
            file_name = shard_file_name(component, number, len(groups))
            if spread:
                file_name = spread_file_name(file_name)
            files.append(_plan_file(file_name, component, group, frozen_file, parts_by_rank, records, chunk_records))
    for i, tensor in general.items():
        if tensor.layout == "chunks":
            chunks = sorted(chunk_records[i], key=operator.attrgetter("offset"))
            records[i] = TensorRecord(tensor.dtype, tensor.shape, tuple(chunks))
    tensors: dict[str, dict[str, TensorRecord]] = {component: {} for component in entries_by_component}
    component = None
    component_records: dict[str, TensorRecord] = {}
    for first, record in zip(firsts, records, strict=True):
        if first.component != component:
            component = first.component
            component_records = tensors[component]
        component_records[first.key] = record  # type: ignore[assignment]
    rank_plans = tuple(_rank_plan(rank, parts) for rank, parts in enumerate(parts_by_rank))
    signature = (max_shard_size, shared_files, separate_frozen, tuple(tuple(local) for local in locals_by_rank))
    return SavePlan(world, tuple(files), rank_plans, tensors, signature)


def _gather(locals_by_rank: Sequence[Sequence[LocalTensor]]) -> _Gathered:
    """Group every rank's pieces by logical tensor; note replicas that disagree (raised in
    logical order by :func:`_validate`)."""
    gathered = _Gathered([], [], [], {}, {}, {})
    firsts, masks, frozen, general, problems, odd = gathered
    index: dict[str, dict[str, int]] = {}
    for rank, local in enumerate(locals_by_rank):
        bit = 1 << rank
        component = None
        keys: dict[str, int] = {}
        for tensor in local:
            if tensor.component != component:
                component = tensor.component
                keys = index.setdefault(component, {})
            i = keys.get(tensor.key)
            if i is None:  # the first holder
                i = keys[tensor.key] = len(firsts)
                firsts.append(tensor)
                masks.append(bit)
                frozen.append(tensor.frozen)
                if tensor.sharded:
                    general[i] = _Logical(tensor, rank)
                continue
            first, seen = firsts[i], masks[i]
            masks[i] = seen | bit
            if not tensor.frozen:
                frozen[i] = False
            if i in general:
                general[i].holders.append(tensor)
                general[i].holder_ranks.append(rank)
            elif tensor.sharded:  # the first holder is a plain tensor: always an error
                problems[i] = (
                    f"tensor {component}.{tensor.key!r} is sharded on some ranks "
                    f"but a plain tensor on rank {(seen & -seen).bit_length() - 1}"
                )
            elif tensor.dtype != first.dtype or tensor.global_shape != first.global_shape:
                problems.setdefault(
                    i,
                    f"tensor {component}.{tensor.key!r} is replicated but rank {rank} holds "
                    f"{tensor.dtype}{list(tensor.global_shape)} while rank {(seen & -seen).bit_length() - 1} "
                    f"holds {first.dtype}{list(first.global_shape)}",
                )
            elif tensor.shape != first.shape and not seen & bit:
                odd.setdefault(i, {})[rank] = tensor
    return gathered


def _validate(gathered: _Gathered) -> None:
    """Raise the first problem in logical order, then check that sharded pieces tile their
    tensors."""
    chunks: list[ChunkInfo] = []
    for i in sorted(gathered.problems.keys() | gathered.general.keys()):
        problem = gathered.problems.get(i)
        if problem is not None:
            raise ShardingError(problem)
        tensor = gathered.general[i]
        name = f"{tensor.component}.{tensor.key}"
        for rank, piece in zip(tensor.holder_ranks, tensor.holders, strict=True):
            if not piece.sharded:
                raise ShardingError(
                    f"tensor {tensor.component}.{tensor.key!r} is sharded on some ranks "
                    f"but a plain tensor on rank {rank}"
                )
            box = Box(piece.offset, piece.shape)
            chunks.append(ChunkInfo(rank, name, piece.dtype, piece.global_shape, box, piece.main))
    validate_sharding(chunks)


def _choose_layout(tensor: _Logical, shared_files: bool, loads: list[int]) -> None:
    """How a sharded tensor is stored (``tensor.layout``); its main pieces written by their own
    ranks count towards those ranks' ``loads``."""
    holders = tensor.holders
    mains = [t for t in holders if t.main]
    if len(mains) == 1 and mains[0].is_whole:
        tensor.layout = "whole"
        return
    if shared_files and tensor.shape and all(t.shape[1:] == tensor.shape[1:] for t in mains):
        tensor.layout = "rows"
    else:
        tensor.layout = "chunks"
    for rank, piece in zip(tensor.holder_ranks, holders, strict=True):
        if piece.main:
            loads[rank] += piece.nbytes


def _general_entries(tensor: _Logical, i: int, nbytes: int, owners: list[int], world: int) -> list[_Entry]:
    """The file entries of a sharded tensor: one whole entry, one entry written by row blocks,
    or one entry per main piece (chunks)."""
    key, dtype, itemsize = tensor.key, tensor.dtype, DTYPE_ITEMSIZE[tensor.dtype]
    pairs = zip(tensor.holder_ranks, tensor.holders, strict=True)
    # Empty pieces (FSDP2 gives ranks past the last row none) are not stored: an entry or write
    # of zero bytes would sit inside another piece's bytes.  A tensor without elements keeps one.
    if tensor.layout == "chunks":
        chunks: list[_Entry] = [
            (_chunk_key(key, piece), dtype, piece.shape, piece.nbytes, itemsize, rank, piece, None, i, key)
            for rank, piece in pairs
            if piece.main and (piece.nbytes or not nbytes)
        ]
        return chunks if nbytes else chunks[:1]
    if tensor.layout == "rows":
        row = math.prod(tensor.shape[1:]) * itemsize
        writers = tuple(
            (rank, piece.offset[0] * row, piece.nbytes, piece) for rank, piece in pairs if piece.main and piece.nbytes
        )
        first_writer = writers[0][0] if writers else 0
        return [(tensor.key, dtype, tensor.shape, nbytes, itemsize, first_writer, None, writers, i, None)]
    owner = owners[i] if owners else 0
    piece = tensor.holders[0] if world == 1 else tensor.holders[tensor.holder_ranks.index(owner)]
    return [(tensor.key, dtype, tensor.shape, nbytes, itemsize, owner, piece, None, i, None)]


def _chunk_key(key: str, piece: LocalTensor) -> str:
    return f"{key}@{','.join(map(str, piece.offset))}"


def _assign_whole(whole: Sequence[int], sizes: list[int], masks: list[int], loads: list[int], world: int) -> list[int]:
    """Pick one writer per tensor written whole (its owner, by logical index; an empty list
    when there is one rank): contiguous runs per rank, balancing total bytes."""
    if world == 1:
        return []
    owners = [-1] * len(sizes)
    total = sum(sizes[i] for i in whole) + sum(loads)
    targets = [max(0, total // world - load) for load in loads]
    assigned = [0] * world
    everyone = (1 << world) - 1
    current = 0
    last = world - 1
    for i in whole:
        holders = masks[i]
        if holders >> current & 1 and (assigned[current] < targets[current] or current == last):
            rank = current
        elif holders == everyone:
            while current < last and assigned[current] >= targets[current]:
                current += 1
            rank = current
        else:
            rank = min((r for r in range(world) if holders >> r & 1), key=lambda r: (loads[r] + assigned[r], r))
        owners[i] = rank
        assigned[rank] += sizes[i]
    return owners


def _group_entries(entries: list[_Entry], max_shard_size: int, shared_files: bool) -> list[list[_Entry]]:
    """Bucket entries into files: in state order when files may be shared, else per writer rank."""
    if shared_files:
        runs = [entries]
    else:
        by_rank: dict[int, list[_Entry]] = {}
        for entry in entries:
            by_rank.setdefault(entry[_WRITER], []).append(entry)
        runs = [by_rank[rank] for rank in sorted(by_rank)]
    return [g for run in runs for g in buckets(run, [e[_NBYTES] for e in run], max_shard_size) if g]


def _plan_file(
    file_name: str,
    component: str,
    group: list[_Entry],
    frozen: bool,
    parts_by_rank: list[dict[str, _FileParts]],
    records: list[TensorRecord | None],
    chunk_records: dict[int, list[ChunkRecord]],
) -> FilePlan:
    """Lay out one file: its header and entries go to their writers' parts, its tensors' places
    to ``records`` (whole tensors) or ``chunk_records`` (stored chunks)."""
    ordered = sorted(group, key=operator.itemgetter(_ITEMSIZE), reverse=True)  # = layout.file_order
    keys, dtypes, shapes, sizes, _, writer_ranks, pieces, writers, indices, chunk_of = zip(*ordered, strict=True)
    header, starts, file_size = file_offsets(keys, dtypes, shapes, sizes)
    file_parts: list[list[tuple[int, int, bytes | LocalTensor]] | None] = [None] * len(parts_by_rank)
    file_parts[writer_ranks[0]] = [(0, len(header), header)]
    whole_record = TensorRecord.whole
    for i, start in enumerate(starts):
        piece, nbytes = pieces[i], sizes[i]
        if piece is not None:  # one writer, the whole entry
            parts = file_parts[writer_ranks[i]]
            if parts is None:
                parts = file_parts[writer_ranks[i]] = []
            parts.append((start, nbytes, piece))
        else:
            for rank, offset, count, rank_piece in writers[i]:
                parts = file_parts[rank]
                if parts is None:
                    parts = file_parts[rank] = []
                parts.append((start + offset, count, rank_piece))
        if chunk_of[i] is None:
            records[indices[i]] = whole_record(dtypes[i], shapes[i], file_name, start, start + nbytes)
        else:
            chunk = ChunkRecord(file_name, start, start + nbytes, piece.offset, piece.shape)
            chunk_records.setdefault(indices[i], []).append(chunk)
    for rank, parts in enumerate(file_parts):
        if parts is not None:
            parts_by_rank[rank][file_name] = (file_size, parts)
    return FilePlan(component, file_name, file_size, frozen)


def _rank_plan(rank: int, files: dict[str, _FileParts]) -> RankPlan:
    """Merge a rank's parts into contiguous pieces and lay them out in its arena."""
    pieces: list[Piece] = []
    cursor = 0
    for file_name in sorted(files):
        file_size, parts = files[file_name]
        parts.sort(key=_BY_OFFSET)  # stable; in order already but for row blocks listed out of order
        start = end = parts[0][0]
        run: list[PiecePart] = []
        for offset, nbytes, what in parts:
            if offset != end:  # a gap in the file: the run so far is a piece
                cursor = _add_piece(pieces, cursor, file_name, file_size, start, end, run)
                start, run = offset, []
            run.append(_piece_part(offset - start, nbytes, what))
            end = offset + nbytes
        cursor = _add_piece(pieces, cursor, file_name, file_size, start, end, run)
    # The parts (header bytes, component, key, dtype, shape) belong to the signature: an arena laid
    # out for other key names of the same sizes must be laid out again, or it stages stale keys.
    signature = tuple((p.file_name, p.file_offset, p.size, p.arena_offset, p.parts) for p in pieces)
    return RankPlan(rank, tuple(pieces), max(cursor, ARENA_ALIGNMENT), signature)


def _add_piece(
    pieces: list[Piece], cursor: int, file_name: str, file_size: int, start: int, end: int, run: list[PiecePart]
) -> int:
    """Append the piece ``[start, end)`` of a file, placed in the arena after ``cursor`` (congruent
    with its file offset modulo the alignment); the new cursor."""
    arena_offset = -(-cursor // ARENA_ALIGNMENT) * ARENA_ALIGNMENT + start % ARENA_ALIGNMENT
    pieces.append(Piece(file_name, start, end - start, arena_offset, tuple(run), start == 0 and end == file_size))
    return arena_offset + end - start


def _piece_part(offset: int, nbytes: int, what: bytes | LocalTensor) -> PiecePart:
    """``PiecePart(offset, nbytes, ...)`` for a header or a local tensor.  There is one per
    tensor, so it is filled in as its frozen ``__init__`` would, without its per-field lookups."""
    if type(what) is bytes:
        return PiecePart(offset, nbytes, what)
    part = _new_record(PiecePart)
    _set(part, "offset", offset)
    _set(part, "nbytes", nbytes)
    _set(part, "header", b"")
    _set(part, "component", what.component)  # type: ignore[union-attr]
    _set(part, "key", what.key)  # type: ignore[union-attr]
    _set(part, "dtype", what.dtype)  # type: ignore[union-attr]
    _set(part, "shape", what.shape)  # type: ignore[union-attr]
    return part


_BY_OFFSET = operator.itemgetter(0)
_new_record = object.__new__
_set = object.__setattr__  # how a frozen dataclass's __init__ sets its fields
