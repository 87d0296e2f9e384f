"""Peer replicas on real gloo ranks: each rank's snapshot in its "host's" memory and a replica in a
peer's; a job that lost a host restores the lost rank from its peer, bit for bit.

Hosts are simulated on this machine: each rank gets a held-memory base of its own
(``CKPTD_HELD_DIR``) and a node name (``CKPTD_NODE``); losing a host is SIGKILL to its processes
(trainer, writer, keepers) and the removal of its memory."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from typing import Any

import pytest
import torch
from conftest import assert_same, pid_alive, wait_for
from distributed import run_ranks

import ckptd
from ckptd.replicas import PeerSnapshots

pytestmark = [pytest.mark.multiprocess, pytest.mark.distributed]

NAME = "job"


def be_host(base: str, rank: int) -> str:
    """Make this process rank ``rank``'s simulated host: its own held memory and node name."""
    host = os.path.join(base, f"host-{rank}")
    os.makedirs(host, exist_ok=True)
    os.environ["CKPTD_HELD_DIR"] = host
    os.environ["CKPTD_NODE"] = f"node-{rank}"
    return host


def rank_state(rank: int, step: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(100 * rank + step)
    model = torch.nn.Linear(6, 5)
    with torch.no_grad():
        model.weight.copy_(torch.randn(5, 6, generator=generator))
        model.bias.copy_(torch.randn(5, generator=generator))
    return {
        "model": model,
        "rng": {"gen": torch.randint(0, 255, (16,), dtype=torch.uint8, generator=generator)},
        "progress": {"step": step, "rank": rank},
    }


def blank_targets() -> dict[str, Any]:
    return {
        "model": torch.nn.Linear(6, 5),
        "rng": {"gen": torch.zeros(16, dtype=torch.uint8)},
        "progress": {"step": -1, "rank": -1},
    }


def save_steps(rank: int, world: int, base: str, steps: list[int], fallback: str | None, die: bool) -> dict[str, Any]:
    """Save ``steps`` with replicas (and to ``fallback``); with ``die``, the trainer is then
    SIGKILLed (its writer dies with it) and its report is a file."""
    be_host(base, rank)
    disk = ckptd.Checkpointer(fallback, dist_timeout=60) if fallback else None
    snapshots = PeerSnapshots(NAME, replicas=1, hold_after_exit=120, timeout=60)
    for step in steps:
        state = rank_state(rank, step)
        snapshots.save(step, state)
        if disk is not None:
            sharing = {"model": "per_rank", "progress": "per_rank"}
            disk.save(step, {"model": state["model"], "progress": state["progress"]}, sharing=sharing)
    report = {
        "held": snapshots.held_bytes(),
        "keepers": [lease.keeper_pid for lease in snapshots._leases] + [snapshots.checkpointer._lease.keeper_pid],
        "writer": snapshots.checkpointer.writer_pid,
        "sent": snapshots.stats.steps_sent,
    }
    if die:
        with open(os.path.join(base, f"rank-{rank}.json"), "w") as f:
            json.dump(report, f)
        os.kill(os.getpid(), signal.SIGKILL)
    snapshots.close()
    if disk is not None:
        disk.close()
    return report


def killed_after_saving(base: str, steps: list[int]) -> dict[int, dict[str, Any]]:
    """Both ranks save ``steps`` and are SIGKILLed; their reports, once their writers are gone."""
    run_ranks(2, save_steps, base, steps, None, True, expect_dead={0, 1})
    reports = {}
    for rank in (0, 1):
        with open(os.path.join(base, f"rank-{rank}.json")) as f:
            reports[rank] = json.load(f)
        wait_for(lambda pid=reports[rank]["writer"]: not pid_alive(pid), timeout=30)
    return reports


def restore(rank: int, world: int, base: str, fallback: str | None, hold: float) -> dict[str, Any]:
    be_host(base, rank)
    disk = ckptd.Checkpointer(fallback, dist_timeout=60) if fallback else None
    with PeerSnapshots(NAME, replicas=1, hold_after_exit=hold, timeout=60) as snapshots:
        targets = blank_targets()
        result = snapshots.restore(into=targets if disk is None else None, fallback=disk)
        own = snapshots.checkpointer.steps()
        keepers = [lease.keeper_pid for lease in snapshots._leases] + [snapshots.checkpointer._lease.keeper_pid]
    if disk is not None:
        disk.close()
    if result is None:
        return {"result": None, "keepers": keepers}
    if result.state is not None:  # from the fallback: the tensors it holds
        targets = {"model": {k: v for k, v in result.state["model"].items()}, "progress": result.state["progress"]}
    else:
        targets = {"model": targets["model"].state_dict(), "rng": targets["rng"], "progress": targets["progress"]}
    return {
        "step": result.step,
        "source": result.source,
        "peer": result.peer,
        "state": targets,
        "own": own,
        "keepers": keepers,
    }


def committed_bytes(root: str) -> int:
    """Bytes of the committed checkpoints under ``root``."""
    return sum(
        os.path.getsize(os.path.join(root, name, f))
        for name in os.listdir(root)
        if name.startswith("checkpoint-")
        for f in os.listdir(os.path.join(root, name))
    )


def lose_host(base: str, rank: int, keepers: list[int]) -> None:
    """The host of ``rank`` is gone: its keepers are killed, its memory with it."""
    for pid in keepers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in keepers:
        wait_for(lambda pid=pid: not pid_alive(pid), timeout=30)
    shutil.rmtree(os.path.join(base, f"host-{rank}"))


def finish(outcomes: dict[int, dict[str, Any]]) -> None:
    """Wait for the keepers of the last run (hold 0.5 s) to release the memory and exit."""
    for outcome in outcomes.values():
        for pid in outcome["keepers"]:
            wait_for(lambda pid=pid: not pid_alive(pid), timeout=60)


def expected(rank: int, step: int) -> dict[str, Any]:
    state = rank_state(rank, step)
    return {"model": state["model"].state_dict(), "rng": state["rng"], "progress": state["progress"]}


def test_a_lost_host_s_rank_restores_from_its_peer_s_replica_bit_for_bit(tmp_path):
    base = str(tmp_path)
    saved = killed_after_saving(base, [1, 2, 3])
    for rank in (0, 1):
        assert saved[rank]["sent"] == [1, 2, 3]
        root = os.path.join(base, f"host-{rank}", f"ckptd-{os.getuid()}")
        peer = 1 - rank
        listed = sorted(os.listdir(os.path.join(root, f"{NAME}.replica-{peer:05d}")))
        assert listed == [".ckptd-spare", "checkpoint-2", "checkpoint-3"], "step 1's replica is the spare"
        # each host holds its own two snapshots and its peer's two: the same bytes (and beside
        # each, a spare: the dropped step 1, whose pages the next save or replica reuses)
        replicas = committed_bytes(os.path.join(root, f"{NAME}.replica-{peer:05d}"))
        own = committed_bytes(os.path.join(base, f"host-{peer}", f"ckptd-{os.getuid()}", f"{NAME}.rank-{peer:05d}"))
        assert replicas == own > 0
        assert saved[rank]["held"]["replicas"] > replicas and saved[rank]["held"]["own"] > own  # + the spares
    lose_host(base, 1, saved[1]["keepers"])

    restored = run_ranks(2, restore, base, None, 0.5)
    finish(restored)
    assert (restored[0]["step"], restored[0]["source"], restored[0]["peer"]) == (3, "memory", None)
    assert (restored[1]["step"], restored[1]["source"], restored[1]["peer"]) == (3, "replica", 0)
    for rank in (0, 1):
        assert_same(expected(rank, 3), restored[rank]["state"], f"rank {rank}")
    assert restored[1]["own"] == [3], "the replica sent back is rank 1's own snapshot again"


def test_a_damaged_replica_is_refused_and_an_older_step_every_rank_has_is_restored(tmp_path):
    base = str(tmp_path)
    saved = run_ranks(2, save_steps, base, [1, 2, 3], None, False)
    replica = os.path.join(base, "host-0", f"ckptd-{os.getuid()}", f"{NAME}.replica-00001", "checkpoint-3")
    shard = next(n for n in os.listdir(replica) if n.endswith(".safetensors"))
    with open(os.path.join(replica, shard), "r+b") as f:  # one bit of a tensor's bytes flipped
        f.seek(os.path.getsize(f.name) - 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    lose_host(base, 1, saved[1]["keepers"])

    restored = run_ranks(2, restore, base, None, 0.5)
    finish(restored)
    assert (restored[1]["step"], restored[1]["source"]) == (2, "replica"), "step 3's copy failed its CRC32C"
    assert (restored[0]["step"], restored[0]["source"]) == (2, "memory"), "every rank goes back to the same step"
    for rank in (0, 1):
        assert_same(expected(rank, 2), restored[rank]["state"], f"rank {rank}")
    assert 3 not in restored[1]["own"], "the damaged copy was never published"


def test_with_both_copies_gone_the_fallback_checkpointer_restores(tmp_path):
    base, disk = str(tmp_path / "hosts"), str(tmp_path / "disk")
    saved = run_ranks(2, save_steps, base, [1, 2], disk, False)
    for rank in (0, 1):
        lose_host(base, rank, saved[rank]["keepers"])

    restored = run_ranks(2, restore, base, disk, 0.5)
    finish(restored)
    for rank in (0, 1):
        assert (restored[rank]["step"], restored[rank]["source"]) == (2, "fallback")
        want = expected(rank, 2)
        assert_same(want["model"], restored[rank]["state"]["model"], f"rank {rank}")
        assert restored[rank]["state"]["progress"] == {"step": 2, "rank": rank}


def one_node(rank: int, world: int, base: str) -> str:
    be_host(base, rank)
    os.environ["CKPTD_NODE"] = "same-host"
    try:
        PeerSnapshots(NAME, replicas=1)
    except ckptd.errors.ConfigError as e:
        return str(e)
    return "accepted"


def test_replicas_need_ranks_on_another_node(tmp_path):
    messages = run_ranks(2, one_node, str(tmp_path))
    assert all("at least 2 nodes" in m and "same-host" in m for m in messages.values()), json.dumps(messages)


def dtensor_job(rank: int, world: int, base: str, phase: str) -> dict[str, Any]:
    """Phase ``save``: a row-sharded DTensor (and an optimizer over it) saved with replicas;
    phase ``restore``: restored into a fresh DTensor and optimizer of the same mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    be_host(base, rank)
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4) if phase == "save" else torch.zeros(6, 4)
    weight = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))
    optimizer = torch.optim.SGD([weight], lr=0.5, momentum=0.9)
    if phase == "save":
        weight.grad = distribute_tensor(torch.ones(6, 4), mesh, [Shard(0)])
        optimizer.step()
    hold = 120 if phase == "save" else 0.5
    with PeerSnapshots(NAME, replicas=1, hold_after_exit=hold, timeout=60) as snapshots:
        keepers = [lease.keeper_pid for lease in snapshots._leases] + [snapshots.checkpointer._lease.keeper_pid]
        if phase == "save":
            snapshots.save(4, {"model": {"weight": weight}, "optimizer": optimizer})
            source = None
        else:
            source = snapshots.restore(into={"model": {"weight": weight}, "optimizer": optimizer}).source
    momentum = optimizer.state[weight]["momentum_buffer"]
    return {"keepers": keepers, "source": source, "weight": weight.full_tensor(), "momentum": momentum.full_tensor()}


def test_a_dtensor_and_its_optimizer_restore_from_a_replica_as_dtensors(tmp_path):
    base = str(tmp_path)
    saved = run_ranks(2, dtensor_job, base, "save")
    lose_host(base, 1, saved[1]["keepers"])
    restored = run_ranks(2, dtensor_job, base, "restore")
    finish(restored)
    assert [restored[r]["source"] for r in (0, 1)] == ["memory", "replica"]
    for rank in (0, 1):
        assert_same(saved[0]["weight"], restored[rank]["weight"], f"rank {rank} weight")
        assert_same(saved[0]["momentum"], restored[rank]["momentum"], f"rank {rank} momentum")


def tiered_job(rank: int, world: int, base: str, phase: str) -> dict[str, Any]:
    """Snapshots in memory with a per-rank local tier ("node-local disk") every step."""
    be_host(base, rank)
    tiers = [ckptd.Tier(os.path.join(base, "nvme", "{rank}"), every=1, keep_last=2)]
    hold = 120 if phase == "save" else 0.5
    with PeerSnapshots(NAME, replicas=1, hold_after_exit=hold, timeout=60, tiers=tiers) as snapshots:
        keepers = [lease.keeper_pid for lease in snapshots._leases] + [snapshots.checkpointer._lease.keeper_pid]
        if phase == "save":
            for step in (1, 2):
                snapshots.save(step, rank_state(rank, step))
            snapshots.checkpointer.wait_promotions()
            return {"keepers": keepers}
        targets = blank_targets()
        result = snapshots.restore(into=targets)
    state = {"model": targets["model"].state_dict(), "rng": targets["rng"], "progress": targets["progress"]}
    return {"keepers": keepers, "result": result, "state": state}


def test_a_rank_whose_memory_is_gone_but_whose_local_tier_is_not_restores_from_that_tier(tmp_path):
    base = str(tmp_path)
    saved = run_ranks(2, tiered_job, base, "save")
    assert sorted(os.listdir(os.path.join(base, "nvme", "00001"))) == ["checkpoint-1", "checkpoint-2"]
    lose_host(base, 1, saved[1]["keepers"])  # the host rebooted: memory gone, its disk kept
    restored = run_ranks(2, tiered_job, base, "restore")
    finish(restored)
    first, second = restored[0]["result"], restored[1]["result"]
    assert (first.step, first.source, first.tier) == (2, "memory", 0)
    assert (second.step, second.source, second.tier, second.peer) == (2, "tier", 1, None)
    assert {"list", "fetch", "load", "agree", "assign"} <= set(second.timings)
    for rank in (0, 1):
        assert_same(expected(rank, 2), restored[rank]["state"], f"rank {rank}")


def test_a_tier_root_without_rank_is_refused():
    from ckptd.replicas.snapshots import rank_tiers

    with pytest.raises(ckptd.errors.ConfigError, match="must name"):
        rank_tiers([ckptd.Tier("/nvme/run")], 0)
    assert rank_tiers([ckptd.Tier("/nvme/run/{rank}")], 3)[0].root == "/nvme/run/00003"


def peer_dies(rank: int, world: int, base: str) -> dict[str, Any]:
    """Both ranks replicate step 1; rank 1 then dies (SIGKILL); rank 0 saves step 2."""
    be_host(base, rank)
    snapshots = PeerSnapshots(NAME, replicas=1, hold_after_exit=0.5, timeout=20)
    snapshots.save(1, rank_state(rank, 1))
    if rank == 1:
        with open(os.path.join(base, "rank-1.json"), "w") as f:
            keepers = [lease.keeper_pid for lease in snapshots._leases] + [snapshots.checkpointer._lease.keeper_pid]
            json.dump({"writer": snapshots.checkpointer.writer_pid, "keepers": keepers}, f)
        os.kill(os.getpid(), signal.SIGKILL)
    request = snapshots.async_save(2, rank_state(rank, 2))
    committed = request.result().step
    try:
        snapshots.wait(timeout=60)
        error = None
    except ckptd.errors.ReplicationError as e:
        error = str(e)
    own = snapshots.checkpointer.steps()
    loaded = snapshots.checkpointer.load(2)
    keepers = [lease.keeper_pid for lease in snapshots._leases] + [snapshots.checkpointer._lease.keeper_pid]
    snapshots.close()
    return {"committed": committed, "error": error, "own": own, "loaded": loaded, "keepers": keepers}


def test_a_peer_that_dies_fails_the_replication_with_our_error_and_the_own_snapshot_stays(tmp_path):
    base = str(tmp_path)
    outcome = run_ranks(2, peer_dies, base, expect_dead={1})[0]
    with open(os.path.join(base, "rank-1.json")) as f:
        dead = json.load(f)
    wait_for(lambda: not pid_alive(dead["writer"]), timeout=30)
    assert outcome["committed"] == 2
    assert outcome["error"] is not None and "step 2" in outcome["error"], outcome["error"]
    assert outcome["own"] == [1, 2], "the rank's own snapshot of step 2 is committed all the same"
    assert_same(expected(0, 2)["rng"], outcome["loaded"]["rng"])
    finish({0: outcome, 1: dead})  # the dead rank's memory is released after its 0.5 s hold too


def saves_back_to_back(rank: int, world: int, base: str) -> dict[str, Any]:
    """keep_last=1 and saves queued back to back: each step is dropped (and its pages reused by
    the next save) while its replica may still be on its way."""
    be_host(base, rank)
    generator = torch.Generator().manual_seed(rank)
    with PeerSnapshots(NAME, replicas=1, keep_last=1, hold_after_exit=0.5, timeout=60) as snapshots:
        keepers = [lease.keeper_pid for lease in snapshots._leases] + [snapshots.checkpointer._lease.keeper_pid]
        states = {}
        for step in range(1, 7):
            states[step] = {"model": {"w": torch.randn(4 << 20, generator=generator)}}
            snapshots.async_save(step, states[step])
        try:
            snapshots.wait(timeout=120)
            error = None
        except ckptd.errors.ReplicationError as e:
            error = str(e)
        refused = list(snapshots.stats.refused)
        replica = os.path.join(held_root_dir(), f"{NAME}.replica-{1 - rank:05d}")
        held = sorted(os.listdir(replica))
        shard = "model-00001-of-00001.safetensors"
        spare_inode = os.stat(os.path.join(replica, ".ckptd-spare", shard)).st_ino  # step 5's replica
        snapshots.save(7, {"model": {"w": torch.randn(4 << 20, generator=generator)}})
        reused = os.stat(os.path.join(replica, "checkpoint-7", shard)).st_ino == spare_inode
    return {"keepers": keepers, "error": error, "refused": refused, "held": held, "reused": reused}


def held_root_dir() -> str:
    return os.path.join(os.environ["CKPTD_HELD_DIR"], f"ckptd-{os.getuid()}")


def test_a_step_is_kept_until_its_replica_is_sent_though_retention_would_drop_it(tmp_path):
    outcomes = run_ranks(2, saves_back_to_back, str(tmp_path))
    finish(outcomes)
    for outcome in outcomes.values():
        assert outcome["error"] is None and outcome["refused"] == [], outcome
        assert [n for n in outcome["held"] if n.startswith("checkpoint-")] == ["checkpoint-6"]
        assert outcome["reused"], "the replica of step 7 took the pages of the dropped replica of step 5"


def close_without_waiting_for_a_late_peer(rank: int, world: int, base: str) -> dict[str, Any]:
    """Rank 0 saves, then closes without waiting while rank 1 is late: rank 0's replication thread
    still waits for rank 1's snapshot when close() returns, and receives it afterwards."""
    be_host(base, rank)
    snapshots = PeerSnapshots(NAME, replicas=1, hold_after_exit=0, timeout=60)
    keepers = [lease.keeper_pid for lease in snapshots._leases] + [snapshots.checkpointer._lease.keeper_pid]
    if rank == 1:
        time.sleep(8.0)  # longer than close(wait=False) waits for the replication thread (5 s)
    snapshots.async_save(1, rank_state(rank, 1)).result()
    if rank == 1:
        snapshots.close()
        return {"keepers": keepers, "outlived": False}
    snapshots.close(wait=False)
    outlived = snapshots._thread.is_alive()
    snapshots._thread.join(60)  # rank 1's snapshot arrives, is published, and the thread ends
    return {"keepers": keepers, "outlived": outlived}


def test_a_replica_received_after_close_without_wait_is_held_under_a_lease_and_released(tmp_path):
    # close(wait=False) gives the replication thread 5 s; one still waiting on a late peer writes
    # the replica later.  It must do so under the leases (they go when it ends), or the replica
    # would stay in memory that no keeper ever releases.
    base = str(tmp_path)
    outcomes = run_ranks(2, close_without_waiting_for_a_late_peer, base)
    assert outcomes[0]["outlived"], "the replication thread was still waiting when close() returned"
    finish(outcomes)  # hold 0: the keepers release everything once the leases are gone
    for rank in (0, 1):
        root = os.path.join(base, f"host-{rank}", f"ckptd-{os.getuid()}")
        assert sorted(os.listdir(root)) == [".hold"], f"host {rank} still holds {os.listdir(root)}"
