"""Typed tensor views of a save plan's pieces over a staging buffer's bytes.

A staging arena (:mod:`ckptd.save.arena`, one shared-memory segment for all pieces) and a
held root's staging files (:mod:`ckptd.save.file_arena`, one file per piece) lay their pieces
out the same way: headers written in place, one view per tensor part, named by its arena
offset so that copies run in arena order.
"""

from __future__ import annotations

import torch

from ..formats.torch_dtypes import dtype_from_name
from .plan import Piece

__all__ = ["ArenaView", "lay_out_piece"]


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (as torch gives them: a zero dimension
    counts as one)."""
    step, strides = 1, []
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


ArenaView = tuple[int, str, str, str, torch.Tensor]  # arena offset, file, component, key, the view


def lay_out_piece(
    base: torch.Tensor,
    at: int,
    piece: Piece,
    views: list[ArenaView],
    typed: dict[str, tuple[torch.Tensor, int]],
    strides: dict[tuple[int, ...], tuple[int, ...]],
) -> None:
    """Write ``piece``'s headers into ``base`` (bytes) from offset ``at`` and append a typed view
    of every tensor part to ``views``, named by its arena offset.  ``typed`` (dtype name -> ``base``
    as that dtype, item size) and ``strides`` (shape -> contiguous strides) are caches the
    caller keeps per ``base`` and per layout: one view op per tensor."""
    for part in piece.parts:
        start = at + part.offset
        if part.header:
            header = torch.frombuffer(bytearray(part.header), dtype=torch.uint8)
            base[start : start + part.nbytes].copy_(header)
            continue
        whole = typed.get(part.dtype)
        if whole is None:
            dtype = dtype_from_name(part.dtype)
            whole = typed[part.dtype] = (base.view(dtype), dtype.itemsize)
        if start % whole[1] == 0:  # always, for plans of ckptd
            stride = strides.get(part.shape) or strides.setdefault(part.shape, _contiguous_strides(part.shape))
            view = whole[0].as_strided(part.shape, stride, start // whole[1])
        else:
            view = base[start : start + part.nbytes].view(dtype_from_name(part.dtype)).view(part.shape)
        views.append((piece.arena_offset + part.offset, piece.file_name, part.component, part.key, view))
