"""How ranks agree on a save's plan: layout digests, coordinator-only planning, a cached plan.

Every save, on the caller's thread of every rank (numbered steps; "coordinator" is
``dist.coordinator``):

1. Each rank describes its state (:class:`~ckptd.save.describe.Describer`) and digests each
   component's description (:func:`layout_of`: blake2b-128 over keys, dtypes, shapes, offsets,
   sharding and frozen flags).  Its :class:`Brief` carries the digests, not the descriptions,
   plus what changes every save (non-tensor state of its own components, the last committed
   save, its error if it could not describe its state).
2. All ranks check in (:class:`~ckptd.dist.arrival.Arrival`): a stalled rank is named within
   ``dist_timeout``, not waited for.
3. ``gather`` of the briefs to the coordinator.  The coordinator (:class:`PlanBook`) keeps one
   description per digest.  If every digest is known and the layouts equal the last plan's, the
   cached plan is reused; it answers each rank (``scatter``) with an :class:`Assignment`: the save's
   key and staging directory, the files it may skip (incremental saves), and its
   :class:`~ckptd.save.plan.RankPlan` only if the rank does not hold it already.
4. Only when some digest is new: the coordinator asks one rank per new digest for its
   description (the same ``scatter``), a second ``gather`` brings them, it plans over unique
   layouts (:func:`~ckptd.save.plan_unique.plan_unique`) and scatters the assignments.

Steady state: two small collectives; a non-coordinator sends and receives O(1) bytes (its
digests and its own assignment), the coordinator O(world size).  No rank but the coordinator holds
the whole plan.  Failures (a rank's error, a planning error on the coordinator) travel in the same
assignments, so every rank raises the same error type instead of hanging.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import errors as errors_module
from ..dist.arrival import Arrival
from ..dist.group import DistContext
from ..errors import CkptdError, DistributedSaveError
from .describe import Payload, planning_failure
from .incremental import Reuse, ReusedFile
from .plan import LocalTensor, RankPlan, SavePlan
from .plan_unique import ClassPlan, Coordinates, Layout, derive_rank_plan, plan_unique

__all__ = ["Assignment", "Brief", "Exchange", "PlanBook", "Planned", "layout_digest", "layout_of", "planned_alone"]

_NO_REUSE = Reuse({}, {})


def layout_digest(tensors: Sequence[LocalTensor]) -> bytes:
    """A 16-byte digest of everything about ``tensors`` that the plan depends on (for a grid
    tensor, its grid instead of this rank's piece: the same on every rank of the mesh)."""
    encoded = "\n".join(
        f"{t.component}\0{t.key}\0{t.dtype}\0{t.global_shape}\0{t.offset}\0{t.shape}\0"
        f"{int(t.sharded)}{int(t.main)}{int(t.frozen)}"
        if t.grid is None
        else f"{t.component}\0{t.key}\0{t.dtype}\0{t.global_shape}\0grid{t.grid.mesh}\0"
        f"{t.grid.mesh_shape}\0{t.grid.shard_dims}\0{int(t.frozen)}"
        for t in tensors
    )
    return hashlib.blake2b(encoded.encode(), digest_size=16).digest()


def layout_of(tensors: Sequence[LocalTensor]) -> tuple[Layout, dict[bytes, tuple[LocalTensor, ...]]]:
    """A rank's layout (its components with their digests, in state order) and the descriptions
    behind the digests."""
    by_component: dict[str, list[LocalTensor]] = {}
    for tensor in tensors:
        by_component.setdefault(tensor.component, []).append(tensor)
    layout: list[tuple[str, bytes]] = []
    descriptions: dict[bytes, tuple[LocalTensor, ...]] = {}
    for component, members in by_component.items():
        digest = layout_digest(members)
        layout.append((component, digest))
        descriptions[digest] = tuple(members)
    return tuple(layout), descriptions


@dataclass(frozen=True)
class Brief:
    """What a rank sends the coordinator every save (small: no tensor descriptions)."""

    rank: int
    layout: Layout = ()
    trees: dict[str, Any] = field(default_factory=dict)
    tied: dict[str, list[list[str]]] = field(default_factory=dict)
    sharing: dict[str, str] = field(default_factory=dict)
    last_committed: str | None = None
    held: bytes = b""  # the id of the plan this rank holds its RankPlan of
    error: tuple[str, str] | None = None
    coordinates: tuple[tuple[int, ...], ...] = ()  # its place in each mesh its grid tensors number


@dataclass(frozen=True)
class Assignment:
    """The coordinator's answer to one rank."""

    send: tuple[bytes, ...] = ()  # step 4: the digests this rank must describe
    more: bool = False  # a second round follows (every rank takes part)
    rank_plan: RankPlan | None = None  # None: keep the one held (plan ``plan_id``)
    class_plan: ClassPlan | None = None  # derive the RankPlan from it (grid tensors)
    plan_id: bytes = b""
    key: str = ""
    staging: str = ""
    reused: Mapping[str, ReusedFile] = field(default_factory=dict)
    hashed: Mapping[str, ReusedFile] = field(default_factory=dict)
    failures: dict[int, tuple[str, str]] | None = None  # ranks that could not describe their state
    planning_error: tuple[str, str] | None = None  # planning failed on the coordinator


@dataclass(frozen=True)
class Planned:
    """A rank's outcome of the exchange (``plan`` and the merged trees on the coordinator only)."""

    rank_plan: RankPlan
    key: str
    staging: str
    reuse: Reuse
    plan: SavePlan | None = None
    trees: dict[str, Any] = field(default_factory=dict)
    tied: dict[str, list[list[str]]] = field(default_factory=dict)
    sharing: dict[str, str] = field(default_factory=dict)


def planned_alone(payload: Payload, plan: SavePlan, reuse: Reuse) -> Planned:
    """One process's outcome: it planned alone (no exchange)."""
    trees, tied, sharing = dict(payload.trees), dict(payload.tied), dict(payload.sharing)
    return Planned(plan.ranks[0], payload.token, payload.staging, reuse, plan, trees, tied, sharing)


class PlanBook:
    """The coordinator's memory: one description per digest, and the last plan."""

    def __init__(
        self, max_shard_size: int, *, shared_files: bool, separate_frozen: bool, key_layout: str = "flat"
    ) -> None:
        self.options = (max_shard_size, shared_files, separate_frozen, key_layout)
        self.descriptions: dict[bytes, tuple[LocalTensor, ...]] = {}
        self.plan: SavePlan | None = None
        self.plan_id = b""
        self.plans_made = 0  # how often it planned (the rest were cache hits)

    def wanted(self, layouts: Sequence[Layout]) -> dict[int, tuple[bytes, ...]]:
        """Rank -> the unknown digests it should describe (one rank per digest)."""
        asked: dict[bytes, int] = {}
        for rank, layout in enumerate(layouts):
            for _, digest in layout:
                if digest not in self.descriptions and digest not in asked:
                    asked[digest] = rank
        wanted: dict[int, list[bytes]] = {}
        for digest, rank in asked.items():
            wanted.setdefault(rank, []).append(digest)
        return {rank: tuple(digests) for rank, digests in wanted.items()}

    def learn(self, sent: Mapping[bytes, Sequence[LocalTensor]]) -> None:
        for digest, tensors in sent.items():
            if layout_digest(tensors) != digest:
                raise DistributedSaveError(f"a rank described layout {digest.hex()} inconsistently")
            self.descriptions[digest] = tuple(tensors)

    def plan_for(self, layouts: Sequence[Layout], coordinates: Sequence[Coordinates] = ()) -> SavePlan:
        """The plan of ``layouts`` (every digest known) with the ranks at ``coordinates`` in the
        meshes of their grid tensors: the cached one if both are unchanged."""
        hasher = hashlib.blake2b(repr(self.options).encode(), digest_size=16)
        for layout in layouts:
            for component, digest in layout:
                hasher.update(component.encode())
                hasher.update(digest)
            hasher.update(b"\n")
        hasher.update(repr(coordinates).encode())
        plan_id = hasher.digest()
        if self.plan is not None and plan_id == self.plan_id:
            return self.plan
        max_shard_size, shared_files, separate_frozen, key_layout = self.options
        self.plan = plan_unique(
            layouts,
            self.descriptions,
            max_shard_size,
            shared_files=shared_files,
            separate_frozen=separate_frozen,
            key_layout=key_layout,
            signature=(plan_id,),
            coordinates=coordinates,
        )
        self.plan_id = plan_id
        self.plans_made += 1
        used = {digest for layout in layouts for _, digest in layout}
        self.descriptions = {d: t for d, t in self.descriptions.items() if d in used}  # forget stale layouts
        return self.plan

    def forget(self) -> None:
        """Drop the cached plan (after a failed save: the next one plans again)."""
        self.plan, self.plan_id = None, b""

    def assignments(self, briefs: Sequence[Brief], key: str, staging: str, reuse: Reuse) -> list[Assignment]:
        """Every rank's answer for the current plan; a rank that holds it gets no RankPlan."""
        plan = self.plan
        if plan is None:
            raise RuntimeError("assignments() before plan_for()")
        out = []
        shared: Assignment | None = None  # the answer of every rank that holds its plan and reuses nothing
        by_class: dict[int, Assignment] = {}  # one answer per class plan: the scatter pickles it once
        class_plans = plan.class_plans or (None,) * len(briefs)
        for brief, rank_plan, class_plan in zip(briefs, plan.ranks, class_plans, strict=True):
            reused, hashed = _reuse_of(rank_plan, reuse)
            if class_plan is not None and brief.held != self.plan_id:
                answer = by_class.get(id(class_plan))
                if answer is None or answer.reused != reused or answer.hashed != hashed:  # or reuses files of its own
                    answer = Assignment(
                        class_plan=class_plan,
                        plan_id=self.plan_id,
                        key=key,
                        staging=staging,
                        reused=reused,
                        hashed=hashed,
                    )
                    by_class.setdefault(id(class_plan), answer)
                out.append(answer)
                continue
            if brief.held == self.plan_id and not reused and not hashed:
                if shared is None:
                    shared = Assignment(plan_id=self.plan_id, key=key, staging=staging)
                out.append(shared)  # one object: the scatter pickles it once
                continue
            send_plan = None if brief.held == self.plan_id else rank_plan
            out.append(
                Assignment(
                    rank_plan=send_plan, plan_id=self.plan_id, key=key, staging=staging, reused=reused, hashed=hashed
                )
            )
        return out


def _reuse_of(rank_plan: RankPlan, reuse: Reuse) -> tuple[dict[str, ReusedFile], dict[str, ReusedFile]]:
    if not reuse.reused and not reuse.hashed:
        return {}, {}
    names = {p.file_name for p in rank_plan.pieces}
    return (
        {n: r for n, r in reuse.reused.items() if n in names},
        {n: r for n, r in reuse.hashed.items() if n in names},
    )


class Exchange:
    """One rank's side of the protocol above (the coordinator's too, on the coordinator)."""

    def __init__(self, dist: DistContext, root: str, book: PlanBook) -> None:
        self.dist = dist
        self.arrival = Arrival(dist, root)
        self.book = book  # used on the coordinator only
        self.rank_plan: RankPlan | None = None  # the last RankPlan received
        self.plan_id = b""

    def run(
        self,
        describe: Callable[[], Payload],
        what: str,
        select: Callable[[SavePlan, list[str | None]], Reuse] | None,
    ) -> Planned:
        """Describe (``describe`` may raise: every rank then raises), agree, plan; ``select``
        (coordinator) chooses what an incremental save reuses."""
        dist = self.dist
        own_error: BaseException | None = None
        descriptions: dict[bytes, tuple[LocalTensor, ...]] = {}
        payload: Payload | None = None
        try:
            payload = describe()
            layout, descriptions = layout_of(payload.locals)
            brief = Brief(
                dist.rank,
                layout,
                payload.trees,
                payload.tied,
                payload.sharing,
                payload.last_committed,
                self.plan_id,
                coordinates=payload.coordinates,
            )
        except Exception as e:  # noqa: BLE001 - reported to every rank, re-raised below
            own_error = e
            brief = Brief(dist.rank, error=(type(e).__name__, str(e)))
        self.arrival.arrive(what)
        briefs = dist.gather(brief)
        if dist.is_coordinator:
            self.arrival.forget()  # every rank has read the arrival's decision
        answers = self.answer_briefs(briefs, payload, select) if briefs is not None else None
        answer: Assignment = dist.scatter(answers)
        if answer.more:
            sent = dist.gather({d: descriptions[d] for d in answer.send})
            answers = self.answer_descriptions(briefs or [], sent, payload, select) if sent is not None else None
            answer = dist.scatter(answers)
        self._raise_failures(answer, own_error)
        if answer.rank_plan is not None:
            self.rank_plan, self.plan_id = answer.rank_plan, answer.plan_id
        elif answer.class_plan is not None and payload is not None:
            self.rank_plan = derive_rank_plan(answer.class_plan, dist.rank, payload.locals)
            self.plan_id = answer.plan_id
        if self.rank_plan is None or self.plan_id != answer.plan_id:
            raise DistributedSaveError(f"rank {dist.rank} holds no plan {answer.plan_id.hex()}", [dist.rank])
        reuse = Reuse(answer.reused, answer.hashed)
        if not dist.is_coordinator:
            return Planned(self.rank_plan, answer.key, answer.staging, reuse)
        trees: dict[str, Any] = {}
        tied: dict[str, list[list[str]]] = {}
        sharing: dict[str, str] = {}
        for b in briefs or []:
            for name, tree in b.trees.items():
                trees.setdefault(name, tree)
                tied.setdefault(name, b.tied.get(name, []))
                sharing.setdefault(name, b.sharing.get(name, "replicated"))
        return Planned(self.rank_plan, answer.key, answer.staging, self._reuse, self.book.plan, trees, tied, sharing)

    # ---- the coordinator ----------------------------------------------------------------------

    def answer_briefs(
        self, briefs: list[Brief], payload: Payload | None, select: Callable[..., Reuse] | None
    ) -> list[Assignment]:
        world = self.dist.world_size
        failures = {b.rank: b.error for b in briefs if b.error is not None}
        if failures:
            return [Assignment(failures=failures)] * world
        wanted = self.book.wanted([b.layout for b in briefs])
        if wanted:
            return [Assignment(send=wanted.get(r, ()), more=True) for r in range(world)]
        return self._final_answers(briefs, payload, select)

    def answer_descriptions(
        self, briefs: list[Brief], sent: list[Any], payload: Payload | None, select: Callable[..., Reuse] | None
    ) -> list[Assignment]:
        try:
            for part in sent:
                self.book.learn(part)
        except Exception as e:  # noqa: BLE001 - every rank raises it
            return [Assignment(planning_error=(type(e).__name__, str(e)))] * self.dist.world_size
        return self._final_answers(briefs, payload, select)

    def _final_answers(
        self, briefs: list[Brief], payload: Payload | None, select: Callable[..., Reuse] | None
    ) -> list[Assignment]:
        try:
            plan = self.book.plan_for([b.layout for b in briefs], [b.coordinates for b in briefs])
            self._reuse = select(plan, [b.last_committed for b in briefs]) if select else _NO_REUSE
        except Exception as e:  # noqa: BLE001 - every rank raises it (the coordinator its own)
            self._planning_error = e
            return [Assignment(planning_error=(type(e).__name__, str(e)))] * self.dist.world_size
        token = secrets.token_hex(8)
        staging = payload.staging if payload is not None else ""
        return self.book.assignments(briefs, token, staging, self._reuse)

    _reuse: Reuse = _NO_REUSE
    _planning_error: BaseException | None = None

    def _raise_failures(self, answer: Assignment, own_error: BaseException | None) -> None:
        if answer.failures:
            failure = planning_failure(answer.failures, self.dist.world_size, own_error)
            if failure is own_error:
                raise own_error
            raise failure from own_error
        if answer.planning_error is not None:
            mine, self._planning_error = self._planning_error, None
            if mine is not None:
                raise mine
            raise _rebuilt(*answer.planning_error, self.dist.coordinator)


def _rebuilt(kind: str, message: str, coordinator: int) -> BaseException:
    """The coordinator's planning error, in its own type when it is a ckptd error."""
    cls = getattr(errors_module, kind, None)
    if isinstance(cls, type) and issubclass(cls, CkptdError) and cls is not DistributedSaveError:
        try:
            return cls(message)
        except TypeError:
            pass
    return DistributedSaveError(f"planning the save failed on the coordinator: {kind}: {message}", [coordinator])
