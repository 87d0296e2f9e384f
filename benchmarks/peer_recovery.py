"""The peer-replica rows of ``bench_recovery.py``: two ranks on gloo, each on a simulated host of
its own (``CKPTD_HELD_DIR``, ``CKPTD_NODE``), save with ``PeerSnapshots(replicas=1)``; both
trainers are SIGKILLed with their process groups (writers included), host 1's keepers are killed
and its memory removed (the host is lost); a new job of two fresh processes restores: rank 0 from
its own memory, rank 1 from rank 0's replica.  Timed from each process's start to its state
restored into live tensors, beside a ``copy_`` of the same bytes (the floor of any restore from
memory)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

RANK = r"""
import json, os, signal, sys, time
began = float(sys.argv[1])
bench, base, phase, port = sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[6]
rank, size_mib = int(sys.argv[5]), int(sys.argv[7])
sys.path.insert(0, bench)
os.environ.update(CKPTD_HELD_DIR=os.path.join(base, f"host-{rank}"), CKPTD_NODE=f"node-{rank}")
os.makedirs(os.environ["CKPTD_HELD_DIR"], exist_ok=True)
import torch, torch.distributed as dist
from ckptd.replicas import PeerSnapshots
from bench_recovery import make_state
dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
state = make_state(size_mib)
if rank:
    state = {k: v + 1 for k, v in state.items()}
snapshots = PeerSnapshots("bench-peers", replicas=1, hold_after_exit=600)
if phase == "save":
    saves = []
    for step in (5, 6, 7):
        started = time.perf_counter()
        request = snapshots.async_save(step, {"model": state})
        blocking = time.perf_counter() - started
        request.result()
        committed = time.perf_counter() - started
        snapshots.wait()
        saves.append({"blocking": blocking, "committed": committed, "replicated": time.perf_counter() - started})
    keepers = [lease.keeper_pid for lease in snapshots._leases] + [snapshots.checkpointer._lease.keeper_pid]
    print(json.dumps({"saves": saves, "keepers": keepers, "held": snapshots.held_bytes()}), flush=True)
    signal.pause()
targets = {k: torch.empty_like(v) for k, v in state.items()}
started = time.time()
result = snapshots.restore(into={"model": targets})
done = time.time()
fresh = {k: torch.empty_like(v) for k, v in state.items()}
floor_started = time.perf_counter()
for key, tensor in fresh.items():
    tensor.copy_(targets[key])
floor = time.perf_counter() - floor_started
exact = all(torch.equal(targets[k], state[k]) for k in state)
snapshots.close()
dist.destroy_process_group()
print(json.dumps({"total": done - began, "load": done - started, "source": result.source, "step": result.step,
                  "copy_floor": floor, "exact": exact, "phases": result.timings}), flush=True)
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _start(base: str, phase: str, rank: int, port: int, size_mib: int) -> subprocess.Popen[bytes]:
    bench = os.path.dirname(os.path.abspath(__file__))
    arguments = [str(time.time()), bench, base, phase, str(rank), str(port), str(size_mib)]
    return subprocess.Popen([sys.executable, "-c", RANK, *arguments], stdout=subprocess.PIPE, start_new_session=True)


def _report(process: subprocess.Popen[bytes]) -> dict[str, Any]:
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line:
        raise SystemExit(f"a peer-replica rank failed (exit {process.wait()})")
    return dict(json.loads(line))


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def peer_replica_rounds(size_mib: int, rounds: int) -> dict[str, list[dict[str, Any]]]:
    """``rounds`` of: save (3 steps), both trainers SIGKILLed, host 1 lost, restore.  The hosts'
    memory is in ``/dev/shm`` (a tmpfs, as ``shm://`` roots are by default)."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for index in range(rounds):
        base = tempfile.mkdtemp(prefix=f"bench-peers-{index}-", dir="/dev/shm")
        port = _free_port()
        savers = [_start(base, "save", rank, port, size_mib) for rank in (0, 1)]
        reports = [_report(p) for p in savers]
        for process in savers:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        rows.setdefault("save with replicas=1", []).extend(s for r in reports for s in r["saves"][1:])
        rows.setdefault("held", []).append(
            {"own": reports[0]["held"]["own"], "replicas": reports[0]["held"]["replicas"]}
        )
        _kill(reports[1]["keepers"])  # host 1 is lost: its keepers and its memory with it
        time.sleep(0.2)
        shutil.rmtree(os.path.join(base, "host-1"))
        port = _free_port()
        restorers = [_start(base, "restore", rank, port, size_mib) for rank in (0, 1)]
        restored = [_report(p) for p in restorers]
        for process in restorers:
            process.wait()
        for rank, outcome in enumerate(restored):
            if not outcome["exact"] or outcome["step"] != 7:
                raise SystemExit(f"rank {rank} restored step {outcome['step']}, exact {outcome['exact']}")
        rows.setdefault("memory, rank 0 (host kept)", []).append(restored[0])
        rows.setdefault("peer replica, rank 1 (host lost)", []).append(restored[1])
        _kill(reports[0]["keepers"])
        shutil.rmtree(base, ignore_errors=True)
    return rows


def print_peer_rows(rows: dict[str, list[dict[str, Any]]]) -> None:
    """The restore rows, the save cost with replicas and the memory each host held."""
    for name in ("memory, rank 0 (host kept)", "peer replica, rank 1 (host lost)"):
        outcomes = rows[name]
        total = statistics.median(o["total"] for o in outcomes)
        load = statistics.median(o["load"] for o in outcomes)
        ratio = statistics.median(o["load"] / o["copy_floor"] for o in outcomes)
        phases = ", ".join(
            f"{phase} {statistics.median(o['phases'][phase] for o in outcomes):.2f}" for phase in outcomes[0]["phases"]
        )
        print(f"  {name:<32} {total:6.2f}s {load:10.2f}s   {outcomes[0]['source']:<7} {ratio:.2f}x   ({phases} s)")
    saves = rows["save with replicas=1"]
    med = {k: statistics.median(s[k] for s in saves) for k in saves[0]}
    held = rows["held"][0]
    print(
        f"  save with replicas=1 (2 ranks, warm): blocking {med['blocking']:.3f}s, committed {med['committed']:.3f}s, "
        f"replicated {med['replicated']:.3f}s; each host held {held['own'] / 2**20:.0f} MiB own + "
        f"{held['replicas'] / 2**20:.0f} MiB of its peer's"
    )
