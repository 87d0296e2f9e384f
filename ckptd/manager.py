"""The :class:`CheckpointManager`: when to save, which checkpoints to keep, and preemption.

A training loop calls :meth:`CheckpointManager.maybe_save` every step; the manager decides from
its :class:`CheckpointPolicy` whether this step is saved (every N steps, every T seconds, on
demand, or because a termination signal arrived) and hands the save to a
:class:`~ckptd.Checkpointer` (any root URL).  After each commit a background thread applies the
retention rules, which compose: a checkpoint survives if *any* rule keeps it (the last N, every
K-th step, the best N by a metric, the preserved ones), and the latest committed checkpoint and
the best one are never deleted.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

from .catalog import CheckpointInfo, ManifestCache, list_checkpoints, remove_checkpoint
from .checkpointer import Checkpointer
from .errors import CheckpointNotFoundError, ConfigError
from .formats.json_files import parse_json, read_small_file
from .request import SaveRequest
from .retention import CheckpointPolicy, ranked_by_metric, select_kept

__all__ = ["PRESERVED_NAME", "CheckpointManager", "CheckpointPolicy", "select_kept"]

logger = logging.getLogger(__name__)

PRESERVED_NAME = ".ckptd-preserved.json"
_DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")


class CheckpointManager:
    """Policy-driven saves, composable retention and preemption on top of a :class:`Checkpointer`.

    Args:
        root: directory or fsspec URL of the checkpoints (``checkpoint-<step>/`` under it).
        policy: a :class:`CheckpointPolicy` (default: save only when asked, keep everything).
        checkpointer: an existing :class:`Checkpointer` to use (not closed by :meth:`close`;
            its ``keep_last`` must be unset: the manager does the retention); otherwise one is
            created from ``root`` and ``checkpointer_options`` (without ``keep_last``).
        **checkpointer_options: keyword arguments of :class:`Checkpointer`.

    Under torch.distributed every rank creates the manager and calls :meth:`maybe_save` with
    the same steps; the save decision is agreed by one small all-reduce per call (wall time,
    signals and :meth:`request_save` may differ between ranks), and only the coordinator deletes.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        policy: CheckpointPolicy | None = None,
        *,
        checkpointer: Checkpointer | None = None,
        **checkpointer_options: Any,
    ) -> None:
        if checkpointer is None:
            if root is None:
                raise ConfigError("CheckpointManager needs a root (or checkpointer=)")
            if checkpointer_options.get("keep_last") is not None:
                raise ConfigError("pass keep_last in CheckpointPolicy, not to the Checkpointer of a CheckpointManager")
            checkpointer = Checkpointer(root, **checkpointer_options)
            self._owns = True
        else:
            if checkpointer_options:
                raise ConfigError(f"checkpointer= was given; {sorted(checkpointer_options)} would be ignored")
            if checkpointer.options.keep_last is not None:
                # Two owners of retention with different rules would each delete what the other keeps.
                raise ConfigError(
                    "the Checkpointer given to a CheckpointManager has keep_last set; retention is the manager's: "
                    "pass keep_last in CheckpointPolicy instead"
                )
            self._owns = False
        self.checkpointer = checkpointer
        self.policy = policy or CheckpointPolicy()
        self.root = checkpointer.root
        self._storage = checkpointer.storage
        dist_context = checkpointer._dist
        self._group = dist_context.group if dist_context is not None else None
        self._is_coordinator = dist_context is None or dist_context.is_coordinator
        self._last_save_time = time.monotonic()
        self._last_saved_step: int | None = None
        self._requested = threading.Event()
        self._signal: int | None = None
        self._exit_on_signal = True
        self._previous_handlers: dict[int, Any] = {}
        self._preserved: set[int] = set(self._read_preserved())
        self._tasks: queue.Queue[CheckpointManager | None] = queue.Queue()
        # Parsed manifests, for retention after each commit: the checkpointer's, which each of its
        # commits fills with the manifest it wrote.
        self._listed: ManifestCache = checkpointer._saver.listed
        self._retention_error: BaseException | None = None
        self._idle = threading.Condition()
        self._busy = 0
        self._closed = False
        # The thread holds no reference to the manager (a queued task holds one until it is done),
        # so a manager dropped without close() is collected, and its own Checkpointer with it.
        self._worker = threading.Thread(target=_run_retention, args=(self._tasks,), name="ckptd-retention", daemon=True)
        self._worker.start()
        self._finalizer = weakref.finalize(self, self._tasks.put, None)  # ends the thread
        self._finalizer.atexit = False

    # ---- deciding and saving ---------------------------------------------------------------

    def request_save(self) -> None:
        """Save at the next :meth:`maybe_save` call, whatever the policy says (thread-safe)."""
        self._requested.set()

    @property
    def stop_requested(self) -> bool:
        """True once a handled signal arrived (the next :meth:`maybe_save` makes the final save)."""
        return self._signal is not None

    def should_save(self, step: int) -> bool:
        """Whether :meth:`maybe_save` would save ``step`` (agreed across ranks: collective)."""
        local = self._local_decision(step)
        if self._group is not None:
            import torch
            import torch.distributed as dist

            flags = torch.tensor([int(local), int(self._signal is not None)], dtype=torch.int64)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
            if flags[1].item() and self._signal is None:
                self._signal = int(signal.SIGTERM)  # another rank was signalled: stop together
            return bool(flags[0].item())
        return local

    def _local_decision(self, step: int) -> bool:
        if self._signal is not None or self._requested.is_set():
            return True
        if self.policy.every_steps is not None and step % self.policy.every_steps == 0:
            return True
        if self.policy.every_seconds is not None:
            return time.monotonic() - self._last_save_time >= self.policy.every_seconds
        return False

    def maybe_save(
        self,
        step: int,
        state: Mapping[str, Any],
        metrics: Mapping[str, Any] | None = None,
        *,
        force: bool = False,
        **kwargs: Any,
    ) -> SaveRequest | None:
        """Save ``state`` at ``step`` if the policy (or ``force``, a request, a signal) says so.

        Returns the :class:`SaveRequest` of the asynchronous save, or ``None``.  ``metrics`` are
        recorded in the manifest (``keep_best`` ranks by them); ``kwargs`` go to
        :meth:`Checkpointer.async_save` (``sharing``, ``metadata``, ...).  After a handled
        signal, this save is the final one: it waits for the commit and pending deletions,
        closes the manager and raises :class:`SystemExit` (``128 + signal number``) unless
        the handlers were installed with ``exit=False``.
        """
        self._check_open()
        decided = self.should_save(step) or force
        if not decided or step == self._last_saved_step:
            if self._signal is not None and step == self._last_saved_step:
                self._finish_for_signal(None)
            return None
        self._requested.clear()
        request = self.checkpointer.async_save(step, state, metrics=metrics, **kwargs)
        self._last_saved_step = step
        self._last_save_time = time.monotonic()
        with self._idle:
            self._busy += 1  # until retention after this save has run (or been skipped)
        request.add_done_callback(self._committed)
        logger.debug("ckptd: saving step %s to %s", step, request.path)
        if self._signal is not None:
            self._finish_for_signal(request)
        return request

    def save(
        self, step: int, state: Mapping[str, Any], metrics: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> SaveRequest:
        """Save ``step`` now (asynchronously), whatever the policy."""
        request = self.maybe_save(step, state, metrics, force=True, **kwargs)
        if request is None:
            raise ConfigError(f"step {step} was already saved by this manager")
        return request

    def _finish_for_signal(self, request: SaveRequest | None) -> None:
        signum = self._signal
        if request is not None:
            request.result()  # the final save must commit before the process goes
            logger.warning("ckptd: final checkpoint of step %s committed after signal %s", request.step, signum)
        self.wait()
        if self._exit_on_signal:
            self.close()
            raise SystemExit(128 + int(signum or 0))

    # ---- signals ---------------------------------------------------------------------------

    def install_signal_handlers(self, signals: Iterable[int | str] = _DEFAULT_SIGNALS, *, exit: bool = True) -> None:
        """On any of ``signals`` (default SIGTERM and SIGUSR1), make the next :meth:`maybe_save`
        a final save: it saves whatever the policy, waits for the commit, and then (``exit``)
        raises ``SystemExit(128 + signum)`` so the process ends through its ``finally`` blocks.

        Call from the main thread.  Slurm: ``#SBATCH --signal=B:USR1@120`` (sent 120 s before
        the time limit); Kubernetes sends SIGTERM at pod deletion and kills after
        ``terminationGracePeriodSeconds``: set it above a step plus a save's commit time.
        """
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError("install_signal_handlers() must be called from the main thread")
        self._exit_on_signal = exit
        for value in signals:
            signum = getattr(signal, value) if isinstance(value, str) else int(value)
            self._previous_handlers[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._signal is None:
            self._signal = signum
        logger.warning("ckptd: signal %s received; the next maybe_save() makes the final checkpoint", signum)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._previous_handlers.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous_handlers.clear()

    # ---- listing and loading ---------------------------------------------------------------

    def _committed_infos(self) -> list[CheckpointInfo]:
        return list_checkpoints(self._storage, self.root)

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return [info.step for info in self._committed_infos()]

    def latest(self) -> int | None:
        """The highest committed step, or ``None``."""
        return self.checkpointer.latest_step()

    def best(self) -> int | None:
        """The committed step with the best ``policy.metric`` (``None`` without a metric or
        without checkpoints carrying it)."""
        ranked = ranked_by_metric(self._committed_infos(), self.policy)
        return ranked[0].step if ranked else None

    def metrics(self, step: int) -> dict[str, Any]:
        """The metrics recorded with ``step``."""
        return dict(self.checkpointer.manifest(step).metrics)

    def load(self, step: int | str = "latest", into: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
        """Load ``"latest"``, ``"best"`` or a step (``into=`` restores in place, as
        :meth:`Checkpointer.load`)."""
        if step == "best":
            best = self.best()
            if best is None:
                raise CheckpointNotFoundError(
                    f"no committed checkpoint under {self.root} carries the metric {self.policy.metric!r}"
                )
            step = best
        elif step == "latest" and self.latest() is None:
            raise CheckpointNotFoundError(f"no committed checkpoint under {self.root}")
        return self.checkpointer.load(step, into, **kwargs)

    # ---- preserved checkpoints -------------------------------------------------------------

    def preserve(self, step: int) -> None:
        """Keep ``step`` whatever the retention rules (recorded under the root, survives restarts)."""
        self._preserved.add(int(step))
        if self._is_coordinator:
            body = json.dumps(sorted(self._preserved)).encode()
            self._storage.write_bytes(self._storage.join(self.root, PRESERVED_NAME), body)

    def preserved(self) -> list[int]:
        """Steps kept by :meth:`preserve` or ``policy.preserve``."""
        return sorted(self._preserved | self.policy.preserve)

    def _read_preserved(self) -> list[int]:
        path = self._storage.join(self.root, PRESERVED_NAME)
        try:
            data = read_small_file(self._storage, path)
        except (FileNotFoundError, OSError):
            return []
        try:
            return [int(s) for s in parse_json(data, path, "list of preserved steps")]
        except (ValueError, TypeError) as e:
            raise ConfigError(
                f"{self._storage.join(self.root, PRESERVED_NAME)} is not a JSON list of steps; fix or remove it"
            ) from e

    # ---- retention (background thread) -----------------------------------------------------

    def _committed(self, request: SaveRequest) -> None:
        if request.exception() is not None or not self._is_coordinator:
            with self._idle:
                self._busy -= 1
                self._idle.notify_all()
            return
        self._tasks.put(self)

    def _retain(self) -> None:
        """One retention pass after a commit (on the retention thread); a failure is kept for wait()."""
        try:
            self.apply_retention()
        except Exception as e:  # noqa: BLE001 - stored, raised by wait()
            logger.error("ckptd: retention under %s failed: %s", self.root, e)
            self._retention_error = e
        finally:
            with self._idle:
                self._busy -= 1
                self._idle.notify_all()

    def apply_retention(self) -> list[int]:
        """Delete the committed checkpoints no rule keeps; returns their steps.  Runs by itself
        after each commit (on a background thread); checkpoints of saves still in flight are
        not committed yet and never touched, nor are those such saves read files from.

        Rules count the checkpoints this run committed as the newest, in the order it committed
        them, after the ones it found (:class:`~ckptd.retention.RunRecord`): after a rollback
        (resumed from step 50 under a root holding 100), the new saves are what ``keep_last``
        keeps, and deleting the abandoned later steps is logged as a warning."""
        if self.policy.retains_all:
            return []
        run = self.checkpointer._saver.run
        with run.lock:
            checkpoints = run.ordered(list_checkpoints(self._storage, self.root, self._listed))
            kept = select_kept(checkpoints, self.policy, self._preserved, run)
        doomed = [info for info in reversed(checkpoints) if info.step not in kept]  # newest first
        for info in doomed:
            remove_checkpoint(self._storage, info.path)
        removed = [info.step for info in doomed]
        if removed:
            newest = checkpoints[-1].step
            later = sorted(step for step in removed if step > newest)
            if later:
                logger.warning(
                    "ckptd: retention under %s removed steps %s, later than this run's newest checkpoint %s "
                    "(the run resumed from an earlier step)",
                    self.root,
                    later,
                    newest,
                )
            logger.info("ckptd: retention removed steps %s under %s", sorted(removed), self.root)
        return sorted(removed)

    # ---- lifecycle -------------------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> None:
        """Wait for pending saves and the deletions that follow them; raises their first failure."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.checkpointer.wait(timeout)
        with self._idle:
            while self._busy:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"retention under {self.root} did not finish in {timeout} s")
                self._idle.wait(remaining)
        if self._retention_error is not None:
            error, self._retention_error = self._retention_error, None
            raise error

    def close(self, wait: bool = True) -> None:
        """Finish pending saves and deletions, restore signal handlers, close an owned Checkpointer."""
        if self._closed:
            return
        try:
            if wait:
                self.wait()
        finally:
            self._closed = True
            self._finalizer.detach()
            self._tasks.put(None)
            if wait:
                self._worker.join()
            self._restore_signal_handlers()
            if self._owns:
                self.checkpointer.close(wait=wait)

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this CheckpointManager is closed")

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointManager({self.root!r}, {self.policy!r})"


def _run_retention(tasks: queue.Queue[CheckpointManager | None]) -> None:
    """The retention thread: one pass per committed save, until ``None``."""
    while True:
        manager = tasks.get()
        if manager is None:
            return
        manager._retain()
        del manager  # holding none while waiting lets a dropped manager be collected
