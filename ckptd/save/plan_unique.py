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
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

from ..formats.manifest import TensorRecord
from .plan import ARENA_ALIGNMENT, FilePlan, LocalTensor, Piece, PiecePart, RankPlan, SavePlan, plan_save

__all__ = ["Layout", "plan_unique"]

Layout = tuple[tuple[str, bytes], ...]  # a rank's components in state order, with their digests


def plan_unique(
    layouts: Sequence[Layout],
    descriptions: Mapping[bytes, Sequence[LocalTensor]],
    max_shard_size: int,
    *,
    shared_files: bool = True,
    separate_frozen: bool = False,
    key_layout: str = "flat",
    signature: tuple[object, ...] = (),
) -> SavePlan:
    """The plan of a save where rank ``r`` holds, for each ``(component, digest)`` of
    ``layouts[r]``, the tensors ``descriptions[digest]``."""
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
    if classes:
        keys = list(classes)
        virtual = [[t for _, digest in key for t in descriptions[digest]] for key in keys]
        plan = plan_files(virtual, max_shard_size)
        files.extend(plan.files)
        tensors.update(plan.tensors)
        sizes = {f.file_name: f.size for f in plan.files}
        for key, rank_plan in zip(keys, plan.ranks, strict=True):
            members = classes[key]
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
    ranks = tuple(_lay_out(rank, pieces) for rank, pieces in enumerate(pieces_by_rank))
    return SavePlan(world, tuple(files), ranks, ordered, signature)


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
    # Shared files: cut the pieces between tensors into contiguous runs of about equal bytes.
    parts = [
        (piece.file_name, piece.file_offset + part.offset, part)
        for piece in sorted(pieces, key=lambda p: (p.file_name, p.file_offset))
        for part in piece.parts
    ]
    total = sum(part.nbytes for _, _, part in parts) or 1
    runs: list[list[tuple[str, int, PiecePart]]] = [[] for _ in range(members)]
    done = 0
    for item in parts:
        member = min(members - 1, (2 * done + item[2].nbytes) * members // (2 * total))
        runs[member].append(item)
        done += item[2].nbytes
    for member, run in enumerate(runs):
        shares[member] = _merge(run, sizes)
    return shares


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
