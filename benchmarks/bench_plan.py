#!/usr/bin/env python
"""Benchmark save planning (``ckptd.save.plan.plan_save``) against the number of tensors.

Planning runs before the first ``async_save`` returns, so its cost is blocking time.  The state
is ``n`` tiny tensors (3 floats each, mixed with bf16 and int64 ones), planned on one rank with
5 GB shards and on two ranks holding the same replicated state.  The target: 100,000 tensors
plan in under one second (the best of ``--repeats`` runs, wall time; the process's CPU time
is printed beside it, which is what to compare on a machine shared with other jobs).

Example::

    python benchmarks/bench_plan.py --counts 1000 10000 100000 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import sys
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the results to this file")
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    target = [r for r in results if r["tensors"] == _TARGET_COUNT]
    if target:
        ok = target[0]["one_rank_s"] < _TARGET_SECONDS
        verdict = "PASS" if ok else "FAIL"
        print(f"target: {_TARGET_COUNT} tensors plan in < {_TARGET_SECONDS} s on one rank: {verdict}")
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
