"""One save, from the caller's ``async_save`` to the commit, on one rank or many.

Caller's thread (:meth:`Saver.start`): describe the local state, agree on the plan with the
coordinator (:mod:`~ckptd.save.exchange`: digests, a cached plan, this rank's part only), let the
coordinator choose what an incremental save reuses (:mod:`~ckptd.save.incremental`), stage this
rank's pieces into its arena.  Completion thread
(:meth:`Saver.complete`), in the order of the :class:`~ckptd.save.coordinate.Coordinator`
protocol: the coordinator prepares the destination (staging directory, or the object-store
claim), every rank writes its pieces through its writer process and reports, the coordinator
checks every report, combines the per-piece checksums, writes the manifest last (the indexes and
the state file were written while the shards were), and posts the outcome, which the other ranks
wait for; then retention runs.

The module is longer than the usual ~450 lines: the two halves of a save (caller's thread and
completion thread) share the :class:`SaveJob` and the pipelining handshake with the writer, and
splitting them would put one protocol in two places.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..catalog import ManifestCache, spare_files
from ..dist.group import DistContext
from ..errors import ConfigError, WriterError
from ..formats.manifest import Manifest
from ..options import MIN_STREAM_CHUNKS, CheckpointerOptions
from ..request import SaveRequest, SaveResult
from ..retention import RunRecord, apply_retention
from ..stats import new_recorder
from ..storage import Storage
from ..storage.cleanup import Cleanup
from ..storage.held import in_held_memory
from ..storage.liveness import Hold, hold_new_directory
from ..storage.retry import retries_of
from ..writer.client import InProcessWriter, WriterClient
from ..writer.protocol import CopySpec, FileResult, FileSpec, FilesWritten, WriteOrder
from .arena import StageHandle, StagingArena, StepGuard
from .commit import (
    ComponentInfo,
    Descriptions,
    check_destination,
    claim_step,
    finalize_checkpoint,
    write_descriptions,
)
from .coordinate import Coordinator, Outcome, Report, Round, SoloCoordinator, StoreCoordinator
from .describe import Describer, Payload
from .exchange import Exchange, PlanBook, Planned, planned_alone
from .file_arena import FileArena, adoptable, arena_directory
from .file_checksums import combine_pieces, fold_shared_pieces
from .flatten import FlatComponent
from .incremental import IncrementalPolicy, Reuse
from .plan import RankPlan, SavePlan, plan_save
from .side_thread import SideThread
from .staging_pool import StagingPool
from .streamed import RingRoom
from .throttle import StepMonitor

__all__ = ["SaveJob", "Saver"]

logger = logging.getLogger(__name__)


@dataclass
class _Progress:
    """What a save has done so far (the job itself is immutable)."""

    owns_destination: bool = False  # we created the staging dir / won the object-store claim
    released: bool = False  # the arena went back to the pool (exactly once)
    reuse_released: bool = False  # the checkpoint the save takes files from is no longer in use
    retries: int = 0  # object-store requests retried (the writer's and this process's)
    staged_at: float = 0.0  # when the copy into the arena started
    described: Future[Descriptions] | None = None  # the coordinator's indexes and state file, being written
    hold: Hold | None = None  # the staging directory's lock (local): gc leaves it while this process lives


_Method = TypeVar("_Method", bound=Callable[..., Any])


def _collector_paused(method: _Method) -> _Method:
    """Run ``method`` with Python's cyclic garbage collector paused (when it is on).

    Planning and laying out a save allocate a few objects per tensor that live on (descriptions,
    plan records, arena views).  With the collector on, those allocations set off collections
    that traverse the whole heap, the caller's tensors included: with 30,000 tensors that was
    about a quarter of a first save's planning.  Paused, the new objects are looked at once, at
    the first collection after.  The collector is switched back on only if it was on.
    """

    @functools.wraps(method)
    def paused(*args: Any, **kwargs: Any) -> Any:
        if not gc.isenabled():
            return method(*args, **kwargs)
        gc.disable()
        try:
            return method(*args, **kwargs)
        finally:
            gc.enable()

    return paused  # type: ignore[return-value]


@dataclass(frozen=True)
class SaveJob:
    """A staged save waiting for completion."""

    request: SaveRequest
    arena: StagingArena | None
    handle: StageHandle | None
    plan: SavePlan | None  # the whole plan, on the coordinator only
    rank_plan: RankPlan  # what this rank stages and writes
    reuse: Reuse  # files linked or copied from the last checkpoint, or written unless unchanged
    planned: Planned  # the coordinator's: every rank's non-tensor state, for the manifest
    key: str
    staging: str
    metadata: dict[str, Any]
    metrics: dict[str, Any]
    overwrite: bool
    started: float
    staging_mode: str = "blocking"  # one of options.STAGING_MODES, as async_save was given it
    # The writer may start before the copy is over: "pipelined" and "background", and a blocking
    # save into new staging memory (the copy faults its pages in and is slower than the write).
    pipelined: bool = False
    progress: _Progress = field(default_factory=_Progress)


class Saver:
    """The save machinery of one :class:`~ckptd.Checkpointer`: it owns the staging thread and
    the plan cache, and runs each save through its :class:`~ckptd.save.describe.Describer`
    (what this rank holds), :class:`~ckptd.save.incremental.IncrementalPolicy` (what is reused)
    and :class:`~ckptd.save.coordinate.Coordinator` (who commits)."""

    def __init__(
        self,
        *,
        root: str,
        storage: Storage,
        options: CheckpointerOptions,
        writer: WriterClient | InProcessWriter,
        pool: StagingPool,
        cleanup: Cleanup,
        dist: DistContext | None,
        coordinator: Coordinator | None = None,
        steps: StepMonitor | None = None,
    ) -> None:
        self.root = root
        self.storage = storage
        self.options = options
        self.writer = writer
        self.pool = pool
        self.cleanup = cleanup
        self.dist = dist
        self.steps = steps  # the adaptive throttle's step monitor (throttle=True)
        self.rank = dist.rank if dist else 0
        self.describer = Describer(storage, root, dist)
        # This run's commits and the checkpoints its saves in flight read from (retention's view).
        self.run = RunRecord()
        self._retention_lock = threading.Lock()
        self.on_commit: Callable[[int | None, str, RunRecord, bool], object] | None = None
        """Called on the coordinator after each commit, before retention (the tiers' promoter)."""
        self.incremental = IncrementalPolicy(storage, root, options.incremental, self.run)
        self.coordinator: Coordinator = coordinator or (StoreCoordinator(dist) if dist else SoloCoordinator())
        self._plan: SavePlan | None = None  # one process: the last plan, reused for the same layout
        self.exchange: Exchange | None = None
        if dist is not None:
            book = PlanBook(
                options.shard_bytes,
                shared_files=storage.local,
                separate_frozen=bool(options.incremental),
                key_layout=options.key_layout,
            )
            self.exchange = Exchange(dist, root, book)
        self._stager = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptd-stage")
        self._streams: set[RingRoom] = set()  # the rings of streamed saves still being copied
        self._streams_lock = threading.Lock()
        # The coordinator writes the indexes and state file here while the shards are written.
        self._describing = SideThread("ckptd-describe")
        self.guard = StepGuard()
        self.stats = new_recorder(root, self.rank)  # every finished save (read by Checkpointer.stats)
        self._tuning = dataclasses.asdict(options.tuning)  # sent with every write request
        # Parsed manifests of the root, for retention after each commit (here, on the completion
        # thread, or a CheckpointManager's); each commit leaves its own manifest in it.
        self.listed = ManifestCache()
        # A held-memory root keeps the newest checkpoint retention drops as its spare, and each
        # save's files reuse its pages (allocating and clearing new tmpfs pages costs the writer
        # about as much CPU again as the copy itself).
        self.recycles = storage.local and in_held_memory(root)
        # There, a save's shard files are the files it staged into (file_arena): the pool keeps
        # the kept checkpoints' arenas mapped, for the save after their deletion.
        pool.lent_limit = max(1, options.keep_last or 2)

    def apply_keep_last(self) -> None:
        """``keep_last`` once more, on the coordinator: a checkpoint it kept while it was being
        copied to slower tiers goes once its copies are done (called by the promoter's thread
        after each promotion, and at close)."""
        if self.options.keep_last is None or (self.dist is not None and not self.dist.is_coordinator):
            return
        self._retain()

    def _retain(self) -> None:
        """Apply ``keep_last`` (set) to the root, one thread at a time (the completion thread
        after each commit, the promoter's after each copy)."""
        keep_last = self.options.keep_last
        assert keep_last is not None
        with self._retention_lock:
            removed = apply_retention(self.storage, self.root, keep_last, self.run, self.listed, spare=self.recycles)
        if removed:
            logger.info("ckptd: keep_last=%d removed %s", keep_last, ", ".join(removed))

    def close(self, wait: bool = True) -> None:
        """Stop the staging thread (after the copies in flight) and remove the step guard.

        Without ``wait``, a streamed copy still waiting for the writer to free its ring stops
        (its save fails): it could otherwise wait for a stuck writer forever, while a copy into
        an arena of its own always ends by itself."""
        if not wait:
            with self._streams_lock:
                rooms = list(self._streams)
            for room in rooms:
                room.fail(WriterError("the Checkpointer was closed with wait=False while this save was staged"))
        self._stager.shutdown(wait=True)
        self._describing.close()
        self.guard.close()

    # ---- caller's thread --------------------------------------------------------------------

    @_collector_paused
    def start(
        self,
        step: int,
        state: Mapping[str, Any],
        final: str,
        *,
        sharing: Mapping[str, Any] | None,
        allow_pickle: bool,
        overwrite: bool,
        metadata: Mapping[str, Any] | None,
        metrics: Mapping[str, Any] | None,
        started: float,
        staging_mode: str = "blocking",
        frozen: Mapping[str, Iterable[str]] | None = None,
    ) -> SaveJob:
        """Describe, gather, plan and stage; returns the job for :meth:`complete`.

        The copy runs on the staging thread (CUDA copies on a side stream).  ``staging_mode``
        (one of ``STAGING_MODES``, checked by the caller): with ``"background"`` the next
        optimizer step waits for the copy; otherwise the caller queues the job and then waits in
        :meth:`finish_staging`.  With ``"pipelined"`` and ``"background"`` the writer starts on
        the first chunks while the copy goes on; with ``"blocking"`` once the copy is over, unless
        the arena is new memory (a first save without ``prepare()``): that copy also faults the
        pages in, so it is the slower half, and the writer writes the chunks it has copied.
        """
        flats: list[FlatComponent] = []

        def describe() -> Payload:
            flats.extend(self.describer.flatten(state, sharing or {}, allow_pickle, frozen or {}))
            # Local stores: refuse an existing step, or someone's files at a chosen path, now (a
            # stat).  Object stores learn it from the prefix listing and the create-only claim
            # in the completion thread (claim_step), off the caller's critical path.
            if self.describer.is_coordinator and self.storage.local:
                check_destination(final, overwrite=overwrite)
            return self.describer.payload(flats, step, self.incremental.last_path)

        planned = self._agree(describe, f"save of step {step}", final)
        planned_at = time.perf_counter()
        key, rank_plan, reuse = planned.key, planned.rank_plan, planned.reuse
        arena: StagingArena | None = None
        handle: StageHandle | None = None
        waited = 0.0
        staged_at = time.perf_counter()
        request = SaveRequest(step, final)
        pipelined = staging_mode != "blocking"
        try:
            if rank_plan.pieces:
                arena, waited = self.pool.acquire(rank_plan, files_in=self._staging_files(rank_plan, reuse))
                staged_at = time.perf_counter()
                pipelined = pipelined or arena.new_memory
                arena.new_memory = False
                try:
                    tensors = {c.name: c.tensors for c in flats}
                    # Always on the staging thread: the writer starts on the first chunks while
                    # the copy goes on (a blocking save then waits in finish_staging).
                    if arena.streamed:
                        self._check_streamable(arena, rank_plan)
                    handle = arena.stage(
                        tensors,
                        self._stager,
                        frozenset(reuse.reused),
                        after_copy=self.pool.after_copy,
                        stream_chunk=self.options.chunk_bytes,
                    )
                    if handle.room is not None:
                        with self._streams_lock:
                            self._streams.add(handle.room)
                except BaseException:
                    self.pool.release(arena)
                    raise
        except BaseException as e:
            self.incremental.release(reuse)  # this save will not read from any checkpoint
            failure = self.coordinator.fail_early(key, step, e)
            if failure is e:
                raise
            raise failure from e  # what the other ranks raise too, this rank's error as the cause
        done = time.perf_counter()
        request.timings.update(plan=planned_at - started, wait=waited, stage=done - staged_at, blocking=done - started)
        if handle is None or handle.done.is_set():
            request.staged.set()
        elif staging_mode == "background":
            handle.set_when_done(request.staged)  # set before the next optimizer step may go on
            self.guard.add(handle)
        return SaveJob(
            request=request,
            arena=arena,
            handle=handle,
            plan=planned.plan,
            rank_plan=rank_plan,
            reuse=reuse,
            planned=planned,
            key=key,
            staging=planned.staging or final,
            metadata=dict(metadata or {}),
            metrics=dict(metrics or {}),
            overwrite=overwrite,
            started=started,
            staging_mode=staging_mode,
            pipelined=pipelined,
            progress=_Progress(staged_at=staged_at),
        )

    def _check_streamable(self, arena: StagingArena, rank_plan: RankPlan) -> None:
        """A save streamed through ``arena``: S3 uploads whole parts, several at once, so the
        ring must hold :data:`MIN_STREAM_CHUNKS` of the largest."""
        if not getattr(self.storage, "uploads_parts", False):
            return
        tuning = self.options.tuning
        part = max(tuning.part_size_for(p.size) for p in rank_plan.pieces)
        if arena.size < MIN_STREAM_CHUNKS * part:
            raise ConfigError(
                f"staging_memory={arena.size} bytes cannot stream this save to {self.root}: uploads go in "
                f"parts of {part} bytes and the staging ring must hold {MIN_STREAM_CHUNKS} of them "
                f"({MIN_STREAM_CHUNKS * part} bytes); raise staging_memory or lower part_size"
            )

    def finish_staging(self, job: SaveJob) -> None:
        """A blocking save, after its job was queued (the writer may already be writing): wait
        for the copy and raise what it raised, as a blocking copy always did; under
        torch.distributed, what every rank raises for the save (its error as the cause)."""
        handle = job.handle
        if handle is None:
            return
        handle.done.wait()
        now = time.perf_counter()
        job.request.timings.update(stage=now - job.progress.staged_at, blocking=now - job.started)
        error = handle.error
        if error is None:
            job.request.staged.set()
            return
        # Under torch.distributed the round's outcome says what every rank raises; a streamed
        # copy stops when its save does, and the save's own error says why.
        if self.dist is not None or handle.room is not None:
            try:
                job.request.result()  # the round's outcome: the other ranks learn of the failure there
            except BaseException as failure:
                if failure is not error:
                    raise failure from error
        raise error

    @_collector_paused
    def prepare(self, state: Mapping[str, Any], *, sharing: Mapping[str, Any] | None, allow_pickle: bool) -> int:
        """Plan ``state`` and allocate its staging arena now (collective like a save); returns
        the arena's size.  The first save of the same layout then only copies."""
        describer = self.describer
        last = self.incremental.last_path
        planned = self._agree(
            lambda: describer.payload(describer.flatten(state, sharing or {}, allow_pickle), 0, last), "prepare", None
        )
        rank_plan = planned.rank_plan
        if not rank_plan.pieces:
            return 0
        files_in = self._staging_files(rank_plan, planned.reuse)
        arena, _ = self.pool.acquire(rank_plan, populate=True, files_in=files_in)
        self.pool.release(arena)
        if files_in is not None:  # a held root: the whole ring of staging files
            self.pool.fill_ring(rank_plan, files_in)
        self.writer.ensure_running()  # hands the arena to the writer now, not at the first save
        return arena.size

    def _staging_files(self, rank_plan: RankPlan, reuse: Reuse) -> str | None:
        """Where this save stages into files that become its shard files (a held-memory root,
        :mod:`ckptd.save.file_arena`), or ``None`` for a shared-memory arena: a budget, a
        reused or compared file, or a file shared with other ranks keeps the writer's copy."""
        if not self.recycles or self.pool.budget is not None or reuse.reused or reuse.hashed:
            return None
        return arena_directory(self.root) if adoptable(rank_plan) else None

    @property
    def last_rank_plan(self) -> RankPlan | None:
        """What this rank wrote (or would write) in the last planned save."""
        if self.exchange is not None:
            return self.exchange.rank_plan
        return self._plan.ranks[0] if self._plan is not None else None

    def _agree(self, describe: Callable[[], Payload], what: str, final: str | None) -> Planned:
        """This rank's part of the plan (and, on the coordinator, the whole plan); ``final`` is
        the destination of a save (``None`` when only preparing: nothing is reused)."""

        def select(plan: SavePlan, last_committed: list[str | None]) -> Reuse:
            return self.incremental.select(plan, final, last_committed) if final else Reuse({}, {})

        if self.exchange is not None:
            return self.exchange.run(describe, what, select)
        payload = describe()
        plan = self._plan_for(payload.locals)
        return planned_alone(payload, plan, select(plan, [payload.last_committed]))

    def _plan_for(self, locals_: Sequence[Any]) -> SavePlan:
        separate = bool(self.options.incremental)
        # plan_save's own signature (key_layout is fixed for the Saver's life, so it is not part of it)
        signature = (self.options.shard_bytes, self.storage.local, separate, ((tuple(locals_)),))
        if self._plan is not None and self._plan.signature == signature:
            return self._plan
        self._plan = plan_save(
            [locals_],
            self.options.shard_bytes,
            shared_files=self.storage.local,
            separate_frozen=separate,
            key_layout=self.options.key_layout,
        )
        return self._plan

    # ---- completion thread -------------------------------------------------------------------

    def complete(self, job: SaveJob) -> SaveResult:
        """Write this rank's pieces and take part in the commit; raises on any rank's failure.
        Either way the save is recorded in :attr:`stats` before this returns."""
        try:
            result = self._complete(job)
        except BaseException as e:
            if job.reuse.holders:
                self.incremental.forget_if_gone()  # a source deleted under the save is not tried again
            timings = {**job.request.timings, "total": time.perf_counter() - job.started}
            self.stats.record_failure(
                job.request.step, job.request.path, e, timings=timings, retries=job.progress.retries
            )
            raise
        self.stats.record_result(result)
        return result

    def _complete(self, job: SaveJob) -> SaveResult:
        timings = dict(job.request.timings)
        retries_before = retries_of(self.storage)  # claim/commit requests made in this process

        def count_retries() -> None:
            nonlocal retries_before
            now = retries_of(self.storage)
            job.progress.retries += now - retries_before
            retries_before = now

        round_ = Round(job.key, job.request.step, time.monotonic())
        coordinator = self.coordinator
        # Published before _finish records it in the run's timeline: meanwhile a retention on
        # another thread (the promoter's, after a copy) would rank it as an older run's
        # checkpoint and could delete it.  In use until then, it is never a candidate.
        self.run.acquire([job.request.path])
        try:
            try:
                coordinator.prepare(round_, lambda: self._prepare(job))
                self._describe_early(job)
                written = self._write(job, timings)
                # Other ranks report one result per shared file, not per piece (W x tensors).
                report = Report(
                    fold_shared_pieces(job.rank_plan, written, job.reuse.reused)
                    if self.dist is not None
                    else tuple(written)
                )
            except BaseException as e:  # noqa: BLE001 - reported, then raised by outcome()
                report = Report(error=e)
            finally:
                self._release(job)
            coordinator.report(round_, report)
            outcome = coordinator.outcome(
                round_,
                report,
                commit=lambda results: self._commit(job, results, timings),
                abort=lambda: self._discard(job),
            )
            count_retries()
            return self._finish(job, outcome)
        finally:
            count_retries()
            self._settle_descriptions(job)
            if job.progress.hold is not None:
                job.progress.hold.release()  # published or discarded by now
            self._release_reuse(job)
            self.run.release([job.request.path])

    def _prepare(self, job: SaveJob) -> None:
        if job.overwrite:
            self.incremental.refuse_overwriting_referenced(job.request.path)
        if not self.storage.local:
            claim_step(self.storage, job.request.path, overwrite=job.overwrite)
        job.progress.owns_destination = True
        if self.storage.local:  # locked until the save is published or discarded (storage.liveness)
            job.progress.hold = hold_new_directory(job.staging, self.storage.makedirs)
        else:
            self.storage.makedirs(job.staging)
        assert job.plan is not None, "only the coordinator prepares the destination"
        for subdirectory in sorted({f.file_name.rpartition("/")[0] for f in job.plan.files} - {""}):
            self.storage.makedirs(self.storage.join(job.staging, subdirectory))  # key_layout="spread"

    def _components(self, job: SaveJob) -> list[ComponentInfo]:
        planned = job.planned
        return [
            ComponentInfo(name, "safetensors", planned.tied[name], sharing=planned.sharing[name])
            for name in planned.trees
        ]

    def _describe_early(self, job: SaveJob) -> None:
        """The coordinator: write the indexes and state file into the staging directory on their
        own thread while the shards are written (they need the plan only), once the copy into
        the arena is over: encoding the state file holds the GIL (json's C encoder) that the copy
        loop needs, which made blocking longer for states of many tensors (docs/benchmarks.md)."""
        plan = job.plan
        if plan is None:
            return
        staged = job.handle.done if job.handle is not None else None
        components = self._components(job)

        def describe() -> Descriptions:
            if staged is not None:
                staged.wait()  # set when the copy ends, failed or not
            return write_descriptions(
                self.storage,
                job.staging,
                tensors=plan.tensors,
                components=components,
                trees=job.planned.trees,
                fsync=self.options.fsync,
            )

        job.progress.described = self._describing.submit(describe)

    def _settle_descriptions(self, job: SaveJob) -> None:
        """Wait until the early description writes are over (before a clean-up removes their
        directory, and before the save returns); their error, if any, was the commit's to raise."""
        if job.progress.described is not None:
            wait([job.progress.described])

    def _discard(self, job: SaveJob) -> None:
        """Remove what a failed save wrote, but only if the destination is ours: a save that lost
        the object-store claim (or never made it) must not delete another save's checkpoint."""
        self._settle_descriptions(job)
        if job.progress.owns_destination:
            self.cleanup.discard(job.staging)

    def _write(self, job: SaveJob, timings: dict[str, float]) -> list[FileResult]:
        """Have the writer write this rank's pieces.  A pipelined save whose copy is still running
        sends a pipelined request: the writer starts on the first files and is told, chunk by
        chunk, how far the copy has got (:meth:`~ckptd.save.arena.StageHandle.feed`).  Any other
        save sends its request once the copy is over."""
        handle = job.handle
        room = handle.room if handle is not None else None  # a streamed save
        if handle is not None and not job.pipelined and room is None:
            handle.done.wait()  # the copy runs alone; its error is raised below (handle.wait())
        started = time.perf_counter()
        writing = False
        try:
            files, copies = self._file_specs(job)
            if handle is not None and (not files or (handle.done.is_set() and room is None) or handle.error):
                handle.wait()  # the bytes must be in the arena (raises what the copy raised)
            if not files and not copies:
                return []
            resume = False
            if self.steps is not None:
                # Training goes on: the writer starts at the limit it learned in earlier saves.
                resume, writing = self.steps.writing_started(), True
            order = WriteOrder(
                # A FileArena's files are attached one by one (FileSpec.adopt); arena 0 is none
                arena_id=job.arena.arena_id if job.arena is not None and not isinstance(job.arena, FileArena) else 0,
                directory=job.staging,
                files=files,
                copies=copies,
                storage_options=self.options.storage_options,
                fsync=self.options.fsync,
                chunk_size=self.options.chunk_bytes,
                threads=self.options.write_threads or 1,  # filled in by for_location()
                abandon_directory=job.staging,
                tuning=self._tuning,
                resume_throttle=resume,
                streamed=room is not None,
            )
            if handle is None or (handle.done.is_set() and room is None):
                written = self.writer.write_files(order).result()
            else:
                end = max(f.arena_offset + f.size for f in files)
                pending = self.writer.write_pipelined(handle.staged_upto, order, room.free if room else None)
                if room is not None:
                    pending.future.add_done_callback(lambda done: _writer_stopped(done, room))
                written = handle.feed(pending, end)
        finally:
            if writing and self.steps is not None:
                self.steps.writing_finished()
            self._release(job)
            timings["write"] = time.perf_counter() - started
        if not isinstance(written, FilesWritten):
            raise WriterError(f"unexpected writer answer {written!r}")
        job.progress.retries += written.retries
        if written.throttled:
            timings["throttled"] = written.throttled
        return list(written.results)

    def _file_specs(self, job: SaveJob) -> tuple[list[FileSpec], list[CopySpec]]:
        """What this rank's writer writes from the arena, and what it makes from the last
        checkpoint's files (the rank holding a reused file's first bytes makes it)."""
        hash_mode = self.options.incremental == "hash"
        # A streamed save writes unchanged files too: comparing needs a file's every byte at once.
        compare = job.arena is None or not job.arena.streamed
        files: list[FileSpec] = []
        copies: list[CopySpec] = []
        spares = spare_files(self.root) if self.recycles else {}
        for p in job.rank_plan.pieces:
            reused = job.reuse.reused.get(p.file_name)
            if reused is not None:
                if p.file_offset == 0:
                    crc = int(reused.crc32c, 16)
                    copies.append(CopySpec(p.file_name, reused.source, reused.size, crc, reused.digest))
                continue
            hashed = job.reuse.hashed.get(p.file_name) if p.whole_file and compare else None
            adopt = job.arena.writer_id(p.file_name) if isinstance(job.arena, FileArena) else None
            recycle = spares.get(p.file_name) if p.whole_file and hashed is None and adopt is None else None
            files.append(
                FileSpec(
                    p.file_name,
                    p.arena_offset,
                    p.size,
                    p.file_offset,
                    p.whole_file,
                    digest=hash_mode and p.whole_file,
                    unchanged_if=hashed.digest if hashed is not None else None,
                    source=hashed.source if hashed is not None else None,
                    recycle=recycle,
                    adopt=adopt,
                )
            )
        return files, copies

    def _release_reuse(self, job: SaveJob) -> None:
        """The save no longer reads the checkpoint it takes files from (once per save)."""
        if not job.progress.reuse_released:
            job.progress.reuse_released = True
            self.incremental.release(job.reuse)

    def _release(self, job: SaveJob) -> None:
        """Give the arena back, once per save (after a background copy into it has finished)."""
        if job.arena is not None and not job.progress.released:
            job.progress.released = True
            if job.handle is not None:
                room = job.handle.room
                if room is not None:  # a streamed copy waiting for a writer that is done
                    room.fail(WriterError(f"the save of step {job.request.step} ended before it was written"))
                job.handle.done.wait()
                if room is not None:
                    with self._streams_lock:
                        self._streams.discard(room)
            self.pool.release(job.arena)

    def _commit(self, job: SaveJob, results: Sequence[FileResult], timings: dict[str, float]) -> Manifest:
        # A blocking save measured its copy (finish_staging) after this thread took the timings.
        timings.update({k: job.request.timings[k] for k in ("stage", "blocking") if k in job.request.timings})
        plan = job.plan
        if plan is None:
            raise RuntimeError("only the coordinator commits")
        described = job.progress.described.result() if job.progress.described is not None else None
        return finalize_checkpoint(
            self.storage,
            job.staging,
            job.request.path,
            step=job.request.step,
            written=combine_pieces(plan, results, job.reuse.reused, job.reuse.hashed),
            expected_sizes={f.file_name: f.size for f in plan.files},
            tensors=plan.tensors,
            components=self._components(job),
            trees=job.planned.trees,
            metadata=job.metadata,
            metrics=job.metrics,
            timings=timings,
            overwrite=job.overwrite,
            fsync=self.options.fsync,
            world_size=plan.world_size,
            described=described,
            listed=self.listed,
        )

    def _finish(self, job: SaveJob, outcome: Outcome) -> SaveResult:
        manifest = outcome.manifest
        path = job.request.path
        bytes_written, bytes_linked, bytes_copied = outcome.bytes_written, 0, 0
        # First: a save planned from now on takes its files from this checkpoint, and retention
        # counts it as this run's newest.
        self.incremental.committed(path, manifest)
        self.run.committed(path)
        self._release_reuse(job)  # its files are linked or copied: retention may delete their source
        if manifest is not None and self.on_commit is not None:
            self.on_commit(job.request.step, path, self.run, job.overwrite)  # slower tiers (ckptd.tiers)
        if manifest is not None:
            if self.options.keep_last is not None:
                self._retain()
            job.request.timings.update(manifest.timings)
            files = manifest.files.values()
            bytes_written = sum(f.size for f in files if f.reused is None)
            bytes_linked = sum(f.size for f in files if f.reused == "link")
            bytes_copied = sum(f.size for f in files if f.reused in ("copy", "server_copy"))
        if isinstance(job.arena, FileArena):  # the next save's files, made in the background
            self.pool.provision(job.rank_plan, arena_directory(self.root))
        job.request.timings["total"] = time.perf_counter() - job.started
        return SaveResult(
            job.request.step,
            path,
            bytes_written,
            dict(job.request.timings),
            bytes_linked + bytes_copied,
            job.progress.retries,
            bytes_linked=bytes_linked,
            bytes_copied=bytes_copied,
        )


def _writer_stopped(done: Future[Any], room: RingRoom) -> None:
    """A streamed save's write ended: if it failed, the copy waiting for room gets its error."""
    error = done.exception()
    if error is not None:
        room.fail(error)
