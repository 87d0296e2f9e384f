"""The pool of staging arenas of one Checkpointer: which arena a save stages into.

Up to ``max_in_flight`` arenas (:class:`~ckptd.save.arena.StagingArena`) are shared with one
writer; a save takes a free one laid out for its plan (the same layout first, else the smallest
that fits, else a new one, unmapping a free one if the pool is full) and waits while all are
busy.  With a ``staging_memory`` budget the arenas together never hold more; a plan larger than
the budget is streamed through one arena of the budget's size (:mod:`ckptd.save.streamed`).

A save to a held-memory root stages into a :class:`~ckptd.save.file_arena.FileArena` when its
plan allows: files that become the checkpoint's.  Such an arena is *lent* while a checkpoint
links its files; lent arenas do not count against ``max_in_flight`` (they are the kept
checkpoints' memory, not staging memory), and beyond ``lent_limit`` of them the oldest is
forgotten (unmapped, its names removed: the checkpoint keeps its bytes).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from ..errors import WriterError
from ..writer.client import InProcessWriter, WriterClient
from ..writer.owner import reset_in_fork_child
from .arena import AfterCopy, StagingArena, arena_bytes, largest_arena
from .file_arena import FileArena
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
        self._uses = 0
        self._provisioning = 0  # FileArenas being created in the background (provision)
        self._provisioner: ThreadPoolExecutor | None = None
        self.lent_limit = 2  # lent FileArenas kept mapped for reuse (the Saver sets keep_last)
        self.after_copy: AfterCopy | None = None  # passed to every stage() (a test seam)
        reset_in_fork_child(self)

    def acquire(
        self, plan: RankPlan, *, populate: bool = False, files_in: str | None = None
    ) -> tuple[StagingArena, float]:
        """A free arena laid out for ``plan``, waiting while all are busy; a new arena is
        pre-faulted only with ``populate`` (``prepare()``: the first save then only copies).
        ``files_in``: a directory for a :class:`FileArena` (the plan must be
        :func:`~ckptd.save.file_arena.adoptable`).

        Returns the arena and the seconds spent waiting (back-pressure).
        """
        started = time.perf_counter()
        with self._cond:
            while True:
                if self._closed:
                    raise WriterError(
                        "the staging pool is closed: the Checkpointer was closed while a save waited for an arena"
                    )
                arena = self._pick(plan, populate, files_in)
                if arena is not None:
                    arena.busy = True
                    self._uses += 1
                    arena.last_used = self._uses
                    break
                self._cond.wait()
        waited = time.perf_counter() - started
        try:
            arena.layout(plan)
        except BaseException:
            self.release(arena)
            raise
        return arena, waited

    def _pick(self, plan: RankPlan, populate: bool, files_in: str | None) -> StagingArena | None:
        self._forget_lent()
        ready = self._free_of(plan, files=files_in is not None)
        if ready is not None:
            return ready
        free = [a for a in self._arenas if not a.busy and not _lent(a)]
        if files_in is not None:
            if self._provisioning:
                return None  # the next one is being made: wait for it
            while self._staging_count() >= self.max_in_flight:
                if not free:
                    return None
                self._evict(free.pop(0))
            return self._create_files(plan, populate, files_in)
        # a shared-memory arena: evict other shared-memory arenas before staging files
        free = [a for a in free if not isinstance(a, FileArena)] + [a for a in free if isinstance(a, FileArena)]
        needed = plan.arena_size if self.budget is None else min(plan.arena_size, largest_arena(self.budget))
        fitting = [a for a in free if a.size >= needed and not isinstance(a, FileArena)]
        if fitting:
            return min(fitting, key=lambda a: a.size)
        while self._staging_count() >= self.max_in_flight or not self._room_for(needed):
            if not free:
                return None  # wait for a busy arena to come back
            self._evict(free.pop(0))
        return self._create(needed, populate)

    def _free_of(self, plan: RankPlan, *, files: bool) -> StagingArena | None:
        """A free arena already laid out for ``plan``: of staging files (``files``) or shared
        memory."""
        for arena in self._arenas:
            if (
                not arena.busy
                and isinstance(arena, FileArena) == files
                and arena.plan is not None
                and arena.plan.signature == plan.signature
                and not _lent(arena)
            ):
                return arena
        return None

    def _staging_count(self) -> int:
        """Arenas that count against ``max_in_flight``: all but the lent ones."""
        return sum(1 for a in self._arenas if not _lent(a))

    def _evict(self, arena: StagingArena) -> None:
        self._arenas.remove(arena)
        for writer_id in _writer_ids(arena):
            self.writer.detach_arena(writer_id)
        arena.close()

    def _forget_lent(self) -> None:
        """Keep at most ``lent_limit`` lent arenas, forgetting the least recently used."""
        lent = sorted((a for a in self._arenas if not a.busy and _lent(a)), key=lambda a: a.last_used)
        for arena in lent[: max(0, len(lent) - self.lent_limit)]:
            logger.debug("forgetting staging arena %d: its files stay with the checkpoint", arena.arena_id)
            self._evict(arena)

    def _create_files(self, plan: RankPlan, populate: bool, directory: str) -> FileArena:
        arena_id = self._writer_id()
        arena = FileArena(arena_id, plan, directory, iter([self._writer_id() for _ in plan.pieces]), populate)
        try:
            for writer_id, segment in arena.writer_segments:
                self.writer.attach_arena(writer_id, segment)
        except BaseException:
            for writer_id, _ in arena.writer_segments:
                self.writer.detach_arena(writer_id)
            arena.close()
            raise
        self._arenas.append(arena)
        logger.debug("created staging arena %d: %d file(s) in %s", arena.arena_id, len(arena.files), directory)
        return arena

    def fill_ring(self, plan: RankPlan, directory: str) -> None:
        """``prepare()`` on a held root: make every :class:`FileArena` of ``plan``'s layout the
        ring needs (``lent_limit + 1``) now, pages faulted in, so that no early save waits for
        one (saves back to back included)."""
        with self._cond:
            while not self._closed and self._ring_size(plan) <= self.lent_limit:
                self._create_files(plan, True, directory)

    def _ring_size(self, plan: RankPlan) -> int:
        return sum(
            1
            for a in self._arenas
            if isinstance(a, FileArena) and a.plan is not None and a.plan.signature == plan.signature
        )

    def provision(self, plan: RankPlan, directory: str) -> None:
        """After a save into a :class:`FileArena` (now lent to its checkpoint): when no free one
        of ``plan``'s layout is left, make the next one in the background, its pages faulted in,
        so that the next save's copy does not allocate memory while training waits (until the
        ring is whole: ``keep_last`` lent arenas and one free)."""
        with self._cond:
            if self._closed or self._provisioning or self._free_of(plan, files=True) is not None:
                return
            if self._ring_size(plan) > self.lent_limit:
                return  # the ring is whole: retention will free one
            self._provisioning += 1
            if self._provisioner is None:
                self._provisioner = ThreadPoolExecutor(1, thread_name_prefix="ckptd-provision")
            arena_id, ids = self._writer_id(), [self._writer_id() for _ in plan.pieces]
        self._provisioner.submit(self._provide, arena_id, ids, plan, directory)

    def _provide(self, arena_id: int, ids: list[int], plan: RankPlan, directory: str) -> None:
        arena: FileArena | None = None
        try:
            arena = FileArena(arena_id, plan, directory, iter(ids), populate=True)
            for writer_id, segment in arena.writer_segments:
                self.writer.attach_arena(writer_id, segment)
        except Exception:
            logger.debug("ckptd: could not prepare the next staging arena in the background", exc_info=True)
            if arena is not None:
                for writer_id, _ in arena.writer_segments:
                    self.writer.detach_arena(writer_id)
                arena.close()
                arena = None
        finally:
            with self._cond:
                self._provisioning -= 1
                if arena is not None:
                    if self._closed:
                        arena.close()
                    else:
                        self._arenas.append(arena)
                self._cond.notify_all()

    def _writer_id(self) -> int:
        """A new id (arenas and the files of FileArenas share the writer's numbering)."""
        self._next_id += 1
        return self._next_id

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
        provisioner, self._provisioner = self._provisioner, None
        if provisioner is not None:
            with self._cond:
                self._closed = True
            provisioner.shutdown(wait=True)  # an arena being made is closed by its thread
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
        self._provisioner, self._provisioning = None, 0  # its thread is the parent's
        for arena in self._arenas:
            arena.pinned = False  # CUDA is unusable after fork(): the parent unpins its own mapping
            arena.close()
        self._arenas.clear()

    @property
    def bytes_reserved(self) -> int:
        """Bytes of staging memory (lent arenas are their checkpoints' memory)."""
        return sum(a.size for a in self._arenas if not _lent(a))


def _lent(arena: StagingArena) -> bool:
    return isinstance(arena, FileArena) and arena.lent


def _writer_ids(arena: StagingArena) -> list[int]:
    """The ids under which the writer maps ``arena``."""
    if isinstance(arena, FileArena):
        return [writer_id for writer_id, _ in arena.writer_segments]
    return [arena.arena_id]
