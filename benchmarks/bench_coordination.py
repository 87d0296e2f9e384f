"""Coordination at scale, simulated: the real digest/plan/commit code for 8 to 16,384 ranks.

One process stands in for every rank.  Each simulated rank builds its description
(:class:`~ckptd.save.plan.LocalTensor` records, as :class:`~ckptd.save.describe.Describer` makes them)
and its :class:`~ckptd.save.exchange.Brief` with the real :func:`~ckptd.save.exchange.layout_of`;
the collectives are replaced by in-memory lists of the pickled messages (their lengths are the
bytes each rank would send or receive); the coordinator's side is the real
:class:`~ckptd.save.exchange.Exchange` (``answer_briefs`` / ``answer_descriptions``, which plan with
:func:`~ckptd.save.plan_unique.plan_unique` and the real ``plan_save``); the commit is the real
:func:`~ckptd.save.saver.combine_pieces` and :func:`~ckptd.save.commit.finalize_checkpoint`,
writing indexes and the manifest to a temporary directory (the shard files are not written:
every rank's write results are made up from its pieces).

Sharding mix (Megatron-style): tensor parallel TP=min(8, W), pipeline PP=min(4, W/TP), data
parallel DP=W/(TP*PP); 16,384 ranks = TP 8 x PP 4 x DP 512.  Each rank holds ``tensors``
tensors of its pipeline stage in component ``model``: two thirds split by rows across the TP
group (sharded, ``main`` only on DP replica 0), one third replicated plain tensors (norms,
biases).  So there are 2 x TP x PP distinct layouts.  With ``--per-rank`` every rank also holds
one per-rank tensor (``rng@rank<r>``, its own file and index): W more distinct layouts.

Run: ``python benchmarks/bench_coordination.py [--worlds 8,64,512,4096,16384] [--tensors 1000]
[--plot docs/coordination.png] [--per-rank]``.  Prints a table per phase (first save / cached save):
seconds, coordinator bytes received+sent, bytes per other rank, peak traced memory
(tracemalloc) of the coordinator's planning and of the manifest build+write, and fitted growth
exponents in world size.
"""

from __future__ import annotations

import argparse
import math
import pickle
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ckptd.dist.group import DistContext
from ckptd.formats.manifest import Manifest
from ckptd.save.commit import ComponentInfo, finalize_checkpoint
from ckptd.save.exchange import Assignment, Brief, Exchange, PlanBook, layout_of
from ckptd.save.incremental import Reuse
from ckptd.save.plan import LocalTensor, SavePlan
from ckptd.save.saver import combine_pieces
from ckptd.storage.local import LocalStorage
from ckptd.writer.protocol import FileResult

__all__ = ["Measure", "mesh", "rank_tensors", "simulate"]

_NO_REUSE = Reuse({}, {})


def mesh(world: int) -> tuple[int, int, int]:
    """(TP, PP, DP) for ``world`` ranks."""
    tp = min(8, world)
    pp = max(1, min(4, world // tp))
    return tp, pp, world // (tp * pp)


def rank_tensors(world: int, rank: int, tensors: int) -> list[LocalTensor]:
    """Rank ``rank``'s model description (see the module docstring)."""
    tp, pp, _ = mesh(world)
    t, p, d = rank % tp, (rank // tp) % pp, rank // (tp * pp)
    out = []
    for i in range(tensors):
        key = f"layers.{p * tensors + i}.w"
        if i % 3 == 2:
            out.append(LocalTensor("model", key, "BF16", (256,), (0,), (256,)))
        else:
            rows = 64 * tp
            out.append(LocalTensor("model", key, "BF16", (rows, 64), (t * 64, 0), (64, 64), True, d == 0))
    return out


@dataclass
class Measure:
    """One phase at one world size."""

    world: int
    phase: str  # "first" or "cached"
    plan_seconds: float = 0.0  # the coordinator: answers to the briefs (and descriptions)
    commit_seconds: float = 0.0  # manifest (and indexes) built and written
    coordinator_bytes: int = 0  # received + sent by the coordinator in the collectives
    other_bytes_max: int = 0  # the most any other rank sent + received
    collectives: int = 0
    plan_peak: int = 0  # tracemalloc peak of the coordinator's planning (bytes)
    commit_peak: int = 0  # tracemalloc peak of the manifest build+write (bytes)
    manifest_bytes: int = 0
    plans_made: int = 0


class _Simulation:
    """Every rank of one job, saving again and again."""

    def __init__(self, world: int, tensors: int, root: str, per_rank: bool) -> None:
        self.world = world
        self.root = root
        self.layouts: dict[tuple[int, int, bool], tuple[Any, dict[bytes, tuple[LocalTensor, ...]]]] = {}
        tp, pp, _ = mesh(world)
        for rank in range(min(world, 2 * tp * pp)):  # the distinct model layouts (DP replica 0 and 1)
            self.layouts[self._class(rank)] = layout_of(rank_tensors(world, rank, tensors))
        self.descriptions: list[dict[bytes, tuple[LocalTensor, ...]]] = []
        self.briefs: list[Brief] = []
        for rank in range(world):
            layout, known = self.layouts[self._class(rank)]
            trees: dict[str, Any] = {}
            if per_rank:
                rng_layout, rng = layout_of([LocalTensor(f"rng@rank{rank}", "state", "U8", (5056,), (0,), (5056,))])
                known = {**known, **rng}
                layout = layout + rng_layout
                trees = {f"rng@rank{rank}": {"__tensor__": "state"}}
            self.descriptions.append(known)
            self.briefs.append(Brief(rank, layout, trees, {}, {}, None))
        self.held = [b""] * world
        context = DistContext(rank=0, world_size=world, coordinator=0, group=None, store=None, timeout=60.0)
        self.exchange = Exchange(context, root, PlanBook(2**30, shared_files=True, separate_frozen=False))
        self.storage = LocalStorage()
        self.saves = 0

    def _class(self, rank: int) -> tuple[int, int, bool]:
        tp, pp, _ = mesh(self.world)
        return rank % tp, (rank // tp) % pp, rank // (tp * pp) == 0

    def save(self, phase: str, trace: bool) -> Measure:
        """One save: briefs -> answers (-> descriptions -> answers) -> commit."""
        measure = Measure(self.world, phase)
        sent = [0] * self.world
        received = [0] * self.world
        briefs = [
            Brief(b.rank, b.layout, b.trees, b.tied, b.sharing, b.last_committed, self.held[b.rank])
            for b in self.briefs
        ]
        blobs = [pickle.dumps(b, protocol=pickle.HIGHEST_PROTOCOL) for b in briefs]
        for rank, blob in enumerate(blobs):
            sent[rank] += len(blob)
        exchange = self.exchange

        def plan() -> list[Assignment]:
            gathered = [pickle.loads(b) for b in blobs]
            answers = exchange.answer_briefs(gathered, None, None)
            self._deliver(answers, received, sent)
            measure.collectives += 2
            if answers[0].more:
                parts = [{d: self.descriptions[r][d] for d in a.send} for r, a in enumerate(answers)]
                part_blobs = [pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL) for p in parts]
                for rank, blob in enumerate(part_blobs):
                    sent[rank] += len(blob)
                answers = exchange.answer_descriptions(gathered, [pickle.loads(b) for b in part_blobs], None, None)
                self._deliver(answers, received, sent)
                measure.collectives += 2
            return answers

        answers, measure.plan_seconds, measure.plan_peak = _run(plan, trace)
        for rank, answer in enumerate(answers):
            if answer.rank_plan is not None:
                self.held[rank] = answer.plan_id
        whole = exchange.book.plan
        assert whole is not None
        measure.plans_made = exchange.book.plans_made
        self.saves += 1
        results = _results(whole)
        _, measure.commit_seconds, measure.commit_peak = _run(lambda: self._commit(whole, results, briefs), trace)
        measure.manifest_bytes = Path(self.root, f"step-{self.saves}", "checkpoint_manifest.json").stat().st_size
        measure.coordinator_bytes = sent[0] + received[0] + sum(sent[1:])  # it receives what the others send
        measure.other_bytes_max = max((sent[r] + received[r] for r in range(1, self.world)), default=0)
        return measure

    def _deliver(self, answers: list[Assignment], received: list[int], sent: list[int]) -> None:
        pickled: dict[int, int] = {}  # as DistContext.scatter: an answer shared by many ranks is pickled once
        for rank, answer in enumerate(answers):
            size = pickled.get(id(answer)) or pickled.setdefault(
                id(answer), len(pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL))
            )
            if rank:
                received[rank] += size
                sent[0] += size

    def _commit(self, plan: SavePlan, results: list[FileResult], briefs: list[Brief]) -> Manifest:
        staging = str(Path(self.root, f".step-{self.saves}.tmp"))
        self.storage.makedirs(staging)
        trees: dict[str, Any] = {}
        for brief in briefs:
            trees.update(brief.trees)
        return finalize_checkpoint(
            self.storage,
            staging,
            str(Path(self.root, f"step-{self.saves}")),
            step=self.saves,
            written=combine_pieces(plan, results),
            expected_sizes={f.file_name: f.size for f in plan.files},
            tensors=plan.tensors,
            components=[ComponentInfo(name, "safetensors", [], sharing="replicated") for name in plan.tensors],
            trees=trees,
            world_size=plan.world_size,
            fsync=False,
        )


def _results(plan: SavePlan) -> list[FileResult]:
    """What every rank's writer would report for its pieces (CRCs made up: nothing is written)."""
    return [FileResult(p.file_name, p.size, 0, 0.0, p.file_offset) for r in plan.ranks for p in r.pieces]


def _run(fn: Callable[[], Any], trace: bool) -> tuple[Any, float, int]:
    if trace:
        tracemalloc.start()
        tracemalloc.reset_peak()
    started = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - started
    peak = 0
    if trace:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return out, seconds, peak


def simulate(world: int, tensors: int, root: str, trace: bool = True, per_rank: bool = False) -> list[Measure]:
    """A first save and a cached save at ``world`` ranks: timed runs, then traced ones (with
    ``per_rank``, every rank also saves a per-rank component: its own file and index)."""
    simulation = _Simulation(world, tensors, root, per_rank)
    first = simulation.save("first", trace=False)
    cached = simulation.save("cached", trace=False)
    if trace:
        traced = _Simulation(world, tensors, root + "-traced", per_rank)
        first.plan_peak, first.commit_peak = _peaks(traced.save("first", trace=True))
        cached.plan_peak, cached.commit_peak = _peaks(traced.save("cached", trace=True))
    return [first, cached]


def _peaks(measure: Measure) -> tuple[int, int]:
    return measure.plan_peak, measure.commit_peak


def growth(xs: list[float], ys: list[float]) -> float:
    """The least-squares slope of log y against log x (y ~ x^slope)."""
    points = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if x > 0 and y > 0]
    if len(points) < 2:
        return 0.0
    mx = sum(p[0] for p in points) / len(points)
    my = sum(p[1] for p in points) / len(points)
    den = sum((p[0] - mx) ** 2 for p in points)
    return sum((p[0] - mx) * (p[1] - my) for p in points) / den if den else 0.0


def table(measures: list[Measure]) -> str:
    lines = [
        "| ranks | TPxPPxDP | save | plan s | coord bytes | bytes/other rank | plan peak MB | manifest s | "
        "manifest peak MB | manifest KB |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in measures:
        tp, pp, dp = mesh(m.world)
        lines.append(
            f"| {m.world} | {tp}x{pp}x{dp} | {m.phase} | {m.plan_seconds:.3f} | {m.coordinator_bytes:,} | "
            f"{m.other_bytes_max:,} | {m.plan_peak / 2**20:.1f} | {m.commit_seconds:.3f} | "
            f"{m.commit_peak / 2**20:.1f} | {m.manifest_bytes / 1024:.0f} |"
        )
    return "\n".join(lines)


def exponents(measures: list[Measure]) -> dict[str, float]:
    out = {}
    for phase in ("first", "cached"):
        ms = [m for m in measures if m.phase == phase]
        worlds = [float(m.world) for m in ms]
        out[f"{phase} coordinator bytes"] = growth(worlds, [float(m.coordinator_bytes) for m in ms])
        out[f"{phase} plan seconds"] = growth(worlds, [m.plan_seconds for m in ms])
        out[f"{phase} bytes per other rank"] = growth(worlds, [float(m.other_bytes_max) for m in ms])
    return out


def plot(measures: list[Measure], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for phase, style in (("first", "o-"), ("cached", "s--")):
        ms = [m for m in measures if m.phase == phase]
        worlds = [m.world for m in ms]
        axes[0].loglog(worlds, [m.coordinator_bytes for m in ms], style, label=f"coordinator, {phase}")
        axes[0].loglog(worlds, [max(m.other_bytes_max, 1) for m in ms], style, label=f"any other rank, {phase}")
        axes[1].loglog(worlds, [m.plan_seconds for m in ms], style, label=f"plan, {phase}")
        axes[1].loglog(worlds, [m.commit_seconds for m in ms], style, label=f"manifest, {phase}")
    axes[0].set(xlabel="ranks", ylabel="bytes per save", title="Collective bytes")
    axes[1].set(xlabel="ranks", ylabel="seconds", title="Coordinator time")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", default="8,64,512,4096,16384")
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--plot", default="")
    parser.add_argument("--no-trace", action="store_true", help="skip the tracemalloc runs")
    parser.add_argument("--per-rank", action="store_true", help="add a per-rank component (RNG state) on every rank")
    args = parser.parse_args()
    measures: list[Measure] = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in (int(w) for w in args.worlds.split(",")):
            root = str(Path(tmp, str(world)))
            measures.extend(simulate(world, args.tensors, root, trace=not args.no_trace, per_rank=args.per_rank))
            print(table(measures[-2:]).splitlines()[-2:], flush=True, file=sys.stderr)
    print(table(measures))
    print()
    for name, value in exponents(measures).items():
        print(f"growth exponent, {name}: {value:.2f}")
    if args.plot:
        plot(measures, args.plot)


if __name__ == "__main__":
    main()
