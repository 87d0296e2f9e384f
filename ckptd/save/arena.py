"""The staging arenas: where ``async_save`` snapshots tensors before the writer persists them.

An arena is one shared-memory segment (see :mod:`ckptd.writer.shm`) laid out by a rank's
:class:`~ckptd.save.plan.RankPlan`: every piece of a file the rank writes (a whole shard file,
header included, on a single rank) is one contiguous slice in file order, so the writer streams
it with no further copy.  Arenas are created once and
reused while the state's layout fits; when CUDA is available they are page-locked with
``cudaHostRegister`` so device→host copies run at full speed.  A pool of ``max_in_flight`` arenas
(:mod:`ckptd.save.staging_pool`) provides back-pressure: a save waits while all of them are
still being written.

Staging returns a :class:`StageHandle`.  In blocking mode the bytes are in the arena when it
returns.  In background mode CPU tensors are copied by a staging thread, in arena order, and the
handle's watermark (:meth:`StageHandle.wait_staged`) says how far the copy has got, so the
writer can write the first files while the last are still being copied; CUDA tensors are copied by
``non_blocking`` copies on a dedicated stream (ordered after the caller's current stream; a CUDA
event marks the end), so the call returns at once; :class:`StepGuard` then makes the next
optimizer step wait for the copies (on CUDA, by making the step's stream wait on the event, so
not even the CPU blocks).

A plan larger than its arena (a ``staging_memory`` budget smaller than the save) is staged as a
stream through the arena used as a ring (:mod:`ckptd.save.streamed`): always on the staging
thread, always pipelined, the handle's :class:`~ckptd.save.streamed.RingRoom` receiving what
the writer has freed.
"""

from __future__ import annotations

import logging
import mmap
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from typing import Any

import torch

from ..errors import CkptdError, WriterError
from ..writer.client import PendingWrite
from ..writer.shm import SharedSegment
from .arena_views import ArenaView, lay_out_piece
from .plan import ARENA_ALIGNMENT, RankPlan
from .streamed import RingRoom, StreamPart, copy_streamed, stream_parts

__all__ = [
    "StageHandle",
    "StagingArena",
    "StepGuard",
    "arena_bytes",
    "largest_arena",
    "pin_pages",
    "unpin_pages",
]

logger = logging.getLogger(__name__)

_GROWTH_ALIGNMENT = 2 * 1024 * 1024
_PUBLISH_BYTES = 4 * 1024 * 1024  # the staging thread moves the watermark in steps of at least this
_STREAM_CHUNK = 16 * 1024 * 1024  # bytes per copy of a streamed save, unless stage() is told

AfterCopy = Callable[[str, str], None]


class StagingArena:
    """One shared-memory segment and the typed tensor views of its current layout."""

    def __init__(self, arena_id: int, size: int, populate: bool = True, limit: int | None = None) -> None:
        self.arena_id = arena_id
        aligned = arena_bytes(size, limit)  # a budget (limit): whole pages, never above it
        self.segment = SharedSegment.create(aligned)  # reserved (fallocate) either way
        self.plan: RankPlan | None = None
        self.busy = False
        self.last_used = 0  # the pool's count of saves when one last staged here
        # No copy has faulted its pages in yet (not pre-faulted): the next save's copy is slower
        # than its write, so that save writes each chunk as soon as it is copied (Saver.start).
        self.new_memory = not populate
        self._base: torch.Tensor | None = torch.frombuffer(self.segment.mmap, dtype=torch.uint8)
        if populate:
            # Pre-faulted: the first copy then only copies.  The pages are faulted in by writing
            # zeros over them (they are zero already) on torch's threads: 0.70-0.78 s per GiB
            # here, fallocate included, against 1.05-1.13 s with MAP_POPULATE (one kernel thread).
            # A save that creates its arena does not pre-fault it: its first copy faults the
            # pages in while the writer already writes the chunks copied before.
            self._base.zero_()
        self._views: list[ArenaView] = []
        self._stream_parts: list[StreamPart] = []  # a streamed plan's parts (then no views)
        self._stream: Any = None
        self.pinned = pin_pages(self._base)

    @property
    def size(self) -> int:
        return self.segment.size

    @property
    def streamed(self) -> bool:
        """The current plan is larger than the arena: it is staged as a stream through it."""
        return self.plan is not None and self.plan.arena_size > self.size

    def layout(self, plan: RankPlan) -> None:
        """Lay the arena out for ``plan`` (headers written, tensor views built) unless it already
        is; a plan larger than the arena is streamed through it (its parts listed instead)."""
        if self.plan is not None and self.plan.signature == plan.signature:
            return
        base = self._require_base()
        if plan.arena_size > self.size:
            self._views = []
            self._stream_parts = stream_parts(plan)
            self.plan = plan
            return
        self._stream_parts = []
        views: list[ArenaView] = []
        typed: dict[str, tuple[torch.Tensor, int]] = {}  # dtype name -> the arena as that dtype, item size
        strides: dict[tuple[int, ...], tuple[int, ...]] = {}  # shape -> contiguous strides
        for piece in plan.pieces:
            lay_out_piece(base, piece.arena_offset, piece, views, typed, strides)
        views.sort(key=lambda v: v[0])  # copied in arena order: the watermark only moves forward
        self._views = views
        self.plan = plan

    def stage(
        self,
        tensors: Mapping[str, Mapping[str, torch.Tensor]],
        background: Executor | None = None,
        skip_files: frozenset[str] = frozenset(),
        after_copy: AfterCopy | None = None,
        stream_chunk: int = _STREAM_CHUNK,
    ) -> StageHandle:
        """Copy every planned local tensor (``tensors[component][key]``) into its arena slot,
        except those of ``skip_files`` (reused by an incremental save).

        A streamed plan (:attr:`streamed`) is copied on ``background`` (required) in chunks of
        ``stream_chunk`` bytes, as the writer frees the ring; the handle's ``room`` receives the
        writer's notices.

        Without ``background`` the copies are done (and CUDA ones synchronised) on return.  With
        an executor, CPU copies run on it in arena order, moving the handle's watermark, and CUDA
        copies are queued on a side stream (the watermark then moves only at the end); the
        returned handle's ``done`` is set once every byte is in the arena.  ``after_copy(component,
        key)`` runs after each CPU copy (a test seam: it may block or raise).
        """
        plan = self.plan
        if plan is None:
            raise WriterError(f"staging arena {self.arena_id} has no layout: call layout(plan) before stage()")
        if self.streamed:
            return self._stage_streamed(tensors, background, skip_files, after_copy, stream_chunk)
        cpu: list[tuple[int, torch.Tensor, torch.Tensor, str, str]] = []
        cuda: list[tuple[torch.Tensor, torch.Tensor]] = []
        for start, file_name, component, key, view in self._views:
            if file_name in skip_files:
                continue
            source = tensors[component][key]
            if source.is_cuda:
                cuda.append((view, source))
            else:
                cpu.append((start, view, source, component, key))
        handle = StageHandle(plan.arena_size, self.arena_id)
        if cuda:
            handle.cuda_event = self._queue_cuda_copies(cuda)
        elif cpu:
            handle.staged_upto = cpu[0][0]  # headers and skipped files before it are in place
        # After copy i, everything below the start of copy i + 1 is staged.
        ready_after = [c[0] for c in cpu[1:]] + [plan.arena_size] if cpu else []

        def copy_cpu() -> None:
            try:
                published = handle.staged_upto
                track = handle.cuda_event is None
                for (_, view, source, component, key), ready in zip(cpu, ready_after, strict=True):
                    view.copy_(source)
                    if after_copy is not None:
                        after_copy(component, key)
                    if track and ready - published >= _PUBLISH_BYTES:
                        handle.publish(ready)
                        published = ready
                if handle.cuda_event is not None:
                    handle.cuda_event.synchronize()
            except BaseException as e:  # noqa: BLE001 - raised by the handle's wait()
                handle.error = e
            finally:
                handle.finish()

        if background is None:
            copy_cpu()
            handle.wait()
        else:
            handle.cpu_pending = bool(cpu)
            handle.background = True
            background.submit(copy_cpu)
        return handle

    def _stage_streamed(
        self,
        tensors: Mapping[str, Mapping[str, torch.Tensor]],
        background: Executor | None,
        skip_files: frozenset[str],
        after_copy: AfterCopy | None,
        chunk: int,
    ) -> StageHandle:
        plan = self.plan
        assert plan is not None
        if background is None:
            raise WriterError("a streamed save is staged on the staging thread, beside its writer")
        base = self._require_base()
        handle = StageHandle(plan.arena_size, self.arena_id)
        room = handle.room = RingRoom(self.size)
        handle.background = True
        handle.cpu_pending = True  # the next optimizer step waits for the copy itself
        parts = self._stream_parts

        def copy() -> None:
            try:
                copy_streamed(
                    base,
                    parts,
                    tensors,
                    skip_files=skip_files,
                    room=room,
                    publish=handle.publish,
                    chunk=min(chunk, self.size // 4),
                    publish_bytes=chunk,  # the writer reads whole chunks: smaller steps only wake it
                    cuda_stream=self._cuda_stream,
                    pinned=self.pinned,
                    after_copy=after_copy,
                )
            except BaseException as e:  # noqa: BLE001 - raised by the handle's wait()
                handle.error = e
            finally:
                handle.finish()

        background.submit(copy)
        return handle

    def _cuda_stream(self, device: torch.device) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        return self._stream

    def _queue_cuda_copies(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """Queue device→host copies on a side stream after the caller's work; returns their event."""
        device = copies[0][1].device
        stream = self._cuda_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for view, source in copies:
                view.copy_(source, non_blocking=self.pinned)
                source.record_stream(stream)  # keep the caching allocator from reusing it early
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def close(self) -> None:
        """Drop the views, unpin and unmap; memory is freed once the writer unmaps too."""
        self._views = []
        self._stream_parts = []
        self.plan = None
        if self._base is not None and self.pinned:
            unpin_pages(self._base)
        self._base = None
        self.segment.close()

    def _require_base(self) -> torch.Tensor:
        if self._base is None:
            raise WriterError(f"staging arena {self.arena_id} is closed (its Checkpointer was closed)")
        return self._base


class StageHandle:
    """The copy of one save into its arena: ``done`` is set once every byte is there, and
    ``staged_upto`` (the watermark) is the arena offset below which every byte already is."""

    def __init__(self, size: int = 0, arena_id: int = 0) -> None:
        self.arena_id = arena_id
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.cuda_event: Any = None
        self.cpu_pending = False
        self.size = size
        self.background = False  # a copy on the staging thread (its error reaches wait() wrapped)
        self.staged_upto = 0
        self.room: RingRoom | None = None  # a streamed save: what the writer has freed of the ring
        self._cond = threading.Condition()
        self._on_finish: list[threading.Event] = []

    def publish(self, upto: int) -> None:
        """The staging thread: the arena bytes below ``upto`` are in place."""
        with self._cond:
            self.staged_upto = upto
            self._cond.notify_all()

    def finish(self) -> None:
        """The staging thread: the copy ended (``error`` says whether it failed)."""
        with self._cond:
            if self.error is None:
                self.staged_upto = self.size
            for event in self._on_finish:
                event.set()
            self.done.set()
            self._cond.notify_all()

    def set_when_done(self, event: threading.Event) -> None:
        """Set ``event`` when the copy ends, before ``done``: whoever waited for ``done`` (an
        optimizer step held by :class:`StepGuard`) then finds ``event`` set too."""
        with self._cond:
            if self.done.is_set():
                event.set()
            else:
                self._on_finish.append(event)

    def wait(self) -> None:
        """Block until the copies finished; raise what the copy raised."""
        self.done.wait()
        self._raise_error()

    def _raise_error(self) -> None:
        """Raise the copy's error; a background copy's as a WriterError (the caller sees it from
        ``wait()``, long after ``async_save`` returned), the original as its cause."""
        error = self.error
        if error is None:
            return
        if not self.background or isinstance(error, CkptdError):
            raise error
        raise WriterError(
            f"copying the state into staging arena {self.arena_id} failed ({type(error).__name__}: {error}); "
            "the save was abandoned and nothing was committed"
        ) from error

    def wait_staged(self, target: int) -> int:
        """Block until the watermark reaches ``target`` or the copy ends; returns the watermark.
        Raises what the copy raised."""
        with self._cond:
            while self.staged_upto < target and not self.done.is_set():
                self._cond.wait()
        self._raise_error()
        return self.staged_upto

    def feed(self, pending: PendingWrite, end: int) -> Any:
        """Tell the writer of ``pending`` how far the copy has got, each time the watermark moves
        (by at least ``_PUBLISH_BYTES``, or to the end), until every byte below ``end`` is staged;
        then return its answer.  If the copy fails, the writer abandons the request (removing the
        file it was writing) and the copy's error is raised."""
        try:
            while pending.staged < end:  # what the writer knows, not what this handle knew earlier
                upto = self.wait_staged(pending.staged + 1)
                if upto > pending.staged:
                    pending.advance(upto)
        except BaseException as e:
            pending.abort(e)
            try:
                pending.future.result()
            except Exception:
                logger.debug("ckptd: the writer abandoned a pipelined write after a staging failure", exc_info=True)
            raise
        return pending.future.result()


class StepGuard:
    """Makes every optimizer step wait for the background copies still in flight.

    One global optimizer step pre-hook is installed on first use and removed by :meth:`close`
    (hooks are never added or removed while a step may be running them).  A step waits for the
    CPU copies; for copies that are only CUDA it makes the current stream wait on their event
    instead, so the CPU goes on.
    """

    def __init__(self) -> None:
        self._pending: list[StageHandle] = []
        self._lock = threading.Lock()
        self._hook: Any = None

    def add(self, handle: StageHandle) -> None:
        with self._lock:
            self._pending.append(handle)
            if self._hook is None:
                from torch.optim.optimizer import register_optimizer_step_pre_hook

                self._hook = register_optimizer_step_pre_hook(self._before_step)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        with self._lock:
            pending = [h for h in self._pending if not h.done.is_set()]
            self._pending = pending
        for handle in pending:
            if handle.cuda_event is not None and not handle.cpu_pending:
                torch.cuda.current_stream().wait_event(handle.cuda_event)
            else:
                handle.done.wait()

    def close(self) -> None:
        with self._lock:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            self._pending.clear()


def largest_arena(limit: int) -> int:
    """The largest arena a budget of ``limit`` bytes allows (whole pages)."""
    return max(ARENA_ALIGNMENT, limit // ARENA_ALIGNMENT * ARENA_ALIGNMENT)


def arena_bytes(size: int, limit: int | None) -> int:
    """The bytes :class:`StagingArena` maps for a plan of ``size`` under the budget ``limit``."""
    aligned = -(-size // _GROWTH_ALIGNMENT) * _GROWTH_ALIGNMENT
    if limit is not None and aligned > limit:
        aligned = largest_arena(limit)
    return max(aligned, mmap.PAGESIZE)


def pin_pages(base: torch.Tensor) -> bool:
    """Page-lock ``base``'s memory for CUDA copies (``cudaHostRegister``); False without CUDA or
    when the driver refuses (the memory then stays pageable)."""
    if not torch.cuda.is_available():
        return False
    result = torch.cuda.cudart().cudaHostRegister(base.data_ptr(), base.numel(), 0)
    if int(result) != 0:
        logger.warning("cudaHostRegister failed (%s); staging arena stays pageable", result)
        return False
    return True


def unpin_pages(base: torch.Tensor) -> None:
    """Undo :func:`pin_pages`."""
    torch.cuda.cudart().cudaHostUnregister(base.data_ptr())
