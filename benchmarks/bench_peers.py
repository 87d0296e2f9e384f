#!/usr/bin/env python
"""ckptd side by side with the libraries it replaces, on one transformer-shaped state.

The peers (``peers.py``): ckptd, DCP ``async_save`` (thread; process; process with a reused
``DefaultStager``), ``torch_checkpointing``, torchsnapshot, ByteCheckpoint, ``torch.save`` of a
clone on a thread and safetensors ``save_file``.  A peer that cannot run here is a row that says
why.  For each peer, measured in one run:

* **Rounds** (``--rounds``, the peers' order rotating from round to round, each save paired with
  its own floors measured right before it): *blocking* (until the library lets the caller change
  the tensors) against the copy floor, *committed* (until the library says the checkpoint is
  written) against the write floor (``floors.py``: the best of O_DIRECT and buffered writes, with
  fsync), the ratios being medians of the per-pair ratios with a bootstrap interval; a *load* of
  that checkpoint into the live tensors after its files left the page cache; then a second save
  with training steps (``bench_interference.MatmulLoop``) running until it commits: the steps'
  median against steps without a save just before, and that commit's time.
* **First save** and **memory**, in a fresh process per peer: the cold floor (``copy_`` into
  freshly mapped memory + the write floor), then the library's constructor and first save timed
  together; then a second save while a sampler reads the PSS of the process and its children
  (peak extra memory over the PSS before the library was built), every tensor changed (``add_``)
  the moment ``save`` returned, and a load checked bit for bit against the state as it was saved.
* **fsync**: one save of a small state under ``strace -f`` counting ``fsync``, ``fdatasync``,
  ``sync_file_range``, ``syncfs`` and ``msync`` calls (a library that never calls them leaves
  its "committed" checkpoint in the page cache: a power loss can take it).

Example::

    python benchmarks/bench_peers.py --quick
    python benchmarks/bench_peers.py --gib 1 --rounds 4 --json peers.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_memory import PeakSampler, tree_pss
from bench_save import (
    GIB,
    MIB,
    Floors,
    State,
    bootstrap_interval,
    build_state,
    machine_info,
    markdown_table,
    state_bytes,
)
from floors import CopyFloor, WriteFloor, cold_copy, drop_from_page_cache, settle_machine
from peers import PEERS, Peer, PeerUnavailable, files_under, import_modules

SAMPLE_SECONDS = 0.01
BASELINE_STEPS = 10
SYNC_CALLS = ("fsync", "fdatasync", "sync_file_range", "syncfs", "msync")
PROBE_GIB = 1 / 16  # the state saved under strace


# ---- one peer's results -------------------------------------------------------------------------


@dataclass
class PeerResult:
    name: str
    note: str = ""
    unavailable: str = ""
    blocking: list[float] = field(default_factory=list)
    committed: list[float] = field(default_factory=list)
    copy_floor: list[float] = field(default_factory=list)
    write_floor: list[float] = field(default_factory=list)
    load: list[float] = field(default_factory=list)
    steps_before: list[float] = field(default_factory=list)
    steps_during: list[float] = field(default_factory=list)
    commit_with_steps: list[float] = field(default_factory=list)
    first: dict[str, Any] = field(default_factory=dict)
    sync_calls: dict[str, int] | None = None
    sync_note: str = ""
    errors: list[str] = field(default_factory=list)

    def ratios(self, times: list[float], floors: list[float]) -> list[float]:
        return [t / f for t, f in zip(times, floors, strict=True)]

    @property
    def slowdown(self) -> float | None:
        if not self.steps_during:
            return None
        return statistics.median(self.steps_during) / statistics.median(self.steps_before)


# ---- the rounds (this process) ----------------------------------------------------------------


def timed_save(peer: Peer, step: int, settle: float) -> tuple[float, float]:
    settle_machine(settle)
    started = time.perf_counter()
    pending = peer.save(step)
    blocking = time.perf_counter() - started
    pending.wait()
    return blocking, time.perf_counter() - started


def timed_load(peer: Peer, step: int, settle: float) -> float:
    drop_from_page_cache(files_under(peer.path(step)))
    settle_machine(settle)
    started = time.perf_counter()
    peer.load_into(step)
    return time.perf_counter() - started


def save_under_steps(peer: Peer, step: int, loop: Any, result: PeerResult) -> None:
    """Steps without a save, then one save with steps run until it commits.  The loop has no torch
    optimizer and calls no ``mark_step``: ckptd's adaptive throttle sees no steps here."""
    result.steps_before += [loop.step() for _ in range(BASELINE_STEPS)]
    started = time.perf_counter()
    pending = peer.save(step)
    steps = []
    while not pending.done():
        steps.append(loop.step())
    pending.wait()
    result.commit_with_steps.append(time.perf_counter() - started)
    result.steps_during += steps


def run_rounds(peers: list[Peer], results: dict[str, PeerResult], state: State, args: argparse.Namespace) -> None:
    from bench_interference import MatmulLoop

    floors = Floors(state, args.dir, settle=args.settle)
    loop = MatmulLoop(args.step_ms / 1e3)
    print(f"step loop: {loop.describe()}", flush=True)
    try:
        for round_ in range(args.rounds):
            shift = round_ % len(peers)
            for peer in [*peers[shift:], *peers[:shift]]:
                result = results[peer.name]
                step = 2 * round_ + 1
                try:
                    measured = floors.measure()
                    blocking, committed = timed_save(peer, step, args.settle)
                    load = timed_load(peer, step, args.settle)
                    peer.remove(step)
                    save_under_steps(peer, step + 1, loop, result)
                    peer.remove(step + 1)
                except Exception as e:  # noqa: BLE001 - a failing peer is a row that says so
                    traceback.print_exc()
                    result.errors.append(f"round {round_}: {type(e).__name__}: {e}")
                    continue
                result.copy_floor.append(measured["copy"]["floor"])
                result.write_floor.append(measured["write"]["floor"])
                result.blocking.append(blocking)
                result.committed.append(committed)
                result.load.append(load)
                print(
                    f"  round {round_} {peer.name}: blocking {blocking:.3f} s, committed {committed:.3f} s, "
                    f"load {load:.3f} s; under steps: committed {result.commit_with_steps[-1]:.3f} s",
                    flush=True,
                )
    finally:
        floors.close()


# ---- first save, memory and exactness (a fresh process per peer) ------------------------------


def cold_floor(state: State, directory: str) -> dict[str, float]:
    """``floors.cold_copy`` of the state, then the write floor of its bytes: the cold floor."""
    tensors = [t for c in state.values() for t in c.values()]
    copy = cold_copy(tensors, settle=1.0)
    buffers = CopyFloor(tensors)
    try:
        writes = WriteFloor(buffers.anonymous, buffers.nbytes, directory, settle=1.0).measure()
    finally:
        buffers.close()
    return {"cold_copy": copy, "write_floor": writes["floor"], "cold_floor": copy + writes["floor"]}


def mutate(state: State) -> None:
    for tensors in state.values():
        for tensor in tensors.values():
            tensor.add_(1)


def first_save_child(name: str, gib: float, directory: str) -> dict[str, Any]:
    """In a fresh process: the cold floor, the first save, peak memory and exactness."""
    peer_class = PEERS[name]
    import_modules(peer_class)
    state = build_state(gib)
    out: dict[str, Any] = cold_floor(state, directory)
    peer = peer_class(state, os.path.join(directory, "peer"))
    peer.environment()
    base = tree_pss()
    try:
        settle_machine(1.0)
        started = time.perf_counter()
        peer.open()
        pending = peer.save(1)
        out["first_blocking"] = time.perf_counter() - started
        pending.wait()
        out["first_committed"] = time.perf_counter() - started
        peer.remove(1)
        expected = {c: {k: t.clone() for k, t in tensors.items()} for c, tensors in state.items()}
        base += sum(t.numel() * t.element_size() for c in expected.values() for t in c.values())
        settle_machine(1.0)
        with PeakSampler(lambda: (tree_pss(),), SAMPLE_SECONDS) as sampler:
            pending = peer.save(2)
            mutate(state)  # the moment the library lets the caller change the tensors
            pending.wait()
        out["peak_extra_pss"] = sampler.peak - base
        peer.load_into(2)
        differing = [
            f"{c}.{k}" for c, tensors in state.items() for k, t in tensors.items() if not torch.equal(t, expected[c][k])
        ]
        out["exact"] = not differing
        out["differing"] = differing[:5]
        out["differing_count"] = len(differing)
        peer.remove(2)
    finally:
        peer.close()
    return out


def run_child(args: argparse.Namespace, mode: str, name: str, wrapper: list[str] | None = None) -> dict[str, Any]:
    """Run this script as ``--MODE NAME`` in a new process; its last stdout line is JSON."""
    directory = tempfile.mkdtemp(prefix=f"{mode}-", dir=args.dir)
    command = [sys.executable, os.path.abspath(__file__), f"--{mode}", name, "--gib", str(args.gib), "--dir", directory]
    try:
        done = subprocess.run([*(wrapper or []), *command], capture_output=True, text=True, timeout=1200)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {done.returncode}: " + " | ".join(tail)}
    payload: dict[str, Any] = json.loads(lines[-1])
    payload["stderr"] = done.stderr
    return payload


# ---- fsync calls (a small save under strace) ---------------------------------------------------


def probe_child(name: str, gib: float, directory: str) -> dict[str, Any]:
    peer_class = PEERS[name]
    import_modules(peer_class)
    peer = peer_class(build_state(gib), os.path.join(directory, "peer"))
    peer.environment()
    try:
        peer.open()
        peer.save(1).wait()
        files = list(files_under(peer.path(1)))
    finally:
        peer.close()
    return {"files": len(files)}


def count_sync_calls(args: argparse.Namespace, name: str) -> tuple[dict[str, int] | None, str]:
    strace = shutil.which("strace")
    if strace is None:
        return None, "strace is not installed"
    with tempfile.NamedTemporaryFile("r", suffix=".strace", dir=args.dir) as report:
        wrapper = [strace, "-f", "-c", "-o", report.name, "-e", "trace=" + ",".join(SYNC_CALLS)]
        saved_gib, args.gib = args.gib, PROBE_GIB
        try:
            payload = run_child(args, "probe-fsync", name, wrapper)
        finally:
            args.gib = saved_gib
        if "error" in payload:
            return None, payload["error"]
        counts = {call: 0 for call in SYNC_CALLS}
        for line in report.read().splitlines():
            fields = line.split()
            if fields and fields[-1] in counts:
                numbers = [f for f in fields[:-1] if re.fullmatch(r"[0-9.]+", f)]
                counts[fields[-1]] = int(numbers[3]) if len(numbers) >= 4 else int(numbers[-1])
        return counts, f"{payload['files']} files"


# ---- report ------------------------------------------------------------------------------------


def median_with_interval(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) < 3:
        return f"{statistics.median(values):.2f}"
    low, high = bootstrap_interval(values)
    return f"{statistics.median(values):.2f} ({low:.2f}-{high:.2f})"


def seconds(values: list[float]) -> str:
    return f"{statistics.median(values):.3f}" if values else "-"


def table(results: list[PeerResult]) -> str:
    header = [
        "peer",
        "blocking s",
        "x copy floor",
        "committed s",
        "x write floor",
        "sync calls",
        "first save s (cold floor)",
        "step slowdown, steps (commit s)",
        "peak extra PSS MiB",
        "load s",
        "exact after mutation",
    ]
    lines = []
    for r in results:
        if r.unavailable:
            lines.append([r.name, f"cannot run here: {r.unavailable}", *[""] * (len(header) - 2)])
            continue
        sync = "?" if r.sync_calls is None else str(sum(r.sync_calls.values()))
        first = r.first
        first_text = (
            f"{first['first_committed']:.2f} ({first['cold_floor']:.2f})" if "first_committed" in first else "-"
        )
        slowdown = r.slowdown
        slow_text = (
            f"{slowdown:.2f}x, {len(r.steps_during)} steps ({seconds(r.commit_with_steps)})"
            if slowdown is not None
            else f"blocks the loop ({seconds(r.commit_with_steps)})"
            if r.commit_with_steps
            else "-"
        )
        exact = first.get("exact")
        lines.append(
            [
                r.name,
                seconds(r.blocking),
                median_with_interval(r.ratios(r.blocking, r.copy_floor)),
                seconds(r.committed),
                median_with_interval(r.ratios(r.committed, r.write_floor)),
                sync,
                first_text,
                slow_text,
                f"{first['peak_extra_pss'] / MIB:.0f}" if "peak_extra_pss" in first else "-",
                seconds(r.load),
                "-" if exact is None else "yes" if exact else f"NO ({first['differing_count']} tensors)",
            ]
        )
    return markdown_table(header, lines, left_aligned={0})


# ---- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="size of the training state (default 1)")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds of every peer (default 4)")
    parser.add_argument("--quick", action="store_true", help="0.25 GiB, 3 rounds")
    parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated names (default: all)")
    parser.add_argument("--settle", type=float, default=0.5, help="seconds of settling before timed work")
    parser.add_argument("--step-ms", type=float, default=50.0, help="training step of the interference loop")
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    parser.add_argument("--json", default=None, help="write every measurement here")
    parser.add_argument("--skip-first", action="store_true", help="no fresh-process first save / memory run")
    parser.add_argument("--skip-sync-count", action="store_true", help="no strace run")
    parser.add_argument("--first-save", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--probe-fsync", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.gib, args.rounds = 0.25, 3
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.first_save or args.probe_fsync:
        child = first_save_child if args.first_save else probe_child
        print(json.dumps(child(args.first_save or args.probe_fsync, args.gib, args.dir)), flush=True)
        return 0
    names = [n.strip() for n in args.peers.split(",") if n.strip()]
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        print(f"bench_peers: unknown peers {unknown}; known: {list(PEERS)}", file=sys.stderr)
        return 2
    own_dir = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="ckptd-peers-")
    os.makedirs(args.dir, exist_ok=True)
    state = build_state(args.gib)
    print(f"state: {state_bytes(state) / GIB:.3f} GiB, {sum(len(c) for c in state.values())} tensors", flush=True)
    results = {n: PeerResult(n, note=PEERS[n].note) for n in names}
    opened: list[Peer] = []
    try:
        for name in names:
            peer = PEERS[name](state, os.path.join(args.dir, re.sub(r"[^a-z0-9]+", "-", name.lower())))
            try:
                import_modules(PEERS[name])
                peer.environment()
                peer.open()
                peer.save(0).wait()  # untimed: processes spawned, buffers faulted in
                peer.remove(0)
            except PeerUnavailable as e:
                results[name].unavailable = str(e)
                peer.close()
                continue
            except Exception as e:  # noqa: BLE001 - the row says why
                traceback.print_exc()
                results[name].unavailable = f"{type(e).__name__}: {e}"
                peer.close()
                continue
            opened.append(peer)
        if opened:
            run_rounds(opened, results, state, args)
    finally:
        for peer in reversed(opened):
            peer.close()
    del state
    for name, result in results.items():
        if result.unavailable:
            continue
        if not args.skip_first:
            result.first = run_child(args, "first-save", name)
            print(f"  first save {name}: {json.dumps({k: v for k, v in result.first.items() if k != 'stderr'})}")
        if not args.skip_sync_count:
            result.sync_calls, result.sync_note = count_sync_calls(args, name)
            print(f"  sync calls {name}: {result.sync_calls} ({result.sync_note})", flush=True)
    ordered = [results[n] for n in names]
    print()
    print(table(ordered))
    print()
    for r in ordered:
        print(f"- {r.name}: {r.note}" + (f"; errors: {r.errors}" if r.errors else ""))
    if args.json:
        payload = {"machine": machine_info(args.dir), "args": vars(args), "peers": [asdict(r) for r in ordered]}
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
    if own_dir:
        shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
