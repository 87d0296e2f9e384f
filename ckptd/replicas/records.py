"""What :class:`~ckptd.replicas.PeerSnapshots` reports: a restore's outcome and the replication's
counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["PeerRestore", "ReplicationStats"]


@dataclass(frozen=True)
class PeerRestore:
    """What :meth:`PeerSnapshots.restore` restored: the step; where this rank's snapshot came from
    (``"memory"``: this host; ``"tier"``: one of the rank's own slower tiers, number ``tier``;
    ``"replica"``: the peer ``peer``'s memory; ``"fallback"``: the fallback Checkpointer); the
    state (``None`` when it went ``into`` the caller's objects); and ``timings``: seconds from the
    call's start to the end of each phase (``list``, ``fetch``, ``load``, ``agree``, ``assign``;
    ``fallback``), of the last step tried."""

    step: int
    source: str
    peer: int | None = None
    state: Any = None
    timings: dict[str, float] = field(default_factory=dict)
    tier: int | None = None


@dataclass
class ReplicationStats:
    """What the replication has done and holds (:attr:`PeerSnapshots.stats`)."""

    steps_sent: list[int] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    refused: list[str] = field(default_factory=list)
