"""The staging arenas: where ``async_save`` snapshots tensors before the writer persists them.

An arena is one shared-memory segment (see :mod:`ckptd.shm`) laid out by a rank's
:class:`~ckptd.planner.RankPlan`: every piece of a file the rank writes (a whole shard file,
header included, on a single rank) is one contiguous slice in file order, so the writer streams
it with no further copy.  Arenas are created once and
reused while the state's layout fits; when CUDA is available they are page-locked with
``cudaHostRegister`` so device→host copies run at full speed.  A pool of ``max_in_flight`` arenas
provides back-pressure: a save waits while all of them are still being written.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping

import torch

from .formats.safetensors import dtype_from_name
from .planner import RankPlan
from .shm import SharedSegment
from .writer import InProcessWriter, WriterClient

__all__ = ["StagingArena", "StagingPool"]

logger = logging.getLogger(__name__)

_GROWTH_ALIGNMENT = 2 * 1024 * 1024


class StagingArena:
    """One shared-memory segment and the typed tensor views of its current layout."""

    def __init__(self, arena_id: int, size: int) -> None:
        self.arena_id = arena_id
        self.segment = SharedSegment.create(-(-size // _GROWTH_ALIGNMENT) * _GROWTH_ALIGNMENT)
        self.plan: RankPlan | None = None
        self.busy = False
        self._base: torch.Tensor | None = torch.frombuffer(self.segment.mmap, dtype=torch.uint8)
        self._views: list[tuple[str, str, torch.Tensor]] = []
        self.pinned = _pin(self._base)

    @property
    def size(self) -> int:
        return self.segment.size

    def layout(self, plan: RankPlan) -> None:
        """Lay the arena out for ``plan`` (headers written, tensor views built) unless it already is."""
        if self.plan is not None and self.plan.signature == plan.signature:
            return
        base = self._require_base()
        if plan.arena_size > self.size:
            raise ValueError(f"plan needs {plan.arena_size} bytes, arena {self.arena_id} has {self.size}")
        views: list[tuple[str, str, torch.Tensor]] = []
        for piece in plan.pieces:
            for part in piece.parts:
                start = piece.arena_offset + part.offset
                if part.header:
                    header = torch.frombuffer(bytearray(part.header), dtype=torch.uint8)
                    base[start : start + part.nbytes].copy_(header)
                    continue
                view = base[start : start + part.nbytes].view(dtype_from_name(part.dtype)).view(part.shape)
                views.append((part.component, part.key, view))
        self._views = views
        self.plan = plan

    def stage(self, tensors: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Copy every planned local tensor (``tensors[component][key]``) into its arena slot."""
        if self.plan is None:
            raise ValueError("arena has no layout")
        any_cuda = False
        for component, key, view in self._views:
            source = tensors[component][key]
            any_cuda = any_cuda or source.is_cuda
            view.copy_(source, non_blocking=source.is_cuda and self.pinned)
        if any_cuda:
            torch.cuda.synchronize()

    def close(self) -> None:
        """Drop the views, unpin and unmap; memory is freed once the writer unmaps too."""
        self._views = []
        self.plan = None
        if self._base is not None and self.pinned:
            _unpin(self._base)
        self._base = None
        self.segment.close()

    def _require_base(self) -> torch.Tensor:
        if self._base is None:
            raise ValueError(f"arena {self.arena_id} is closed")
        return self._base


def _pin(base: torch.Tensor) -> bool:
    if not torch.cuda.is_available():
        return False
    result = torch.cuda.cudart().cudaHostRegister(base.data_ptr(), base.numel(), 0)
    if int(result) != 0:
        logger.warning("cudaHostRegister failed (%s); staging arena stays pageable", result)
        return False
    return True


def _unpin(base: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(base.data_ptr())


class StagingPool:
    """Up to ``max_in_flight`` arenas shared with one writer; hands out a free one per save."""

    def __init__(self, writer: WriterClient | InProcessWriter, max_in_flight: int) -> None:
        self.writer = writer
        self.max_in_flight = max_in_flight
        self._arenas: list[StagingArena] = []
        self._next_id = 0
        self._cond = threading.Condition()
        self._closed = False

    def acquire(self, plan: RankPlan) -> tuple[StagingArena, float]:
        """A free arena laid out for ``plan``, waiting while all are busy.

        Returns the arena and the seconds spent waiting (back-pressure).
        """
        started = time.perf_counter()
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("the staging pool is closed")
                arena = self._pick(plan)
                if arena is not None:
                    arena.busy = True
                    break
                self._cond.wait()
        waited = time.perf_counter() - started
        try:
            arena.layout(plan)
        except BaseException:
            self.release(arena)
            raise
        return arena, waited

    def _pick(self, plan: RankPlan) -> StagingArena | None:
        free = [a for a in self._arenas if not a.busy]
        for arena in free:
            if arena.plan is not None and arena.plan.signature == plan.signature:
                return arena
        fitting = [a for a in free if a.size >= plan.arena_size]
        if fitting:
            return min(fitting, key=lambda a: a.size)
        if len(self._arenas) < self.max_in_flight:
            return self._create(plan.arena_size)
        if free:
            victim = free[0]
            self._arenas.remove(victim)
            self.writer.detach_arena(victim.arena_id)
            victim.close()
            return self._create(plan.arena_size)
        return None

    def _create(self, size: int) -> StagingArena:
        self._next_id += 1
        arena = StagingArena(self._next_id, size)
        try:
            self.writer.attach_arena(arena.arena_id, arena.segment)
        except BaseException:
            arena.close()
            raise
        self._arenas.append(arena)
        logger.debug("created staging arena %d of %d bytes", arena.arena_id, arena.size)
        return arena

    def release(self, arena: StagingArena) -> None:
        """Give an arena back once the writer no longer reads it."""
        with self._cond:
            arena.busy = False
            self._cond.notify_all()

    def close(self) -> None:
        """Free every arena (callers make sure no write still reads them)."""
        with self._cond:
            self._closed = True
            for arena in self._arenas:
                arena.close()
            self._arenas.clear()
            self._cond.notify_all()

    @property
    def bytes_reserved(self) -> int:
        return sum(a.size for a in self._arenas)
