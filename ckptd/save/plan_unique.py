"""Planning over unique layouts: ranks that describe the same tensors are planned once.

With data parallelism most ranks hold exactly what other ranks hold (a TP=8 x PP=4 x DP=512 job
has 32 distinct model shards, plus the "not main" replicas of each: 64 layouts for 16,384 ranks).
:func:`plan_unique` takes each rank's layout as a tuple of ``(component, digest)`` pairs and one
description per digest, and calls :func:`~ckptd.save.plan.plan_save` twice:

* **shared components** (held by more than one rank): over one virtual rank per distinct
  combination of digests; the virtual rank's pieces are then split among the ranks it stands
  for (contiguous runs of tensors balanced by bytes where files may be shared, whole files
  otherwise), so replicas still share the writing;
* **solo components** (held by one rank: ``per_rank``, ``global``): over the ranks that hold them.

Each rank's pieces are then laid out in its arena as :func:`~ckptd.save.plan.plan_save` does.
The result is a :class:`~ckptd.save.plan.SavePlan` over the real world size whose files and tensor
records are those of the virtual plan: the manifest has one record per logical tensor, never
one per replica.  Planning time and memory grow with the unique descriptions plus one small
record per rank, not with world size x tensors.

**Symbolic (grid) descriptions.**  A row-sharded DTensor (FSDP2, HSDP) is described by a
:class:`~ckptd.dist.grid.Grid`, the same on every rank of its mesh, so all ranks of an FSDP
job have one layout and each sends only its coordinate in the mesh.  The coordinator checks that
a class's coordinates cover each mesh exactly once, plans the class's virtual rank with every
grid tensor whole (one file entry), and answers every member with one shared
:class:`ClassPlan`; each member derives its own :class:`~ckptd.save.plan.RankPlan`
(:func:`derive_rank_plan`): the row block of each grid tensor it holds the main replica of,
its share of the class's plain tensors (the same cut :func:`_split` makes), and its own solo
components.  Coordination, plan and manifest are then O(tensors), not O(world size x tensors).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..dist.grid import Grid
from ..errors import ShardingError
from ..formats.manifest import TensorRecord, zero_offset
from ..formats.safetensors import DTYPE_ITEMSIZE
from .plan import ARENA_ALIGNMENT, FilePlan, LocalTensor, Piece, PiecePart, RankPlan, SavePlan, plan_save

__all__ = ["ClassPlan", "Layout", "derive_rank_plan", "plan_unique"]

Layout = tuple[tuple[str, bytes], ...]  # a rank's components in state order, with their digests
Coordinates = tuple[tuple[int, ...], ...]  # a rank's coordinate in each mesh its grids number


@dataclass(frozen=True)
class ClassPlan:
    """The plan of the ranks that share a layout with grid tensors: the virtual rank's pieces
    (grid tensors whole), the file sizes, the members in rank order and the planning options.
    One object answers every member; each derives its own plan (:func:`derive_rank_plan`)."""

    members: Sequence[int]  # a range when the members are consecutive ranks (it pickles in a few bytes)
    components: frozenset[str]
    pieces: tuple[Piece, ...]
    file_sizes: Mapping[str, int]
    options: tuple[int, bool, bool, str]  # max_shard_size, shared_files, separate_frozen, key_layout


def plan_unique(
    layouts: Sequence[Layout],
    descriptions: Mapping[bytes, Sequence[LocalTensor]],
    max_shard_size: int,
    *,
    shared_files: bool = True,
    separate_frozen: bool = False,
    key_layout: str = "flat",
    signature: tuple[object, ...] = (),
    coordinates: Sequence[Coordinates] = (),
) -> SavePlan:
    """The plan of a save where rank ``r`` holds, for each ``(component, digest)`` of
    ``layouts[r]``, the tensors ``descriptions[digest]`` (grid tensors at its place
    ``coordinates[r]`` in their meshes)."""
    world = len(layouts)
    holders: dict[str, int] = {}
    order: dict[str, None] = {}  # components in first-seen order (the manifest's order)
    for layout in layouts:
        for component, _ in layout:
            holders[component] = holders.get(component, 0) + 1
            order.setdefault(component)
    classes: dict[Layout, list[int]] = {}
    solo_ranks: list[int] = []
    solo_locals: list[list[LocalTensor]] = []
    for rank, layout in enumerate(layouts):
        shared = tuple(pair for pair in layout if holders[pair[0]] > 1)
        if shared:
            classes.setdefault(shared, []).append(rank)
        solo = [t for component, digest in layout if holders[component] == 1 for t in descriptions[digest]]
        if solo:
            solo_ranks.append(rank)
            solo_locals.append(solo)
    pieces_by_rank: list[list[Piece]] = [[] for _ in range(world)]
    files: list[FilePlan] = []
    tensors: dict[str, dict[str, TensorRecord]] = {}
    plan_files = functools.partial(
        plan_save, shared_files=shared_files, separate_frozen=separate_frozen, key_layout=key_layout
    )
    class_plans: list[ClassPlan | None] = [None] * world
    if classes:
        keys = list(classes)
        virtual = [[_whole(t) for _, digest in key for t in descriptions[digest]] for key in keys]
        plan = plan_files(virtual, max_shard_size)
        files.extend(plan.files)
        tensors.update(plan.tensors)
        sizes = {f.file_name: f.size for f in plan.files}
        options = (max_shard_size, shared_files, separate_frozen, key_layout)
        for key, rank_plan in zip(keys, plan.ranks, strict=True):
            members = classes[key]
            grids = _grids(key, descriptions)
            if grids:
                _check_cover(grids, members, coordinates)
                class_files = {p.file_name for p in rank_plan.pieces}
                class_plan = ClassPlan(
                    _compact(members),
                    frozenset(component for component, _ in key),
                    rank_plan.pieces,
                    {name: size for name, size in sizes.items() if name in class_files},
                    options,
                )
                for member in members:
                    class_plans[member] = class_plan
                continue
            shares = _split(rank_plan.pieces, len(members), sizes, shared_files)
            for member, share in zip(members, shares, strict=True):
                pieces_by_rank[member].extend(share)
    if solo_ranks:
        plan = plan_files(solo_locals, max_shard_size)
        files.extend(plan.files)
        tensors.update(plan.tensors)
        for rank, rank_plan in zip(solo_ranks, plan.ranks, strict=True):
            pieces_by_rank[rank].extend(rank_plan.pieces)
    position = {component: i for i, component in enumerate(order)}
    files.sort(key=lambda f: position.get(f.component, len(position)))
    ordered = {component: tensors[component] for component in order if component in tensors}
    ranks = tuple(
        _lay_out(rank, pieces) if derived_from is None else _stand_in(rank, derived_from, pieces)
        for rank, (pieces, derived_from) in enumerate(zip(pieces_by_rank, class_plans, strict=True))
    )
    derived = tuple(class_plans) if any(c is not None for c in class_plans) else ()
    return SavePlan(world, tuple(files), ranks, ordered, signature, derived)


def _compact(ranks: Sequence[int]) -> Sequence[int]:
    """``ranks`` (ascending) as a range when they are consecutive, else as a tuple."""
    if ranks and ranks[-1] - ranks[0] == len(ranks) - 1:
        return range(ranks[0], ranks[-1] + 1)
    return tuple(ranks)


def _whole(tensor: LocalTensor) -> LocalTensor:
    """A grid tensor as the virtual rank plans it: the whole tensor, one file entry."""
    if tensor.grid is None:
        return tensor
    shape = tensor.global_shape
    return LocalTensor(
        tensor.component, tensor.key, tensor.dtype, shape, zero_offset(len(shape)), shape, True, True, tensor.frozen
    )


def _grids(key: Layout, descriptions: Mapping[bytes, Sequence[LocalTensor]]) -> dict[int, tuple[str, Grid]]:
    """Mesh number -> (a tensor's name, its grid) over the grid tensors of a layout."""
    grids: dict[int, tuple[str, Grid]] = {}
    for _, digest in key:
        for tensor in descriptions[digest]:
            grid = tensor.grid
            if grid is None:
                continue
            name = f"{tensor.component}.{tensor.key}"
            seen = grids.setdefault(grid.mesh, (name, grid))
            if seen[1].mesh_shape != grid.mesh_shape:
                raise ShardingError(
                    f"tensors {seen[0]!r} and {name!r} name mesh {grid.mesh} with shapes "
                    f"{list(seen[1].mesh_shape)} and {list(grid.mesh_shape)}"
                )
    return grids


def _check_cover(
    grids: Mapping[int, tuple[str, Grid]], members: Sequence[int], coordinates: Sequence[Coordinates]
) -> None:
    """Every mesh of a class's grid tensors is covered by its members' coordinates exactly once:
    then torch's placements give the main replicas of every grid tensor exactly one owner per
    element (O(members) per mesh, instead of checking every rank's box of every tensor)."""
    for mesh, (name, grid) in grids.items():
        seen: dict[tuple[int, ...], int] = {}
        for rank in members:
            places = coordinates[rank] if rank < len(coordinates) else ()
            if mesh >= len(places):
                raise ShardingError(f"tensor {name!r}: rank {rank} sent no coordinate in its mesh")
            place = places[mesh]
            inside = len(place) == len(grid.mesh_shape) and all(
                0 <= c < n for c, n in zip(place, grid.mesh_shape, strict=True)
            )
            if not inside:
                raise ShardingError(
                    f"tensor {name!r}: rank {rank}'s coordinate {list(place)} is outside the mesh "
                    f"{list(grid.mesh_shape)}"
                )
            other = seen.setdefault(place, rank)
            if other != rank:
                raise ShardingError(
                    f"tensor {name!r}: ranks {other} and {rank} both sit at {list(place)} of the mesh "
                    f"{list(grid.mesh_shape)} (their pieces would overlap)"
                )
        if len(seen) != math.prod(grid.mesh_shape):
            raise ShardingError(
                f"tensor {name!r}: {len(seen)} ranks hold it, but its mesh {list(grid.mesh_shape)} has "
                f"{math.prod(grid.mesh_shape)} places (some pieces would be missing)"
            )


def _stand_in(rank: int, class_plan: ClassPlan, solo: Sequence[Piece]) -> RankPlan:
    """The coordinator's record of a member of a class plan: the class's pieces (every file it
    may write into, which is all an incremental save's choice of files needs) and its solo ones."""
    return RankPlan(rank, (*class_plan.pieces, *solo), 0, ())


def derive_rank_plan(class_plan: ClassPlan, rank: int, locals_: Sequence[LocalTensor]) -> RankPlan:
    """Rank ``rank``'s own plan from its class's plan and its own descriptions: the row block of
    each grid tensor it holds the main replica of, its share of the class's plain tensors and
    headers (cut as :func:`_split` cuts them), and its solo components (planned as the
    coordinator planned them)."""
    own = {(t.component, t.key): t for t in locals_ if t.grid is not None}
    plain: list[tuple[str, int, PiecePart]] = []
    rows: list[tuple[str, int, PiecePart]] = []
    for piece in sorted(class_plan.pieces, key=lambda p: (p.file_name, p.file_offset)):
        for part in piece.parts:
            at = piece.file_offset + part.offset
            mine = own.get((part.component, part.key)) if part.key else None
            if mine is None:
                plain.append((piece.file_name, at, part))
                continue
            if not mine.main or not mine.nbytes:
                continue
            row = math.prod(mine.global_shape[1:]) * DTYPE_ITEMSIZE[mine.dtype]
            block = PiecePart(0, mine.nbytes, b"", part.component, part.key, mine.dtype, mine.shape)
            rows.append((piece.file_name, at + (mine.offset[0] if mine.offset else 0) * row, block))
    members = class_plan.members
    index = members.index(rank)
    share = _split_parts(plain, len(members))[index]
    pieces = _merge(sorted(share + rows, key=lambda item: (item[0], item[1])), class_plan.file_sizes)
    solo = [t for t in locals_ if t.component not in class_plan.components]
    if solo:
        max_shard_size, shared_files, separate_frozen, key_layout = class_plan.options
        solo_plan = plan_save(
            [solo], max_shard_size, shared_files=shared_files, separate_frozen=separate_frozen, key_layout=key_layout
        )
        pieces.extend(solo_plan.ranks[0].pieces)
    return _lay_out(rank, pieces)


def _split(pieces: Sequence[Piece], members: int, sizes: Mapping[str, int], shared_files: bool) -> list[list[Piece]]:
    """A virtual rank's pieces shared among the ``members`` ranks it stands for."""
    if members == 1:
        return [list(pieces)]
    shares: list[list[Piece]] = [[] for _ in range(members)]
    if not shared_files:  # one writer per file: hand out whole files, largest first, to the least loaded
        by_file: dict[str, list[Piece]] = {}
        for piece in pieces:
            by_file.setdefault(piece.file_name, []).append(piece)
        loads = [0] * members
        for group in sorted(by_file.values(), key=lambda g: -sum(p.size for p in g)):
            member = min(range(members), key=loads.__getitem__)
            shares[member].extend(group)
            loads[member] += sum(p.size for p in group)
        return shares
    parts = [
        (piece.file_name, piece.file_offset + part.offset, part)
        for piece in sorted(pieces, key=lambda p: (p.file_name, p.file_offset))
        for part in piece.parts
    ]
    return [_merge(run, sizes) for run in _split_parts(parts, members)]


def _split_parts(parts: Sequence[tuple[str, int, PiecePart]], members: int) -> list[list[tuple[str, int, PiecePart]]]:
    """Shared files: the parts (in file order) cut between tensors into ``members`` contiguous
    runs of about equal bytes."""
    total = sum(part.nbytes for _, _, part in parts) or 1
    runs: list[list[tuple[str, int, PiecePart]]] = [[] for _ in range(members)]
    done = 0
    for item in parts:
        member = min(members - 1, (2 * done + item[2].nbytes) * members // (2 * total))
        runs[member].append(item)
        done += item[2].nbytes
    return runs


def _merge(run: Sequence[tuple[str, int, PiecePart]], sizes: Mapping[str, int]) -> list[Piece]:
    """Adjacent parts of one file as pieces (arena offsets are assigned by :func:`_lay_out`)."""
    pieces: list[Piece] = []
    group: list[tuple[str, int, PiecePart]] = []

    def close() -> None:
        file_name, start, _ = group[0]
        end = group[-1][1] + group[-1][2].nbytes
        parts = tuple(
            PiecePart(at - start, p.nbytes, p.header, p.component, p.key, p.dtype, p.shape) for _, at, p in group
        )
        pieces.append(Piece(file_name, start, end - start, 0, parts, start == 0 and end == sizes[file_name]))

    for item in run:
        if group and (item[0] != group[-1][0] or item[1] != group[-1][1] + group[-1][2].nbytes):
            close()
            group = []
        group.append(item)
    if group:
        close()
    return pieces


def _lay_out(rank: int, pieces: Sequence[Piece]) -> RankPlan:
    """Pieces back to back in the arena, each congruent with its file offset modulo the alignment
    (as :func:`~ckptd.save.plan.plan_save` lays them out)."""
    laid: list[Piece] = []
    cursor = 0
    for piece in sorted(pieces, key=lambda p: (p.file_name, p.file_offset)):
        arena_offset = -(-cursor // ARENA_ALIGNMENT) * ARENA_ALIGNMENT + piece.file_offset % ARENA_ALIGNMENT
        if arena_offset != piece.arena_offset:
            piece = Piece(piece.file_name, piece.file_offset, piece.size, arena_offset, piece.parts, piece.whole_file)
        laid.append(piece)
        cursor = arena_offset + piece.size
    signature = tuple((p.file_name, p.file_offset, p.size, p.arena_offset, p.parts) for p in laid)
    return RankPlan(rank, tuple(laid), max(cursor, ARENA_ALIGNMENT), signature)
