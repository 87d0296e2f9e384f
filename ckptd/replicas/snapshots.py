"""Peer snapshots: each rank's state in its host's memory, with replicas in peer ranks' memory.

:class:`PeerSnapshots` keeps, on every rank of a torch.distributed job, a snapshot of that rank's
own state in the held memory of its host (``shm://NAME.rank-RRRRR``, an ordinary world-of-one
:class:`~ckptd.Checkpointer`: staged once, written by the rank's writer process, committed whole or
invisible, kept ``hold_after_exit`` after the trainer dies).  With ``replicas=N`` each committed
snapshot is then copied to ``N`` ranks on other nodes (:mod:`.topology`), in the background, on a
gloo group of its own (never the training group's stream of collectives), into their held memory
(``shm://NAME.replica-RRRRR``), one 8 MiB piece at a time.

After a failure the job restarts with the same world size; :meth:`PeerSnapshots.restore` finds the
newest step that every rank can get (its own memory, or a peer's replica of it), has the peers send
the missing snapshots back, loads each rank's snapshot (CRC32C checked), and agrees across ranks
that every rank succeeded; otherwise it tries an older step, and then the ``fallback``
Checkpointer (a disk or object-store root).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any, cast

import torch.distributed as dist

from ..catalog import list_checkpoints
from ..checkpointer import Checkpointer
from ..errors import CkptdError, ConfigError, ReplicationError
from ..formats.names import checkpoint_dir_name
from ..garbage import collect_garbage
from ..load.inline_verify import VerifyMode
from ..options import DEFAULT_HELD_KEEP_LAST, DEFAULT_HOLD_AFTER_EXIT, parse_duration
from ..request import SaveRequest
from ..retention import apply_retention
from ..storage.held import bytes_under, held_name, held_path
from ..tiers import Tier
from ..writer.keeper import HoldLease
from .local_state import local_state, restore_into, split_targets
from .records import PeerRestore, ReplicationStats
from .topology import node_name, replica_holders, wards
from .transfer import BackgroundSend, Received, receive_checkpoint, send_checkpoint

__all__ = ["PeerSnapshots", "rank_tiers"]

logger = logging.getLogger(__name__)

DEFAULT_REPLICATION_TIMEOUT = 600.0
"""Seconds a replication transfer may wait for its peer before the group gives up on it."""


class PeerSnapshots:
    """Snapshots of each rank's state in its host's memory, replicated to peer ranks' memory.

    Args:
        name: ``shm://NAME`` or ``NAME``: the held-memory names ``NAME.rank-RRRRR`` (this rank's
            snapshots) and ``NAME.replica-RRRRR`` (the replicas this rank holds) derive from it.
        replicas: how many peers on other nodes hold a copy of each snapshot (0: none).  Nodes
            are host names, or ``CKPTD_NODE`` where set.
        keep_last: snapshots kept per rank, and replicas kept per peer (default 2).
        hold_after_exit: how long the memory outlives the job (default 5 minutes).
        timeout: seconds a transfer waits for its peer (the replication group's timeout).
        tiers: slower tiers of each rank's own snapshots (:class:`~ckptd.Tier`), each root
            naming ``{rank}`` (``Tier("/local_nvme/run42/{rank}", every=100, keep_last=3)``):
            per-node local tiers, copied from the memory snapshot as a Checkpointer's tiers are.
        **overrides: other :class:`~ckptd.CheckpointerOptions` fields of the own snapshots'
            Checkpointer.

    Every rank of the default group constructs it (it creates a process group), saves the same
    steps and calls :meth:`restore` together.  The replicas need the same world size and the
    same rank placement to be useful; a rank's snapshot is its own state (a DTensor as its local
    piece), not a checkpoint another layout can load (the slower tiers are for that).
    """

    def __init__(
        self,
        name: str,
        *,
        replicas: int = 1,
        keep_last: int = DEFAULT_HELD_KEEP_LAST,
        hold_after_exit: float | str = DEFAULT_HOLD_AFTER_EXIT,
        timeout: float = DEFAULT_REPLICATION_TIMEOUT,
        tiers: Iterable[Tier] | None = None,
        **overrides: Any,
    ) -> None:
        self.name = held_name(name)
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("PeerSnapshots needs torch.distributed initialized (use a Checkpointer on shm:// alone)")
        if keep_last < 1:
            raise ConfigError(f"keep_last must be at least 1, got {keep_last}")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.keep_last = keep_last
        hold = parse_duration(hold_after_exit, "hold_after_exit")
        nodes: list[Any] = [None] * self.world
        dist.all_gather_object(nodes, node_name())
        self.nodes: list[str] = [str(n) for n in nodes]
        self.holders = replica_holders(self.nodes, replicas)
        self.replicas = replicas
        # All ranks create the group in the same order: it carries only replication traffic.
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        self.checkpointer = Checkpointer(
            f"shm://{self.name}.rank-{self.rank:05d}",
            no_dist=True,
            keep_last=keep_last,
            hold_after_exit=hold,
            tiers=rank_tiers(tiers or (), self.rank),
            **overrides,
        )
        self._storage = self.checkpointer.storage
        self._pins = self.checkpointer._saver.run  # the in-use pins retention honours (as promotions')
        self._leases: list[HoldLease] = []
        self._replica_roots: dict[int, str] = {}
        try:
            for round_ in range(replicas):
                for ward in wards(self.holders, self.rank, round_):
                    replica_name = f"{self.name}.replica-{ward:05d}"
                    self._leases.append(HoldLease(replica_name, hold))
                    root = held_path(f"shm://{replica_name}")
                    self._storage.makedirs(root)
                    collect_garbage(self._storage, root)
                    self._replica_roots[ward] = root
        except BaseException:
            self._release()
            raise
        self.stats = ReplicationStats()
        self._errors: list[ReplicationError] = []
        self._jobs: queue.Queue[tuple[int, SaveRequest] | None] = queue.Queue()
        self._idle = threading.Condition()
        self._replication_ended = False  # the replication thread returned (under _idle)
        self._release_after_replication = False  # close() left the leases to that thread (under _idle)
        self._pending = 0
        self._thread = threading.Thread(target=self._replicate_loop, name="ckptd-replicas", daemon=True)
        self._thread.start()
        self._closed = False

    # ---- saving ---------------------------------------------------------------------------

    def async_save(self, step: int, state: Mapping[str, Any], **kwargs: Any) -> SaveRequest:
        """Snapshot this rank's ``state`` into its host's memory (as
        :meth:`Checkpointer.async_save`, from which ``kwargs`` go); once it is committed it is
        copied to the replica holders in the background.  Every rank saves the same steps."""
        self._check_open()
        # Retention keeps the checkpoint until its replicas are sent: on a held root a dropped
        # checkpoint's pages are reused by the next save, under the sender's open files.
        path = self.checkpointer.path_for(step)
        self._pins.acquire([path])
        try:
            request = self.checkpointer.async_save(step, local_state(state), **kwargs)
        except BaseException:
            self._pins.release([path])
            raise
        with self._idle:
            self._pending += 1
        self._jobs.put((step, request))
        return request

    def save(self, step: int, state: Mapping[str, Any], **kwargs: Any) -> None:
        """:meth:`async_save`, then wait for the commit and the replicas."""
        self.async_save(step, state, **kwargs).result()
        self.wait()

    def wait(self, timeout: float | None = None) -> None:
        """Wait until every save so far is committed and replicated; raises the first
        :class:`~ckptd.errors.ReplicationError` since the last call (once)."""
        with self._idle:
            if not self._idle.wait_for(lambda: self._pending == 0, timeout):
                raise TimeoutError(f"replication of {self.name} not done after {timeout} s")
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def _replicate_loop(self) -> None:
        try:
            self._replicate_jobs()
        finally:
            with self._idle:
                self._replication_ended = True
                release = self._release_after_replication
            if release:  # close() did not wait for this thread: the leases were its to let go
                self._release()

    def _replicate_jobs(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            step, request = job
            try:
                self._replicate(step, request)
            except BaseException as e:  # noqa: BLE001 - kept for wait(); training goes on
                error = e if isinstance(e, ReplicationError) else ReplicationError(f"replication of step {step}: {e}")
                if error is not e:
                    error.__cause__ = e
                logger.warning("ckptd: rank %s: %s", self.rank, error)
                with self._idle:
                    self._errors.append(error)
            finally:
                self._pins.release([self.checkpointer.path_for(step)])
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _replicate(self, step: int, request: SaveRequest) -> None:
        started = time.perf_counter()
        try:
            request.result()
            path: str | None = self.checkpointer.path_for(step)
        except Exception:  # noqa: BLE001 - the save's own error reaches its caller through result()
            path = None  # the holder is told: it keeps its older replicas
        refused: list[str] = []
        for round_ in range(self.replicas):  # every round, whatever was refused: the peers go on too
            sender = BackgroundSend(path, step, self.holders[self.rank][round_], self._group)
            results = [self._receive(ward, step) for ward in wards(self.holders, self.rank, round_)]
            self.stats.bytes_sent += sender.join()
            refused += [result.error for result in results if result.error is not None]
        self.stats.seconds += time.perf_counter() - started
        if refused:
            self.stats.refused += refused
            raise ReplicationError("; ".join(refused))
        self.stats.steps_sent.append(step)

    def _receive(self, ward: int, step: int) -> Received:
        root = self._replica_roots[ward]
        result = receive_checkpoint(self._storage, root, ward, self._group)
        self.stats.bytes_received += result.nbytes
        if result.step != step:
            raise ReplicationError(f"rank {ward} sent step {result.step} while step {step} was replicated")
        if result.path is not None:  # the dropped replica's pages are the next one's (its spare)
            apply_retention(self._storage, root, self.keep_last, spare=True)
        return result

    # ---- memory --------------------------------------------------------------------------

    def held_bytes(self) -> dict[str, int]:
        """Bytes of memory this rank's snapshots (``own``, with the staging files or spare
        whose pages its next save reuses) and the replicas it holds (``replicas``) take now."""
        replicas = sum(bytes_under(root) for root in self._replica_roots.values())
        return {"own": bytes_under(self.checkpointer.root), "replicas": replicas}

    # ---- restoring -----------------------------------------------------------------------

    def restore(
        self,
        into: Mapping[str, Any] | None = None,
        *,
        fallback: Checkpointer | None = None,
        verify: VerifyMode = True,
    ) -> PeerRestore | None:
        """Restore every rank from the newest step all ranks can get from memory: their own
        snapshot, or a peer's replica of it (sent back first, and kept as this rank's snapshot).

        Collective: every rank calls it.  ``into`` (components to objects with
        ``load_state_dict``, or mappings of tensors filled in place) receives the state; without
        it the result carries it.  A step is taken only if every rank loaded it (CRC32C checked
        with ``verify``); otherwise an older one is tried.  When memory holds no step every rank
        can get, or ``fallback`` (a Checkpointer on slower storage) has a newer one, the state
        comes from ``fallback.load("latest")``; without a fallback the answer is then ``None``.
        """
        self._check_open()
        self.wait()
        started = time.perf_counter()
        timings: dict[str, float] = {}
        own = self.checkpointer.steps(tiers=True)
        held = {
            ward: [info.step for info in list_checkpoints(self._storage, root)]
            for ward, root in self._replica_roots.items()
        }
        newest_elsewhere = fallback.latest_step() if fallback is not None else None
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, (own, held, newest_elsewhere), group=self._group)
        owners = {rank: set(entry[0]) for rank, entry in enumerate(gathered)}
        replicas = {rank: {int(w): set(s) for w, s in entry[1].items()} for rank, entry in enumerate(gathered)}
        floor = gathered[0][2]
        _lap(timings, "list", started)
        for step in self._common_steps(owners, replicas):
            if floor is not None and floor > step:
                break
            peer = self._fetch_missing(step, owners, replicas)
            _lap(timings, "fetch", started)
            restored = self._load_everywhere(step, into, verify, timings, started)
            if restored is not None:
                last = self.checkpointer.last_load
                tier = last.tier if last is not None else 0
                source = "replica" if peer is not None else "memory" if tier == 0 else "tier"
                logger.info("ckptd: rank %s restored step %s from %s", self.rank, step, source)
                return PeerRestore(step, source, peer, restored[0], timings, tier)
        if fallback is None:
            return None
        state = fallback.load("latest", into=into, verify=verify)
        _lap(timings, "fallback", started)
        last = fallback.last_load
        step = last.step if last is not None and last.step is not None else -1
        return PeerRestore(step, "fallback", None, state, timings)

    def _common_steps(self, owners: dict[int, set[int]], replicas: dict[int, dict[int, set[int]]]) -> list[int]:
        reachable = []
        for rank in range(self.world):
            steps = set(owners[rank])
            for holder in self.holders[rank]:
                steps |= replicas[holder].get(rank, set())
            reachable.append(steps)
        return sorted(set.intersection(*reachable), reverse=True) if reachable else []

    def _fetch_missing(
        self, step: int, owners: dict[int, set[int]], replicas: dict[int, dict[int, set[int]]]
    ) -> int | None:
        """Have each rank without its own snapshot of ``step`` receive it from a holder; returns
        the peer this rank's came from (``None``: it had its own)."""
        mine = None
        for rank in range(self.world):
            if step in owners[rank]:
                continue
            holder = next(h for h in self.holders[rank] if step in replicas[h].get(rank, set()))
            if self.rank == holder:
                root = self._replica_roots[rank]
                self.stats.bytes_sent += send_checkpoint(
                    self._storage.join(root, checkpoint_dir_name(step)), step, rank, self._group
                )
            elif self.rank == rank:
                result = receive_checkpoint(self._storage, self.checkpointer.root, holder, self._group)
                if result.error is not None:
                    logger.warning("ckptd: rank %s: %s", self.rank, result.error)
                mine = holder
        return mine

    def _load_everywhere(
        self, step: int, into: Mapping[str, Any] | None, verify: VerifyMode, timings: dict[str, float], started: float
    ) -> tuple[Any] | None:
        """Load ``step`` on every rank; the state (``None`` with ``into``) if every rank did.

        Tensors that ``into`` holds directly (a module's parameters and buffers, the tensors of
        a mapping; a DTensor's local piece) are filled in place by the load; the rest (an
        optimizer, a scheduler, other values) is loaded first and handed over afterwards, only
        once every rank has succeeded."""
        in_place, rest = split_targets(into) if into is not None else ({}, None)
        state, problem = None, None
        try:
            if in_place:
                self.checkpointer.load(step, into=in_place, verify=verify)
            if rest is None or rest:
                components = list(rest) if rest else None
                state = self.checkpointer.load(step, components=components, verify=verify)
        except CkptdError as e:
            problem = f"rank {self.rank}: {e}"
        _lap(timings, "load", started)
        problems: list[Any] = [None] * self.world
        dist.all_gather_object(problems, problem, group=self._group)
        _lap(timings, "agree", started)
        failed = [p for p in problems if p is not None]
        if failed:
            logger.warning("ckptd: step %s is not restored from memory: %s", step, "; ".join(failed))
            return None
        if rest:
            restore_into(cast(Mapping[str, Any], state), rest)
            _lap(timings, "assign", started)
        return (None,) if into is not None else (state,)

    # ---- closing -------------------------------------------------------------------------

    def close(self, wait: bool = True) -> None:
        """Finish the saves and their replicas (unless ``wait`` is false), then let go of the
        memory: it stays held ``hold_after_exit`` for a restarted job."""
        if self._closed:
            return
        self._closed = True
        try:
            if wait:
                self.wait()
        finally:
            self._jobs.put(None)
            self._thread.join(timeout=None if wait else 5.0)
            self.checkpointer.close(wait=wait)
            with self._idle:  # a replication thread still waiting on a peer keeps the leases over what
                self._release_after_replication = not self._replication_ended  # it writes, then lets go
            if not self._release_after_replication:
                self._release()

    def _release(self) -> None:
        for lease in self._leases:
            lease.close()
        self._leases.clear()

    def _check_open(self) -> None:
        if getattr(self, "_closed", False):
            raise ConfigError(f"PeerSnapshots {self.name} is closed")

    def __enter__(self) -> PeerSnapshots:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(wait=exc[0] is None)


def rank_tiers(tiers: Iterable[Tier], rank: int) -> list[Tier]:
    """Each tier with ``{rank}`` in its root replaced by this rank's number (5 digits); a tier
    without ``{rank}`` would have every rank write the same checkpoint: a :class:`ConfigError`."""
    out = []
    for tier in tiers:
        if not isinstance(tier, Tier) or "{rank}" not in tier.root:
            raise ConfigError(
                f"PeerSnapshots tiers are per rank: each root must name {{rank}} (got {getattr(tier, 'root', tier)!r})"
            )
        out.append(dataclasses.replace(tier, root=tier.root.replace("{rank}", f"{rank:05d}")))
    return out


def _lap(timings: dict[str, float], phase: str, started: float) -> None:
    timings[phase] = time.perf_counter() - started
