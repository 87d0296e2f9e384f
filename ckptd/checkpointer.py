"""The :class:`Checkpointer`: asynchronous saves to a root directory or URL, and loads.

``async_save`` runs plan and stage on the caller's thread (the only part that blocks training),
then hands the save to a background completion thread which asks the writer process to write
the shards and finalizes the checkpoint.  Saves complete in the order they were made.

It belongs to its process: in a ``fork()`` child saving raises WriterError (:mod:`ckptd.writer.owner`).
It is longer than 450 lines for its docstrings: the public methods are documented here, where
users read them; the work is in :mod:`ckptd.save` and :mod:`ckptd.load`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import socket
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .catalog import (
    CheckpointInfo,
    checkpoint_dir_name,
    find_step,
    is_linked_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    read_manifest,
)
from .dist.group import DistContext, group_leaders
from .errors import (
    CheckpointNotFoundError,
    CheckpointReplacedError,
    CkptdError,
    ConfigError,
    CorruptCheckpointError,
    StorageError,
    UnsafeCheckpointError,
    WriterError,
)
from .formats.manifest import Manifest
from .formats.names import parse_step
from .garbage import collect_garbage
from .load.assign import read_components, read_keys, reads_everything, restore_components
from .load.inline_verify import VerifyMode, verify_mode
from .load.reader import CheckpointReader
from .options import DEFAULT_HELD_KEEP_LAST, CheckpointerOptions, check_staging
from .request import SaveRequest, SaveResult
from .save.saver import SaveJob, Saver
from .save.staging_pool import StagingPool
from .save.throttle import StepMonitor
from .stats import StatsSummary
from .storage import in_process_only, is_local, local_path, normalize_location, storage_for
from .storage.cleanup import Cleanup
from .storage.held import held_name, is_held
from .tiers import LoadSource, Promoter, PromotionResult, Tier, committed_steps, record_tiers
from .writer.client import InProcessWriter, WriterClient
from .writer.keeper import HoldLease
from .writer.owner import CtrlC, bind_to_process, check_process, exiting_on_ctrl_c, unbind

__all__ = ["Checkpointer"]

logger = logging.getLogger(__name__)

LOAD_ATTEMPTS = 5
"""Tries of :meth:`Checkpointer.load` when the checkpoint is replaced while it is read (each opens
it afresh: the version committed by then is as good an answer)."""
_REPLACED_DELAY = 0.1  # seconds before the third try, times 3 before each next one (the second is at once)
_ABANDON_WRITER_SECONDS = 3.0
"""After a second Ctrl-C, how long the writer may take to stop and remove the save it was writing
before it is killed (the trainer then removes that save itself).  Under 5 s, the time the reader
thread waits for a closed writer's exit: no clean-up of the trainer's starts while it lives."""
_ABANDON_SECONDS = 10.0
"""After a second Ctrl-C, how long the abandoned saves' clean-up may take at most (the commit
thread's, then the retries of what failed); what is left is removed by ``ckptd gc``."""


class Checkpointer:
    """Saves and loads training state under ``root`` (a path or an fsspec URL).

    Each save becomes ``<root>/checkpoint-<step>/`` holding HF-compatible safetensors shards per
    component (``model-00001-of-00002.safetensors`` + ``model.safetensors.index.json``...),
    ``state.json`` for non-tensor state and ``checkpoint_manifest.json``, written last.

    Args:
        root: directory or URL holding the checkpoints (a path, ``file://``, ``s3://``,
            ``gs://``, ``memory://`` or any fsspec URL), or ``shm://NAME``: a root held in this
            user's shared memory on this host, which outlives the training process for
            ``hold_after_exit`` (5 minutes by default) so a restarted trainer restores from
            memory (``keep_last`` defaults to 2 there; see :mod:`ckptd.writer.keeper`).
        options: a :class:`~ckptd.CheckpointerOptions`; default: ``CheckpointerOptions.from_env()``
            (the ``DEFAULT_*`` values, replaced by the ``CKPTD_*`` variables that are set).
        process_group: the torch.distributed group whose ranks save together (default: the
            default group when one is initialized; ``options.no_dist`` saves alone).
        tiers: slower tiers (:class:`~ckptd.Tier`, fastest first), each another root receiving
            a copy of every committed checkpoint whose step is a multiple of its ``every``, and
            keeping its own ``keep_last``: ``[Tier("s3://bucket/run1", every=1000, keep_last=5)]``.
            The copies are made in the background from the committed files (never staged
            again); ``load`` then takes the newest step of any tier (see :meth:`load`).
        **overrides: any field of :class:`~ckptd.CheckpointerOptions` (``max_shard_size="2GB"``,
            ``keep_last=3``, ``storage_options={...}``, ``incremental=True``, ...), winning over
            ``options``.  An unknown name is a :class:`~ckptd.errors.ConfigError`.

    With ``incremental``, unchanged files are not written again but hard-linked (or copied
    server-side) from the previous checkpoint: every checkpoint holds all of its files and
    stands alone (``keep_last``, ``rm``, ``from_pretrained`` treat each one on its own).

    Use as a context manager, or call :meth:`close`; pending saves are finished first.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        options: CheckpointerOptions | None = None,
        *,
        process_group: Any = None,
        tiers: Iterable[Tier] | None = None,
        **overrides: Any,
    ) -> None:
        self._owner_pid = os.getpid()
        root = os.fspath(root)
        base = options if options is not None else CheckpointerOptions.from_env()
        self.options = base.with_overrides(**overrides).for_location(remote=not is_local(root))
        self._lease: HoldLease | None = None
        if is_held(root):  # memory is finite: a held root keeps 2 unless told otherwise
            if self.options.keep_last is None:
                self.options = self.options.with_overrides(keep_last=DEFAULT_HELD_KEEP_LAST)
            self._lease = HoldLease(held_name(root), float(self.options.hold_after_exit))
        self.root = normalize_location(root)
        self.storage = storage_for(self.root, self.options.storage_options, self.options.tuning)
        self.storage.check_access(self.root)
        if self.storage.local:
            collect_garbage(self.storage, self.root)
        self._promoter: Promoter | None = None
        tier_list = list(tiers or ())
        if tier_list:  # checked before anything is started that would need stopping
            if any(not isinstance(t, Tier) for t in tier_list):
                raise ConfigError("tiers must be ckptd.Tier objects")
            roots = [self.root] + [normalize_location(t.root) for t in tier_list]
            if len(set(roots)) != len(roots):
                raise ConfigError(f"every tier needs a root of its own; got {roots}")
            self._promoter = Promoter(
                self.storage, tier_list, nice=self.options.writer_nice, ionice=self.options.writer_ionice
            )
        self._writer: WriterClient | InProcessWriter = (
            InProcessWriter()
            if in_process_only(self.root)
            else WriterClient(
                start_timeout=self.options.writer_start_timeout,
                nice=self.options.writer_nice,
                ionice=self.options.writer_ionice,
                label=self.root,
            )
        )
        self._cleanup = Cleanup(self.storage)
        self._dist = (
            None
            if self.options.no_dist
            else DistContext.detect(process_group, self.options.coordinator_rank, self.options.dist_timeout)
        )
        if self._lease is not None and self._dist is not None:
            _check_one_host(self._dist, root)
        self._pool = StagingPool(self._writer, self.options.max_in_flight, self.options.staging_budget)
        self._steps: StepMonitor | None = None
        if self.options.throttle:
            self._steps = StepMonitor(self._writer.throttle)
            self._steps.install()
        self._saver = Saver(
            root=self.root,
            storage=self.storage,
            options=self.options,
            writer=self._writer,
            pool=self._pool,
            cleanup=self._cleanup,
            dist=self._dist,
            steps=self._steps,
        )
        if self._promoter is not None and (self._dist is None or self._dist.is_coordinator):
            self._saver.on_commit = self._promoter.submit  # copies to the slower tiers after each commit
            self._promoter.after_release = self._saver.apply_keep_last  # what was kept for a copy goes after it
            record_tiers(self.storage, self.root, tier_list)  # for `ckptd ls ROOT`
        self.last_load: LoadSource | None = None
        """Where the last successful :meth:`load` of a step read from (its tier and path)."""
        self._jobs: queue.Queue[tuple[Checkpointer, SaveJob] | None] = queue.Queue()
        self._pending: list[SaveRequest] = []
        self._pending_lock = threading.Lock()
        self._save_lock = threading.Lock()
        self._starting: int | None = None  # the thread inside _saver.start (holding _save_lock)
        self._closed = False
        self._closer: int | None = None  # the thread running the first close()
        self._close_done = threading.Event()  # set when the first close() has ended
        # The threads hold no reference to the Checkpointer (a queued save holds one until it is
        # done), so one that is dropped without close() is collected and _release stops its writer.
        self._completer = threading.Thread(target=_complete_jobs, args=(self._jobs,), name="ckptd-commit", daemon=True)
        self._completer.start()
        threading.Thread(target=_start_writer, args=(self._writer,), name="ckptd-writer-start", daemon=True).start()
        self._abandoned: str | None = None  # why close() abandoned the saves in flight: failures are expected
        # _close_at_exit() at exit; forget_after_fork() in a fork child
        self._atexit = bind_to_process(self, Checkpointer._close_at_exit)
        self._finalizer = weakref.finalize(
            self,
            _release,
            repr(self),
            self._owner_pid,
            self._jobs,
            self._completer,
            (self._saver, self._steps, self._writer, self._pool, self._promoter, self._lease),
            self._cleanup,
            self.options.cleanup_timeout,
            self._atexit,
            collected=True,
        )
        self._finalizer.atexit = False  # the exit hook closes it, waiting for its saves

    # ---- paths and listing -----------------------------------------------------------------

    def path_for(self, step: int) -> str:
        """Where the checkpoint of ``step`` lives (or will)."""
        return self.storage.join(self.root, checkpoint_dir_name(step))

    def checkpoints(self) -> list[CheckpointInfo]:
        """Committed checkpoints, oldest step first (directories without a manifest are ignored)."""
        return list_checkpoints(self.storage, self.root)

    def steps(self, *, tiers: bool = False) -> list[int]:
        """Steps of the committed checkpoints, ascending: of the root, or with ``tiers`` of the
        root and every slower tier together (a tier that cannot be listed is skipped, with a
        warning)."""
        if tiers and self._promoter is not None:
            return sorted(committed_steps(self._tier_roots()))
        return [info.step for info in self.checkpoints()]

    def latest_step(self) -> int | None:
        """The highest committed step (of any tier, with ``tiers``), or ``None`` if there is no
        checkpoint yet."""
        if self._promoter is not None:
            steps = committed_steps(self._tier_roots())
            return steps[0] if steps else None
        info = latest_checkpoint(self.storage, self.root)
        return info.step if info else None

    # ---- tiers -----------------------------------------------------------------------------

    @property
    def tiers(self) -> list[Tier]:
        """The slower tiers given at construction (empty without)."""
        return [t.tier for t in self._promoter.tiers] if self._promoter is not None else []

    def promotions(self) -> list[PromotionResult]:
        """The promotions to slower tiers finished so far, in order (``error`` set on failures)."""
        return list(self._promoter.results) if self._promoter is not None else []

    def wait_promotions(self, timeout: float | None = None) -> bool:
        """Wait until every committed checkpoint due for a slower tier has been copied (or has
        failed); returns False if ``timeout`` seconds passed first."""
        return self._promoter.wait(timeout) if self._promoter is not None else True

    def _tier_roots(self) -> list[tuple[int, Any, str]]:
        assert self._promoter is not None
        return [(0, self.storage, self.root)] + [(t.index, t.storage, t.root) for t in self._promoter.tiers]

    def manifest(self, step: int | str = "latest") -> Manifest:
        """The manifest of a committed checkpoint (``"latest"``, a step, or a path)."""
        path = self._resolve(step)
        manifest = read_manifest(self.storage, path)
        if manifest is None:
            raise CheckpointNotFoundError(f"{path} is not a committed ckptd checkpoint")
        return manifest

    def _resolve(self, step: int | str | os.PathLike[str]) -> str:
        if step == "latest":
            info = latest_checkpoint(self.storage, self.root)
            if info is None:
                raise CheckpointNotFoundError(f"no committed checkpoint under {self.root}")
            return info.path
        if isinstance(step, bool) or not isinstance(step, (int, str, os.PathLike)):
            raise ConfigError(f"step must be an int, 'latest' or a path, got {step!r}")
        if isinstance(step, int):
            found = find_step(self.storage, self.root, step)  # zero-padded names too
            if found is not None:
                return found
            path = self.path_for(step)
            if is_linked_checkpoint(self.storage, path):
                raise UnsafeCheckpointError(
                    f"{path} is a symlink: a checkpoint under a root must be a directory of the root; "
                    "load the link by its path to follow it"
                )
            return path
        path = os.fspath(step)
        return local_path(path) if is_local(path) and self.storage.local else path

    # ---- saving ----------------------------------------------------------------------------

    def async_save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        metadata: Mapping[str, Any] | None = None,
        metrics: Mapping[str, Any] | None = None,
        overwrite: bool = False,
        allow_pickle: bool | None = None,
        sharing: Mapping[str, Any] | None = None,
        staging: str | None = None,
        frozen: Mapping[str, Iterable[str]] | None = None,
        path: str | os.PathLike[str] | None = None,
    ) -> SaveRequest:
        """Snapshot ``state`` and return at once; the writer process persists it in the background.

        ``state`` maps component names to modules, optimizers, schedulers, objects with
        ``state_dict()``, dicts, tensors or plain values.  When this returns, the caller may
        mutate or free its tensors.  If ``max_in_flight`` saves are still being written, this
        waits for one to finish first (back-pressure; reported as ``timings["wait"]``).

        Under torch.distributed every rank calls it (two small collectives with the coordinator;
        four when the layout changed).  Plain tensors are treated as replicated and written once; DTensors and
        :class:`~ckptd.ShardedTensor` pieces are written by their main replicas.  ``sharing``
        overrides that per component: ``{"rng": "per_rank", "scheduler": "global"}`` (see
        :class:`~ckptd.Sharing`).

        ``staging="background"`` returns before the copy is done: the copy runs on a staging
        thread (CUDA tensors: ``non_blocking`` copies on a side stream), ``request.staged`` is
        set when it finishes, and every optimizer ``step()`` waits for it, so forward and
        backward overlap the snapshot.  Only optimizer steps are guarded: code that changes the
        saved tensors in other ways (BatchNorm running statistics in a forward pass, manual
        in-place edits) must wait for ``request.staged`` first.  The default,
        ``staging="blocking"`` (or the Checkpointer's ``staging``), returns after the copy, and
        the writer starts once the copy is over: the copy has the CPU and memory bandwidth to
        itself, so the call stalls training least.  ``staging="pipelined"`` also returns after
        the copy, but the writer writes each chunk as soon as it is copied: committed sooner by
        up to the copy's time, at the cost of a longer call wherever writing slows the copy
        (docs/benchmarks.md).  ``"background"`` is pipelined too.

        ``frozen={"model": ["embed.*"]}`` declares tensors (glob patterns per component)
        unchanged since the previous save, for ``incremental`` Checkpointers.

        ``path`` chooses where the checkpoint goes instead of :meth:`path_for` ``(step)`` (a
        framework's own naming, e.g. Lightning's ``epoch=0-step=10.ckpt``): on the root's storage,
        and on local disk on the root's filesystem (the save is staged under the root and renamed
        into place).  Such checkpoints are not listed by :meth:`checkpoints` nor touched by
        ``keep_last`` unless they are named ``checkpoint-<step>`` under the root.  A local
        ``path`` may be new, an empty directory or a checkpoint (``overwrite=True``); a
        directory of other files is never replaced, whatever ``overwrite`` says
        (:class:`~ckptd.errors.ForeignFilesError`, a ``CheckpointExistsError``, before anything
        is written).  On object stores a prefix holding objects that are not ckptd's is refused
        the same way, from ``wait()``.

        Raises before anything is written if the state holds values that cannot be stored
        (:class:`~ckptd.errors.UnsupportedValueError`), the sharding is invalid
        (:class:`~ckptd.errors.ShardingError`) or the checkpoint already exists on local
        storage (:class:`~ckptd.errors.CheckpointExistsError`; on object stores the
        create-only claim reports it from ``wait()``, keeping a round trip off this call).  A
        checkpoint whose manifest is unreadable still counts as existing: ``overwrite=True``
        replaces it.
        """
        started = time.perf_counter()
        self._check_process()
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"step must be a non-negative int, got {step!r}")
        pickle_ok = self.options.allow_pickle if allow_pickle is None else allow_pickle
        mode = check_staging(staging or self.options.staging)
        final = self.path_for(step) if path is None else self._chosen_path(path)
        with self._save_lock:
            # close() sets _closed, then waits for a save being started (which may wait for a
            # slot) until it is queued: one that starts after that is refused here.
            self._starting = threading.get_ident()
            try:
                self._check_open()
                job = self._saver.start(
                    step,
                    state,
                    final,
                    sharing=sharing,
                    allow_pickle=pickle_ok,
                    overwrite=overwrite,
                    metadata=metadata,
                    metrics=metrics,
                    started=started,
                    staging_mode=mode,
                    frozen=frozen,
                )
                with self._pending_lock:
                    self._pending.append(job.request)
                if self._steps is not None:
                    job.request._release_on_wait(self._release_throttle)  # a wait on this thread: nobody trains
                # pipelined: the writer starts on the first chunks while the copy goes on.  The queued
                # entry keeps the Checkpointer alive until the completion thread is done with the save.
                self._jobs.put((self, job))
            finally:
                self._starting = None
        if mode != "background":
            self._saver.finish_staging(job)
        return job.request

    def _chosen_path(self, path: str | os.PathLike[str]) -> str:
        """Check a caller-chosen checkpoint location: same storage as the root, and on local disk
        the same filesystem (the staging directory under the root is renamed to it)."""
        location = normalize_location(os.fspath(path))
        if is_local(location) != self.storage.local:
            raise ConfigError(
                f"path {location!r} is not on the storage of this Checkpointer's root {self.root!r}; "
                "create a Checkpointer whose root is on the same storage"
            )
        if self.storage.local:
            parent = os.path.dirname(location)
            os.makedirs(parent, exist_ok=True)
            if os.stat(parent).st_dev != os.stat(self.root).st_dev:
                raise ConfigError(
                    f"path {location!r} is on another filesystem than the root {self.root!r} (saves are staged "
                    "under the root and renamed into place); use a root on the same filesystem"
                )
        elif location.split("://", 1)[0] != self.root.split("://", 1)[0]:
            raise ConfigError(f"path {location!r} uses another protocol than the root {self.root!r}")
        if location.rstrip("/") == self.root.rstrip("/"):
            raise ConfigError(f"path {location!r} is the root itself; give a directory inside or beside it")
        return location

    def prepare(self, state: Mapping[str, Any], *, sharing: Mapping[str, Any] | None = None) -> int:
        """Plan ``state`` and allocate (and hand to the writer) its staging arena now, so the
        first :meth:`async_save` of that layout only copies.  Call it once at start-up, on every
        rank; returns the arena's size in bytes.  On a held-memory root (``shm://``) it makes
        ``keep_last + 1`` arenas of staging files, the memory the root holds once it keeps
        ``keep_last`` checkpoints, so that no early save waits for one."""
        self._check_process()
        self._check_open()
        with self._save_lock:
            return self._saver.prepare(state, sharing=sharing, allow_pickle=self.options.allow_pickle)

    def save(self, step: int, state: Mapping[str, Any], **kwargs: Any) -> SaveResult:
        """Save and wait for the commit; same arguments as :meth:`async_save`."""
        return self.async_save(step, state, **kwargs).result()  # the wait lifts the throttle's limit

    def mark_step(self) -> None:
        """Tell the adaptive throttle (on by default) that a training step began.

        Torch optimizer steps are timed without it; call it once per step in loops that do not
        call ``optimizer.step()``.  With ``throttle=False`` it does nothing.
        """
        if self._steps is not None:
            self._steps.step()

    def _release_throttle(self) -> None:
        """The caller is about to wait for saves: nobody trains, so write at full speed."""
        if self._steps is not None and self._pending:
            self._steps.release()

    # ---- completion (background thread) ----------------------------------------------------

    def _complete(self, job: SaveJob) -> None:
        """Write and commit one queued save (on the completion thread); its request gets the outcome."""
        try:
            result = self._saver.complete(job)
        except BaseException as e:  # noqa: BLE001 - stored in the request, raised by wait()
            if self._abandoned is not None:
                logger.info("ckptd: save of step %s to %s abandoned: %s", job.request.step, job.request.path, e)
                error = WriterError(
                    f"the save of step {job.request.step} to {job.request.path} was abandoned {self._abandoned}; "
                    "nothing was committed"
                )
                error.__cause__ = e
                job.request._set_exception(error)
            else:
                logger.error("ckptd: save of step %s to %s failed: %s", job.request.step, job.request.path, e)
                job.request._set_exception(e)
        else:
            job.request._set_result(result)
        finally:
            with self._pending_lock:
                if job.request in self._pending:
                    self._pending.remove(job.request)

    def stats(self) -> StatsSummary:
        """Totals over this Checkpointer's finished saves (timings, bytes, retries: :mod:`ckptd.stats`)."""
        return self._saver.stats.summary()

    # ---- loading ---------------------------------------------------------------------------

    def load(
        self,
        step: int | str | os.PathLike[str] = "latest",
        into: Mapping[str, Any] | None = None,
        *,
        components: Iterable[str] | None = None,
        keys: Iterable[str] | None = None,
        device: str | torch.device = "cpu",
        strict: bool = True,
        assign: bool = False,
        verify: VerifyMode = False,
        allow_pickle: bool | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        sharing: Mapping[str, Any] | None = None,
    ) -> Any:
        """Load a committed checkpoint (``"latest"``, a step, or a checkpoint path).

        * ``into={"model": model, "optimizer": opt, ...}`` restores each object in place
          (modules honour ``strict``/``assign``; others get ``load_state_dict``) and returns None.
        * Otherwise returns ``{component: state}`` as saved, tensors on ``device``; ``components``
          picks some components; ``keys`` (``"model.layers.0.weight"``: component, dot, key)
          returns only those tensors as ``{component: {key: tensor}}``, reading only the shards
          that hold them.

        File sizes are always checked; ``verify=True`` also checks CRC32C of the files read: in a
        pass of its own before their bytes reach the caller's tensors (``into=`` modules read in
        place), or as they are read when the tensors are new (one pass over the bytes).
        ``verify="inline"`` checks as they are read into the caller's tensors too (one pass; a
        damaged file's bytes may then be in them when the error is raised).
        ``cache_dir`` (default: the Checkpointer's) keeps local copies of remote files read.

        Every rank loads on its own (no collective): DTensors and :class:`~ckptd.ShardedTensor`
        targets receive exactly their piece, whatever world size and layout the checkpoint was
        saved with; components saved per rank come back as this rank's copy;
        ``sharing={"model": ("per_group", group)}`` picks this group's copy of a per-group save.

        With ``tiers``, ``"latest"`` is the newest step committed in any tier, and a step is read
        from the fastest tier holding it, its files' CRC32C checked first (``verify`` is on); a
        copy that is missing, damaged or unreachable is skipped for the next tier's copy, then
        for older steps, each with a warning.  :attr:`last_load` says which copy was read.

        A load reads one version of the checkpoint, never parts of two.  If the checkpoint is
        overwritten while it is read (another process saving the same step with
        ``overwrite=True``), the load starts again on the version now committed, up to
        ``LOAD_ATTEMPTS`` times in all, then raises :class:`~ckptd.errors.CheckpointReplacedError`.
        With ``into=``, every byte range is read and found to be of one version before anything
        is assigned.  Tensors read in place (a module's own) take no byte of another version on
        local disk and S3 (a replacement is noticed before a byte is read); on other object
        stores a retry reads the version now committed over them.
        """
        self._check_open()
        verify_mode(verify)
        keys = None if keys is None else list(keys)  # read again by a retry
        components = None if components is None else list(components)
        arguments = (into, components, keys, device, strict, assign, verify, allow_pickle, cache_dir, sharing)
        if self._promoter is not None and (step == "latest" or (isinstance(step, int) and not isinstance(step, bool))):
            return self._load_across_tiers(step, arguments)
        path = self._resolve(step)
        result = self._load_retrying(path, self.options.storage_options, arguments)
        self.last_load = LoadSource(_step_of(path), 0, path)
        return result

    def _load_across_tiers(self, step: int | str, arguments: tuple[Any, ...]) -> Any:
        """``load`` of ``"latest"`` or a step with tiers: the steps newest first, each from the
        fastest tier whose copy verifies.  Under torch.distributed every rank loads the same
        step: the coordinator's listing names the steps to try, and a step counts as loaded only
        once every rank has loaded it (else every rank goes on to the next older step)."""
        assert self._promoter is not None
        roots = self._tier_roots()
        steps = committed_steps(roots)
        if step != "latest":
            steps = [s for s in steps if s == step]
        if self._dist is not None:
            steps = self._dist.all_gather(steps)[self._dist.coordinator]  # one list for every rank
        if not steps:
            where = ", ".join(root for _, _, root in roots)
            which = "" if step == "latest" else f" of step {step}"
            raise CheckpointNotFoundError(f"no committed checkpoint{which} in {where}")
        options = {0: self.options.storage_options, **{t.index: t.tier.storage_options for t in self._promoter.tiers}}
        # A damaged copy is found before a caller's target is written (unless verify="inline").
        verified = (*arguments[:6], arguments[6] or True, *arguments[7:])
        failures: list[str] = []
        for candidate in steps:
            result, source = None, None
            for tier, storage, root in roots:
                path = find_step(storage, root, candidate)
                if path is None:
                    continue
                try:
                    result = self._load_retrying(path, options[tier], verified)
                except (CorruptCheckpointError, StorageError, CheckpointNotFoundError) as e:
                    logger.warning("ckptd: cannot load step %d from tier %d (%s): %s", candidate, tier, path, e)
                    failures.append(f"tier {tier} {path}: {e}")
                    continue
                source = LoadSource(candidate, tier, path)
                break
            if self._dist is not None and not all(self._dist.all_gather(source is not None)):
                logger.warning("ckptd: step %d was not loaded on every rank; every rank tries an older one", candidate)
                failures.append(f"step {candidate}: not loaded on every rank")
                continue
            if source is not None:
                log = logger.warning if failures else logger.info
                log("ckptd: loaded step %d from tier %d (%s)", source.step, source.tier, source.path)
                self.last_load = source
                return result
        raise CorruptCheckpointError("no tier holds a loadable copy: " + "; ".join(failures))

    def _load_retrying(self, path: str, storage_options: dict[str, Any], arguments: tuple[Any, ...]) -> Any:
        """One checkpoint path, loaded again if it is replaced while read (``LOAD_ATTEMPTS``)."""
        for attempt in range(1, LOAD_ATTEMPTS + 1):
            try:
                return self._load_once(path, storage_options, *arguments)
            except (CheckpointReplacedError, CheckpointNotFoundError) as e:
                # Not found after a replacement: an object-store overwrite between removing the old
                # manifest and writing the new one.  Not found at first is the answer.
                if attempt == LOAD_ATTEMPTS or (attempt == 1 and isinstance(e, CheckpointNotFoundError)):
                    raise
                logger.info("ckptd: load of %s: %s; loading again (try %d of %d)", path, e, attempt + 1, LOAD_ATTEMPTS)
                time.sleep(_REPLACED_DELAY * (3 ** (attempt - 2)) if attempt > 1 else 0.0)
        raise AssertionError("unreachable")  # pragma: no cover - the last try returns or raises

    def _load_once(
        self,
        path: str,
        storage_options: dict[str, Any],
        into: Mapping[str, Any] | None,
        components: list[str] | None,
        keys: list[str] | None,
        device: str | torch.device,
        strict: bool,
        assign: bool,
        verify: VerifyMode,
        allow_pickle: bool | None,
        cache_dir: str | os.PathLike[str] | None,
        sharing: Mapping[str, Any] | None,
    ) -> Any:
        """One try of :meth:`load`, on the version committed when it opens the checkpoint."""
        reader = CheckpointReader.open(
            path,
            storage_options,
            require_manifest=True,
            cache_dir=cache_dir if cache_dir is not None else self.options.cache_dir,
            tuning=self.options.tuning,
        )
        with reader:
            pickle_ok = self.options.allow_pickle if allow_pickle is None else allow_pickle
            rank = self._dist.rank if self._dist else 0
            groups = group_leaders(sharing)
            if reads_everything(reader, rank, into, components, keys):
                reader.check_complete()  # a full load needs every file; a partial one only its own
            if into is not None:
                restore_components(
                    reader,
                    into,
                    strict=strict,
                    assign=assign,
                    device=device,
                    verify=verify,
                    allow_pickle=pickle_ok,
                    rank=rank,
                    groups=groups,
                )
                return None
            if keys is not None:
                return read_keys(reader, keys, device=device, verify=verify, rank=rank, groups=groups)
            return read_components(
                reader, components, device=device, verify=verify, allow_pickle=pickle_ok, rank=rank, groups=groups
            )

    async def aload(
        self,
        step: int | str | os.PathLike[str] = "latest",
        into: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """:meth:`load` for asyncio code: same arguments and result, run on a worker thread
        (``asyncio.to_thread``) so the event loop goes on meanwhile; a failure is raised from the
        ``await`` (``CheckpointNotFoundError`` for a missing step, ...).

        A load that has started cannot be stopped: if the awaiting task is cancelled, the
        cancellation is raised once the load thread has finished, so objects passed in ``into=``
        are never written after ``aload`` has returned or raised.  To save from asyncio code,
        ``await checkpointer.async_save(step, state)``: the copy of the state runs on the
        loop's thread (with ``staging="background"`` on a staging thread), the wait for the
        commit does not block the loop.
        """
        self._check_open()
        load = asyncio.ensure_future(asyncio.to_thread(self.load, step, into, **kwargs))
        try:
            return await asyncio.shield(load)
        except asyncio.CancelledError:
            while not load.done():
                with contextlib.suppress(asyncio.CancelledError):  # cancelled again: keep waiting
                    await asyncio.wait([load])
            if not load.cancelled():
                load.exception()  # retrieved: the cancellation is what the caller gets
            raise

    # ---- lifecycle -------------------------------------------------------------------------

    def pending(self) -> list[SaveRequest]:
        """Saves not yet committed or failed."""
        with self._pending_lock:
            return list(self._pending)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every pending save; raises the first failure among them."""
        self._check_process()
        self._release_throttle()
        deadline = None if timeout is None else time.monotonic() + timeout
        for request in self.pending():
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            request.result(remaining)

    def health_check(self, timeout: float = 10.0) -> dict[str, Any]:
        """Ping the writer (starting it if needed); returns its pid, state, bytes written and
        the adaptive throttle's current limit (``write_rate`` in bytes/s, ``None`` when
        unthrottled) and seconds it has held writes back."""
        self._check_process()
        self._check_open()
        self._writer.ensure_running()
        pong = self._writer.ping(timeout)
        return {
            "writer_pid": self._writer.pid,
            "busy": pong.busy,
            "bytes_written": pong.bytes_written,
            "restarts": self._writer.restarts,
            "arena_bytes": self._pool.bytes_reserved,
            "pending_saves": len(self.pending()),
            "write_rate": pong.write_rate,
            "throttled_seconds": pong.throttled_seconds,
        }

    @property
    def writer_pid(self) -> int | None:
        """The writer process id (``None`` before it started)."""
        return self._writer.pid

    def close(self, wait: bool = True) -> None:
        """Finish pending saves, stop the writer and free the arenas; ``wait=False`` abandons the
        saves in flight instead of finishing them.

        With ``wait=False`` the writer stops the write in flight at once (it removes that save's
        staging directory, and on object stores aborts its multipart uploads), the pending saves
        fail with :class:`~ckptd.errors.WriterError` and nothing more is committed; a stuck
        writer is killed after a few seconds.  What was committed before stays as it was.

        Runs by itself at interpreter exit, so a program that ends with saves in flight waits
        for them.  Ctrl-C during that wait (on the main thread, while SIGINT has Python's own
        handler) prints one line naming the saves it waits for; a second Ctrl-C abandons them:
        the writer stops at once, nothing more is committed, the saves' staging directories
        (on object stores their objects and multipart uploads) are removed, the writer and the
        arenas are released, and then ``close()`` raises KeyboardInterrupt (at exit: the program
        ends with no traceback).  When the program ended on Ctrl-C, the line comes at once and
        the next Ctrl-C abandons.
        """
        self._close(wait)

    def _close_at_exit(self) -> None:
        """``close()`` from the interpreter's exit hook: never raises."""
        self._close(True, told=exiting_on_ctrl_c(), at_exit=True)

    def _close(self, wait: bool, *, told: bool = False, at_exit: bool = False) -> None:
        """``close()``; ``told``: a KeyboardInterrupt already ended the program (or the ``with``
        block), so the first Ctrl-C is behind us and nothing is raised after an abandon."""
        if self._closed:
            if os.getpid() == self._owner_pid and self._closer != threading.get_ident():
                self._close_done.wait()  # a second close() returns once the first one is done
            return
        self._closed = True
        if os.getpid() != self._owner_pid:
            return  # a fork() child: the parent's saves, writer and arenas are the parent's to finish
        self._closer = threading.get_ident()
        try:
            self._close_now(wait, told=told, at_exit=at_exit)
        finally:
            self._close_done.set()

    def _abandon_in_flight(self, why: str) -> None:
        """From here the saves in flight cannot finish writing: they fail, saying ``why``."""
        self._abandoned = why
        self._writer.abandon()

    def _abandon_unless_waiting(self, wait: bool) -> None:
        """``close(wait=False)`` with saves pending: they are abandoned, not left to run on."""
        if not wait and self._abandoned is None and self.pending():
            self._abandon_in_flight("when the Checkpointer was closed with wait=False")

    def _close_now(self, wait: bool, *, told: bool, at_exit: bool) -> None:
        self._abandon_unless_waiting(wait)  # first, so that a save waiting for a slot gets one
        if self._starting is not None and self._starting != threading.get_ident():
            with self._save_lock:  # a save being started is queued (or refused) before the snapshot below
                pass
        self._abandon_unless_waiting(wait)  # and one queued meanwhile
        pending = self.pending()
        abandon = False
        active = wait and bool(pending)
        with CtrlC(self._waiting_for, active=active, told=told and active) as ctrl_c:
            try:
                if at_exit and ctrl_c.armed and CtrlC.abandoned_at_exit:
                    abandon = True  # the user abandoned another Checkpointer's saves at this exit
                elif wait:
                    self._release_throttle()
                    if pending:
                        where = "the exit" if at_exit else "close()"
                        logger.debug("ckptd: %s waits for %s", where, self._waiting_for())
                    ctrl_c.start_waiting()
                    for request in pending:
                        try:
                            request.result()
                        except Exception:  # noqa: BLE001 - already logged; raised by its own wait()
                            pass
            except KeyboardInterrupt:
                if not ctrl_c.armed:
                    raise  # the program's own SIGINT handler: not ours to interpret
                abandon = True
            finally:
                ctrl_c.stop_waiting()
                if abandon:
                    what = self._waiting_for()
                    self._abandon_in_flight("by Ctrl-C while close() waited for it")
                    ctrl_c.abandoning(what)
                parts = self._finalizer.detach()
                if parts is not None:
                    _, release, args, _ = parts
                    release(*args, wait=wait, abandon=self._abandoned is not None)
        if abandon:
            if at_exit:
                CtrlC.abandoned_at_exit = True
            elif not told:
                raise KeyboardInterrupt

    def _waiting_for(self) -> str:
        """The pending saves, in words: "the save of step 7", "the saves of steps 7, 8"."""
        steps = [str(request.step) for request in self.pending()]
        if len(steps) == 1:
            return f"the save of step {steps[0]}"
        return f"the saves of steps {', '.join(steps)}" if steps else "the pending saves"

    def _check_process(self) -> None:
        check_process(self._owner_pid, "Checkpointer")

    def forget_after_fork(self) -> None:
        """In a fork() child (the writer and pool reset themselves): fresh locks, no saves."""
        self._pending_lock, self._save_lock, self._pending = threading.Lock(), threading.Lock(), []

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this Checkpointer is closed")

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self._close(True, told=exc_type is not None and issubclass(exc_type, KeyboardInterrupt))

    def __repr__(self) -> str:
        return f"Checkpointer({self.root!r})"


# ---- threads and release (no reference to the Checkpointer) ----------------------------------------


def _start_writer(writer: WriterClient | InProcessWriter) -> None:
    """Start the writer process ahead of the first save (on a thread of its own)."""
    try:
        writer.ensure_running()
    except CkptdError as e:  # reported again by the first save
        if writer.abandoned:  # close(wait=False) or Ctrl-C came first: nothing went wrong
            logger.debug("ckptd writer start given up: %s", e)
        else:
            logger.warning("ckptd writer did not start: %s", e)


def _complete_jobs(jobs: queue.Queue[tuple[Checkpointer, SaveJob] | None]) -> None:
    """The completion thread: saves in the order they were queued, until ``None``."""
    while True:
        entry = jobs.get()
        if entry is None:
            return
        owner, job = entry
        owner._complete(job)
        del entry, owner, job  # holding none while waiting lets a dropped Checkpointer be collected


def _release(
    name: str,
    owner_pid: int,
    jobs: queue.Queue[Any],
    completer: threading.Thread,
    parts: tuple[
        Saver, StepMonitor | None, WriterClient | InProcessWriter, StagingPool, Promoter | None, HoldLease | None
    ],
    cleanup: Cleanup,
    cleanup_timeout: float,
    exit_hook: Callable[[], None],
    *,
    wait: bool = True,
    collected: bool = False,
    abandon: bool = False,
) -> None:
    """Stop a Checkpointer's completion thread, writer, arenas and clean-up: from ``close()``, or
    (``collected``) when it was garbage-collected unclosed, then on a thread of its own (the
    collection may happen on any thread, holding any lock), with a ResourceWarning.

    ``abandon`` (the writer was told to abandon its work): wait for the writer to exit (killed
    after ``_ABANDON_WRITER_SECONDS``), then give the completion thread, which fails and cleans
    up every pending save, and the retried clean-ups ``_ABANDON_SECONDS`` at most."""
    if os.getpid() != owner_pid:
        return  # a fork() child: the parent's writer and arenas are the parent's
    if collected:
        args = (name, owner_pid, jobs, completer, parts, cleanup, cleanup_timeout, exit_hook)
        threading.Thread(target=_release, args=args, name="ckptd-release", daemon=True).start()
        with contextlib.suppress(Exception):  # -W error must not turn this into a leak
            warnings.warn(f"{name} was not closed; its writer is stopped now", ResourceWarning, stacklevel=2)
        return
    saver, steps, writer, pool, promoter, lease = parts
    if abandon or not wait:  # no save waits on it any longer: a stuck writer is killed soon
        writer.close(timeout=_ABANDON_WRITER_SECONDS)
    jobs.put(None)
    if (wait or abandon) and completer is not threading.current_thread():
        completer.join(_ABANDON_SECONDS if abandon else None)  # abandoned saves fail and clean up first
    saver.close(wait=wait and not abandon)
    if steps is not None:
        steps.close()
    writer.close()
    pool.close()
    if promoter is not None:  # after the writer and the arenas: copies to slow tiers may take a while
        promoter.close(wait=wait and not abandon)
        if wait and not abandon:
            try:
                saver.apply_keep_last()  # what was kept for the copies goes now
            except Exception as e:  # noqa: BLE001 - retention is not worth failing a close for
                logger.warning("ckptd: keep_last after the tier copies failed: %s", e)
    cleanup.drain(min(cleanup_timeout, _ABANDON_SECONDS) if abandon else cleanup_timeout if wait else 0.0)
    cleanup.close()
    if lease is not None:  # last: the held root's hold clock starts once no process uses it
        lease.close()
    unbind(exit_hook)


def _check_one_host(dist: DistContext, root: str) -> None:
    """A held-memory root is one host's memory: every rank of the group must run on that host
    (a commit across hosts needs a per-node commit, which held roots do not have)."""
    hosts = sorted(set(dist.all_gather(socket.gethostname())))
    if len(hosts) > 1:
        raise ConfigError(
            f"{root} is held in one host's memory, but the ranks of this group run on {len(hosts)} hosts "
            f"({', '.join(hosts[:4])}{', ...' if len(hosts) > 4 else ''}): use a shared root (a path or URL) "
            "with a group per host, or one Checkpointer per host with its own process group"
        )


def _step_of(path: str) -> int | None:
    """The step a checkpoint directory's name says (``checkpoint-120`` -> 120), else ``None``."""
    return parse_step(os.path.basename(path.rstrip("/")))
