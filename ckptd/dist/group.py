"""The torch.distributed seam: who we are, the collectives of a save, and the c10d store.

Planning runs on the caller's thread, inside ``async_save``, where a collective is safe: every
rank sends a small brief to the coordinator (:meth:`DistContext.gather`) and receives only its own
part of the plan back (:meth:`DistContext.scatter`), on a CPU (gloo) group.  Both send each
rank's pickled bytes at their exact size, point to point after a collective of the sizes:
torch's ``gather_object``/``scatter_object_list`` pad every rank's bytes to the largest, which
at 16,384 ranks turns one 150 KB plan into 2.4 GB on the coordinator, and a part shared by many
ranks is held once.  Everything after that (waiting
for other ranks' writes, the commit, failures) happens on background threads and must not issue
collectives on the training group, so it goes through the c10d key-value store with per-save
keys and deadlines instead.  :attr:`DistContext.traffic` counts what this rank sent and received
through the collectives and which store keys it created (read by tests and benchmarks).
"""

from __future__ import annotations

import json
import logging
import pickle
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ConfigError, DistributedSaveError

__all__ = ["DistContext", "Sharing", "Traffic", "group_leader", "group_leaders", "normalize_sharing", "rank_failure"]

logger = logging.getLogger(__name__)

_POLL_SECONDS = 0.05


class Sharing:
    """How a component is shared across ranks (strings are accepted too).

    * ``REPLICATED`` (default): the same on every rank; plain tensors are written once (by a rank
      chosen to balance bytes); DTensors and :class:`~ckptd.ShardedTensor` are written as shards.
    * ``PER_RANK``: every rank's own copy (RNG, data position), restored to the same rank.
    * ``GLOBAL``: one copy, saved by the coordinator only, loaded by every rank.
    * ``PER_GROUP``: one copy per process group (pass ``(Sharing.PER_GROUP, group)``), replicated
      inside the group.
    Forgather's names (``GLOBAL``, ``PER_RANK``, ``REPLICATED``, ``PER_GROUP``) and ``"sharded"``
    (same as replicated: sharded tensors are recognised by their type) are accepted.
    """

    REPLICATED = "replicated"
    PER_RANK = "per_rank"
    GLOBAL = "global"
    PER_GROUP = "per_group"


_ALIASES = {
    "replicated": Sharing.REPLICATED,
    "sharded": Sharing.REPLICATED,
    "per_rank": Sharing.PER_RANK,
    "global": Sharing.GLOBAL,
    "per_group": Sharing.PER_GROUP,
}


def normalize_sharing(value: Any) -> tuple[str, Any]:
    """``(pattern, group)`` from a string, an enum member (Forgather's ``SharingPattern``) or a
    ``(pattern, group)`` pair."""
    group = None
    if isinstance(value, tuple) and len(value) == 2:
        value, group = value
    name = getattr(value, "name", None) or getattr(value, "value", None) or value
    pattern = _ALIASES.get(str(name).lower())
    if pattern is None:
        raise ConfigError(f"unknown sharing pattern {value!r}; use replicated, per_rank, global or per_group")
    if pattern == Sharing.PER_GROUP and group is None:
        raise ConfigError("per_group sharing needs a process group: pass (Sharing.PER_GROUP, group)")
    return pattern, group


def group_leader(group: Any) -> int:
    """The lowest global rank of ``group``: it names a ``PER_GROUP`` component's copy
    (``name@group<leader>``), the same on every rank of the group."""
    return min(dist.get_process_group_ranks(group))


@dataclass
class Traffic:
    """What one rank exchanged for its saves: collectives, pickled bytes, c10d store keys."""

    collectives: int = 0
    sent: int = 0  # pickled bytes this rank put into collectives
    received: int = 0  # pickled bytes it got out of them
    keys: set[str] = field(default_factory=set)  # store keys it created (deleted ones stay listed)


@dataclass
class DistContext:
    """This process's place in a multi-rank run."""

    rank: int
    world_size: int
    coordinator: int
    group: Any
    store: Any
    timeout: float
    traffic: Traffic = field(default_factory=Traffic)

    @classmethod
    def detect(cls, process_group: Any = None, coordinator: int = 0, timeout: float = 600.0) -> DistContext | None:
        """The context of the current process group, or ``None`` outside torch.distributed (or
        with a single rank).  With an NCCL group it creates a gloo group over the same ranks,
        which ``new_group`` requires every rank of the *world* to call: create the Checkpointer
        on every rank (even with a subgroup)."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        group = process_group or dist.group.WORLD
        world = dist.get_world_size(group)
        if world == 1:
            return None
        if "gloo" not in str(dist.get_backend(group)).lower():
            ranks = dist.get_process_group_ranks(group)
            group = dist.new_group(ranks=ranks, backend="gloo", timeout=timedelta(seconds=timeout))
        store = dist.distributed_c10d._get_default_store()
        return cls(dist.get_rank(group), world, coordinator, group, store, timeout)

    @property
    def is_coordinator(self) -> bool:
        return self.rank == self.coordinator

    def all_gather(self, payload: Any) -> list[Any]:
        """Every rank's ``payload``, in rank order."""
        out: list[Any] = [None] * self.world_size
        data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            dist.all_gather_object(out, data, group=self.group)
        except Exception as e:  # gloo reports a dead peer as one of several error types
            raise self._collective_failed(e) from e
        self._count(len(data), sum(len(b) for b in out))
        return [pickle.loads(b) for b in out]

    def gather(self, payload: Any) -> list[Any] | None:
        """Every rank's ``payload`` in rank order on the coordinator; ``None`` on the others."""
        data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        coordinator = self.coordinator
        try:
            size = torch.tensor([len(data)], dtype=torch.int64)
            sizes = [torch.empty(1, dtype=torch.int64) for _ in range(self.world_size)] if self.is_coordinator else None
            dist.gather(size, sizes, group=self.group, group_dst=coordinator)
            if not self.is_coordinator:
                dist.send(_as_tensor(data), group=self.group, group_dst=coordinator)
                self._count(len(data), 0)
                return None
            assert sizes is not None
            buffers: list[Any] = []
            works = []
            for rank, n in enumerate(sizes):
                if rank == self.rank:
                    buffers.append(data)
                    continue
                buffer = torch.empty(int(n.item()), dtype=torch.uint8)
                works.append(dist.irecv(buffer, group=self.group, group_src=rank))
                buffers.append(buffer)
            for work in works:
                if work is not None:
                    work.wait()
        except Exception as e:
            raise self._collective_failed(e) from e
        received = sum(b.numel() for i, b in enumerate(buffers) if i != self.rank)
        self._count(len(data), received)
        return [pickle.loads(b if isinstance(b, bytes) else _as_bytes(b)) for b in buffers]

    def scatter(self, parts: list[Any] | None) -> Any:
        """This rank's item of the coordinator's ``parts`` (one per rank; ``None`` elsewhere).  A
        part given for many ranks (the same object) is pickled and held once."""
        coordinator = self.coordinator
        if self.is_coordinator and (parts is None or len(parts) != self.world_size):
            raise ValueError("the coordinator scatters exactly one part per rank")
        try:
            size = torch.empty(1, dtype=torch.int64)
            if not self.is_coordinator:
                dist.scatter(size, None, group=self.group, group_src=coordinator)
                buffer = torch.empty(int(size.item()), dtype=torch.uint8)
                dist.recv(buffer, group=self.group, group_src=coordinator)
                self._count(0, buffer.numel())
                return pickle.loads(_as_bytes(buffer))
            assert parts is not None
            pickled: dict[int, tuple[bytes, Any]] = {}  # by id: a part given for many ranks is pickled once
            for p in parts:
                if id(p) not in pickled:
                    data = pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL)
                    pickled[id(p)] = (data, _as_tensor(data))
            sizes = [torch.tensor([len(pickled[id(p)][0])], dtype=torch.int64) for p in parts]
            dist.scatter(size, sizes, group=self.group, group_src=coordinator)
            works = [
                dist.isend(pickled[id(p)][1], group=self.group, group_dst=rank)
                for rank, p in enumerate(parts)
                if rank != self.rank
            ]
            for work in works:
                if work is not None:
                    work.wait()
        except Exception as e:
            raise self._collective_failed(e) from e
        sent = sum(len(pickled[id(p)][0]) for rank, p in enumerate(parts) if rank != self.rank)
        self._count(sent, 0)
        return pickle.loads(pickled[id(parts[self.rank])][0])

    def _count(self, sent: int, received: int) -> None:
        self.traffic.collectives += 1
        self.traffic.sent += sent
        self.traffic.received += received

    def _global(self, rank: int) -> int:
        """The global rank of ``rank`` of our group (collectives name their root globally)."""
        if self.group is None or self.group is dist.group.WORLD:
            return rank
        return int(dist.get_global_rank(self.group, rank))

    def _collective_failed(self, error: BaseException) -> DistributedSaveError:
        return DistributedSaveError(
            f"planning the save failed: the collective over {self.world_size} ranks did not complete "
            f"(a rank died, or did not call async_save/prepare): {error}"
        )

    # ---- the store ------------------------------------------------------------------------

    def post(self, key: str, value: dict[str, Any]) -> None:
        """Publish ``value`` (JSON) under ``key`` for the other ranks."""
        self.traffic.keys.add(f"ckptd/{key}")
        try:
            self.store.set(f"ckptd/{key}", json.dumps(value))
        except Exception as e:
            raise self._lost(e) from e

    def poll(self, key: str) -> dict[str, Any] | None:
        """The value under ``key`` if it was posted, else ``None`` (never blocks)."""
        full = f"ckptd/{key}"
        try:
            if not self.store.check([full]):
                return None
            return json.loads(self.store.get(full))
        except Exception as e:
            raise self._lost(e) from e

    def _lost(self, error: BaseException) -> DistributedSaveError:
        return DistributedSaveError(
            f"lost contact with the c10d store (hosted by the process of global rank 0; did it exit?): {error}",
            [0],
        )

    def wait(self, keys: list[str], deadline: float, what: str) -> dict[str, dict[str, Any]]:
        """Wait until every key is posted; returns what was posted so far when the deadline
        passes (the caller reports the missing ones)."""
        found: dict[str, dict[str, Any]] = {}
        while True:
            for key in keys:
                if key not in found:
                    value = self.poll(key)
                    if value is not None:
                        found[key] = value
            if len(found) == len(keys) or time.monotonic() >= deadline:
                return found
            time.sleep(_POLL_SECONDS)

    def forget(self, keys: list[str]) -> None:
        for key in keys:
            try:
                self.store.delete_key(f"ckptd/{key}")
            except Exception:  # noqa: BLE001 - some stores cannot delete; keys are small
                return


def rank_failure(failures: dict[int, str], what: str) -> DistributedSaveError:
    """One error naming every failed rank and its cause."""
    details = "; ".join(f"rank {rank}: {cause}" for rank, cause in sorted(failures.items()))
    return DistributedSaveError(f"{what} failed on rank(s) {sorted(failures)}: {details}", sorted(failures))


def group_leaders(sharing: Mapping[str, Any] | None) -> dict[str, int]:
    """Component name -> leader rank of its group, for the per-group components in ``sharing``."""
    leaders: dict[str, int] = {}
    for name, value in (sharing or {}).items():
        pattern, group = normalize_sharing(value)
        if pattern == Sharing.PER_GROUP:
            leaders[name] = group_leader(group)
    return leaders


def _as_tensor(data: bytes) -> Any:
    """``data`` as a uint8 tensor to send, without a copy (it is only read: torch's warning
    about a read-only buffer does not apply)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8)


def _as_bytes(tensor: Any) -> memoryview:
    """A received uint8 tensor's bytes, without a copy."""
    return memoryview(tensor.numpy()).cast("B")
