"""Who decides whether a save commits: one process alone, or a coordinator over the c10d store.

Every rank writes its own pieces; exactly one (the coordinator) prepares the destination, checks
every rank's write results, commits or aborts, and tells the others.  :class:`SoloCoordinator`
is the one-process case; :class:`StoreCoordinator` talks through the c10d key-value store of
:class:`~ckptd.dist.group.DistContext` (never a collective: this runs on the completion thread),
with per-save keys and deadlines, so a rank that dies or hangs is named instead of waited for.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..dist.group import DistContext, rank_failure
from ..errors import CheckpointExistsError, DistributedSaveError, ReferencedCheckpointError
from ..formats.manifest import Manifest
from ..writer.protocol import FileResult

__all__ = ["Coordinator", "Outcome", "Report", "Round", "SoloCoordinator", "StoreCoordinator"]

logger = logging.getLogger(__name__)

_ACK_SECONDS = 60.0  # at most this long for the other ranks to read the outcome

# Errors the coordinator re-raises in their own type (not as a DistributedSaveError): they say
# what is wrong with the destination, which the caller can act on.
_DESTINATION_ERRORS = (CheckpointExistsError, ReferencedCheckpointError)


@dataclass(frozen=True)
class Round:
    """One save's completion, as the coordinator sees it."""

    key: str  # unique per save (the coordinator's token): names its store keys
    step: int | None  # None: a save to a path of the caller's choosing (no step number)
    opened: float  # time.monotonic() when completion began; deadlines count from here


@dataclass(frozen=True)
class Report:
    """What one rank did: its write results, or why it could not write."""

    results: tuple[FileResult, ...] = ()
    error: BaseException | None = None


@dataclass(frozen=True)
class Outcome:
    """A committed save: the manifest on the rank that committed, else what it reported."""

    manifest: Manifest | None
    bytes_written: int = 0


class Coordinator(Protocol):
    """The commit protocol of one save.  Every rank calls, on its completion thread, in order:

    1. :meth:`prepare` (all ranks): the coordinator calls ``make_destination`` (staging
       directory, object-store claim) and announces "ready" or its error; every other rank waits
       for "ready" and raises if the coordinator failed or did not answer.
    2. (all ranks write their pieces; not the coordinator's business.)
    3. :meth:`report` (all ranks, also after step 1 or 2 failed): post this rank's
       :class:`Report` (its write results, or its error).
    4. :meth:`outcome` (all ranks, with the same report): the coordinator collects every rank's
       report, calls ``commit`` with all results (or ``abort`` on any failure), posts the outcome
       and waits until every rank has read it; every other rank waits for the outcome.  Returns
       the :class:`Outcome`, or raises (a failed rank's own error is the cause).

    A rank whose save fails before it reaches the completion thread (planning is done, staging
    failed) calls :meth:`fail_early` on the caller's thread instead, so nobody waits for it, and
    raises the error it returns (the one the other ranks raise, with its own as the cause).
    """

    def prepare(self, round_: Round, make_destination: Callable[[], None]) -> None: ...

    def report(self, round_: Round, report: Report) -> None: ...

    def outcome(
        self,
        round_: Round,
        report: Report,
        commit: Callable[[Sequence[FileResult]], Manifest],
        abort: Callable[[], None],
    ) -> Outcome: ...

    def fail_early(self, key: str, step: int, error: BaseException) -> BaseException: ...


class SoloCoordinator:
    """One process: it prepares, writes and commits alone."""

    def prepare(self, round_: Round, make_destination: Callable[[], None]) -> None:
        make_destination()

    def report(self, round_: Round, report: Report) -> None:
        return None  # nobody to tell: outcome() gets the same report

    def outcome(
        self,
        round_: Round,
        report: Report,
        commit: Callable[[Sequence[FileResult]], Manifest],
        abort: Callable[[], None],
    ) -> Outcome:
        try:
            if report.error is not None:
                raise report.error
            return Outcome(commit(report.results))
        except BaseException:
            abort()
            raise

    def fail_early(self, key: str, step: int, error: BaseException) -> BaseException:
        return error  # nobody waits for us: the caller raises its own error


class StoreCoordinator:
    """Ranks of one process group, talking through the c10d store (keys ``<key>/ready``,
    ``<key>/rank<r>``, ``<key>/commit``, ``<key>/ack<r>``).  Every wait has a deadline of
    ``dist.timeout`` from :attr:`Round.opened` (the outcome, which waits for the commit too, two)."""

    def __init__(self, dist: DistContext) -> None:
        self.dist = dist

    def prepare(self, round_: Round, make_destination: Callable[[], None]) -> None:
        dist = self.dist
        if dist.is_coordinator:
            try:
                make_destination()
            except BaseException as e:
                dist.post(f"{round_.key}/ready", {"error": f"{type(e).__name__}: {e}"})
                raise
            dist.post(f"{round_.key}/ready", {"ok": True})
            return
        answer = dist.wait([f"{round_.key}/ready"], self._deadline(round_), "coordinator").get(f"{round_.key}/ready")
        if answer is None:
            raise DistributedSaveError(
                f"the coordinator (rank {dist.coordinator}) did not prepare the save within {dist.timeout:.0f}s",
                [dist.coordinator],
            )
        if "error" in answer:
            raise DistributedSaveError(
                f"the coordinator could not prepare the save: {answer['error']}", [dist.coordinator]
            )

    def report(self, round_: Round, report: Report) -> None:
        error = report.error
        posted: dict[str, Any] = (
            {"error": f"{type(error).__name__}: {error}"}
            if error is not None
            else {"ok": [dataclasses.asdict(r) for r in report.results]}
        )
        self.dist.post(f"{round_.key}/rank{self.dist.rank}", posted)

    def outcome(
        self,
        round_: Round,
        report: Report,
        commit: Callable[[Sequence[FileResult]], Manifest],
        abort: Callable[[], None],
    ) -> Outcome:
        if not self.dist.is_coordinator:
            return self._await_outcome(round_, report.error)
        return self._decide(round_, report.error, commit, abort)

    def fail_early(self, key: str, step: int, error: BaseException) -> BaseException:
        dist = self.dist
        cause = f"{type(error).__name__}: {error}"
        report = {"error": cause, "early": True}
        failure = rank_failure({dist.rank: cause}, f"save of step {step}")  # what the coordinator says
        dist.post(f"{key}/rank{dist.rank}", report)
        if dist.is_coordinator:
            dist.post(f"{key}/ready", report)
            dist.post(f"{key}/commit", {"error": str(failure), "ranks": [dist.rank]})
        return failure if isinstance(error, Exception) else error  # KeyboardInterrupt stays itself

    # ---- the coordinator's side ---------------------------------------------------------------

    def _decide(
        self,
        round_: Round,
        own_error: BaseException | None,
        commit: Callable[[Sequence[FileResult]], Manifest],
        abort: Callable[[], None],
    ) -> Outcome:
        dist = self.dist
        keys = [f"{round_.key}/rank{r}" for r in range(dist.world_size)]
        reports = dist.wait(keys, self._deadline(round_), "write reports")
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
                raise rank_failure(failures, f"save of step {round_.step}") from own_error
            manifest = commit(gathered)
        except BaseException as e:
            abort()
            ranks = e.ranks if isinstance(e, DistributedSaveError) else [dist.rank]
            dist.post(f"{round_.key}/commit", {"error": str(e), "ranks": ranks})
            self._await_acks(round_, keys, gone)
            if isinstance(own_error, _DESTINATION_ERRORS):
                raise own_error from e  # e.g. the step exists: say so, in its own type
            raise
        dist.post(f"{round_.key}/commit", {"ok": sum(f.size for f in manifest.files.values())})
        self._await_acks(round_, keys, gone)
        return Outcome(manifest)

    def _await_acks(self, round_: Round, keys: list[str], gone: set[int]) -> None:
        """Wait until every rank has read the outcome: the store lives in the coordinator's
        process, which may exit as soon as this save is done."""
        dist = self.dist
        acks = [f"{round_.key}/ack{r}" for r in range(dist.world_size) if r != dist.rank and r not in gone]
        found = dist.wait(acks, time.monotonic() + min(dist.timeout, _ACK_SECONDS), "acknowledgements")
        if len(found) < len(acks):
            logger.warning("ckptd: ranks %s did not acknowledge the commit", sorted(set(acks) - set(found)))
        dist.forget([*keys, *acks, f"{round_.key}/ready", f"{round_.key}/commit"])

    # ---- every other rank's side --------------------------------------------------------------

    def _await_outcome(self, round_: Round, own_error: BaseException | None) -> Outcome:
        dist = self.dist
        # The coordinator waits up to dist_timeout for the reports and then commits (which may
        # retry against an object store): allow it a second timeout.  A coordinator that dies is
        # noticed sooner, when its store stops answering.
        key = f"{round_.key}/commit"
        answer = dist.wait([key], self._deadline(round_) + dist.timeout, "commit").get(key)
        if answer is not None:
            dist.post(f"{round_.key}/ack{dist.rank}", {"ok": True})
        if answer is None:
            error = DistributedSaveError(
                f"the coordinator (rank {dist.coordinator}) did not commit step {round_.step} within "
                f"{dist.timeout:.0f}s (the process died or hangs)",
                [dist.coordinator],
            )
        elif "error" in answer:
            error = DistributedSaveError(answer["error"], answer.get("ranks") or [])
        else:
            return Outcome(None, bytes_written=int(answer["ok"]))
        if own_error is not None:
            raise error from own_error
        raise error

    def _deadline(self, round_: Round) -> float:
        return round_.opened + self.dist.timeout
