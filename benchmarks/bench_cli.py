#!/usr/bin/env python
"""How long the read-only ``ckptd`` commands take from start to exit, against the floor of
starting the same interpreter at all.

A small checkpoint (a 2-layer MLP and its Adam state: two steps, so ``diff`` has two sides) is
saved once.  Then, in rounds, each command runs as a fresh process (``python -m ckptd ...``),
interleaved with the floor ``python -c "import ckptd.cli"`` (the interpreter, site-packages and
the CLI's own module: what no command can avoid).  Printed per command: the median wall time,
the median of the per-round ratios to the floor of the same round, and whether torch or numpy
was imported (``-X importtime``; the read-only commands must import neither).

Example::

    python benchmarks/bench_cli.py --rounds 7
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

COMMANDS = {
    "ls": ["ls", "{root}"],
    "info": ["info", "{root}/checkpoint-20"],
    "verify": ["verify", "{root}/checkpoint-20"],
    "diff": ["diff", "{root}/checkpoint-10", "{root}/checkpoint-20"],
    "diff --exact": ["diff", "{root}/checkpoint-10", "{root}/checkpoint-20", "--exact"],
    "gc": ["gc", "{root}"],
}
FLOOR = [sys.executable, "-c", "import ckptd.cli"]


def save_checkpoints(root: str) -> None:
    import torch

    import ckptd

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 16))
    optimizer = torch.optim.Adam(model.parameters())
    with ckptd.Checkpointer(root) as checkpointer:
        for step in (10, 20):
            model(torch.randn(8, 256)).sum().backward()
            optimizer.step()
            checkpointer.save(step, {"model": model, "optimizer": optimizer})


def timed(argv: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode not in (0, 7):  # 7: diff found the checkpoints different
        raise SystemExit(f"{' '.join(argv)} failed with {done.returncode}: {done.stderr.strip()}")
    return elapsed


def imports_torch(argv: list[str]) -> bool:
    done = subprocess.run(
        [sys.executable, "-X", "importtime", *argv[1:]], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    modules = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if "|" in line}
    return bool(modules & {"torch", "numpy"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", help="write the results here as well")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        save_checkpoints(root)
        commands = {
            name: [sys.executable, "-m", "ckptd", *(part.format(root=root) for part in parts)]
            for name, parts in COMMANDS.items()
        }
        times: dict[str, list[float]] = {name: [] for name in commands}
        ratios: dict[str, list[float]] = {name: [] for name in commands}
        floors: list[float] = []
        for argv in [FLOOR, *commands.values()]:
            timed(argv)  # warm the page cache and the bytecode caches
        for _ in range(args.rounds):
            for name, argv in commands.items():  # floor, command, floor, command, ...
                floor = timed(FLOOR)
                elapsed = timed(argv)
                floors.append(floor)
                times[name].append(elapsed)
                ratios[name].append(elapsed / floor)
        torch_loaded = {name: imports_torch(argv) for name, argv in commands.items()}
    results = {
        "floor_s": statistics.median(floors),
        "commands": {
            name: {
                "median_s": statistics.median(times[name]),
                "ratio_to_floor": statistics.median(ratios[name]),
                "imports_torch_or_numpy": torch_loaded[name],
            }
            for name in commands
        },
    }
    print(f"floor (python -c 'import ckptd.cli'): {results['floor_s']:.3f} s (median of {len(floors)})")
    print(f"{'command':<14} {'median':>8} {'/ floor':>8}  torch or numpy")
    for name, row in results["commands"].items():
        flag = "yes" if row["imports_torch_or_numpy"] else "no"
        print(f"{name:<14} {row['median_s']:>7.3f}s {row['ratio_to_floor']:>7.2f}x  {flag}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    os.environ.setdefault("CKPTD_LOG_LEVEL", "WARNING")
    main()
