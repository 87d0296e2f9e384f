"""Whether two checkpoints' tensors hold the same bytes (``ckptd diff --exact``), without torch.

Each tensor is streamed in blocks of :data:`COMPARE_BLOCK` bytes from both sides, so a
comparison holds two blocks whatever the tensors' sizes.  The two sides may store a tensor in
different pieces (sharded saves at different world sizes): elements are matched by their place
in the global tensor, in runs that are contiguous in both files.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

from ..formats.manifest import ChunkRecord, TensorRecord
from ..formats.safetensors import DTYPE_ITEMSIZE
from .inspection import CheckpointView

__all__ = ["COMPARE_BLOCK", "same_bytes"]

COMPARE_BLOCK = 8 * 1024 * 1024
"""Bytes of each side :func:`same_bytes` reads at once."""


def same_bytes(
    a: CheckpointView, record_a: TensorRecord, b: CheckpointView, record_b: TensorRecord, block: int = COMPARE_BLOCK
) -> bool:
    """Whether two tensors of one dtype and shape hold the same bytes, read ``block`` bytes of
    each side at a time, piece layouts (sharded saves) matched element by element.  Ranges of one
    local file (a hard link an incremental save made) are equal without being read."""
    if record_a.dtype != record_b.dtype or record_a.shape != record_b.shape:
        return False
    itemsize = DTYPE_ITEMSIZE[record_a.dtype]
    for chunk_a, offset_a, chunk_b, offset_b, length in _runs(record_a, record_b, itemsize):
        identity = a.identity(chunk_a.file)
        if identity is not None and identity == b.identity(chunk_b.file) and offset_a == offset_b:
            continue
        for done in range(0, length, block):
            size = min(block, length - done)
            if a.read_range(chunk_a.file, offset_a + done, size) != b.read_range(chunk_b.file, offset_b + done, size):
                return False
    return True


def _runs(a: TensorRecord, b: TensorRecord, itemsize: int) -> Iterator[tuple[ChunkRecord, int, ChunkRecord, int, int]]:
    """``(piece of a, file offset, piece of b, file offset, length)``: byte runs contiguous in both
    files that hold the same elements, covering every element both pieces hold.

    Where two pieces overlap (a box of the global tensor), the trailing dimensions that the box
    spans whole in both pieces are contiguous in both files, and so is the box's extent in the
    dimension before them: one run per index of the dimensions before that."""
    rank = len(a.shape)
    for chunk_a, chunk_b in itertools.product(a.chunks, b.chunks):
        low = [max(x, y) for x, y in zip(chunk_a.offset, chunk_b.offset, strict=True)]
        high = [
            min(x + m, y + n)
            for x, m, y, n in zip(chunk_a.offset, chunk_a.shape, chunk_b.offset, chunk_b.shape, strict=True)
        ]
        box = [h - lo for lo, h in zip(low, high, strict=True)]
        if any(extent <= 0 for extent in box):
            continue
        whole = rank
        while whole > 0 and box[whole - 1] == chunk_a.shape[whole - 1] == chunk_b.shape[whole - 1]:
            whole -= 1
        split = max(whole - 1, 0)  # dimensions [split:] are one run
        length = math.prod(box[split:]) * itemsize
        strides_a, strides_b = _strides(chunk_a.shape), _strides(chunk_b.shape)
        for outer in itertools.product(*(range(low[d], high[d]) for d in range(split))):
            index = [*outer, *low[split:]]
            start_a = chunk_a.start + itemsize * sum(
                (i - o) * s for i, o, s in zip(index, chunk_a.offset, strides_a, strict=True)
            )
            start_b = chunk_b.start + itemsize * sum(
                (i - o) * s for i, o, s in zip(index, chunk_b.offset, strides_b, strict=True)
            )
            yield chunk_a, start_a, chunk_b, start_b, length


def _strides(shape: tuple[int, ...]) -> list[int]:
    """Row-major element strides of ``shape``."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return strides
