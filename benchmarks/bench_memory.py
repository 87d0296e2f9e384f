#!/usr/bin/env python
"""Benchmark ckptd's host memory: steady overhead per in-flight save, and growth over many saves.

Two parts, each with its own Checkpointer (default settings, so one in-flight save); the soak
runs first, so its peak RSS is not the big state's:

* **steady**: builds the transformer-shaped state of ``bench_save.py`` (about ``--gib`` GiB),
  reads this process's PSS from ``/proc/self/smaps_rollup``, creates the Checkpointer and runs
  one first save and ``--repeats`` warm saves. After each save it reads the PSS of this process
  and of the writer process (``ckpt.writer_pid``). Extra memory = (PSS of both) - (PSS of this
  process before the Checkpointer existed), divided by the state's bytes. PSS counts a shared
  page once across the processes that map it, so the staging arena (a memfd both processes map)
  counts once. The page cache is not counted.
* **soak**: ``--saves`` saves (default 200) of a small state (``--soak-mib``, default 32 MiB) with
  ``keep_last=2``. Reported at save 10 and at the last save: peak RSS (``VmHWM``) and RSS of both
  processes, their open file descriptors, and the number of entries in ``/dev/shm``; ``/dev/shm``
  is also counted before the Checkpointer and after ``close()``.

Example::

    python benchmarks/bench_memory.py --gib 2 --repeats 3 --json memory.json
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_save import (  # the sibling script, importable once its directory is on the path
    GIB,
    MIB,
    State,
    build_state,
    dump_json,
    free_memory,
    iter_tensors,
    machine_info,
    state_bytes,
    timed_phase,
)

SHM_DIR = "/dev/shm"
SOAK_SHAPE = (512, 512)  # one bf16 weight + two fp32 moments of this shape = 2.5 MiB


# ---- /proc readers -------------------------------------------------------------------------


def smaps_rollup(pid: int | str = "self") -> dict[str, int]:
    """``/proc/<pid>/smaps_rollup`` as ``{field: bytes}`` (``Pss``, ``Pss_Anon``, ``Pss_Shmem``, ...)."""
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return fields


def pss(pid: int | str = "self") -> int:
    """Proportional set size of ``pid`` in bytes (0 once it is gone)."""
    try:
        return smaps_rollup(pid).get("Pss", 0)
    except OSError:
        return 0


def child_pids(pid: int | str = "self") -> list[int]:
    """The direct children of ``pid`` (every thread's), from ``/proc/PID/task/*/children``."""
    base = f"/proc/{pid}/task"
    out: list[int] = []
    try:
        tasks = os.listdir(base)
    except OSError:
        return out
    for task in tasks:
        try:
            with open(os.path.join(base, task, "children")) as f:
                out += [int(p) for p in f.read().split()]
        except OSError:
            continue
    return out


def process_tree(pid: int | str = "self") -> list[int]:
    """``pid``'s descendants (children, their children, ...)."""
    out: list[int] = []
    pending = child_pids(pid)
    while pending:
        child = pending.pop()
        out.append(child)
        pending += child_pids(child)
    return out


def tree_pss() -> int:
    """PSS of this process and every process it started (writer processes, DCP's daemon)."""
    return pss("self") + sum(pss(child) for child in process_tree())


class PeakSampler:
    """The highest sum of ``sample()`` (PSS of some processes), sampled on a thread every
    ``interval`` seconds while the ``with`` block runs; :attr:`parts` is the sample at the peak.

    Reading ``smaps_rollup`` of a large process costs CPU and takes its memory map's lock: keep
    samplers off timed work."""

    def __init__(self, sample: Callable[[], tuple[int, ...]], interval: float) -> None:
        self._sample = sample
        self._interval = interval
        self.peak = 0
        self.parts: tuple[int, ...] = ()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            parts = self._sample()
            if sum(parts) > self.peak:
                self.peak, self.parts = sum(parts), parts
            if self._stop.wait(self._interval):
                return


def status_memory(pid: int | str = "self") -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` (peak RSS) of a process from ``/proc/<pid>/status``, in bytes."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def open_fds(pid: int | str = "self") -> int:
    """Number of open file descriptors of a process."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def shm_entries() -> int:
    """Number of entries in ``/dev/shm`` (named shared-memory segments and semaphores)."""
    return len(os.listdir(SHM_DIR))


def pss_breakdown(pid: int | str) -> dict[str, int]:
    """PSS in total and split into anonymous, shared-memory and file-backed pages, in bytes."""
    rollup = smaps_rollup(pid)
    return {k: rollup.get(k, 0) for k in ("Pss", "Pss_Anon", "Pss_Shmem", "Pss_File", "Rss")}


# ---- steady overhead -----------------------------------------------------------------------


def bench_steady(state: State, bench_dir: str, repeats: int) -> dict[str, Any]:
    """PSS of this process + the writer after each save, minus this process's PSS before."""
    import ckptd

    total = state_bytes(state)
    free_memory()
    before = pss_breakdown("self")
    print(f"  PSS before the Checkpointer: {before['Pss'] / GIB:.3f} GiB", flush=True)
    samples: list[dict[str, Any]] = []
    with ckptd.Checkpointer(os.path.join(bench_dir, "steady")) as ckpt:
        for step in range(repeats + 1):
            result = ckpt.async_save(step, state).result()
            shutil.rmtree(result.path)
            free_memory()
            writer = ckpt.writer_pid
            if writer is None:
                raise RuntimeError("the Checkpointer reports no writer process after a save")
            main, other = pss_breakdown("self"), pss_breakdown(writer)
            extra = main["Pss"] + other["Pss"] - before["Pss"]
            samples.append({"step": step, "first": step == 0, "main": main, "writer": other, "extra": extra})
            print(
                f"  save {step}: PSS main {main['Pss'] / GIB:.3f} GiB (shmem {main['Pss_Shmem'] / GIB:.3f}), "
                f"writer {other['Pss'] / GIB:.3f} GiB (shmem {other['Pss_Shmem'] / GIB:.3f}); "
                f"extra {extra / GIB:.3f} GiB = {extra / total:.3f}x the state",
                flush=True,
            )
    warm = [s["extra"] for s in samples if not s["first"]] or [samples[-1]["extra"]]
    return {
        "state_bytes": total,
        "pss_before": before,
        "samples": samples,
        "extra_last": samples[-1]["extra"],
        "extra_max_warm": max(warm),
        "ratio_last": samples[-1]["extra"] / total,
        "ratio_max_warm": max(warm) / total,
    }


# ---- soak ----------------------------------------------------------------------------------


def small_state(mib: float, seed: int = 1) -> State:
    """A ``{"model", "optimizer"}`` state of about ``mib`` MiB (bf16 weights, fp32 Adam moments)."""
    gen = torch.Generator().manual_seed(seed)
    per_weight = SOAK_SHAPE[0] * SOAK_SHAPE[1] * (2 + 4 + 4)
    model: dict[str, torch.Tensor] = {}
    optimizer: dict[str, torch.Tensor] = {}
    for i in range(max(1, round(mib * MIB / per_weight))):
        name = f"layers.{i}.weight"
        model[name] = torch.randn(SOAK_SHAPE, generator=gen, dtype=torch.bfloat16)
        optimizer[f"state.{name}.exp_avg"] = torch.randn(SOAK_SHAPE, generator=gen)
        optimizer[f"state.{name}.exp_avg_sq"] = torch.rand(SOAK_SHAPE, generator=gen)
    optimizer["step"] = torch.tensor(0, dtype=torch.int64)
    return {"model": model, "optimizer": optimizer}


def snapshot(writer_pid: int) -> dict[str, Any]:
    """RSS, peak RSS and open fds of this process and the writer, and ``/dev/shm`` entries."""
    return {
        "main": {**status_memory("self"), "fds": open_fds("self")},
        "writer": {**status_memory(writer_pid), "fds": open_fds(writer_pid)},
        "shm_entries": shm_entries(),
    }


def bench_soak(bench_dir: str, saves: int, mib: float, checkpoints_at: tuple[int, ...] = (10,)) -> dict[str, Any]:
    """``saves`` saves of a small state with ``keep_last=2``; snapshots at ``checkpoints_at`` and the end."""
    import ckptd

    state = small_state(mib)
    nbytes = state_bytes(state)
    print(f"  soak state: {nbytes / MIB:.1f} MiB, {sum(1 for _ in iter_tensors(state))} tensors", flush=True)
    shm_before = shm_entries()
    snapshots: dict[int, dict[str, Any]] = {}
    started = time.perf_counter()
    ckpt = ckptd.Checkpointer(os.path.join(bench_dir, "soak"), keep_last=2)
    try:
        marks = set(checkpoints_at) | {saves} | set(range(50, saves, 50))
        for step in range(1, saves + 1):
            state["optimizer"]["step"].fill_(step)
            ckpt.async_save(step, state).result()
            if step in marks:
                assert ckpt.writer_pid is not None
                snapshots[step] = snapshot(ckpt.writer_pid)
                main, writer = snapshots[step]["main"], snapshots[step]["writer"]
                print(
                    f"  save {step}: main RSS {main['VmRSS'] / MIB:.1f} MiB (peak {main['VmHWM'] / MIB:.1f}), "
                    f"writer RSS {writer['VmRSS'] / MIB:.1f} MiB (peak {writer['VmHWM'] / MIB:.1f}), "
                    f"fds {main['fds']}/{writer['fds']}, /dev/shm entries {snapshots[step]['shm_entries']}",
                    flush=True,
                )
        kept = len(ckpt.steps())
    finally:
        ckpt.close()
    seconds = time.perf_counter() - started
    shm_after = shm_entries()
    print(f"  {saves} saves in {seconds:.1f} s; /dev/shm entries before {shm_before}, after close {shm_after}")
    return {
        "state_bytes": nbytes,
        "saves": saves,
        "seconds": seconds,
        "checkpoints_kept": kept,
        "shm_before": shm_before,
        "shm_after_close": shm_after,
        "snapshots": {str(k): v for k, v in sorted(snapshots.items())},
        "early": min(checkpoints_at),
    }


# ---- report --------------------------------------------------------------------------------


def format_summary(steady: dict[str, Any], soak: dict[str, Any]) -> str:
    """A two-column Markdown table of both parts' results."""
    early_step, last_step = soak["early"], soak["saves"]
    early, last = soak["snapshots"][str(early_step)], soak["snapshots"][str(last_step)]
    at = f"at save {early_step} / {last_step}"
    rows = [
        ("PSS before the Checkpointer", f"{steady['pss_before']['Pss'] / GIB:.3f} GiB"),
        ("extra PSS after the last warm save", f"{steady['extra_last'] / GIB:.3f} GiB ({steady['ratio_last']:.3f}x)"),
        (
            "extra PSS, max over warm saves",
            f"{steady['extra_max_warm'] / GIB:.3f} GiB ({steady['ratio_max_warm']:.3f}x)",
        ),
    ]
    for proc in ("main", "writer"):
        a, b = early[proc], last[proc]
        rows += [
            (f"{proc} peak RSS {at}", f"{a['VmHWM'] / MIB:.1f} / {b['VmHWM'] / MIB:.1f} MiB"),
            (f"{proc} RSS {at}", f"{a['VmRSS'] / MIB:.1f} / {b['VmRSS'] / MIB:.1f} MiB"),
            (f"{proc} open fds {at}", f"{a['fds']} / {b['fds']}"),
        ]
    rows.append(
        (
            f"/dev/shm entries before / save {early_step} / save {last_step} / after close",
            f"{soak['shm_before']} / {early['shm_entries']} / {last['shm_entries']} / {soak['shm_after_close']}",
        )
    )
    return "\n".join(["| what | value |", "|---|---|", *(f"| {what} | {value} |" for what, value in rows)])


# ---- main ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.0, help="state size of the steady part in GiB (default 2.0)")
    parser.add_argument("--repeats", type=int, default=3, help="warm saves of the steady part (default 3)")
    parser.add_argument("--saves", type=int, default=200, help="saves of the soak part (default 200)")
    parser.add_argument("--soak-mib", type=float, default=32.0, help="state size of the soak part in MiB (default 32)")
    parser.add_argument("--dir", default="/work", help="parent of the fresh benchmark directory (default /work)")
    parser.add_argument("--json", metavar="PATH", help="also write all samples as JSON")
    args = parser.parse_args(argv)
    if args.gib <= 0 or args.repeats < 1 or args.saves < 10 or args.soak_mib <= 0:
        parser.error("--gib and --soak-mib must be > 0, --repeats >= 1, --saves >= 10")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    bench_dir = tempfile.mkdtemp(prefix="ckptd-bench-memory-", dir=args.dir)
    machine = machine_info(bench_dir)
    command = shlex.join([sys.executable, *sys.argv])
    print("command:", command)
    print("machine:", ", ".join(f"{k}={v}" for k, v in machine.items()))
    try:
        # The soak runs first: peak RSS (VmHWM) never goes down, so after the big state it would
        # only show the steady part's peak.
        soak = timed_phase(f"soak: {args.saves} saves", lambda: bench_soak(bench_dir, args.saves, args.soak_mib))
        steady = timed_phase(
            "steady extra memory", lambda: bench_steady(build_state(args.gib), bench_dir, args.repeats)
        )
        sizes = f"steady state {steady['state_bytes'] / GIB:.3f} GiB; soak {soak['state_bytes'] / MIB:.1f} MiB"
        print(f"\n== results: {sizes}")
        print(format_summary(steady, soak))
        if args.json:
            dump_json(args.json, {"command": command, "machine": machine, "steady": steady, "soak": soak})
            print(f"wrote {args.json}")
    finally:
        shutil.rmtree(bench_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
