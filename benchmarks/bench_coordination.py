"""Coordination at scale, simulated: the real digest/plan/commit code for 8 to 16,384 ranks.

One process stands in for every rank.  Each simulated rank builds its description
(:class:`~ckptd.save.plan.LocalTensor` records, as :class:`~ckptd.save.describe.Describer` makes them)
and its :class:`~ckptd.save.exchange.Brief` with the real :func:`~ckptd.save.exchange.layout_of`;
the collectives are replaced by in-memory lists of the pickled messages (their lengths are the
bytes each rank would send or receive); the coordinator's side is the real
:class:`~ckptd.save.exchange.Exchange` (``answer_briefs`` / ``answer_descriptions``, which plan with
:func:`~ckptd.save.plan_unique.plan_unique` and the real ``plan_save``); the commit is the real
:func:`~ckptd.save.file_checksums.combine_pieces` and :func:`~ckptd.save.commit.finalize_checkpoint`,
writing indexes and the manifest to a temporary directory (the shard files are not written:
every rank's write results are made up from its pieces).

Sharding mixes (``--mix``):

* ``megatron`` (default): tensor parallel TP=min(8, W), pipeline PP=min(4, W/TP), data parallel
  DP=W/(TP*PP); 16,384 ranks = TP 8 x PP 4 x DP 512.  Each rank holds ``tensors`` tensors of its
  pipeline stage in component ``model``: two thirds split by rows across the TP group (sharded,
  ``main`` only on DP replica 0), one third replicated plain tensors (norms, biases).  So there
  are 2 x TP x PP distinct layouts.
* ``fsdp``: FSDP2, every tensor a DTensor ``Shard(0)`` over all W ranks (mesh ``(W,)``): two
  thirds ``(8192, 64)`` matrices, one third ``(8192,)`` vectors, BF16.  W distinct pieces per
  tensor; described symbolically (one :class:`~ckptd.dist.grid.Grid` layout, a coordinate
  per rank).
* ``hsdp``: HSDP, mesh ``(W/S, S)`` with S = min(8, W) (sharded within a node, replicated
  across), placements ``(Replicate(), Shard(0))``, the same tensors.

With ``--explicit`` the ``fsdp``/``hsdp`` mixes are described by boxes instead (a layout per
rank, as the code before did; object stores still do): O(W x tensors) descriptions to build, so
for small W; each rank folds its pieces (``fold s``: the slowest rank) and the commit combines the
folded results.  With ``--per-rank`` every rank
also holds one per-rank tensor (``rng@rank<r>``, its own file and index): W more distinct
layouts.

For the grid mixes the coordinator's answer is one :class:`~ckptd.save.plan_unique.ClassPlan`
for every rank; each rank derives its own pieces and folds its pieces of each shared file into one
write result (:func:`~ckptd.save.file_checksums.fold_shared_pieces`; both timed for one rank:
``derive s``, ``fold s``).  The commit is then fed one made-up folded result per rank and file
(every rank writing part of every file: the most the coordinator combines; ``results``).

Run: ``python benchmarks/bench_coordination.py [--mix megatron,fsdp,hsdp] [--worlds
8,64,512,4096,16384] [--tensors 1000] [--plot docs/coordination.png] [--per-rank] [--explicit]
[--json FILE]``.  Prints, per mix, a table per phase (first save / cached save): seconds,
coordinator bytes received+sent, bytes per other rank, peak traced memory (tracemalloc) of the
coordinator's planning and of the manifest build+write, and fitted growth exponents in world
size.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pickle
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ckptd.dist.grid import Grid
from ckptd.dist.group import DistContext
from ckptd.formats.manifest import Manifest
from ckptd.save.commit import ComponentInfo, finalize_checkpoint
from ckptd.save.exchange import Assignment, Brief, Exchange, PlanBook, layout_of
from ckptd.save.file_checksums import combine_pieces, fold_shared_pieces
from ckptd.save.incremental import Reuse
from ckptd.save.plan import LocalTensor, RankPlan, SavePlan
from ckptd.save.plan_unique import derive_rank_plan
from ckptd.storage.local import LocalStorage
from ckptd.writer.protocol import FileResult

__all__ = ["MIXES", "Measure", "grid_coordinate", "grid_tensors", "mesh", "rank_tensors", "simulate"]

_NO_REUSE = Reuse({}, {})
MIXES = ("megatron", "fsdp", "hsdp")
GRID_ROWS = 8192


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


def grid_mesh(world: int, mix: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(mesh shape, shard dims) of the ``fsdp`` or ``hsdp`` mix."""
    if mix == "fsdp":
        return (world,), (0,)
    shard = min(8, world)
    return (world // shard, shard), (-1, 0)


def grid_coordinate(world: int, rank: int, mix: str) -> tuple[int, ...]:
    """Rank ``rank``'s coordinate in the mix's mesh (row-major, as ``init_device_mesh``)."""
    shape, _ = grid_mesh(world, mix)
    return (rank,) if len(shape) == 1 else (rank // shape[1], rank % shape[1])


def grid_tensors(world: int, rank: int, tensors: int, mix: str) -> list[LocalTensor]:
    """Rank ``rank``'s description in the ``fsdp``/``hsdp`` mix: every tensor a grid tensor,
    its own rows as torch's ``Shard(0)`` places them (ceil-sized blocks, empty past the end)."""
    shape, dims = grid_mesh(world, mix)
    coordinate = grid_coordinate(world, rank, mix)
    shards, index = shape[-1], coordinate[-1]
    grid = Grid(shape, dims, 0)
    main = len(coordinate) == 1 or coordinate[0] == 0
    block = -(-GRID_ROWS // shards)
    start = min(GRID_ROWS, index * block)
    rows = min(GRID_ROWS, start + block) - start
    out = []
    for i in range(tensors):
        key = f"layers.{i}.w"
        if i % 3 == 2:
            out.append(LocalTensor("model", key, "BF16", (GRID_ROWS,), (start,), (rows,), True, main, False, grid))
        else:
            out.append(
                LocalTensor("model", key, "BF16", (GRID_ROWS, 64), (start, 0), (rows, 64), True, main, False, grid)
            )
    return out


@dataclass
class Measure:
    """One phase at one world size."""

    world: int
    phase: str  # "first" or "cached"
    mix: str = "megatron"
    plan_seconds: float = 0.0  # the coordinator: answers to the briefs (and descriptions)
    commit_seconds: float = 0.0  # manifest (and indexes) built and written
    coordinator_bytes: int = 0  # received + sent by the coordinator in the collectives
    other_bytes_max: int = 0  # the most any other rank sent + received
    collectives: int = 0
    plan_peak: int = 0  # tracemalloc peak of the coordinator's planning (bytes)
    commit_peak: int = 0  # tracemalloc peak of the manifest build+write (bytes)
    manifest_bytes: int = 0
    plans_made: int = 0
    derive_seconds: float = 0.0  # one rank deriving its plan from its class plan (grid mixes)
    fold_seconds: float = 0.0  # one rank folding its pieces of shared files into one result per file
    results: int = 0  # write results the coordinator receives and combines


class _Simulation:
    """Every rank of one job, saving again and again."""

    def __init__(
        self, world: int, tensors: int, root: str, per_rank: bool, mix: str = "megatron", explicit: bool = False
    ) -> None:
        self.world = world
        self.root = root
        self.mix = mix
        self.explicit = explicit
        self.tensors = tensors
        self.layouts: dict[tuple[int, int, bool], tuple[Any, dict[bytes, tuple[LocalTensor, ...]]]] = {}
        coordinates: list[tuple[tuple[int, ...], ...]] = [()] * world
        if mix == "megatron":
            tp, pp, _ = mesh(world)
            for rank in range(min(world, 2 * tp * pp)):  # the distinct model layouts (DP replica 0 and 1)
                self.layouts[self._class(rank)] = layout_of(rank_tensors(world, rank, tensors))
        elif explicit:  # the same mesh described by boxes: a layout per rank (object stores, the code before)
            for rank in range(world):
                boxes = [dataclasses.replace(t, grid=None) for t in grid_tensors(world, rank, tensors, mix)]
                self.layouts[(rank, 0, False)] = layout_of(boxes)
        else:  # one layout for the whole mesh: rank 0's description stands for every rank's
            self.layouts[(0, 0, True)] = layout_of(grid_tensors(world, 0, tensors, mix))
            for rank in sorted({1, world // 2, world - 1} - {0}):  # checked on a sample: the digests agree
                if layout_of(grid_tensors(world, rank, tensors, mix))[0] != self.layouts[(0, 0, True)][0]:
                    raise AssertionError(f"rank {rank} of the {mix} mesh digests its layout differently")
            coordinates = [(grid_coordinate(world, rank, mix),) for rank in range(world)]
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
            self.briefs.append(Brief(rank, layout, trees, {}, {}, None, coordinates=coordinates[rank]))
        self.held = [b""] * world
        context = DistContext(rank=0, world_size=world, coordinator=0, group=None, store=None, timeout=60.0)
        self.exchange = Exchange(context, root, PlanBook(2**30, shared_files=True, separate_frozen=False))
        self.storage = LocalStorage()
        self.saves = 0
        self.derived: RankPlan | None = None  # the last rank's own plan, derived from its class plan

    def _class(self, rank: int) -> tuple[int, int, bool]:
        if self.mix != "megatron":
            return (rank, 0, False) if self.explicit else (0, 0, True)
        tp, pp, _ = mesh(self.world)
        return rank % tp, (rank // tp) % pp, rank // (tp * pp) == 0

    def save(self, phase: str, trace: bool) -> Measure:
        """One save: briefs -> answers (-> descriptions -> answers) -> commit."""
        measure = Measure(self.world, phase, self.mix)
        sent = [0] * self.world
        received = [0] * self.world
        briefs = [
            Brief(
                b.rank, b.layout, b.trees, b.tied, b.sharing, b.last_committed, self.held[b.rank], None, b.coordinates
            )
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
            if answer.rank_plan is not None or answer.class_plan is not None:
                self.held[rank] = answer.plan_id
        whole = exchange.book.plan
        assert whole is not None
        measure.plans_made = exchange.book.plans_made
        self.saves += 1
        last = self.world - 1
        if answers[last].class_plan is not None:  # what the last rank does on receiving its answer
            own = grid_tensors(self.world, last, self.tensors, self.mix)
            if self.briefs[last].trees:
                own += [LocalTensor(f"rng@rank{last}", "state", "U8", (5056,), (0,), (5056,))]
            self.derived, measure.derive_seconds, _ = _run(
                lambda: derive_rank_plan(answers[last].class_plan, last, own), False
            )
        if whole.class_plans:  # the last rank folds its own pieces (it kept its derived plan)
            derived = self.derived
            assert derived is not None
            _, measure.fold_seconds, _ = _run(lambda: fold_shared_pieces(derived, _piece_results(derived)), False)
            results = _class_results(whole)
        else:
            folded = [_run(lambda r=r: fold_shared_pieces(r, _piece_results(r)), False) for r in whole.ranks]
            measure.fold_seconds = max(seconds for _, seconds, _ in folded)
            results = [result for made, _, _ in folded for result in made]
        measure.results = len(results)
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


def _piece_results(plan: RankPlan) -> list[FileResult]:
    """What a rank's writer would report for its pieces (CRCs made up: nothing is written)."""
    return [FileResult(p.file_name, p.size, 0, 0.0, p.file_offset) for p in plan.pieces]


def _class_results(plan: SavePlan) -> list[FileResult]:
    """What the coordinator receives with class plans (grid mixes), made up without deriving
    every rank's plan: one folded result per rank and file, as if every rank wrote part of every
    file (an upper bound of the combining work: W results per file)."""
    out = []
    for f in plan.files:
        share, extra = divmod(f.size, plan.world_size)
        for rank in range(plan.world_size):
            size = share + (rank < extra)
            if size:
                out.append(FileResult(f.file_name, size, rank, 0.0, 0, spread_end=f.size))
    return out


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


def simulate(
    world: int,
    tensors: int,
    root: str,
    trace: bool = True,
    per_rank: bool = False,
    mix: str = "megatron",
    explicit: bool = False,
) -> list[Measure]:
    """A first save and a cached save at ``world`` ranks: timed runs, then traced ones (with
    ``per_rank``, every rank also saves a per-rank component: its own file and index; with
    ``explicit``, the ``fsdp``/``hsdp`` mixes are described by boxes, a layout per rank)."""
    simulation = _Simulation(world, tensors, root, per_rank, mix, explicit)
    first = simulation.save("first", trace=False)
    cached = simulation.save("cached", trace=False)
    if trace:
        traced = _Simulation(world, tensors, root + "-traced", per_rank, mix, explicit)
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


def mesh_label(world: int, mix: str) -> str:
    if mix == "megatron":
        return "TP{}xPP{}xDP{}".format(*mesh(world))
    shape, _ = grid_mesh(world, mix)
    return "FSDP {}".format(*shape) if mix == "fsdp" else "HSDP {}x{}".format(*shape)


def table(measures: list[Measure]) -> str:
    lines = [
        "| ranks | mesh | save | plan s | coord bytes | bytes/other rank | plan peak MB | manifest s | "
        "manifest peak MB | manifest KB | derive s | fold s | results |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in measures:
        lines.append(
            f"| {m.world} | {mesh_label(m.world, m.mix)} | {m.phase} | {m.plan_seconds:.3f} | "
            f"{m.coordinator_bytes:,} | {m.other_bytes_max:,} | {m.plan_peak / 2**20:.1f} | "
            f"{m.commit_seconds:.3f} | {m.commit_peak / 2**20:.1f} | {m.manifest_bytes / 1024:.0f} | "
            f"{m.derive_seconds:.3f} | {m.fold_seconds:.3f} | {m.results:,} |"
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
    parser.add_argument(
        "--mix", default="megatron", help=f"sharding mixes, comma-separated, of {', '.join(MIXES)} (module docstring)"
    )
    parser.add_argument(
        "--explicit",
        action="store_true",
        help="describe the fsdp/hsdp mixes by boxes, a layout per rank (as on object stores; small W only)",
    )
    parser.add_argument("--json", default="", help="write every measure to this file")
    args = parser.parse_args()
    mixes = args.mix.split(",")
    if set(mixes) - set(MIXES):
        parser.error(f"unknown mix in {args.mix!r}; choose from {', '.join(MIXES)}")
    by_mix: dict[str, list[Measure]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mix in mixes:
            measures = by_mix[mix] = []
            for world in (int(w) for w in args.worlds.split(",")):
                root = str(Path(tmp, mix, str(world)))
                trace = not args.no_trace
                measures.extend(
                    simulate(world, args.tensors, root, trace, args.per_rank, mix, args.explicit and mix != "megatron")
                )
                print(table(measures[-2:]).splitlines()[-2:], flush=True, file=sys.stderr)
    for mix, measures in by_mix.items():
        print(f"\n{mix}:\n")
        print(table(measures))
        print()
        for name, value in exponents(measures).items():
            print(f"growth exponent, {name}: {value:.2f}")
    if args.plot:
        plot(by_mix[mixes[0]], args.plot)
    if args.json:
        out = {"tensors": args.tensors, "per_rank": args.per_rank, "mixes": {}}
        for mix, measures in by_mix.items():
            out["mixes"][mix] = {"measures": [asdict(m) for m in measures], "exponents": exponents(measures)}
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
