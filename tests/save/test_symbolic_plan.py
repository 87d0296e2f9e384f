"""Symbolic (grid) descriptions of row-sharded DTensors: one layout for every rank of an FSDP or
HSDP mesh, a plan made once for the class, each rank deriving its own pieces.  Checked against
the explicit plan of the same boxes (computed by torch's own placement code)."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from ckptd.dist.grid import Grid
from ckptd.errors import CorruptCheckpointError, ShardingError
from ckptd.formats.checksum import crc32c
from ckptd.save.exchange import layout_of
from ckptd.save.file_checksums import combine_pieces, fold_shared_pieces
from ckptd.save.plan import LocalTensor, plan_save
from ckptd.save.plan_unique import derive_rank_plan, plan_unique
from ckptd.writer.protocol import FileResult

SHAPES = [(7, 5), (2, 3), (16,), (9, 4, 2), (1, 8), ()]  # uneven rows, empty pieces, 1-D, 3-D, 0-D


def rank_state(mesh_shape, placements, coordinate, rank):
    """(grid descriptions, explicit descriptions) of one rank's state: a grid tensor per shape,
    a replicated plain tensor, and a per-rank component."""
    dims = tuple(p.dim if isinstance(p, Shard) else -1 for p in placements)
    grid_locals, explicit = [], []
    for i, shape in enumerate(SHAPES):
        used = [p if shape else Replicate() for p in placements]  # a 0-dim tensor cannot be sharded
        local, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coordinate), used)
        main = all(c == 0 for c, p in zip(coordinate, used, strict=True) if not isinstance(p, Shard))
        grid_dims = dims if shape else (-1,) * len(dims)
        common = ("model", f"w{i}", "F32", shape, tuple(offset), tuple(local))
        grid_locals.append(LocalTensor(*common, True, main, False, Grid(mesh_shape, grid_dims, 0)))
        explicit.append(LocalTensor(*common, True, main))
    plain = LocalTensor.whole("model", "norm", "BF16", (6,), False)
    rng = LocalTensor.whole(f"rng@rank{rank}", "state", "U8", (24,), False)
    return [*grid_locals, plain, rng], [*explicit, plain, rng]


def job(mesh_shape, placements):
    coordinates = list(itertools.product(*(range(n) for n in mesh_shape)))
    states = [rank_state(mesh_shape, placements, c, rank) for rank, c in enumerate(coordinates)]
    return coordinates, [s[0] for s in states], [s[1] for s in states]


@pytest.mark.parametrize(
    ("mesh_shape", "placements"),
    [((3,), [Shard(0)]), ((4,), [Shard(0)]), ((2, 3), [Replicate(), Shard(0)]), ((2, 2), [Shard(0), Shard(0)])],
    ids=["fsdp-3", "fsdp-4", "hsdp-2x3", "shard-twice-2x2"],
)
def test_derived_plans_cover_every_byte_once_and_match_the_explicit_plan(mesh_shape, placements):
    coordinates, symbolic, explicit = job(mesh_shape, placements)
    layouts, descriptions = [], {}
    for local in symbolic:
        layout, known = layout_of(local)
        layouts.append(layout)
        descriptions.update(known)
    model_digests = {dict(layout)["model"] for layout in layouts}
    assert len(model_digests) == 1, "every rank of the mesh describes the model alike"
    plan = plan_unique(layouts, descriptions, 64, coordinates=[(c,) for c in coordinates])
    reference = plan_save(explicit, 64)
    assert plan.files == reference.files and plan.tensors == reference.tensors, "same files, same records"
    class_plans = {id(c) for c in plan.class_plans if c is not None}
    assert len(class_plans) == 1, "one class plan answers every rank"
    results = []
    for rank, local in enumerate(symbolic):
        derived = derive_rank_plan(plan.class_plans[rank], rank, local)
        for piece in derived.pieces:
            for part in piece.parts:  # a part stages this rank's own piece: its own shape
                if part.key:
                    mine = next(t for t in local if (t.component, t.key) == (part.component, part.key))
                    assert part.shape == mine.shape and part.nbytes == mine.nbytes
                    assert mine.main, "replicas write nothing of a grid tensor"
        results.extend(FileResult(p.file_name, p.size, 0, 0.0, p.file_offset) for p in derived.pieces)
    records = combine_pieces(plan, results)  # raises on a gap, an overlap or a short file
    assert set(records) == {f.file_name for f in plan.files}


def test_replicas_share_the_plain_tensors_and_the_headers():
    coordinates, symbolic, _ = job((2, 2), [Replicate(), Shard(0)])
    layouts, descriptions = zip(*(layout_of(local) for local in symbolic), strict=True)
    merged = {d: t for known in descriptions for d, t in known.items()}
    plan = plan_unique(list(layouts), merged, 1 << 20, coordinates=[(c,) for c in coordinates])
    written = [derive_rank_plan(plan.class_plans[r], r, symbolic[r]).bytes for r in range(4)]
    assert all(written), written  # every rank writes something: rows, headers or plain tensors


@pytest.mark.parametrize(
    ("coordinates", "message"),
    [
        ([(0,), (0,), (2,)], "both sit at"),
        ([(0,), (1,), (5,)], "outside the mesh"),
        ([(0,), (1,), ()], "sent no coordinate"),
    ],
)
def test_coordinates_that_do_not_cover_the_mesh_are_refused(coordinates, message):
    _, symbolic, _ = job((3,), [Shard(0)])
    layouts, descriptions = zip(*(layout_of(local) for local in symbolic), strict=True)
    merged = {d: t for known in descriptions for d, t in known.items()}
    places = [(c,) if c else () for c in coordinates]
    with pytest.raises(ShardingError, match=message):
        plan_unique(list(layouts), merged, 64, coordinates=places)


def test_a_mesh_with_fewer_ranks_than_places_is_refused():
    _, symbolic, _ = job((4,), [Shard(0)])
    layouts, descriptions = zip(*(layout_of(local) for local in symbolic[:3]), strict=True)
    merged = {d: t for known in descriptions for d, t in known.items()}
    with pytest.raises(ShardingError, match="some pieces would be missing"):
        plan_unique(list(layouts), merged, 64, coordinates=[((0,),), ((1,),), ((2,),)])


@pytest.mark.parametrize("shared_files", [True, False], ids=["rows", "chunks"])
def test_the_explicit_plan_skips_empty_pieces(shared_files):
    """Ranks past a tensor's last row hold empty pieces (w1 has 2 rows on 4 ranks): neither a
    zero-byte write inside another rank's rows nor a zero-byte chunk."""
    _, _, explicit = job((4,), [Shard(0)])
    plan = plan_save(explicit, 64, shared_files=shared_files)
    results = [FileResult(p.file_name, p.size, 0, 0.0, p.file_offset) for r in plan.ranks for p in r.pieces]
    combine_pieces(plan, results)  # raises on a gap or an overlap
    chunks = plan.tensors["model"]["w1"].chunks
    assert [c.shape for c in chunks] == ([(2, 3)] if shared_files else [(1, 3), (1, 3)])


def written_results(plan, pieces, contents):
    """The writer's per-piece results for ``pieces``, with the real CRC32C of their bytes."""
    return [
        FileResult(
            p.file_name,
            p.size,
            crc32c(contents[p.file_name][p.file_offset : p.file_offset + p.size]),
            0.0,
            p.file_offset,
        )
        for p in pieces
    ]


@pytest.mark.parametrize(
    ("mesh_shape", "placements"),
    [((4,), [Shard(0)]), ((2, 3), [Replicate(), Shard(0)]), ((2, 2), [Shard(0), Shard(0)])],
    ids=["fsdp-4", "hsdp-2x3", "shard-twice-2x2"],
)
def test_each_rank_folds_its_pieces_of_a_shared_file_into_one_result_and_the_file_crc_is_exact(mesh_shape, placements):
    """What the coordinator receives: one result per rank and shared file (not one per piece),
    from which every file's CRC32C comes out as that of its bytes."""
    coordinates, symbolic, _ = job(mesh_shape, placements)
    layouts, descriptions = zip(*(layout_of(local) for local in symbolic), strict=True)
    merged = {d: t for known in descriptions for d, t in known.items()}
    plan = plan_unique(list(layouts), merged, 64, coordinates=[(c,) for c in coordinates])
    rng = random.Random(3)
    contents = {f.file_name: rng.randbytes(f.size) for f in plan.files}
    reported, per_piece = [], 0
    for rank, local in enumerate(symbolic):
        derived = derive_rank_plan(plan.class_plans[rank], rank, local)
        results = written_results(plan, derived.pieces, contents)
        per_piece += len(results)
        folded = fold_shared_pieces(derived, results)
        shared = {p.file_name for p in derived.pieces if not p.whole_file}
        assert sorted(r.name for r in folded if r.spread_end) == sorted(shared), "one result per shared file"
        reported.extend(folded)
    assert len(reported) < per_piece
    records = combine_pieces(plan, reported)
    assert {name: r.crc32c for name, r in records.items()} == {
        name: f"{crc32c(data):08x}" for name, data in contents.items()
    }


def test_a_rank_whose_writer_did_not_write_its_plan_and_a_rank_that_did_not_report_are_caught():
    coordinates, symbolic, _ = job((4,), [Shard(0)])
    layouts, descriptions = zip(*(layout_of(local) for local in symbolic), strict=True)
    merged = {d: t for known in descriptions for d, t in known.items()}
    plan = plan_unique(list(layouts), merged, 64, coordinates=[(c,) for c in coordinates])
    contents = {f.file_name: bytes(f.size) for f in plan.files}
    derived = [derive_rank_plan(plan.class_plans[r], r, symbolic[r]) for r in range(4)]
    results = [written_results(plan, d.pieces, contents) for d in derived]
    shared_piece = next(i for i, p in enumerate(derived[1].pieces) if not p.whole_file)
    with pytest.raises(CorruptCheckpointError, match="where the plan has"):
        fold_shared_pieces(derived[1], results[1][:shared_piece] + results[1][shared_piece + 1 :])  # one missing
    with pytest.raises(CorruptCheckpointError, match="where the plan has"):
        fold_shared_pieces(derived[1], [*results[1], results[1][shared_piece]])  # one twice
    folded = [fold_shared_pieces(d, r) for d, r in zip(derived, results, strict=True)]
    with pytest.raises(CorruptCheckpointError, match="bytes were written"):
        combine_pieces(plan, [r for f in folded[:3] for r in f])  # rank 3 reported nothing
    mixed = [r for f in folded[:3] for r in f] + results[3]  # rank 3 reported its pieces one by one
    assert combine_pieces(plan, mixed) == combine_pieces(plan, [r for f in folded for r in f])
    piece = next(i for i, p in enumerate(derived[3].pieces) if not p.whole_file and p.size)
    size = next(f.size for f in plan.files if f.file_name == derived[3].pieces[piece].file_name)
    beyond = [*results[3]]
    beyond[piece] = dataclasses.replace(beyond[piece], file_offset=size)  # past the file's end
    with pytest.raises(CorruptCheckpointError, match="bytes up to"):
        combine_pieces(plan, [r for f in folded[:3] for r in f] + beyond)


def test_an_empty_piece_of_a_file_another_rank_writes_whole(tmp_path):
    """A zero-element tensor sorts to the end of its file and may go to another rank than the
    file's bytes: that rank folds its empty piece while the writer of the rest reports a whole
    file.  The save failed ("reported its pieces one by one where the others folded") until the
    coordinator took both kinds of result for one file (found by a randomized pass)."""
    local = [
        LocalTensor.whole("model", k, d, s, False)
        for k, d, s in (("a", "F32", (1000,)), ("empty", "I8", (0,)), ("b", "F32", (1000,)))
    ]
    plan = plan_save([local, local], 4096 + 1024)
    owners = {r.rank: {(p.file_name, p.whole_file, p.size) for p in r.pieces} for r in plan.ranks}
    first = plan.files[0].file_name
    assert any((first, True, plan.files[0].size) in o for o in owners.values())
    assert any((first, False, 0) in o for o in owners.values()), "the setting this test is about"
    contents = {f.file_name: random.Random(1).randbytes(f.size) for f in plan.files}
    reported = [
        r for rank in plan.ranks for r in fold_shared_pieces(rank, written_results(plan, rank.pieces, contents))
    ]
    records = combine_pieces(plan, reported)
    assert {name: r.crc32c for name, r in records.items()} == {name: f"{crc32c(d):08x}" for name, d in contents.items()}
