"""Retention: which committed checkpoints are kept, and deleting the others.

- :class:`CheckpointPolicy`: when a :class:`~ckptd.CheckpointManager` saves, and what its
  retention keeps (:func:`select_kept`).  The rules compose: a checkpoint survives if *any* rule
  keeps it, and the latest committed checkpoint and the best one are never deleted.
- :func:`apply_retention`: the Checkpointer's ``keep_last``.
- :class:`RunRecord`: what both owners of retention know about the saving run (its timeline, the
  checkpoints its saves in flight read from).
- :func:`legacy_references`: what checkpoints of older versions reference, kept alive by both.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from .catalog import CheckpointInfo, ManifestCache, list_checkpoints, remove_checkpoint, retire_to_spare
from .errors import ConfigError
from .formats.manifest import Manifest
from .storage import Storage, base_name
from .storage.local import LocalStorage

__all__ = [
    "CheckpointPolicy",
    "RunRecord",
    "apply_retention",
    "legacy_references",
    "legacy_referrers",
    "ranked_by_metric",
    "select_kept",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointPolicy:
    """When to save and what to keep.

    Saving (any trigger saves): ``every_steps`` (``step % every_steps == 0``), ``every_seconds``
    (wall time since the last save), plus :meth:`CheckpointManager.request_save` and signals.

    Retention (a checkpoint is kept if any rule keeps it; no rule at all keeps everything):
    ``keep_last`` newest, every ``keep_every``-th step, the ``keep_best`` best by ``metric``
    (``mode`` ``"min"`` or ``"max"``), and steps in ``preserve``.  The latest committed
    checkpoint, and the best one when ``metric`` is set, are always kept.
    """

    every_steps: int | None = None
    every_seconds: float | None = None
    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: int | None = None
    metric: str | None = None
    mode: str = "min"
    preserve: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        for name in ("every_steps", "keep_last", "keep_every", "keep_best"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"CheckpointPolicy.{name} must be a positive int or None, got {value!r}")
        if self.every_seconds is not None and not self.every_seconds > 0:
            raise ConfigError(f"CheckpointPolicy.every_seconds must be > 0, got {self.every_seconds!r}")
        if self.mode not in ("min", "max"):
            raise ConfigError(f"CheckpointPolicy.mode must be 'min' or 'max', got {self.mode!r}")
        if self.keep_best is not None and self.metric is None:
            raise ConfigError("CheckpointPolicy.keep_best needs metric= (the name of a metric passed to maybe_save)")
        object.__setattr__(self, "preserve", frozenset(int(s) for s in self.preserve))

    @property
    def retains_all(self) -> bool:
        return self.keep_last is None and self.keep_every is None and self.keep_best is None


def _metric_value(info: CheckpointInfo, metric: str) -> float | None:
    value = info.manifest.metrics.get(metric)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def ranked_by_metric(checkpoints: Iterable[CheckpointInfo], policy: CheckpointPolicy) -> list[CheckpointInfo]:
    """Checkpoints carrying ``policy.metric``, best first (ties: the newer step first)."""
    if policy.metric is None:
        return []
    scored = [(v, info) for info in checkpoints if (v := _metric_value(info, policy.metric)) is not None]
    sign = 1.0 if policy.mode == "min" else -1.0
    scored.sort(key=lambda pair: (sign * pair[0], -pair[1].step))
    return [info for _, info in scored]


def select_kept(
    checkpoints: list[CheckpointInfo],
    policy: CheckpointPolicy,
    preserved: Iterable[int] = (),
    run: RunRecord | None = None,
) -> set[int]:
    """The steps retention keeps among ``checkpoints`` (committed, any order).

    ``run`` (the saving run's :class:`~ckptd.retention.RunRecord`) orders them by the run's
    timeline for ``keep_last`` and "the latest" (after a rollback the run's own saves are the
    newest, whatever their steps), and keeps the checkpoints its saves in flight read from."""
    run = run or RunRecord()
    with run.lock:
        ordered = run.ordered(checkpoints)
        in_use = run.in_use()
    steps = [info.step for info in ordered]
    if not steps:
        return set()
    if policy.retains_all:
        return set(steps)
    kept = {steps[-1]}  # the latest committed of the run's timeline
    if policy.keep_last is not None:
        kept.update(steps[-policy.keep_last :])
    if policy.keep_every is not None:
        kept.update(s for s in steps if s % policy.keep_every == 0)
    ranked = ranked_by_metric(checkpoints, policy)
    if ranked:
        kept.update(info.step for info in ranked[: max(1, policy.keep_best or 1)])
    kept.update(s for s in steps if s in policy.preserve or s in set(preserved))
    kept.update(info.step for info in checkpoints if info.path in in_use)
    # checkpoints whose files a kept checkpoint of an older version references stay too
    names = legacy_references(info.manifest for info in checkpoints if info.step in kept)
    kept.update(info.step for info in checkpoints if base_name(info.path) in names)
    return kept


class RunRecord:
    """What retention needs to know about the run that saves under a root, beyond what storage
    shows.  Shared by the Checkpointer's ``keep_last`` and a :class:`~ckptd.CheckpointManager`'s
    rules, so that both owners of retention decide alike.

    1. **The run's timeline** (:meth:`committed`, :meth:`ordered`): retention ranks checkpoints
       oldest to newest as the checkpoints this run did not write, by step, then this run's, in
       the order it committed them.  After a rollback (a run that resumed from step 50 under a
       root holding 100) the run's own saves (60, 70) are the newest, not the abandoned 100.
    2. **Checkpoints in use** (:meth:`acquire`, :meth:`release`, :meth:`in_use`): an
       incremental save links or copies files from the last committed checkpoint while it is
       written; that checkpoint is never deleted before the save has finished with it.

    ``lock`` serializes "read the last committed checkpoint and mark it in use" (a save being
    planned) against "record a commit, then read what is in use" (retention after a commit), so a
    checkpoint retention is deleting is never chosen as a source.  Thread-safe.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._sequence: dict[str, int] = {}  # path -> commit number in this run
        self._commits = 0
        self._in_use: collections.Counter[str] = collections.Counter()

    def committed(self, path: str) -> None:
        """``path`` was committed by this run (now the newest of its timeline)."""
        with self.lock:
            self._commits += 1
            self._sequence[path] = self._commits

    def ordered(self, checkpoints: Iterable[CheckpointInfo]) -> list[CheckpointInfo]:
        """``checkpoints`` from the oldest to the newest of this run's timeline."""
        with self.lock:
            sequence = dict(self._sequence)
        others = [info for info in checkpoints if info.path not in sequence]
        mine = [info for info in checkpoints if info.path in sequence]
        others.sort(key=lambda info: (info.step, info.manifest.created_utc))
        mine.sort(key=lambda info: sequence[info.path])
        return others + mine

    def acquire(self, paths: Iterable[str]) -> None:
        """Saves in flight read from the checkpoints at ``paths``: retention keeps them."""
        with self.lock:
            self._in_use.update(paths)

    def release(self, paths: Iterable[str]) -> None:
        """The save that acquired ``paths`` is over."""
        with self.lock:
            self._in_use.subtract(paths)
            self._in_use += collections.Counter()  # drop the zero counts

    def in_use(self) -> set[str]:
        """Paths of the checkpoints saves in flight read from."""
        with self.lock:
            return set(self._in_use)


def legacy_references(manifests: Iterable[Manifest]) -> set[str]:
    """Names of the checkpoints whose files the checkpoints of ``manifests`` reference.

    Only manifests written by ckptd versions before self-contained checkpoints hold such
    references (an incremental save then pointed at the earlier checkpoint's files instead of
    linking them in); new checkpoints never do.  The one place that reads them: retention, ``rm``,
    overwrites and the Forgather rotation all keep what this returns.
    """
    return {f.checkpoint for manifest in manifests for f in manifest.files.values() if f.checkpoint}


def legacy_referrers(checkpoints: Iterable[CheckpointInfo], path: str) -> list[str]:
    """Paths among ``checkpoints`` (other than ``path``) whose manifests reference the files of
    the checkpoint at ``path`` (older versions' incremental saves only)."""
    name = base_name(path)
    return [
        info.path
        for info in checkpoints
        if info.path != path and any(f.checkpoint == name for f in info.manifest.files.values())
    ]


def apply_retention(
    storage: Storage,
    root: str,
    keep_last: int,
    run: RunRecord | None = None,
    cache: ManifestCache | None = None,
    spare: bool = False,
) -> list[str]:
    """Keep the ``keep_last`` newest checkpoints of the run's timeline (:class:`RunRecord`;
    without one, by step), plus those in use by saves in flight, plus any whose files a kept
    checkpoint of an older version references; delete the others, newest first (so a crash
    never leaves an older version's checkpoint whose referenced files are gone).  Returns the
    paths removed.  With ``spare`` (a local held-memory root) the newest one removed becomes the
    root's spare (:func:`~ckptd.catalog.retire_to_spare`): the next save reuses its pages."""
    run = run or RunRecord()
    with run.lock:
        checkpoints = run.ordered(list_checkpoints(storage, root, cache))
        in_use = run.in_use()
    cut = max(0, len(checkpoints) - keep_last)
    doomed = [info for info in checkpoints[:cut] if info.path not in in_use]
    kept = [info for info in checkpoints if info not in doomed]
    referenced = legacy_references(info.manifest for info in kept)
    removed: list[str] = []
    for info in reversed(doomed):
        if base_name(info.path) in referenced:
            continue
        if spare and not removed and isinstance(storage, LocalStorage):
            retire_to_spare(storage, root, info.path)
        else:
            remove_checkpoint(storage, info.path)
        removed.append(info.path)
    if removed:
        newest = checkpoints[-1]
        later = [path for path in removed if _step_of(checkpoints, path) > newest.step]
        if later:
            logger.warning(
                "ckptd: retention under %s deleted %s: later steps than this run's newest checkpoint %s "
                "(this run resumed from an earlier step; keep_last counts this run's checkpoints as the newest)",
                root,
                ", ".join(later),
                newest.path,
            )
    return removed


def _step_of(checkpoints: list[CheckpointInfo], path: str) -> int:
    return next(info.step for info in checkpoints if info.path == path)
