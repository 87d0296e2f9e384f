"""The coordination harness (benchmarks/bench_coordination.py) at small size: growth bounds by
bytes and counts (not wall time), and planning over unique layouts against the plain planner."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

from ckptd.save.exchange import layout_of
from ckptd.save.plan import plan_save
from ckptd.save.plan_unique import plan_unique
from ckptd.save.saver import combine_pieces
from ckptd.writer.protocol import FileResult

_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_coordination.py"
_SPEC = importlib.util.spec_from_file_location("bench_coordination", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
bench = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = bench  # dataclasses look their module up there
_SPEC.loader.exec_module(bench)

WORLDS = (8, 32, 64, 128, 256)


@pytest.fixture(scope="module")
def measures(tmp_path_factory):
    root = tmp_path_factory.mktemp("coordination")
    out = []
    for world in WORLDS:
        out.extend(bench.simulate(world, 30, str(root / str(world)), trace=False, per_rank=True))
    return out


def test_cached_saves_cost_other_ranks_constant_bytes(measures):
    cached = [m for m in measures if m.phase == "cached"]
    other = [m.other_bytes_max for m in cached]
    assert max(other) - min(other) <= 16, other  # O(1): a few bytes for larger rank numbers
    assert all(m.collectives == 2 and m.plans_made == 1 for m in cached), "the plan was reused, not remade"
    first = [m for m in measures if m.phase == "first"]
    assert all(m.collectives == 4 and m.plans_made == 1 for m in first)
    assert all(c.other_bytes_max * 5 < f.other_bytes_max for c, f in zip(cached, first, strict=True))


def test_coordinator_bytes_grow_at_most_linearly(measures):
    for phase in ("first", "cached"):
        ms = [m for m in measures if m.phase == phase]
        exponent = bench.growth([float(m.world) for m in ms], [float(m.coordinator_bytes) for m in ms])
        assert exponent <= 1.05, (phase, exponent)
        per_rank = [m.coordinator_bytes / m.world for m in ms]
        assert per_rank[-1] <= 1.1 * per_rank[0], (phase, per_rank)


def test_the_manifest_has_one_record_per_logical_tensor_whatever_the_world_size(measures):
    by_world = {m.world: m.manifest_bytes for m in measures if m.phase == "cached"}
    # TP x PP grows to 8 x 4 at 32 ranks; from there on only DP grows: the manifest stays put
    # but for one per-rank component per rank.
    growth = (by_world[256] - by_world[32]) / (256 - 32)
    assert growth < 600, by_world


def test_unique_layout_planning_covers_every_byte_once_and_matches_the_plain_plan():
    world = 128  # TP 8 x PP 4 x DP 4: the replicas of DP 1-3 have one layout per shard
    layouts, descriptions, full = [], {}, []
    for rank in range(world):
        tensors = bench.rank_tensors(world, rank, 12)
        layout, known = layout_of(tensors)
        layouts.append(layout)
        descriptions.update(known)
        full.append(tensors)
    unique = plan_unique(layouts, descriptions, 4096, shared_files=True)
    plain = plan_save(full, 4096, shared_files=True)
    assert unique.tensors == plain.tensors and unique.files == plain.files
    results = [FileResult(p.file_name, p.size, 0, 0.0, p.file_offset) for r in unique.ranks for p in r.pieces]
    records = combine_pieces(unique, results)  # raises unless every file is covered exactly once
    assert set(records) == {f.file_name for f in unique.files}
    written = [r.bytes for r in unique.ranks]
    assert sum(1 for w in written if w) >= world // 2, "DP replicas share the writes"
    assert len(descriptions) == 64 + 0, "2 x TP x PP distinct layouts"
    remote = plan_unique(layouts, descriptions, 4096, shared_files=False)
    owners: dict[str, set[int]] = {}
    for rank_plan in remote.ranks:
        for piece in rank_plan.pieces:
            owners.setdefault(piece.file_name, set()).add(rank_plan.rank)
            assert piece.whole_file
    assert all(len(o) == 1 for o in owners.values()), "object stores: one writer per file"


@pytest.mark.parametrize("mix", ["fsdp", "hsdp"])
def test_fsdp_and_hsdp_meshes_are_planned_once_for_every_rank(tmp_path, mix):
    """Every rank of the mesh sends one shared (symbolic) layout: one description, one class
    plan of the same size at every world size, a manifest that does not grow with the ranks."""
    measures = {w: bench.simulate(w, 30, str(tmp_path / str(w)), trace=False, mix=mix) for w in (8, 64, 256)}
    manifests = [m.manifest_bytes for ms in measures.values() for m in ms]
    assert max(manifests) - min(manifests) <= 16, manifests  # the world size's digits
    for first, cached in measures.values():
        assert first.plans_made == 1 and first.collectives == 4 and cached.collectives == 2
    class_plans = [first.other_bytes_max for first, _ in measures.values()]
    assert max(class_plans) - min(class_plans) <= 16, class_plans  # one class plan, members a range
    exponent = bench.growth([8.0, 64.0, 256.0], [float(first.coordinator_bytes) for first, _ in measures.values()])
    assert exponent <= 1.05, exponent  # a class plan per rank on the wire: linear, not W x tensors
