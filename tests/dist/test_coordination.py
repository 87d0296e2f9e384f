"""Coordination on real gloo groups: the cached plan, coordinator-only planning, stalled ranks,
and the c10d store keys a save creates (and deletes)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from conftest import assert_same
from distributed import run_ranks

import ckptd
from ckptd.errors import DistributedSaveError

pytestmark = [pytest.mark.multiprocess, pytest.mark.distributed]


def rows_of(rank: int, world: int, rows: int = 12) -> ckptd.ShardedTensor:
    full = torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4)
    per = rows // world
    return ckptd.ShardedTensor("w", full[rank * per : (rank + 1) * per].clone(), (rows, 4), (rank * per, 0))


def state_of(rank: int, world: int, step: int, grow: bool = False) -> dict[str, object]:
    torch.manual_seed(step)
    extra = {"x": torch.full((3,), float(rank * 10 + step))}
    if grow:
        extra["y"] = torch.arange(5, dtype=torch.int64) + rank  # a layout change on this rank only
    return {
        "model": {"shared": torch.randn(8, 8), "rows": rows_of(rank, world)},
        "extra": extra,
    }


def three_saves(rank: int, world: int, root: str) -> dict[str, object]:
    out: dict[str, object] = {"traffic": []}
    with ckptd.Checkpointer(root, dist_timeout=60) as ckpt:
        traffic = ckpt._saver.dist.traffic
        for step, grow in ((1, False), (2, False), (3, rank == 1)):
            before = (traffic.collectives, traffic.sent, traffic.received)
            ckpt.save(step, state_of(rank, world, step, grow), sharing={"extra": "per_rank"})
            out["traffic"].append(
                (traffic.collectives - before[0], traffic.sent - before[1], traffic.received - before[2])
            )
            if rank == 0:
                out.setdefault("plans", []).append(ckpt._saver.exchange.book.plans_made)
        out["whole_plan_held"] = ckpt._saver.exchange.book.plan is not None if rank else None
        for step, grow in ((1, False), (2, False), (3, rank == 1)):
            loaded = ckpt.load(step, sharing={"extra": "per_rank"})
            expected = state_of(rank, world, step, grow)
            assert_same(expected["extra"], loaded["extra"], f"rank {rank} step {step}")
            assert_same(expected["model"]["shared"], loaded["model"]["shared"])
            assert_same(expected["model"]["rows"].data, loaded["model"]["rows"][rank * 4 : rank * 4 + 4])
    return out


def test_an_unchanged_layout_reuses_the_plan_and_a_changed_one_replans(tmp_path):
    results = run_ranks(3, three_saves, str(tmp_path / "ckpts"))
    plans = results[0]["plans"]
    assert plans == [1, 1, 2], "planned at the first save, reused at the second, planned again at the third"
    for rank, outcome in results.items():
        first, cached, changed = outcome["traffic"]
        assert first[0] == 4 and changed[0] == 4, "briefs, a request for descriptions, descriptions, assignments"
        assert cached[0] == 2, "steady state: one gather of briefs and one scatter of assignments"
        if rank:
            sent, received = cached[1], cached[2]
            assert sent < 700 and received < 400, (rank, cached)  # digests and a key: no descriptions
            assert first[2] > 2 * received, "the first save sent this rank its RankPlan"
            assert outcome["whole_plan_held"] is False  # only the coordinator's book holds the plan
    assert results[0]["traffic"][1][2] < 3 * 700


def stall_one_rank(rank: int, world: int, root: str) -> dict[str, object]:
    with ckptd.Checkpointer(root, dist_timeout=3) as ckpt:
        if rank == 2:
            time.sleep(8)  # alive, but late for the save
        started = time.monotonic()
        with pytest.raises(DistributedSaveError) as info:
            ckpt.save(1, {"model": {"w": torch.ones(4)}})
        elapsed = time.monotonic() - started
        assert ckpt.steps() == []
    dist.barrier()  # rank 0 hosts the store: it stays until the late rank has read the decision
    return {"ranks": info.value.ranks, "message": str(info.value), "elapsed": elapsed}


def test_a_stalled_rank_is_named_within_the_timeout_and_nobody_waits_forever(tmp_path):
    results = run_ranks(3, stall_one_rank, str(tmp_path / "ckpts"), timeout=120)
    for rank in (0, 1):
        assert results[rank]["ranks"] == [2], results[rank]
        assert "did not arrive within 3s" in results[rank]["message"]
        assert results[rank]["elapsed"] < 8, "detected within dist_timeout, not the process group's timeout"
    assert results[2]["ranks"] == [2] and results[2]["elapsed"] < 2, "the late rank reads the decision at once"


def count_store_keys(rank: int, world: int, root: str) -> dict[str, object]:
    store = dist.distributed_c10d._get_default_store()
    with ckptd.Checkpointer(root, dist_timeout=60) as ckpt:
        dist.barrier()
        before = store.num_keys()
        ckpt.save(1, {"model": {"w": torch.ones(64) * rank}}, sharing={"model": "per_rank"})
        ckpt.save(2, {"model": {"w": torch.ones(64) * rank}}, sharing={"model": "per_rank"})
        dist.barrier()
        after = store.num_keys()
        keys = sorted(ckpt._saver.dist.traffic.keys)
        left = [k for k in keys if store.check([k])]
    return {"before": before, "after": after, "keys": keys, "left": left}


def test_store_keys_per_save_are_bounded_and_deleted(tmp_path):
    world = 3
    results = run_ranks(world, count_store_keys, str(tmp_path / "ckpts"))
    created = set().union(*(set(r["keys"]) for r in results.values()))
    # per save: 4 arrival keys, ready, commit, one report per rank, one ack per other rank
    assert len(created) == 2 * (4 + 2 + world + (world - 1)), sorted(created)
    for rank, outcome in results.items():
        assert outcome["left"] == [], (rank, outcome["left"])
    assert results[0]["after"] <= results[0]["before"], "the saves left no key in the store"
