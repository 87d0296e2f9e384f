"""Sharded tensors: pieces of a global tensor held by different ranks.

* :class:`ShardedTensor` describes a local piece explicitly (Megatron-style: key, local data,
  global shape, global offset, replica id); :meth:`ShardedTensor.from_rank_offsets` builds one
  from ``(axis, rank_offset, fragments)`` triples.
* DTensors (FSDP2, tensor parallel) are described by their placements.
* :func:`validate_sharding` checks that the main replicas of every global tensor cover it exactly
  once; :func:`paired_runs` turns the intersection of two boxes into contiguous element runs
  of both, which is all a resharding load needs.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ShardingError

__all__ = [
    "Box",
    "ChunkInfo",
    "ShardedTensor",
    "paired_runs",
    "describe_dtensor",
    "intersect",
    "is_dtensor",
    "is_main_replica",
    "validate_sharding",
]

ReplicaId = int | tuple[int, ...]


def is_main_replica(replica_id: ReplicaId) -> bool:
    """Replica id 0 (or all zeros) is the copy that gets written."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


class ShardedTensor:
    """A rank's piece of a global tensor.

    Args:
        key: the global tensor's name in the checkpoint (unique across the whole state).
        data: the local piece (any device; a view is fine).
        global_shape: shape of the whole tensor.
        global_offset: where ``data`` starts inside it, per dimension (in elements).
        replica_id: 0 (or all zeros) for the copy that is written; other values mark replicas
            of the same piece held by other ranks (e.g. data-parallel copies of a TP shard).
    """

    def __init__(
        self,
        key: str,
        data: torch.Tensor | None,
        global_shape: Sequence[int],
        global_offset: Sequence[int],
        replica_id: ReplicaId = 0,
        *,
        dtype: torch.dtype | None = None,
        local_shape: Sequence[int] | None = None,
    ) -> None:
        self.key = key
        self.data = data
        self.global_shape = tuple(int(d) for d in global_shape)
        self.global_offset = tuple(int(o) for o in global_offset)
        self.replica_id = replica_id
        self.dtype = data.dtype if data is not None else dtype
        self.local_shape = tuple(data.shape) if data is not None else tuple(local_shape or ())
        if len(self.global_offset) != len(self.global_shape) or len(self.local_shape) != len(self.global_shape):
            raise ShardingError(
                f"sharded tensor {key!r}: global shape {self.global_shape}, offset {self.global_offset} and "
                f"local shape {self.local_shape} must have the same number of dimensions"
            )
        for dim, (offset, size, total) in enumerate(
            zip(self.global_offset, self.local_shape, self.global_shape, strict=False)
        ):
            if offset < 0 or offset + size > total:
                raise ShardingError(
                    f"sharded tensor {key!r}: local piece [{offset}, {offset + size}) on dim {dim} "
                    f"exceeds the global size {total}"
                )

    @classmethod
    def from_rank_offsets(
        cls, key: str, data: torch.Tensor, *rank_offsets: tuple[int, int, int], replica_id: ReplicaId = 0
    ) -> ShardedTensor:
        """Megatron's constructor: each ``(axis, rank_offset, fragments)`` says that along
        ``axis`` the global tensor is split into ``fragments`` equal pieces and ``data`` is piece
        number ``rank_offset``."""
        global_shape = list(data.shape)
        global_offset = [0] * data.dim()
        for axis, rank_offset, fragments in rank_offsets:
            if not 0 <= rank_offset < fragments:
                raise ShardingError(f"sharded tensor {key!r}: rank offset {rank_offset} is not in [0, {fragments})")
            global_shape[axis] = data.shape[axis] * fragments
            global_offset[axis] = data.shape[axis] * rank_offset
        return cls(key, data, global_shape, global_offset, replica_id)

    @property
    def box(self) -> Box:
        return Box(self.global_offset, self.local_shape)

    def __repr__(self) -> str:
        return (
            f"ShardedTensor({self.key!r}, global_shape={self.global_shape}, global_offset={self.global_offset}, "
            f"local_shape={self.local_shape}, replica_id={self.replica_id})"
        )


def is_dtensor(value: Any) -> bool:
    """True for a ``torch.distributed.tensor.DTensor``."""
    return type(value).__name__ == "DTensor" and hasattr(value, "placements") and hasattr(value, "to_local")


def describe_dtensor(value: Any) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``(local tensor, global shape, global offset, replica id)`` of a DTensor.

    The replica id is this rank's coordinate along every mesh dimension whose placement is not a
    shard (replicated or partial), so exactly one rank per distinct piece has id all-zeros.
    """
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = value.device_mesh
    local = value.to_local()
    _, offset = compute_local_shape_and_global_offset(value.shape, mesh, value.placements)
    coordinate = mesh.get_coordinate() or [0] * mesh.ndim
    replica = tuple(c for c, p in zip(coordinate, value.placements, strict=False) if not isinstance(p, Shard))
    return local, tuple(value.shape), tuple(int(o) for o in offset), replica


@dataclass(frozen=True)
class Box:
    """An axis-aligned block of a global tensor: ``offset`` and ``shape`` per dimension."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def end(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offset, self.shape, strict=False))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def slices(self, origin: Sequence[int] | None = None) -> tuple[slice, ...]:
        """Index of this box inside a tensor whose element 0 sits at ``origin`` (default 0)."""
        origin = origin or (0,) * len(self.offset)
        return tuple(slice(o - g, o - g + s) for o, s, g in zip(self.offset, self.shape, origin, strict=False))


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes, or ``None``."""
    lo = tuple(max(x, y) for x, y in zip(a.offset, b.offset, strict=False))
    hi = tuple(min(x, y) for x, y in zip(a.end, b.end, strict=False))
    if any(h <= low for low, h in zip(lo, hi, strict=False)) and a.shape:
        return None
    return Box(lo, tuple(h - low for low, h in zip(lo, hi, strict=False)))


def _split_dim(box: Box, part: Box) -> int:
    """The outermost dimension from which ``part`` spans ``box`` completely, minus one."""
    split = len(box.shape) - 1
    while split > 0 and part.offset[split] == box.offset[split] and part.shape[split] == box.shape[split]:
        split -= 1
    return split


def paired_runs(source: Box, target: Box, part: Box) -> Iterator[tuple[int, int, int]]:
    """Copy plan for ``part`` (inside both boxes) from a row-major ``source`` block to a
    row-major ``target`` block: ``(source element, target element, length)`` runs."""
    dims = len(part.shape)
    if dims == 0:
        yield 0, 0, 1
        return
    if part.numel == 0:
        return
    split = max(_split_dim(source, part), _split_dim(target, part))
    src_strides = [math.prod(source.shape[d + 1 :]) for d in range(dims)]
    dst_strides = [math.prod(target.shape[d + 1 :]) for d in range(dims)]
    length = part.shape[split] * src_strides[split]
    src_rel = [p - o for p, o in zip(part.offset, source.offset, strict=True)]
    dst_rel = [p - o for p, o in zip(part.offset, target.offset, strict=True)]
    for index in itertools.product(*(range(part.shape[d]) for d in range(split))):
        src = sum((src_rel[d] + i) * src_strides[d] for d, i in enumerate(index)) + src_rel[split] * src_strides[split]
        dst = sum((dst_rel[d] + i) * dst_strides[d] for d, i in enumerate(index)) + dst_rel[split] * dst_strides[split]
        yield src, dst, length


@dataclass(frozen=True)
class ChunkInfo:
    """What a rank says about one piece of a global tensor (used for validation and planning)."""

    rank: int
    key: str
    dtype: str
    global_shape: tuple[int, ...]
    box: Box
    main: bool


def validate_sharding(chunks: Iterable[ChunkInfo]) -> None:
    """Raise :class:`ShardingError` unless, for every global tensor, all pieces agree on global
    shape and dtype and the main replicas cover it exactly once (no gap, no overlap)."""
    by_key: dict[str, list[ChunkInfo]] = {}
    for chunk in chunks:
        by_key.setdefault(chunk.key, []).append(chunk)
    for key, pieces in by_key.items():
        shapes = {(c.global_shape, c.dtype) for c in pieces}
        if len(shapes) > 1:
            seen = ", ".join(f"rank {c.rank}: {c.dtype}{list(c.global_shape)}" for c in pieces)
            raise ShardingError(f"tensor {key!r}: ranks disagree on its global shape or dtype ({seen})")
        main = [c for c in pieces if c.main]
        global_box = Box((0,) * len(pieces[0].global_shape), pieces[0].global_shape)
        for a, b in itertools.combinations(main, 2):
            overlap = intersect(a.box, b.box)
            if overlap is not None and overlap.numel > 0:
                raise ShardingError(
                    f"tensor {key!r}: the pieces of rank {a.rank} and rank {b.rank} overlap at offset "
                    f"{list(overlap.offset)} shape {list(overlap.shape)} (mark one as a replica)"
                )
        covered = sum(c.box.numel for c in main)
        if covered != global_box.numel:
            hole = _uncovered_point([c.box for c in main], global_box)
            raise ShardingError(
                f"tensor {key!r}: main replicas cover {covered} of {global_box.numel} elements; "
                f"element {list(hole) if hole is not None else '?'} is in no piece"
            )


def _uncovered_point(boxes: list[Box], whole: Box) -> tuple[int, ...] | None:
    candidates = [sorted({0, *(b.end[d] for b in boxes if b.end[d] < whole.shape[d])}) for d in range(len(whole.shape))]
    for point in itertools.product(*candidates):
        if not any(all(b.offset[d] <= point[d] < b.end[d] for d in range(len(point))) for b in boxes):
            return point
    return None
