"""The pool of staging arenas of one Checkpointer: which arena a save stages into.

Up to ``max_in_flight`` arenas (:class:`~ckptd.save.arena.StagingArena`) are shared with one
writer; a save takes a free one laid out for its plan (the same layout first, else the smallest
that fits, else a new one, unmapping a free one if the pool is full) and waits while all are
busy.  With a ``staging_memory`` budget the arenas together never hold more; a plan larger than
the budget is streamed through one arena of the budget's size (:mod:`ckptd.save.streamed`).
"""

from __future__ import annotations

import logging
import threading
import time

from ..errors import WriterError
from ..writer.client import InProcessWriter, WriterClient
from ..writer.owner import reset_in_fork_child
from .arena import AfterCopy, StagingArena, arena_bytes, largest_arena
from .plan import RankPlan

__all__ = ["StagingPool"]

logger = logging.getLogger(__name__)


class StagingPool:
    """Up to ``max_in_flight`` arenas shared with one writer; hands out a free one per save.

    ``budget`` (``staging_memory``): the arenas together never hold more bytes.  A plan that
    fits gets an arena of its size once the others leave room (free ones are unmapped, busy ones
    waited for); a larger plan gets one arena of the budget's size and is streamed through it.
    """

    def __init__(self, writer: WriterClient | InProcessWriter, max_in_flight: int, budget: int | None = None) -> None:
        self.writer = writer
        self.max_in_flight = max_in_flight
        self.budget = budget
        self._arenas: list[StagingArena] = []
        self._next_id = 0
        self._cond = threading.Condition()
        self._closed = False
        self.after_copy: AfterCopy | None = None  # passed to every stage() (a test seam)
        reset_in_fork_child(self)

    def acquire(self, plan: RankPlan, *, populate: bool = False) -> tuple[StagingArena, float]:
        """A free arena laid out for ``plan``, waiting while all are busy; a new arena is
        pre-faulted only with ``populate`` (``prepare()``: the first save then only copies).

        Returns the arena and the seconds spent waiting (back-pressure).
        """
        started = time.perf_counter()
        with self._cond:
            while True:
                if self._closed:
                    raise WriterError(
                        "the staging pool is closed: the Checkpointer was closed while a save waited for an arena"
                    )
                arena = self._pick(plan, populate)
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

    def _pick(self, plan: RankPlan, populate: bool) -> StagingArena | None:
        free = [a for a in self._arenas if not a.busy]
        for arena in free:
            if arena.plan is not None and arena.plan.signature == plan.signature:
                return arena
        needed = plan.arena_size if self.budget is None else min(plan.arena_size, largest_arena(self.budget))
        fitting = [a for a in free if a.size >= needed]
        if fitting:
            return min(fitting, key=lambda a: a.size)
        while len(self._arenas) >= self.max_in_flight or not self._room_for(needed):
            if not free:
                return None  # wait for a busy arena to come back
            victim = free.pop(0)
            self._arenas.remove(victim)
            self.writer.detach_arena(victim.arena_id)
            victim.close()
        return self._create(needed, populate)

    def _room_for(self, size: int) -> bool:
        if self.budget is None:
            return True
        return self.bytes_reserved + arena_bytes(size, self.budget) <= self.budget

    def _create(self, size: int, populate: bool) -> StagingArena:
        self._next_id += 1
        arena = StagingArena(self._next_id, size, populate, limit=self.budget)
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

    def forget_after_fork(self) -> None:
        """In a child created by ``fork()``: a fresh condition (a parent thread may have held it)
        and no arenas (the parent's are the parent's writer's; the child's mappings are freed)."""
        self._cond = threading.Condition()
        self._closed = True
        for arena in self._arenas:
            arena.pinned = False  # CUDA is unusable after fork(): the parent unpins its own mapping
            arena.close()
        self._arenas.clear()

    @property
    def bytes_reserved(self) -> int:
        return sum(a.size for a in self._arenas)
