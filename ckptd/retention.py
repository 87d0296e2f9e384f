"""Checkpoint policies: when a :class:`~ckptd.CheckpointManager` saves, and which committed
checkpoints its retention keeps (:func:`select_kept`).  The rules compose: a checkpoint survives
if *any* rule keeps it, and the latest committed checkpoint and the best one are never deleted.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from .catalog import CheckpointInfo
from .errors import ConfigError

__all__ = ["CheckpointPolicy", "ranked_by_metric", "select_kept"]


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


def select_kept(checkpoints: list[CheckpointInfo], policy: CheckpointPolicy, preserved: Iterable[int] = ()) -> set[int]:
    """The steps retention keeps among ``checkpoints`` (committed, any order)."""
    steps = sorted(info.step for info in checkpoints)
    if not steps:
        return set()
    if policy.retains_all:
        return set(steps)
    kept = {steps[-1]}  # the latest committed
    if policy.keep_last is not None:
        kept.update(steps[-policy.keep_last :])
    if policy.keep_every is not None:
        kept.update(s for s in steps if s % policy.keep_every == 0)
    ranked = ranked_by_metric(checkpoints, policy)
    if ranked:
        kept.update(info.step for info in ranked[: max(1, policy.keep_best or 1)])
    kept.update(s for s in steps if s in policy.preserve or s in set(preserved))
    # checkpoints whose files a kept (incremental) checkpoint references stay too
    by_name = {os.path.basename(info.path.rstrip("/")) or info.path: info.step for info in checkpoints}
    for info in checkpoints:
        if info.step in kept:
            for record in info.manifest.files.values():
                if record.checkpoint and record.checkpoint in by_name:
                    kept.add(by_name[record.checkpoint])
    return kept
