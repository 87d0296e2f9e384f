"""A process's first save, in many fresh processes: the cold-floor target of issue 29 (item 4).

``bench_save.py`` times one first save per configuration and run (a process has one first
save).  This script starts a fresh process per sample instead, ``--rounds`` times per
configuration, interleaved (round 1: every configuration, round 2: every configuration, ...), so
the first-save rows are decided on a median like the warm rows.

Each child process builds the state (``bench_save.build_state``), loads ckptd's modules with a
throwaway ``Checkpointer`` (untimed, as ``bench_save.py`` does), measures its **cold floor** right
before its save (a ``copy_`` of the state into freshly mapped memory, plus the write floor of
``floors.py``: the same bytes to one new file with ``O_DIRECT`` and ``fsync``), then builds a
``Checkpointer`` and times its first ``async_save`` from the constructor: the call (``blocking``)
and until committed (``total``).  Configurations:

* ``default``: ``async_save(0, state)`` (``staging="blocking"``; its arena is new memory, so the
  writer starts on the chunks already copied);
* ``pipelined``: ``staging="pipelined"``;
* ``prepare``: ``ckpt.prepare(state)`` first, its time counted in the total.

Run: ``python benchmarks/bench_first_save.py --gib 1 --rounds 8 [--json PATH]``;
``--quick`` is 0.25 GiB and 3 rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = ("default", "pipelined", "prepare")
TARGET_SECONDS = 0.2  # issue 29, item 4: first save <= cold floor + 0.2 s


def run_child(config: str, gib: float, bench_dir: str) -> dict[str, Any]:
    """One sample, in this process (``--child``): cold floor, then the first save."""
    sys.path.insert(0, HERE)
    from bench_save import Floors, build_state, iter_tensors, warm_up_ckptd
    from floors import cold_copy

    state = build_state(gib)
    warm_up_ckptd(bench_dir)
    floors = Floors(state, bench_dir)
    write = floors.measure()["write"]["floor"]
    floors.close()
    cold = cold_copy(t for _, t in iter_tensors(state))
    import ckptd

    root = os.path.join(bench_dir, f"first-{config}")
    started = time.perf_counter()
    ckpt = ckptd.Checkpointer(root, max_shard_size="2GB")
    try:
        if config == "prepare":
            ckpt.prepare(state)
        call = time.perf_counter()
        request = ckpt.async_save(0, state, staging="pipelined" if config == "pipelined" else None)
        blocking = time.perf_counter() - started
        call_blocking = time.perf_counter() - call
        request.result()
        total = time.perf_counter() - started
    finally:
        ckpt.close()
    shutil.rmtree(root, ignore_errors=True)
    return {
        "config": config,
        "cold_copy": cold,
        "write_floor": write,
        "cold_floor": cold + write,
        "blocking": blocking,
        "call_blocking": call_blocking,
        "total": total,
        "timings": dict(request.timings),
    }


def sample(config: str, gib: float, bench_dir: str) -> dict[str, Any]:
    """One sample in a fresh Python process."""
    command = [sys.executable, os.path.abspath(__file__), "--child", config, "--gib", str(gib), "--dir", bench_dir]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"child {config} failed (exit code {done.returncode}):\n{done.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(lines[-1])
    return out


def summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of one configuration's samples, and the target's verdict on the median excess."""
    from bench_save import bootstrap_interval

    excess = [s["total"] - s["cold_floor"] for s in samples]
    ratio = [s["total"] / s["cold_floor"] for s in samples]
    low, high = bootstrap_interval(excess)
    return {
        "samples": len(samples),
        "total": statistics.median(s["total"] for s in samples),
        "blocking": statistics.median(s["blocking"] for s in samples),
        "cold_floor": statistics.median(s["cold_floor"] for s in samples),
        "excess": statistics.median(excess),
        "excess_interval": [low, high],
        "ratio": statistics.median(ratio),
        "passes": statistics.median(excess) <= TARGET_SECONDS,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default 1.0)")
    parser.add_argument("--rounds", type=int, default=8, help="fresh processes per configuration (default 8)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {CONFIGS}")
    parser.add_argument("--quick", action="store_true", help="0.25 GiB, 3 rounds")
    parser.add_argument("--dir", default=None, help="directory for the checkpoints (default: a temporary one)")
    parser.add_argument("--json", metavar="PATH", help="also write every sample and the summary as JSON")
    parser.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(args.child, args.gib, args.dir)), flush=True)
        return 0
    gib, rounds = (0.25, 3) if args.quick else (args.gib, args.rounds)
    configs = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; choose from {list(CONFIGS)}")
    sys.path.insert(0, HERE)
    from bench_save import machine_info

    bench_dir = tempfile.mkdtemp(prefix="ckptd-first-", dir=args.dir)
    print(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    print("machine:", ", ".join(f"{k}={v}" for k, v in machine_info(bench_dir).items()), flush=True)
    samples: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    try:
        for round_ in range(rounds):
            for config in configs:
                s = sample(config, gib, bench_dir)
                samples[config].append(s)
                t = s["timings"]
                print(
                    f"  round {round_ + 1} {config:9s}: total {s['total']:.3f} s, blocking {s['blocking']:.3f} s; "
                    f"cold floor {s['cold_floor']:.3f} s (copy {s['cold_copy']:.3f} + write {s['write_floor']:.3f}); "
                    f"wait {t.get('wait', 0):.3f} stage {t.get('stage', 0):.3f} write {t.get('write', 0):.3f}",
                    flush=True,
                )
    finally:
        shutil.rmtree(bench_dir, ignore_errors=True)
    results = {c: summary(v) for c, v in samples.items()}
    print(f"\n== first save, {gib} GiB, {rounds} fresh processes per configuration (medians)")
    print(
        "| configuration | first total | blocking | cold floor | total - floor (95% interval) | total / floor "
        "| target <= floor + 0.2 s |"
    )
    print("|---|---|---|---|---|---|---|")
    for config, r in results.items():
        low, high = r["excess_interval"]
        print(
            f"| {config} | {r['total']:.3f} s | {r['blocking']:.3f} s | {r['cold_floor']:.3f} s | "
            f"{r['excess']:+.3f} s ({low:+.3f} to {high:+.3f}) | {r['ratio']:.2f}x | "
            f"{'pass' if r['passes'] else 'FAIL'} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gib": gib, "rounds": rounds, "samples": samples, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
