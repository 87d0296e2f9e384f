"""One save, from the caller's ``async_save`` to the commit, on one rank or many.

Caller's thread (:meth:`Saver.start`): describe the local state, gather every rank's description
(the single collective), plan, stage this rank's pieces into its arena.  Completion thread
(:meth:`Saver.complete`): the coordinator prepares the destination (staging directory, or the
object-store claim), every rank writes its pieces through its writer process and reports to the
c10d store, the coordinator checks every report, combines the per-piece checksums, writes the
indexes, the state file and the manifest last, and posts the outcome, which the other ranks wait
for.  Every wait has a deadline, and a rank that does not report is named in the error.
"""

from __future__ import annotations

import collections
import dataclasses
import fnmatch
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..catalog import apply_retention, list_checkpoints, read_manifest
from ..dist.group import DistContext, Sharing, normalize_sharing, rank_failure
from ..errors import (
    CheckpointExistsError,
    CkptdError,
    ConfigError,
    CorruptCheckpointError,
    DistributedSaveError,
    WriterError,
)
from ..formats.checksum import crc32c_combine, format_crc
from ..formats.manifest import FileRecord, Manifest
from ..formats.names import MANIFEST_NAME, staging_dir_name
from ..formats.torch_dtypes import dtype_name
from ..options import CheckpointerOptions
from ..request import SaveRequest, SaveResult
from ..storage import Storage
from ..storage.cleanup import Cleanup
from ..writer.client import InProcessWriter, WriterClient
from ..writer.protocol import FileResult, FileSpec, FilesWritten
from .arena import StageHandle, StagingArena, StagingPool, StepGuard
from .commit import ComponentInfo, claim_step, finalize_checkpoint
from .flatten import FlatComponent, flatten_component
from .plan import LocalTensor, RankPlan, SavePlan, plan_save

__all__ = ["SaveJob", "Saver", "combine_pieces"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Payload:
    """What one rank contributes to the plan (sent to every rank; picklable)."""

    rank: int
    locals: tuple[LocalTensor, ...] = ()
    trees: dict[str, Any] = field(default_factory=dict)
    tied: dict[str, list[list[str]]] = field(default_factory=dict)
    sharing: dict[str, str] = field(default_factory=dict)
    token: str = ""
    staging: str = ""
    last_committed: str | None = None  # the save an incremental save may reuse files of
    error: tuple[str, str] | None = None  # (exception type name, message)


@dataclass
class _Progress:
    """What a save has done so far (the job itself is immutable)."""

    owns_destination: bool = False  # we created the staging dir / won the object-store claim
    released: bool = False  # the arena went back to the pool (exactly once)


@dataclass(frozen=True)
class SaveJob:
    """A staged save waiting for completion."""

    request: SaveRequest
    arena: StagingArena | None
    handle: StageHandle | None
    plan: SavePlan
    reused: dict[str, FileRecord]  # files not written: the previous save's, referenced
    hashed: dict[str, FileRecord]  # files written unless their CRC32C matches the previous save's
    payloads: tuple[_Payload, ...]
    key: str
    staging: str
    metadata: dict[str, Any]
    metrics: dict[str, Any]
    overwrite: bool
    started: float
    progress: _Progress = field(default_factory=_Progress)


def _describe(flat: FlatComponent) -> list[LocalTensor]:
    out = []
    for key, tensor in flat.tensors.items():
        dtype = dtype_name(tensor.dtype, f"{flat.name}.{key}")
        placement = flat.placements.get(key)
        if placement is None:
            shape = tuple(tensor.shape)
            out.append(LocalTensor(flat.name, key, dtype, shape, (0,) * len(shape), shape, frozen=key in flat.frozen))
        else:
            out.append(
                LocalTensor(
                    flat.name,
                    key,
                    dtype,
                    placement.global_shape,
                    placement.offset,
                    tuple(tensor.shape),
                    sharded=True,
                    main=placement.main,
                )
            )
    return out


def _error_of(payloads: Sequence[_Payload]) -> dict[int, tuple[str, str]]:
    return {p.rank: p.error for p in payloads if p.error is not None}


class Saver:
    """The save machinery of one :class:`~ckptd.Checkpointer`."""

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
    ) -> None:
        self.root = root
        self.storage = storage
        self.options = options
        self.writer = writer
        self.pool = pool
        self.cleanup = cleanup
        self.dist = dist
        self.rank = dist.rank if dist else 0
        self._plan: SavePlan | None = None
        self._last_path: str | None = None  # the last committed save (incremental saves reuse its files)
        self._last_manifest: Manifest | None = None
        self._patterns: dict[str, str] = {}  # stored component name -> sharing pattern
        self._references: collections.Counter[str] = collections.Counter()  # checkpoints queued saves reuse files of
        self._stager = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptd-stage")
        self.guard = StepGuard()

    def close(self) -> None:
        """Stop the staging thread (after the copies in flight) and remove the step guard."""
        self._stager.shutdown(wait=True)
        self.guard.close()

    # ---- caller's thread --------------------------------------------------------------------

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
        background: bool = False,
        frozen: Mapping[str, Iterable[str]] | None = None,
    ) -> SaveJob:
        """Describe, gather, plan and stage; returns the job for :meth:`complete`.

        With ``background`` the copy runs on the staging thread (CUDA copies on a side stream)
        and the next optimizer step waits for it instead of this call.
        """
        flats: list[FlatComponent] = []

        def describe() -> _Payload:
            flats.extend(self._flatten(state, sharing or {}, allow_pickle, frozen or {}))
            # Local stores: refuse an existing step now (a stat).  Object stores learn it from
            # the create-only claim in the completion thread, off the caller's critical path.
            if self._is_coordinator and not overwrite and self.storage.local:
                if self.storage.exists(self.storage.join(final, MANIFEST_NAME)):
                    raise CheckpointExistsError(f"checkpoint {final} already exists; pass overwrite=True to replace it")
            return self._payload(flats, step)

        payloads = self._gather(describe)
        plan = self._plan_for(payloads)
        planned = time.perf_counter()
        coordinator = payloads[self.dist.coordinator if self.dist else 0]
        key = f"{coordinator.token}"
        rank_plan = plan.ranks[self.rank]
        # Reuse only when every rank agrees on the last committed save (a rank whose completion
        # thread has not seen the last commit yet would otherwise plan different writes).
        agreed = {p.last_committed for p in payloads}
        candidates = self._reusable(plan) if len(agreed) == 1 and None not in agreed else {}
        if _base_name(final) in {r.checkpoint for r in candidates.values()}:
            candidates = {}  # overwriting the very checkpoint that holds the files
        reused = {name: record for name, record in candidates.items() if plan_file_frozen(plan, name)}
        hashed = {} if self.options.incremental != "hash" else {n: r for n, r in candidates.items() if n not in reused}
        holders = {r.checkpoint for r in [*reused.values(), *hashed.values()] if r.checkpoint}
        self._references.update(holders)
        arena: StagingArena | None = None
        handle: StageHandle | None = None
        waited = 0.0
        staged_at = time.perf_counter()
        request = SaveRequest(step, final)
        try:
            if rank_plan.pieces:
                arena, waited = self.pool.acquire(rank_plan)
                staged_at = time.perf_counter()
                try:
                    tensors = {c.name: c.tensors for c in flats}
                    handle = arena.stage(tensors, self._stager if background else None, frozenset(reused))
                except BaseException:
                    self.pool.release(arena)
                    raise
        except BaseException as e:
            self._report_early_failure(key, e)
            raise
        done = time.perf_counter()
        request.timings.update(plan=planned - started, wait=waited, stage=done - staged_at, blocking=done - started)
        if handle is None or handle.done.is_set():
            request.staged.set()
        else:
            self.guard.add(handle)
            self._stager.submit(_mark_staged, handle, request)
        return SaveJob(
            request=request,
            arena=arena,
            handle=handle,
            plan=plan,
            reused=reused,
            hashed=hashed,
            payloads=payloads,
            key=key,
            staging=coordinator.staging or final,
            metadata=dict(metadata or {}),
            metrics=dict(metrics or {}),
            overwrite=overwrite,
            started=started,
        )

    def prepare(self, state: Mapping[str, Any], *, sharing: Mapping[str, Any] | None, allow_pickle: bool) -> int:
        """Plan ``state`` and allocate its staging arena now (collective like a save); returns
        the arena's size.  The first save of the same layout then only copies."""
        payloads = self._gather(lambda: self._payload(self._flatten(state, sharing or {}, allow_pickle), 0))
        rank_plan = self._plan_for(payloads).ranks[self.rank]
        if not rank_plan.pieces:
            return 0
        arena, _ = self.pool.acquire(rank_plan)
        self.pool.release(arena)
        self.writer.ensure_running()  # hands the arena to the writer now, not at the first save
        return arena.size

    def _gather(self, describe: Callable[[], _Payload]) -> tuple[_Payload, ...]:
        """Every rank's description (the one collective of a save).  A rank that cannot describe
        its state says so in the same collective, so every rank raises instead of hanging."""
        own_error: BaseException | None = None
        try:
            payload = describe()
        except Exception as e:  # noqa: BLE001 - reported to every rank, re-raised here below
            own_error = e
            payload = _Payload(self.rank, error=(type(e).__name__, str(e)))
        payloads = tuple(self.dist.all_gather(payload) if self.dist else [payload])
        if own_error is not None:
            raise own_error
        errors = _error_of(payloads)
        if errors:
            raise _planning_failure(errors)
        return payloads

    @property
    def _is_coordinator(self) -> bool:
        return self.dist is None or self.dist.is_coordinator

    def _flatten(
        self,
        state: Mapping[str, Any],
        sharing: Mapping[str, Any],
        allow_pickle: bool,
        frozen: Mapping[str, Iterable[str]] | None = None,
    ) -> list[FlatComponent]:
        if not isinstance(state, Mapping) or not state:
            raise ConfigError("state must be a non-empty mapping of component names to state")
        unknown = set(sharing) - set(state)
        if unknown:
            raise ConfigError(f"sharing names components that are not in the state: {sorted(unknown)}")
        flats = []
        for name, value in state.items():
            pattern, group = normalize_sharing(sharing.get(name, Sharing.REPLICATED))
            if pattern == Sharing.GLOBAL and not self._is_coordinator:
                continue
            flat = flatten_component(name, value, allow_pickle=allow_pickle)
            patterns = list((frozen or {}).get(name, ()))
            if patterns:
                declared = {k for k in flat.tensors if any(fnmatch.fnmatchcase(k, p) for p in patterns)}
                flat = dataclasses.replace(flat, frozen=flat.frozen | declared)
            if pattern == Sharing.PER_RANK and self.dist is not None:
                flat = dataclasses.replace(flat, name=f"{name}@rank{self.rank}")
            elif pattern == Sharing.PER_GROUP and self.dist is not None:
                import torch.distributed as torch_dist

                leader = min(torch_dist.get_process_group_ranks(group))
                flat = dataclasses.replace(flat, name=f"{name}@group{leader}")
            self._patterns[flat.name] = pattern
            flats.append(flat)
        return flats

    def _payload(self, flats: list[FlatComponent], step: int) -> _Payload:
        locals_: list[LocalTensor] = []
        trees: dict[str, Any] = {}
        tied: dict[str, list[list[str]]] = {}
        sharing: dict[str, str] = {}
        for flat in flats:
            locals_.extend(_describe(flat))
            qualified = "@" in flat.name
            if self._is_coordinator or qualified:
                trees[flat.name] = flat.tree
                tied[flat.name] = flat.tied
                sharing[flat.name] = self._patterns.get(flat.name, Sharing.REPLICATED)
        token = secrets.token_hex(8) if self._is_coordinator else ""
        staging = ""
        if self._is_coordinator and self.storage.local:
            staging = self.storage.join(self.root, staging_dir_name(step))
        return _Payload(self.rank, tuple(locals_), trees, tied, sharing, token, staging, self._last_path)

    def _plan_for(self, payloads: Sequence[_Payload]) -> SavePlan:
        locals_by_rank = [p.locals for p in payloads]
        separate = bool(self.options.incremental)
        signature = (
            self.options.max_shard_size,
            self.storage.local,
            separate,
            tuple(tuple(x) for x in locals_by_rank),
        )
        if self._plan is not None and self._plan.signature == signature:
            return self._plan
        self._plan = plan_save(
            locals_by_rank, self.options.max_shard_size, shared_files=self.storage.local, separate_frozen=separate
        )
        return self._plan

    def _reusable(self, plan: SavePlan) -> dict[str, FileRecord]:
        """Files of ``plan`` laid out exactly as in the last committed save (same name, size and
        tensor records), referenced to the checkpoint that holds them."""
        if not self.options.incremental or self._last_path is None:
            return {}
        if self._last_manifest is None:
            self._last_manifest = read_manifest(self.storage, self._last_path)
        previous = self._last_manifest
        if previous is None:
            return {}
        holder = _base_name(self._last_path)
        out: dict[str, FileRecord] = {}
        for file in plan.files:
            record = previous.files.get(file.file_name)
            if record is None or record.size != file.size:
                continue
            mine = {
                (c, k): t
                for c, tensors in plan.tensors.items()
                for k, t in tensors.items()
                if file.file_name in t.files
            }
            theirs = {
                (c, k): t
                for c, component in previous.components.items()
                for k, t in component.tensors.items()
                if file.file_name in t.files
            }
            if mine == theirs:
                out[file.file_name] = FileRecord(record.size, record.crc32c, record.checkpoint or holder)
        return out

    def _report_early_failure(self, key: str, error: BaseException) -> None:
        """This rank failed before it could write: tell the others (nobody waits for us)."""
        if self.dist is None:
            return
        report = {"error": f"{type(error).__name__}: {error}", "early": True}
        self.dist.post(f"{key}/rank{self.rank}", report)
        if self.dist.is_coordinator:
            self.dist.post(f"{key}/ready", report)
            self.dist.post(f"{key}/commit", {"error": f"rank {self.rank}: {report['error']}", "ranks": [self.rank]})

    # ---- completion thread -------------------------------------------------------------------

    def complete(self, job: SaveJob) -> SaveResult:
        """Write this rank's pieces and take part in the commit; raises on any rank's failure."""
        timings = dict(job.request.timings)
        try:
            if self.dist is None:
                return self._complete_alone(job, timings)
            return self._complete_together(job, timings)
        finally:
            self._forget_references(job)

    def _complete_alone(self, job: SaveJob, timings: dict[str, float]) -> SaveResult:
        try:
            try:
                self._prepare(job)
                results = self._write(job, timings)
            finally:
                self._release(job)
            manifest = self._commit(job, results, timings)
        except BaseException:
            self._discard(job)
            raise
        return self._finish(job, manifest)

    def _discard(self, job: SaveJob) -> None:
        """Remove what a failed save wrote, but only if the destination is ours: a save that lost
        the object-store claim (or never made it) must not delete another save's checkpoint."""
        if job.progress.owns_destination:
            self.cleanup.discard(job.staging)

    def _complete_together(self, job: SaveJob, timings: dict[str, float]) -> SaveResult:
        dist = self.dist
        if dist is None:
            raise CkptdError("no process group")
        deadline = time.monotonic() + dist.timeout
        own_error: BaseException | None = None
        results: list[FileResult] = []
        try:
            if dist.is_coordinator:
                try:
                    self._prepare(job)
                except BaseException as e:
                    dist.post(f"{job.key}/ready", {"error": f"{type(e).__name__}: {e}"})
                    raise
                dist.post(f"{job.key}/ready", {"ok": True})
            else:
                self._await_ready(job, deadline)
            results = self._write(job, timings)
        except BaseException as e:  # noqa: BLE001 - reported to the coordinator
            own_error = e
            self._release(job)
        report: dict[str, Any] = (
            {"error": f"{type(own_error).__name__}: {own_error}"}
            if own_error is not None
            else {"ok": [dataclasses.asdict(r) for r in results]}
        )
        dist.post(f"{job.key}/rank{dist.rank}", report)
        if not dist.is_coordinator:
            return self._await_commit(job, deadline, own_error)
        keys = [f"{job.key}/rank{r}" for r in range(dist.world_size)]
        reports = dist.wait(keys, deadline, "write reports")
        failures: dict[int, str] = {}
        gathered: list[FileResult] = []
        gone: set[int] = set()  # ranks that will not read the outcome
        for rank, key in enumerate(keys):
            answer = reports.get(key)
            if answer is None:
                failures[rank] = f"did not report within {dist.timeout:.0f}s (the process died or hangs)"
                gone.add(rank)
            elif "error" in answer:
                failures[rank] = answer["error"]
                if answer.get("early"):
                    gone.add(rank)
            else:
                gathered.extend(FileResult(**r) for r in answer["ok"])
        try:
            if failures:
                raise rank_failure(failures, f"save of step {job.request.step}")
            manifest = self._commit(job, gathered, timings)
        except BaseException as e:
            self._discard(job)
            ranks = e.ranks if isinstance(e, DistributedSaveError) else [dist.rank]
            dist.post(f"{job.key}/commit", {"error": str(e), "ranks": ranks})
            self._await_acks(job, keys, gone)
            if isinstance(own_error, CheckpointExistsError):
                raise own_error from e  # the step exists: say so, in its own type
            raise
        dist.post(f"{job.key}/commit", {"ok": sum(f.size for f in manifest.files.values())})
        self._await_acks(job, keys, gone)
        return self._finish(job, manifest)

    def _await_acks(self, job: SaveJob, keys: list[str], gone: set[int]) -> None:
        """Wait until every rank has read the outcome: the store lives in the coordinator's
        process, which may exit as soon as this save is done."""
        dist = self.dist
        if dist is None:
            return
        acks = [f"{job.key}/ack{r}" for r in range(dist.world_size) if r != dist.rank and r not in gone]
        found = dist.wait(acks, time.monotonic() + min(dist.timeout, 60.0), "acknowledgements")
        if len(found) < len(acks):
            logger.warning("ckptd: ranks %s did not acknowledge the commit", sorted(set(acks) - set(found)))
        dist.forget([*keys, *acks, f"{job.key}/ready", f"{job.key}/commit"])

    def _await_ready(self, job: SaveJob, deadline: float) -> None:
        dist = self.dist
        if dist is None:
            return
        answer = dist.wait([f"{job.key}/ready"], deadline, "coordinator").get(f"{job.key}/ready")
        if answer is None:
            raise DistributedSaveError(
                f"the coordinator (rank {dist.coordinator}) did not prepare the save within {dist.timeout:.0f}s",
                [dist.coordinator],
            )
        if "error" in answer:
            raise DistributedSaveError(
                f"the coordinator could not prepare the save: {answer['error']}", [dist.coordinator]
            )

    def _await_commit(self, job: SaveJob, deadline: float, own_error: BaseException | None) -> SaveResult:
        dist = self.dist
        if dist is None:
            raise CkptdError("no process group")
        # The coordinator waits up to dist_timeout for the reports and then commits (which may
        # retry against an object store): allow it a second timeout.  A coordinator that dies is
        # noticed sooner, when its store stops answering.
        answer = dist.wait([f"{job.key}/commit"], deadline + dist.timeout, "commit").get(f"{job.key}/commit")
        if answer is not None:
            dist.post(f"{job.key}/ack{dist.rank}", {"ok": True})
        if answer is None:
            error = DistributedSaveError(
                f"the coordinator (rank {dist.coordinator}) did not commit step {job.request.step} within "
                f"{dist.timeout:.0f}s (the process died or hangs)",
                [dist.coordinator],
            )
        elif "error" in answer:
            error = DistributedSaveError(answer["error"], answer.get("ranks") or [])
        else:
            return self._finish(job, None, bytes_written=int(answer["ok"]))
        if own_error is not None:
            raise error from own_error
        raise error

    def _prepare(self, job: SaveJob) -> None:
        if job.overwrite:
            self._refuse_overwriting_referenced(job.request.path)
        if not self.storage.local:
            claim_step(self.storage, job.request.path, overwrite=job.overwrite)
        job.progress.owns_destination = True
        self.storage.makedirs(job.staging)

    def _refuse_overwriting_referenced(self, path: str) -> None:
        """Overwriting a checkpoint whose files incremental saves reference would break them."""
        name = _base_name(path)
        users = [
            info.path
            for info in list_checkpoints(self.storage, self.root)
            if info.path != path and any(f.checkpoint == name for f in info.manifest.files.values())
        ]
        if users:
            raise CheckpointExistsError(
                f"checkpoint {path} holds files that {', '.join(users[:3])} reference (incremental saves); "
                "consolidate those first, or save under another step"
            )

    def _write(self, job: SaveJob, timings: dict[str, float]) -> list[FileResult]:
        started = time.perf_counter()
        rank_plan: RankPlan = job.plan.ranks[self.rank]
        try:
            if job.handle is not None:
                job.handle.wait()  # background staging: the bytes must be in the arena
            if not rank_plan.pieces or job.arena is None:
                return []
            future = self.writer.write_files(
                arena_id=job.arena.arena_id,
                directory=job.staging,
                files=[
                    FileSpec(
                        p.file_name,
                        p.arena_offset,
                        p.size,
                        p.file_offset,
                        p.whole_file,
                        _crc_int(job.hashed.get(p.file_name)) if p.whole_file else None,
                    )
                    for p in rank_plan.pieces
                    if p.file_name not in job.reused
                ],
                storage_options=self.options.storage_options,
                fsync=self.options.fsync,
                chunk_size=self.options.chunk_size,
                threads=self.options.write_threads,
                abandon_directory=job.staging,
                tuning=dataclasses.asdict(self.options.tuning),
            )
            written = future.result()
        finally:
            self._release(job)
            timings["write"] = time.perf_counter() - started
        if not isinstance(written, FilesWritten):
            raise WriterError(f"unexpected writer answer {written!r}")
        return list(written.results)

    def _release(self, job: SaveJob) -> None:
        """Give the arena back, once per save (after a background copy into it has finished)."""
        if job.arena is not None and not job.progress.released:
            job.progress.released = True
            if job.handle is not None:
                job.handle.done.wait()
            self.pool.release(job.arena)

    def _commit(self, job: SaveJob, results: Sequence[FileResult], timings: dict[str, float]) -> Manifest:
        trees: dict[str, Any] = {}
        tied: dict[str, list[list[str]]] = {}
        sharing: dict[str, str] = {}
        for payload in job.payloads:
            for name, tree in payload.trees.items():
                trees.setdefault(name, tree)
                tied.setdefault(name, payload.tied.get(name, []))
                sharing.setdefault(name, payload.sharing.get(name, "replicated"))
        return finalize_checkpoint(
            self.storage,
            job.staging,
            job.request.path,
            step=job.request.step,
            written=combine_pieces(job.plan, results, job.reused, job.hashed),
            expected_sizes={f.file_name: f.size for f in job.plan.files},
            tensors=job.plan.tensors,
            components=[ComponentInfo(name, "safetensors", tied[name], sharing=sharing[name]) for name in trees],
            trees=trees,
            metadata=job.metadata,
            metrics=job.metrics,
            timings=timings,
            overwrite=job.overwrite,
            fsync=self.options.fsync,
            world_size=job.plan.world_size,
        )

    def _forget_references(self, job: SaveJob) -> None:
        holders = {r.checkpoint for r in [*job.reused.values(), *job.hashed.values()] if r.checkpoint}
        self._references.subtract(holders)
        self._references += collections.Counter()  # drop the zero counts

    def _finish(self, job: SaveJob, manifest: Manifest | None, bytes_written: int = 0) -> SaveResult:
        bytes_reused = 0
        if manifest is not None:
            if self.options.keep_last is not None:
                # Keep what saves still queued will reference once they commit.
                queued = {self.storage.join(self.root, name) for name in self._references}
                apply_retention(self.storage, self.root, self.options.keep_last, protect={job.request.path, *queued})
            job.request.timings.update(manifest.timings)
            bytes_written = sum(f.size for f in manifest.files.values() if f.checkpoint is None)
            bytes_reused = sum(f.size for f in manifest.files.values() if f.checkpoint is not None)
        if manifest is None and self.options.incremental:
            manifest = read_manifest(self.storage, job.request.path)  # here, not on the next save's critical path
        self._last_path, self._last_manifest = job.request.path, manifest
        job.request.timings["total"] = time.perf_counter() - job.started
        return SaveResult(job.request.step, job.request.path, bytes_written, dict(job.request.timings), bytes_reused)


def _mark_staged(handle: StageHandle, request: SaveRequest) -> None:
    handle.done.wait()
    request.staged.set()


def _base_name(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1].rsplit(os.sep, 1)[-1]


def _crc_int(record: FileRecord | None) -> int | None:
    return int(record.crc32c, 16) if record is not None else None


def plan_file_frozen(plan: SavePlan, file_name: str) -> bool:
    return any(f.file_name == file_name and f.frozen for f in plan.files)


def combine_pieces(
    plan: SavePlan,
    results: Sequence[FileResult],
    reused: Mapping[str, FileRecord] | None = None,
    hashed: Mapping[str, FileRecord] | None = None,
) -> dict[str, FileRecord]:
    """File records from per-piece write results: every file must be covered exactly, in order;
    the pieces' CRC32Cs combine into the file's.  Files an incremental save did not write
    (``reused``, or ``hashed`` ones whose checksum matched) keep the earlier checkpoint's record."""
    by_file: dict[str, list[FileResult]] = {}
    for result in results:
        by_file.setdefault(result.name, []).append(result)
    records: dict[str, FileRecord] = dict(reused or {})
    for file in plan.files:
        if file.file_name in records:
            continue
        written = by_file.get(file.file_name, [])
        if hashed and file.file_name in hashed and written and all(r.reused for r in written):
            records[file.file_name] = hashed[file.file_name]
            continue
        pieces = sorted(by_file.get(file.file_name, []), key=lambda r: r.file_offset)
        position = 0
        value = 0
        for piece in pieces:
            if piece.file_offset != position:
                raise CorruptCheckpointError(
                    f"{file.file_name}: bytes {position}-{piece.file_offset} were not written by any rank"
                )
            value = crc32c_combine(value, piece.crc32c, piece.size) if position else piece.crc32c
            position += piece.size
        if position != file.size:
            raise CorruptCheckpointError(f"{file.file_name}: {position} of {file.size} bytes were written")
        records[file.file_name] = FileRecord(file.size, format_crc(value))
    return records


def _planning_failure(errors: dict[int, tuple[str, str]]) -> Exception:
    if len({kind for kind, _ in errors.values()}) == 1:
        kind, message = next(iter(errors.values()))
        if kind == "CheckpointExistsError":
            return CheckpointExistsError(message)
    return rank_failure({r: f"{kind}: {message}" for r, (kind, message) in errors.items()}, "planning the save")
