#!/usr/bin/env python
"""Per-tensor cost of a warm save, with and without retention, in one process.

The same bytes (``--gib``, default 0.25 GiB of fp32) in 300 and in 30,000 equal tensors, one
component, saved to local disk with ``keep_last`` unset and with ``keep_last=2`` (retention
lists the root after every commit).  For each configuration: the medians of ``--repeats`` warm
saves (after two unmeasured ones) of blocking (until ``async_save`` returns) and total (until
the request's result, retention included), and the per-tensor overhead = the growth from 300 to
30,000 tensors divided by 29,700.

It measures whatever ``ckptd`` is imported, so an A/B of two versions of the code is two runs
with ``PYTHONPATH`` pointing at each copy, alternated (old, new, old, new)::

    PYTHONPATH=/path/to/old python benchmarks/bench_many_tensors.py
    PYTHONPATH=/path/to/new python benchmarks/bench_many_tensors.py
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

import ckptd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

COUNTS = (300, 30_000)


def warm_saves(directory: str, count: int, gib: float, repeats: int, keep_last: int | None) -> tuple[float, float]:
    """Median blocking and total seconds of ``repeats`` warm saves of ``count`` tensors."""
    each = int(gib * 2**30) // 4 // count
    state = {"model": {f"layers.{i}.weight": torch.randn(each) for i in range(count)}}
    blocking, total = [], []
    with ckptd.Checkpointer(directory, keep_last=keep_last, max_shard_size="2GB") as ckpt:
        ckpt.save(0, state)
        ckpt.save(1, state)  # the plan is reused from here on
        for step in range(2, 2 + repeats):
            started = time.perf_counter()
            request = ckpt.async_save(step, state)
            blocking.append(time.perf_counter() - started)
            request.result()
            total.append(time.perf_counter() - started)
    return statistics.median(blocking), statistics.median(total)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=0.25, help="state size in GiB (default 0.25)")
    parser.add_argument("--repeats", type=int, default=6, help="measured warm saves per configuration (default 6)")
    parser.add_argument("--dir", default="/work", help="parent of the temporary checkpoint directory (default /work)")
    args = parser.parse_args(argv)
    if args.gib <= 0 or args.repeats < 1:
        parser.error("--gib must be > 0 and --repeats >= 1")
    print(f"ckptd from {os.path.dirname(ckptd.__file__)}")
    lines = []
    for keep_last in (None, 2):
        measured = {}
        for count in COUNTS:
            directory = tempfile.mkdtemp(prefix="ckptd-bench-many-", dir=args.dir)
            try:
                measured[count] = warm_saves(directory, count, args.gib, args.repeats, keep_last)
            finally:
                shutil.rmtree(directory, ignore_errors=True)
        added = COUNTS[1] - COUNTS[0]
        per_tensor = [(measured[COUNTS[1]][i] - measured[COUNTS[0]][i]) / added * 1e6 for i in (0, 1)]
        lines.append(
            [
                str(keep_last),
                *(f"{measured[c][0]:.3f} / {measured[c][1]:.3f}" for c in COUNTS),
                f"{per_tensor[0]:.1f}",
                f"{per_tensor[1]:.1f}",
            ]
        )
    header = [
        "keep_last",
        f"{COUNTS[0]} tensors: blocking / total s",
        f"{COUNTS[1]} tensors: blocking / total s",
        "per tensor, blocking us",
        "per tensor, total us",
    ]
    from bench_save import markdown_table

    print(markdown_table(header, lines, left_aligned={0}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
