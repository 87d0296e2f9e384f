#!/usr/bin/env python
"""Benchmark a staging budget: a state larger than ``staging_memory`` streamed through the arena.

Issue 29's first target: a 2 GiB state saved through a 256 MiB budget keeps the extra host
memory at the budget + 64 MiB or less, and commits within 1.15x the write floor; what training
waits for (blocking) is reported as it is.

Per round, interleaved (floor, ckptd, floor, ckptd on this noisy machine):

* **write floor**: the state's bytes from one page-aligned buffer into one new file with
  ``O_DIRECT`` in 16 MiB ``pwrite`` calls, then ``fsync`` (``floors.WriteFloor``): the same
  bytes, the same durability, the fastest method this machine has;
* **ring floor** (budget phase): the same writes from a buffer of the budget's size, over and
  over: what a save bound to that much memory can do at best;
* **ckptd, budget**: ``async_save`` of the state with ``staging_memory=--budget`` (``--staging``
  mode, ``"blocking"`` by default), then ``result()``: blocking (``timings["blocking"]``),
  committed (from the call to the committed manifest);
* **peak extra memory**, after the timed rounds, in one more save (the sampler costs CPU and
  takes the processes' memory-map locks, so no timed save runs with it): the highest PSS of the
  trainer plus its writer process, sampled every 5 ms from ``/proc/<pid>/smaps_rollup``, minus
  the trainer's PSS before its Checkpointer existed (on a GPU host with its CUDA context made
  first, as a trainer's is).  PSS counts the arena, shared by both processes, once; the page
  cache is not counted (ckptd writes with ``O_DIRECT``);
* **ckptd, no budget** (``--compare-unbudgeted``): the same save with the arena as large as the
  state, for reference, in a second phase with its own Checkpointer (one Checkpointer at a time,
  so that one's arena is not counted in the other's memory).

Each save goes to a fresh step; the previous checkpoint is deleted before the pair, untimed.
Reported: medians over rounds, and medians of the per-round ratios committed / write floor with a
95% bootstrap interval; a target passes when the median meets it.

Example::

    python benchmarks/bench_staging_budget.py --gib 2 --budget 256MiB --rounds 8 --compare-unbudgeted --json budget.json
    python benchmarks/bench_staging_budget.py --quick   # 256 MiB through 64 MiB, 3 rounds: under a minute
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
from statistics import median
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_memory import PeakSampler, pss  # sibling script
from bench_save import (  # sibling script
    GIB,
    MIB,
    bootstrap_interval,
    build_state,
    dump_json,
    iter_tensors,
    machine_info,
    state_bytes,
)
from floors import CopyFloor, WriteFloor, settle_machine

import ckptd
from ckptd.options import parse_size

SAMPLE_SECONDS = 0.005
TARGET_EXTRA_SLACK = 64 * MIB  # issue 29: peak extra memory <= budget + 64 MiB
TARGET_COMMITTED_RATIO = 1.15  # issue 29: committed <= 1.15x the write floor


def timed_save(ckpt: ckptd.Checkpointer, step: int, state: Any, staging: str) -> dict[str, float]:
    settle_machine(1.0)
    started = time.perf_counter()
    request = ckpt.async_save(step, state, staging=staging)
    returned = time.perf_counter() - started
    result = request.result(600)
    committed = time.perf_counter() - started
    return {
        "returned": returned,
        "blocking": float(result.timings.get("blocking", returned)),
        "committed": committed,
        "write": float(result.timings.get("write", 0.0)),
    }


def peak_extra_memory(ckpt: ckptd.Checkpointer, step: int, state: Any, staging: str, base_pss: int) -> int:
    """One more save, untimed, with the PSS sampler on (reading ``smaps_rollup`` of a large
    process costs CPU and takes its memory map's lock: the timed saves run without it)."""
    settle_machine(1.0)

    def trainer_and_writer() -> tuple[int, int]:
        writer_pid = ckpt.writer_pid
        return pss("self"), pss(writer_pid) if writer_pid else 0

    with PeakSampler(trainer_and_writer, SAMPLE_SECONDS) as sampler:
        ckpt.async_save(step, state, staging=staging).result(600)
    trainer, writer = sampler.parts
    print(
        f"  at the peak: trainer {(trainer - base_pss) / MIB:.0f} MiB over its PSS before, "
        f"writer {writer / MIB:.0f} MiB",
        flush=True,
    )
    return sampler.peak - base_pss


def run_phase(
    args: argparse.Namespace,
    state: Any,
    floor: WriteFloor,
    bench_dir: str,
    budget: int | None,
    ring_floor: WriteFloor | None = None,
) -> tuple[list[dict[str, float]], int, int]:
    """``--rounds`` pairs (write floor, ckptd save) with one Checkpointer of ``staging_memory=budget``,
    alone in this process, then one save for its peak extra memory (counted from before the
    Checkpointer existed).  Returns the rows, the peak extra bytes and the arenas' bytes."""
    label = "no budget" if budget is None else f"budget {budget / MIB:.0f} MiB"
    if torch.cuda.is_available():
        # A GPU trainer has its CUDA context already; the arena's cudaHostRegister would create it
        # here, and its ~100 MiB of host memory is not ckptd's.
        torch.zeros(1, device="cuda")
    gc.collect()
    base_pss = pss("self")
    rows = []
    root = os.path.join(bench_dir, label.replace(" ", "-"))
    with ckptd.Checkpointer(root, staging_memory=budget) as ckpt:
        ckpt.save(0, state)  # the writer started and the arena made, as in a running job
        for round_ in range(args.rounds):
            shutil.rmtree(os.path.join(root, f"checkpoint-{round_}"))  # untimed: the disk stays as empty
            row = {"floor": floor.write(True)}
            if ring_floor is not None:
                row["ring_floor"] = ring_floor.write(True)
            row |= timed_save(ckpt, round_ + 1, state, args.staging)
            rows.append(row)
            print(
                f"{label}, round {round_ + 1}: floor {row['floor']:.3f} s | blocking {row['blocking']:.3f} s, "
                f"committed {row['committed']:.3f} s ({row['committed'] / row['floor']:.2f}x floor), "
                f"write {row['write']:.3f} s"
                + (f", ring floor {row['ring_floor']:.3f} s" if ring_floor is not None else ""),
                flush=True,
            )
        shutil.rmtree(os.path.join(root, f"checkpoint-{args.rounds}"))
        peak = peak_extra_memory(ckpt, args.rounds + 1, state, args.staging, base_pss)
        arenas = int(ckpt.health_check()["arena_bytes"])
        print(f"{label}: peak extra memory {peak / MIB:.0f} MiB (arenas {arenas / MIB:.0f} MiB)", flush=True)
    return rows, peak, arenas


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.0, help="state size in GiB (default 2)")
    parser.add_argument("--budget", default="256MiB", help="staging_memory (default 256MiB)")
    parser.add_argument("--rounds", type=int, default=8, help="interleaved pairs (default 8)")
    parser.add_argument("--staging", default="blocking", choices=["blocking", "pipelined", "background"])
    parser.add_argument("--compare-unbudgeted", action="store_true", help="then the same rounds with no budget")
    parser.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--quick", action="store_true", help="256 MiB through 64 MiB, 3 rounds")
    args = parser.parse_args()
    if args.quick:
        args.gib, args.budget, args.rounds = 0.25, "64MiB", 3
    budget = parse_size(args.budget, "--budget")

    bench_dir = tempfile.mkdtemp(prefix="ckptd-budget-", dir=args.dir)
    try:
        state = build_state(args.gib)
        nbytes = state_bytes(state)
        print(
            f"state: {nbytes / GIB:.2f} GiB in {sum(1 for _ in iter_tensors(state))} tensors; "
            f"budget {budget / MIB:.0f} MiB"
        )
        copy = CopyFloor(t for _, t in iter_tensors(state))
        copy.measure()
        floor = WriteFloor(copy.anonymous, copy.nbytes, bench_dir, settle=1.0)
        floor.measure()  # warm-up
        ring_floor = WriteFloor(copy.anonymous, copy.nbytes, bench_dir, settle=1.0, source_bytes=budget)
        budget_rows, budget_peak, budget_arenas = run_phase(args, state, floor, bench_dir, budget, ring_floor)
        summary: dict[str, Any] = {
            "floor": median([r["floor"] for r in budget_rows]),
            "budget_blocking": median([r["blocking"] for r in budget_rows]),
            "budget_committed": median([r["committed"] for r in budget_rows]),
            "budget_committed_ratio": median([r["committed"] / r["floor"] for r in budget_rows]),
            "budget_committed_interval": bootstrap_interval([r["committed"] / r["floor"] for r in budget_rows]),
            "ring_floor": median([r["ring_floor"] for r in budget_rows]),
            "budget_committed_ring_ratio": median([r["committed"] / r["ring_floor"] for r in budget_rows]),
            "budget_committed_ring_interval": bootstrap_interval(
                [r["committed"] / r["ring_floor"] for r in budget_rows]
            ),
            "budget_peak_extra": budget_peak,
            "budget_arena_bytes": budget_arenas,
        }
        rows = {"budget": budget_rows}
        if args.compare_unbudgeted:
            full_rows, full_peak, full_arenas = run_phase(args, state, floor, bench_dir, None)
            rows["full"] = full_rows
            summary |= {
                "full_blocking": median([r["blocking"] for r in full_rows]),
                "full_committed": median([r["committed"] for r in full_rows]),
                "full_committed_ratio": median([r["committed"] / r["floor"] for r in full_rows]),
                "full_committed_interval": bootstrap_interval([r["committed"] / r["floor"] for r in full_rows]),
                "full_peak_extra": full_peak,
                "full_arena_bytes": full_arenas,
            }
        copy.close()

        extra_ok = summary["budget_peak_extra"] <= budget + TARGET_EXTRA_SLACK
        committed_ok = summary["budget_committed_ratio"] <= TARGET_COMMITTED_RATIO
        print(
            f"\nmedians of {len(budget_rows)} rounds: write floor {summary['floor']:.3f} s; "
            f"through {budget / MIB:.0f} MiB: "
            f"blocking {summary['budget_blocking']:.3f} s, committed {summary['budget_committed']:.3f} s = "
            f"{summary['budget_committed_ratio']:.2f}x the floor "
            f"(95% bootstrap interval {summary['budget_committed_interval'][0]:.2f}-"
            f"{summary['budget_committed_interval'][1]:.2f}; target <= {TARGET_COMMITTED_RATIO}: "
            f"{'pass' if committed_ok else 'FAIL'}); peak extra memory {summary['budget_peak_extra'] / MIB:.0f} MiB "
            f"(target <= {(budget + TARGET_EXTRA_SLACK) / MIB:.0f} MiB: {'pass' if extra_ok else 'FAIL'})"
        )
        low, high = summary["budget_committed_ring_interval"]
        print(
            f"against the ring floor (the same writes from a {budget / MIB:.0f} MiB buffer, "
            f"{summary['ring_floor']:.3f} s): {summary['budget_committed_ring_ratio']:.2f}x ({low:.2f}-{high:.2f})"
        )
        if args.compare_unbudgeted:
            print(
                f"no budget: blocking {summary['full_blocking']:.3f} s, "
                f"committed {summary['full_committed_ratio']:.2f}x the floor "
                f"({summary['full_committed_interval'][0]:.2f}-{summary['full_committed_interval'][1]:.2f}), "
                f"peak extra memory {summary['full_peak_extra'] / MIB:.0f} MiB"
            )
        if args.json:
            dump_json(
                args.json,
                {
                    "machine": machine_info(bench_dir),
                    "args": vars(args),
                    "state_bytes": nbytes,
                    "budget": budget,
                    "rounds": rows,
                    "summary": summary,
                    "targets": {"peak_extra": extra_ok, "committed": committed_ok},
                },
            )
    finally:
        shutil.rmtree(bench_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
