"""Sharded tensors: pieces of a global tensor held by different ranks.

* :class:`ShardedTensor` describes a local piece explicitly (Megatron-style: key, local data,
  global shape, global offset, replica id); :meth:`ShardedTensor.from_rank_offsets` builds one
  from ``(axis, rank_offset, fragments)`` triples.
* DTensors (FSDP2, tensor parallel) are described by their placements (and, for row blocks, by
  a :class:`~ckptd.dist.grid.Grid`).
* :func:`paired_runs` turns the intersection of two boxes into contiguous element runs of both,
  which is all a resharding load needs.  (:mod:`~ckptd.dist.coverage` checks that pieces cover
  their tensors exactly once.)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ShardingError

__all__ = [
    "Box",
    "ShardedTensor",
    "paired_runs",
    "describe_dtensor",
    "flat_range_box",
    "intersect",
    "is_dtensor",
    "is_main_replica",
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
        dtype, local_shape: what the piece is when ``data`` is None (a load target described
            only by its layout).

    Megatron-Core's further arguments, with its meaning:
        axis_fragmentations: how many pieces each axis is cut into (a regular grid); checked:
            every offset must then be a multiple of the local size on that axis.
        prepend_axis_num: ``global_shape`` has this many leading axes that ``data`` lacks (each
            of size 1 locally, like ``data.unsqueeze(0)``): e.g. one layer's weight as slice
            ``global_offset[0]`` of a stacked ``[layers, ...]`` tensor.  ``local_shape`` excludes them.
        flattened_range: ``data`` is ``local.flatten()[flattened_range]`` of a local piece of
            shape ``local_shape`` (from :meth:`from_rank_offsets_flat`).  ckptd stores boxes, so
            the range must cover a box of that piece (whole rows, or a run inside one row);
            others raise :class:`~ckptd.errors.ShardingError`.  (Megatron-Core 0.16 itself
            no longer accepts ``flattened_range``.)
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
        axis_fragmentations: Sequence[int] | None = None,
        prepend_axis_num: int = 0,
        flattened_range: slice | None = None,
    ) -> None:
        self.key = key
        self.data = data
        self.global_shape = tuple(int(d) for d in global_shape)
        self.global_offset = tuple(int(o) for o in global_offset)
        self.replica_id = replica_id
        self.dtype = data.dtype if data is not None else dtype
        self.prepend_axis_num = int(prepend_axis_num)
        self.flattened_range = flattened_range
        self.axis_fragmentations = None if axis_fragmentations is None else tuple(int(f) for f in axis_fragmentations)
        if flattened_range is None and data is not None:
            if local_shape is not None and tuple(local_shape) != tuple(data.shape):
                raise ShardingError(
                    f"sharded tensor {key!r}: local_shape {tuple(local_shape)} differs from the data's "
                    f"shape {tuple(data.shape)}"
                )
            self.local_shape = tuple(data.shape)
        else:
            self.local_shape = tuple(int(d) for d in (local_shape or ()))
        self._local_offset, self._local_box_shape = self._flat_box()
        self._check()

    def _flat_box(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Offset and shape, inside the local piece, of what ``data`` holds."""
        if self.flattened_range is None:
            return (0,) * len(self.local_shape), self.local_shape
        key, flat = self.key, self.flattened_range
        if flat.step not in (None, 1) or flat.start is None or flat.stop is None:
            raise ShardingError(f"sharded tensor {key!r}: flattened_range {flat} must be slice(start, stop)")
        start, stop = int(flat.start), int(flat.stop)
        if not self.local_shape and self.data is not None:
            raise ShardingError(f"sharded tensor {key!r}: a flattened_range needs local_shape (the unflattened shape)")
        if not 0 <= start < stop <= math.prod(self.local_shape):
            raise ShardingError(
                f"sharded tensor {key!r}: flattened_range [{start}, {stop}) is empty or outside the "
                f"{math.prod(self.local_shape)} elements of local shape {self.local_shape}; leave empty pieces out"
            )
        if self.data is not None and (self.data.dim() != 1 or self.data.numel() != stop - start):
            raise ShardingError(
                f"sharded tensor {key!r}: flattened data must be 1-D with {stop - start} elements, "
                f"not shape {tuple(self.data.shape)}"
            )
        box = flat_range_box(self.local_shape, start, stop)
        if box is None:
            raise ShardingError(
                f"sharded tensor {key!r}: flattened_range [{start}, {stop}) of local shape {self.local_shape} "
                "is not a box (it wraps across rows); ckptd stores boxes: split the range at row ends, "
                "or save the unflattened local tensor"
            )
        return box

    def _check(self) -> None:
        key, ndim = self.key, len(self.global_shape)
        if self.prepend_axis_num < 0:
            raise ShardingError(f"sharded tensor {key!r}: prepend_axis_num must be >= 0, not {self.prepend_axis_num}")
        if len(self.global_offset) != ndim or len(self.local_shape) + self.prepend_axis_num != ndim:
            raise ShardingError(
                f"sharded tensor {key!r}: global shape {self.global_shape}, offset {self.global_offset} and "
                f"local shape {self.local_shape} (plus prepend_axis_num={self.prepend_axis_num}) must have the "
                "same number of dimensions"
            )
        if self.axis_fragmentations is not None:
            if len(self.axis_fragmentations) != ndim or min(self.axis_fragmentations, default=1) < 1:
                raise ShardingError(
                    f"sharded tensor {key!r}: axis_fragmentations {self.axis_fragmentations} must give a count "
                    f">= 1 for each of the {ndim} axes"
                )
            for dim, (offset, size) in enumerate(
                zip(self.global_offset[self.prepend_axis_num :], self.local_shape, strict=True)
            ):
                if size and offset % size:
                    raise ShardingError(
                        f"sharded tensor {key!r}: offset {offset} on axis {dim + self.prepend_axis_num} is not a "
                        f"multiple of the local size {size} (axis_fragmentations says the pieces form a grid)"
                    )
        box = self.box
        for dim, (offset, size, total) in enumerate(zip(box.offset, box.shape, self.global_shape, strict=True)):
            if offset < 0 or offset + size > total:
                raise ShardingError(
                    f"sharded tensor {key!r}: local piece [{offset}, {offset + size}) on dim {dim} "
                    f"exceeds the global size {total}"
                )

    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: tuple[int, int, int],
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        flattened_range: None = None,
        **init_kwargs: Any,
    ) -> ShardedTensor:
        """Megatron's constructor: each ``(axis, rank_offset, fragments)`` says that along
        ``axis`` the global tensor is split into ``fragments`` equal pieces and ``data`` is piece
        number ``rank_offset``.  Axes count the ``prepend_axis_num`` leading axes (size 1
        locally) first."""
        if flattened_range is not None:
            raise ShardingError(
                f"sharded tensor {key!r}: from_rank_offsets takes no flattened_range; use from_rank_offsets_flat"
            )
        ndim = data.dim() + prepend_axis_num
        global_shape = [1] * prepend_axis_num + list(data.shape)
        global_offset = [0] * ndim
        fragmentations = [1] * ndim
        for axis, rank_offset, fragments in rank_offsets:
            if not 0 <= axis < ndim:
                raise ShardingError(f"sharded tensor {key!r}: axis {axis} is not in [0, {ndim}) (prepended axes count)")
            if not 0 <= rank_offset < fragments:
                raise ShardingError(f"sharded tensor {key!r}: rank offset {rank_offset} is not in [0, {fragments})")
            local = 1 if axis < prepend_axis_num else data.shape[axis - prepend_axis_num]
            global_shape[axis] = local * fragments
            global_offset[axis] = local * rank_offset
            fragmentations[axis] = fragments
        return cls(
            key,
            data,
            global_shape,
            global_offset,
            replica_id,
            axis_fragmentations=fragmentations,
            prepend_axis_num=prepend_axis_num,
            **init_kwargs,
        )

    @classmethod
    def from_rank_offsets_flat(
        cls,
        key: str,
        data: torch.Tensor,
        non_flat_local_shape: Sequence[int],
        *rank_offsets: tuple[int, int, int],
        flattened_range: slice | None = None,
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
    ) -> ShardedTensor:
        """A flat slice of a local piece (distributed optimizers): the piece of shape
        ``non_flat_local_shape`` is placed by ``rank_offsets`` as in :meth:`from_rank_offsets`, and
        ``data`` (1-D) is ``piece.flatten()[flattened_range]``."""
        if flattened_range is None:
            raise ShardingError(f"sharded tensor {key!r}: from_rank_offsets_flat needs flattened_range")
        placed = cls.from_rank_offsets(
            key,
            torch.empty(tuple(non_flat_local_shape), dtype=data.dtype, device="meta"),
            *rank_offsets,
            replica_id=replica_id,
            prepend_axis_num=prepend_axis_num,
        )
        return cls(
            key,
            data,
            placed.global_shape,
            placed.global_offset,
            replica_id,
            local_shape=placed.local_shape,
            axis_fragmentations=placed.axis_fragmentations,
            prepend_axis_num=prepend_axis_num,
            flattened_range=flattened_range,
        )

    def like(self, key: str, data: torch.Tensor | None) -> ShardedTensor:
        """The same placement (shape, offset, replica, Megatron arguments) for other data."""
        return ShardedTensor(
            key,
            data,
            self.global_shape,
            self.global_offset,
            self.replica_id,
            dtype=self.dtype if data is None else None,
            local_shape=self.local_shape,
            axis_fragmentations=self.axis_fragmentations,
            prepend_axis_num=self.prepend_axis_num,
            flattened_range=self.flattened_range,
        )

    @property
    def box(self) -> Box:
        """The block of the global tensor that ``data`` holds (all dimensions)."""
        p = self.prepend_axis_num
        offset = self.global_offset[:p] + tuple(
            g + o for g, o in zip(self.global_offset[p:], self._local_offset, strict=True)
        )
        return Box(offset, (1,) * p + self._local_box_shape)

    def local_view(self) -> torch.Tensor:
        """``data`` viewed with the box's shape (prepended axes added, a flat range unflattened);
        shares its storage, so a load into it fills ``data``."""
        if self.data is None:
            raise ShardingError(f"sharded tensor {self.key!r} has no data")
        if self.flattened_range is not None:
            return self.data.view(self.box.shape)
        return self.data[(None,) * self.prepend_axis_num] if self.prepend_axis_num else self.data

    def init_data(self, device: str | torch.device = "cpu", init_fn: Any = torch.empty) -> torch.Tensor:
        """Give a layout-only piece (``data`` None) a tensor of its shape and dtype; returns ``data``."""
        if self.data is None:
            flat = self.flattened_range
            shape = (int(flat.stop) - int(flat.start),) if flat is not None else self.local_shape
            self.data = init_fn(shape, dtype=self.dtype, device=device)
        return self.data

    def __repr__(self) -> str:
        extra = f", prepend_axis_num={self.prepend_axis_num}" if self.prepend_axis_num else ""
        if self.flattened_range is not None:
            extra += f", flattened_range={self.flattened_range}"
        return (
            f"ShardedTensor({self.key!r}, global_shape={self.global_shape}, global_offset={self.global_offset}, "
            f"local_shape={self.local_shape}, replica_id={self.replica_id}{extra})"
        )


def flat_range_box(shape: Sequence[int], start: int, stop: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``(offset, shape)`` of the box that elements ``[start, stop)`` of a row-major tensor of
    ``shape`` form, or None when they do not form one (the range wraps across rows)."""
    dims = len(shape)
    if dims == 0:
        return ((), ()) if (start, stop) == (0, 1) else None
    strides = [math.prod(shape[d + 1 :]) for d in range(dims)]
    for k in range(dims):
        step = strides[k]
        if step == 0 or start % step or stop % step:
            continue
        if k and start // strides[k - 1] != (stop - 1) // strides[k - 1]:
            continue  # crosses a boundary of an outer axis
        index = []
        rest = start
        for stride in strides:
            index.append(rest // stride)
            rest %= stride
        offset = (*index[:k], index[k], *([0] * (dims - k - 1)))
        size = (*([1] * k), (stop - start) // step, *shape[k + 1 :])
        return tuple(offset), tuple(int(s) for s in size)
    return None


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
