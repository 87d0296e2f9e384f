"""Save planning at scale: a plan of 100,000 tiny tensors is complete and consistent.

Planning used to re-sum every file's items once per item (quadratic); these tests pin what the
plan must say at that scale -- file sizes, non-overlapping offsets, every tensor exactly once --
and that each file is laid out once, not how long it takes (``benchmarks/bench_plan.py``
measures that).  ``data/pinned_plans.json`` holds the plans of varied inputs as the planner made
them before its fast path for plain tensors: a rewrite for speed must not change a byte.
"""

from __future__ import annotations

import itertools
import json
import math
import pathlib
import struct

import pytest
import torch
from plan_cases import PLAN_CASES, plan_json

import ckptd
import ckptd.save.layout
import ckptd.save.plan
import ckptd.save.saver
from ckptd.errors import ShardingError
from ckptd.formats.manifest import TensorRecord
from ckptd.formats.safetensors import DTYPE_ITEMSIZE, parse_header
from ckptd.save.plan import ARENA_ALIGNMENT, LocalTensor, SavePlan, plan_save

_PINNED = pathlib.Path(__file__).parent / "data" / "pinned_plans.json"

_DTYPES = ("F32", "BF16", "I64", "BOOL", "F64", "U8")


def _tiny_tensors(count: int, component: str = "model") -> list[LocalTensor]:
    out = []
    for i in range(count):
        shape = (3,) if i % 7 else (2, i % 5)  # some empty tensors too
        out.append(LocalTensor(component, f"layers.{i}.w", _DTYPES[i % len(_DTYPES)], shape, (0,) * len(shape), shape))
    return out


def _check_plan(plan: SavePlan, expected: dict[str, dict[str, LocalTensor]]) -> None:
    sizes = {f.file_name: f.size for f in plan.files}
    assert len(sizes) == len(plan.files), "a file name is planned twice"

    # The manifest records: every tensor once, the right byte count, inside its file.
    assert {c: set(t) for c, t in plan.tensors.items()} == {c: set(t) for c, t in expected.items()}
    spans: dict[str, list[tuple[int, int, str]]] = {name: [] for name in sizes}
    for component, records in plan.tensors.items():
        for key, record in records.items():
            local = expected[component][key]
            assert record.is_whole and (record.dtype, record.shape) == (local.dtype, local.shape)
            assert record.end - record.start == math.prod(local.shape) * DTYPE_ITEMSIZE[local.dtype]
            assert record.start % DTYPE_ITEMSIZE[local.dtype] == 0, f"{key} is not naturally aligned"
            spans[record.file].append((record.start, record.end, key))

    # What the ranks write: every byte of every file exactly once, headers that parse back to
    # the same records, tensors at the recorded offsets.
    written: dict[str, list[tuple[int, int]]] = {name: [] for name in sizes}
    headers: dict[str, bytes] = {}
    staged: dict[tuple[str, str], tuple[str, int]] = {}
    for rank_plan in plan.ranks:
        arena_spans = []
        for piece in rank_plan.pieces:
            assert piece.arena_offset % ARENA_ALIGNMENT == piece.file_offset % ARENA_ALIGNMENT
            arena_spans.append((piece.arena_offset, piece.arena_offset + piece.size))
            written[piece.file_name].append((piece.file_offset, piece.file_offset + piece.size))
            cursor = 0
            for part in piece.parts:
                assert part.offset == cursor, "the parts of a piece are not back to back"
                cursor += part.nbytes
                if part.header:
                    assert piece.file_offset + part.offset == 0
                    headers[piece.file_name] = part.header
                else:
                    assert (part.component, part.key) not in staged, f"{part.key} is staged twice"
                    staged[(part.component, part.key)] = (piece.file_name, piece.file_offset + part.offset)
            assert cursor == piece.size
        arena_spans.sort()
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(arena_spans))
        assert rank_plan.arena_size >= max((end for _, end in arena_spans), default=0)
    assert set(staged) == {(c, k) for c, records in expected.items() for k in records}
    for (component, key), (file_name, offset) in staged.items():
        record = plan.tensors[component][key]
        assert (record.file, record.start) == (file_name, offset)

    for name, size in sizes.items():
        ranges = sorted(written[name])
        assert ranges[0][0] == 0 and ranges[-1][1] == size
        assert all(a_end == b_start for (_, a_end), (b_start, _) in itertools.pairwise(ranges))
        header = headers[name]
        (length,) = struct.unpack("<Q", header[:8])
        assert len(header) == 8 + length
        parsed = parse_header(header[:8], header[8:], size, name)
        assert size == len(header) + parsed.data_size
        file_spans = sorted(spans[name])
        assert len(parsed.entries) == len(file_spans)
        for start, end, key in file_spans:
            entry = parsed.entries[key]
            assert (parsed.data_start + entry.start, parsed.data_start + entry.end) == (start, end)
        nonempty = [(s, e) for s, e, _ in file_spans if e > s]
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(nonempty))
        assert sum(e - s for s, e in nonempty) == size - len(header), "a file has bytes no tensor owns"


def test_plan_of_100k_tiny_tensors_is_complete_and_consistent():
    tensors = _tiny_tensors(100_000)
    plan = plan_save([tensors], max_shard_size=256 * 1024)
    assert len(plan.files) > 1  # several shards, so bucketing is exercised at scale
    names = [f.file_name for f in plan.files]
    assert names[0] == f"model-00001-of-{len(names):05d}.safetensors"
    _check_plan(plan, {"model": {t.key: t for t in tensors}})


def test_plan_of_many_replicated_tensors_on_two_ranks_writes_each_once():
    model = _tiny_tensors(20_000)
    optim = _tiny_tensors(5_000, "optim")
    plan = plan_save([model + optim, model + optim], max_shard_size=64 * 1024)
    assert {f.component for f in plan.files} == {"model", "optim"}
    assert all(rank_plan.pieces for rank_plan in plan.ranks), "one rank writes everything"
    _check_plan(plan, {"model": {t.key: t for t in model}, "optim": {t.key: t for t in optim}})


@pytest.mark.parametrize("case", PLAN_CASES, ids=[case[0] for case in PLAN_CASES])
def test_plan_equals_the_pinned_plan(case):
    name, locals_by_rank, max_shard_size, shared_files, separate_frozen = case
    pinned = json.loads(_PINNED.read_text())[name]
    plan = plan_save(locals_by_rank, max_shard_size, shared_files=shared_files, separate_frozen=separate_frozen)
    assert plan_json(plan) == pinned
    assert plan.world_size == len(locals_by_rank)
    expected = {(t.component, t.key) for local in locals_by_rank for t in local}
    assert {(c, k) for c, records in plan.tensors.items() for k in records} == expected


def test_each_file_is_laid_out_once_and_each_entry_once(monkeypatch):
    """The layout of a file (header, offsets, size) is computed once per file over its own
    entries: a quadratic planner (re-laying out a file per entry) fails here without a timer."""
    layouts: list[int] = []
    headers: list[int] = []
    records = 0
    real_offsets, real_header = ckptd.save.plan.file_offsets, ckptd.save.layout.header_bytes
    real_whole = TensorRecord.whole

    def file_offsets(keys, dtypes, shapes, sizes):
        layouts.append(len(keys))
        return real_offsets(keys, dtypes, shapes, sizes)

    def header_bytes(rows, metadata=None):
        rows = list(rows)
        headers.append(len(rows))
        return real_header(rows, metadata)

    def whole(dtype, shape, file, start, end):
        nonlocal records
        records += 1
        return real_whole(dtype, shape, file, start, end)

    monkeypatch.setattr(ckptd.save.plan, "file_offsets", file_offsets)
    monkeypatch.setattr(ckptd.save.layout, "header_bytes", header_bytes)
    monkeypatch.setattr(TensorRecord, "whole", staticmethod(whole))
    model = _tiny_tensors(3_000)
    optim = _tiny_tensors(1_000, "optim")
    plan = plan_save([model + optim, model + optim], max_shard_size=4 * 1024)
    assert len(plan.files) > 4
    assert len(layouts) == len(headers) == len(plan.files)
    assert sum(layouts) == sum(headers) == records == 4_000
    _check_plan(plan, {"model": {t.key: t for t in model}, "optim": {t.key: t for t in optim}})


def test_replicas_that_disagree_are_refused_naming_both_ranks():
    a = LocalTensor("model", "w", "F32", (4,), (0,), (4,))
    b = LocalTensor("model", "w", "F16", (4,), (0,), (4,))
    ok = LocalTensor("model", "v", "F32", (2,), (0,), (2,))
    with pytest.raises(ShardingError, match=r"model.'w' is replicated but rank 2 holds F16\[4\] while rank 0 holds"):
        plan_save([[ok, a], [ok, a], [b, ok]], 2**20)
    sharded = LocalTensor("model", "w", "F32", (4,), (0,), (2,), sharded=True)
    with pytest.raises(ShardingError, match=r"model.'w' is sharded on some ranks but a plain tensor on rank 0"):
        plan_save([[a], [sharded]], 2**20)
    with pytest.raises(ShardingError, match=r"model.'w' is sharded on some ranks but a plain tensor on rank 1"):
        plan_save([[sharded], [a]], 2**20)


@pytest.mark.parametrize("key_layout", ["flat", "spread"])
def test_a_save_with_an_unchanged_layout_reuses_the_plan(tmp_path, monkeypatch, key_layout):
    """The warm save's plan comes from the Saver's cache: planning again costs ~18 µs per tensor
    (a key_layout in the cache key once made every save re-plan)."""
    calls: list[int] = []
    real = ckptd.save.saver.plan_save

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(ckptd.save.saver, "plan_save", counting)
    state = {"model": {"w": torch.arange(6, dtype=torch.float32), "b": torch.ones(3, dtype=torch.bfloat16)}}
    with ckptd.Checkpointer(str(tmp_path), key_layout=key_layout) as ckpt:
        for step in range(3):
            state["model"]["w"].add_(1)
            ckpt.save(step, state)
        loaded = ckpt.load(2)
    assert len(calls) == 1, f"planned {len(calls)} times for three saves of one layout"
    w = loaded["model"]["w"]
    assert w.dtype == torch.float32 and w.shape == (6,) and torch.equal(w, torch.arange(6, dtype=torch.float32) + 3)


@pytest.mark.parametrize("shape", [(), (3,), (2, 0, 5), tuple(range(1, 12))])
@pytest.mark.parametrize("frozen", [False, True])
def test_whole_local_tensor_equals_the_one_its_constructor_builds(shape, frozen):
    fast = LocalTensor.whole("model", "w", "BF16", shape, frozen)
    built = LocalTensor("model", "w", "BF16", shape, (0,) * len(shape), shape, frozen=frozen)
    assert fast == built and hash(fast) == hash(built) and repr(fast) == repr(built)
    assert fast.offset == (0,) * len(shape) and fast.is_whole and fast.main and not fast.sharded
