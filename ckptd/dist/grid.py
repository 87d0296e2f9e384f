"""Symbolic descriptions of DTensors: one record for every rank of a mesh.

A DTensor placed only by plain ``Shard``/``Replicate`` placements says its whole layout: the
mesh's shape and which tensor dimension each mesh dimension shards.  :class:`Grid` is that
record, the same on every rank of the mesh; a rank's coordinate in the mesh (sent apart) says
which piece it holds.  :mod:`ckptd.save.plan_unique` plans such tensors once for all ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Grid", "grid_of"]


@dataclass(frozen=True)
class Grid:
    """A DTensor's layout as every rank of its mesh sees it: the mesh's shape and, per mesh
    dimension, the tensor dimension it shards (``-1``: replicated).  ``mesh`` numbers the mesh
    among the meshes of the saving rank's state, in order of first use (ranks with the same
    state number their meshes alike).  With it, one description stands for the tensor on every
    rank of the mesh; a rank's coordinate in the mesh, sent apart, says which piece it holds."""

    mesh_shape: tuple[int, ...]
    shard_dims: tuple[int, ...]
    mesh: int = 0

    @property
    def rows_only(self) -> bool:
        """Every shard is a block of rows (FSDP2 and HSDP): a rank's piece is contiguous in the
        whole tensor's bytes."""
        return all(d in (-1, 0) for d in self.shard_dims)


def grid_of(value: Any) -> tuple[Any, Grid, tuple[int, ...]] | None:
    """``(mesh, grid, this rank's coordinate in the mesh)`` of a DTensor placed only by plain
    ``Shard`` and ``Replicate`` placements (the grid's ``mesh`` number left at 0), or None
    (``Partial``, ``_StridedShard`` and other placements are described by explicit boxes, as is
    a DTensor whose mesh does not hold this rank)."""
    from torch.distributed.tensor import Replicate, Shard

    dims = []
    for placement in value.placements:
        if type(placement) is Shard:
            dims.append(int(placement.dim) % max(1, value.ndim))
        elif type(placement) is Replicate:
            dims.append(-1)
        else:
            return None
    mesh = value.device_mesh
    coordinate = mesh.get_coordinate()
    if not coordinate:
        return None
    return mesh, Grid(tuple(int(n) for n in mesh.shape), tuple(dims)), tuple(int(c) for c in coordinate)
