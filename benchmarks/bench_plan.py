#!/usr/bin/env python
"""Benchmark save planning (``ckptd.save.plan.plan_save``) against the number of tensors.

Planning runs before the first ``async_save`` returns, so its cost is blocking time.  The state
is ``n`` tiny tensors (3 floats each, mixed with bf16 and int64 ones), planned on one rank with
5 GB shards and on two ranks holding the same replicated state.  The target: 100,000 tensors
plan in under one second (the best of ``--repeats`` runs, wall time; the process's CPU time
is printed beside it, which is what to compare on a machine shared with other jobs).

``--end-to-end`` also times the first ``Checkpointer.async_save`` of the same ``n`` tiny tensors
(one rank, a local temporary directory, a fresh writer): the blocking time (flatten, describe,
plan, arena layout and copies), the time until the checkpoint is committed (the writer's files,
the manifest, HF index and commit), and the blocking time per tensor.

Example::

    python benchmarks/bench_plan.py --counts 1000 10000 100000 --repeats 3
    python benchmarks/bench_plan.py --counts 100000 --end-to-end
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

from ckptd.save.plan import LocalTensor, plan_save

_TARGET_COUNT = 100_000
_TARGET_SECONDS = 1.0


def _state(count: int) -> list[LocalTensor]:
    dtypes = ("F32", "BF16", "I64")
    return [LocalTensor("model", f"layers.{i}.weight", dtypes[i % len(dtypes)], (3,), (0,), (3,)) for i in range(count)]


def _best(count: int, world: int, repeats: int) -> tuple[float, float]:
    """Best wall time and best CPU time (this process) of ``repeats`` plans."""
    state = _state(count)
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        plan_save([state] * world, 5 * 10**9)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return min(walls), min(cpus)


def _end_to_end(count: int) -> dict[str, float]:
    """Blocking and committed wall times (and blocking CPU time) of a first ``async_save``."""
    import torch

    from ckptd import Checkpointer

    dtypes = (torch.float32, torch.bfloat16, torch.int64)
    state = {"model": {f"layers.{i}.weight": torch.zeros(3, dtype=dtypes[i % 3]) for i in range(count)}}
    with tempfile.TemporaryDirectory() as root:
        checkpointer = Checkpointer(root)
        try:
            wall, cpu = time.perf_counter(), time.process_time()
            request = checkpointer.async_save(1, state)
            blocking, blocking_cpu = time.perf_counter() - wall, time.process_time() - cpu
            request.result()
            committed = time.perf_counter() - wall
        finally:
            checkpointer.close()
    return {
        "tensors": count,
        "blocking_s": blocking,
        "blocking_cpu_s": blocking_cpu,
        "committed_s": committed,
        "blocking_us_per_tensor": blocking / count * 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument(
        "--end-to-end", action="store_true", help="also time a first Checkpointer.async_save of each count"
    )
    args = parser.parse_args(argv)

    results = []
    print(f"{'tensors':>9} {'1 rank (s)':>11} {'cpu (s)':>8} {'2 ranks (s)':>12} {'cpu (s)':>8}")
    for count in args.counts:
        one, one_cpu = _best(count, 1, args.repeats)
        two, two_cpu = _best(count, 2, args.repeats)
        results.append(
            {
                "tensors": count,
                "one_rank_s": one,
                "one_rank_cpu_s": one_cpu,
                "two_ranks_s": two,
                "two_ranks_cpu_s": two_cpu,
            }
        )
        print(f"{count:>9} {one:>11.3f} {one_cpu:>8.3f} {two:>12.3f} {two_cpu:>8.3f}")
    if args.end_to_end:
        print(f"{'tensors':>9} {'blocking (s)':>13} {'cpu (s)':>8} {'committed (s)':>14} {'us/tensor':>10}")
        for count in args.counts:
            row = _end_to_end(count)
            results.append({"end_to_end": row})
            print(
                f"{count:>9} {row['blocking_s']:>13.3f} {row['blocking_cpu_s']:>8.3f} {row['committed_s']:>14.3f} "
                f"{row['blocking_us_per_tensor']:>10.1f}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    target = [r for r in results if r.get("tensors") == _TARGET_COUNT]
    if target:
        ok = target[0]["one_rank_s"] < _TARGET_SECONDS
        verdict = "PASS" if ok else "FAIL"
        print(f"target: {_TARGET_COUNT} tensors plan in < {_TARGET_SECONDS} s on one rank: {verdict}")
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
