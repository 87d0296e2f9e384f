#!/usr/bin/env python
"""How ckptd's save costs grow with the state's size and with its tensor count.

Two scans, each configuration in a fresh child process (so the writer's RSS and the first save
belong to that configuration alone, and a configuration that takes too long can be stopped):

* **size**: the transformer-shaped state of ``bench_save.py`` (301 tensors) at ``--sizes`` GiB
  (default 0.25, 0.5, 1).  Before each save, the copy and write floors of ``floors.py`` are
  measured (floor, ours, floor, ours), so the table shows them beside ckptd's times;
* **count**: ``--count-gib`` GiB (default 0.25) of fp32 tensors of equal size, in ``--counts``
  tensors (default 300, 3000, 30000), all in one component.

Per configuration: the first save (constructor, writer start, first plan and arena included:
blocking and total; in the count scan the median of ``--first-repeats`` first saves, each in a
fresh process, the counts interleaved round by round), the median of ``--repeats`` warm saves
(blocking = until ``async_save`` returns, total = until the commit), and the writer process's
``VmRSS`` / ``VmHWM`` after the last save (``/proc/<writer_pid>/status``; the staging arena is a
shared mapping the writer touches, so it is in the writer's RSS).  Every timed copy and write
(each floor method, each save) comes after ``--settle`` seconds of ``sync`` + pause and 0.1 s of
matrix products (``floors.settle_machine``), as in ``bench_save.py``, so a save does not pay for
the disk work of the save or floor before it, nor start on an idle CPU.  Per-tensor overhead = the
warm time's growth from the smallest to the largest count, divided by the added tensors.  A
configuration that does not finish within ``--timeout`` seconds is reported as such.

The table is printed; ``--plot`` writes a PNG (matplotlib, the ``bench`` extra).

Example::

    python benchmarks/bench_scaling.py --repeats 3 --plot docs/scaling.png --json scaling.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GIB = 1024**3
MIB = 1024**2
RESULT_PREFIX = "RESULT "


# ---- child: one configuration ----------------------------------------------------------------


def writer_status(pid: int | None) -> dict[str, int]:
    """``VmRSS``, ``VmHWM``, ``RssAnon``, ``RssShmem`` of a process in bytes (empty if gone)."""
    out: dict[str, int] = {}
    if pid is None:
        return out
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in ("VmRSS", "VmHWM", "RssAnon", "RssShmem"):
                    out[name] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def count_state(gib: float, count: int) -> dict[str, dict[str, Any]]:
    """``count`` fp32 tensors of equal size, ``gib`` GiB in all, in one component."""
    import torch

    numel = max(1, int(gib * GIB / 4 / count))
    gen = torch.Generator().manual_seed(0)
    return {"model": {f"layers.{i}.weight": torch.randn(numel, generator=gen) for i in range(count)}}


def run_one(kind: str, gib: float, count: int, repeats: int, parent_dir: str, settle: float = 0.0) -> dict[str, Any]:
    """Measure one configuration in this process; returns the record the parent prints."""
    import torch
    from bench_save import Floors, build_state, iter_tensors, state_bytes
    from floors import settle_machine

    import ckptd

    torch.set_num_threads(2)
    state = build_state(gib) if kind == "size" else count_state(gib, count)
    nbytes = state_bytes(state)
    tensors = sum(1 for _ in iter_tensors(state))
    bench_dir = tempfile.mkdtemp(prefix="ckptd-bench-scaling-", dir=parent_dir)
    floors = Floors(state, bench_dir, settle) if kind == "size" else None
    record: dict[str, Any] = {"kind": kind, "bytes": nbytes, "tensors": tensors, "saves": [], "floors": []}
    try:
        if floors is not None:
            record["floors"].append(floors.measure())
        settle_machine(settle)
        started = time.perf_counter()
        ckpt = ckptd.Checkpointer(os.path.join(bench_dir, "ckpt"), max_shard_size="2GB")
        try:
            for step in range(repeats + 1):
                if step:
                    if floors is not None:
                        record["floors"].append(floors.measure())
                    settle_machine(settle)
                    started = time.perf_counter()
                call = time.perf_counter()
                request = ckpt.async_save(step, state)
                blocking = time.perf_counter() - call
                result = request.result()
                total = time.perf_counter() - started
                record["saves"].append(
                    {"first": step == 0, "blocking": blocking, "total": total, "timings": dict(request.timings)}
                )
                print(
                    f"  {kind} {tensors} tensors {nbytes / GIB:.3f} GiB save {step}: blocking {blocking:.3f} s, "
                    f"total {total:.3f} s",
                    flush=True,
                )
                shutil.rmtree(result.path)
            record["writer"] = writer_status(ckpt.writer_pid)
        finally:
            ckpt.close()
    finally:
        if floors is not None:
            floors.close()
        shutil.rmtree(bench_dir, ignore_errors=True)
    return record


# ---- parent --------------------------------------------------------------------------------


def run_child(
    kind: str, gib: float, count: int, args: argparse.Namespace, repeats: int | None = None
) -> dict[str, Any]:
    """Run one configuration in a child process (``repeats`` warm saves after the first, default
    ``--repeats``); a record with ``"timeout"`` if it took too long.

    The child works in a directory made here and removed here, so that a child stopped at its
    timeout (killed before its own clean-up) leaves nothing behind."""
    workdir = tempfile.mkdtemp(prefix="ckptd-bench-scaling-", dir=args.dir)
    try:
        return _run_child_in(kind, gib, count, args, workdir, args.repeats if repeats is None else repeats)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run_child_in(
    kind: str, gib: float, count: int, args: argparse.Namespace, workdir: str, repeats: int
) -> dict[str, Any]:
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--one",
        kind,
        str(gib),
        str(count),
        "--repeats",
        str(repeats),
        "--dir",
        workdir,
        "--settle",
        str(args.settle),
    ]
    print(f"\n== {kind}: {gib} GiB, {count or 301} tensors", flush=True)
    started = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, check=False)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        print(out, end="", flush=True)
        print(f"   timed out after {args.timeout:.0f} s", flush=True)
        return {"kind": kind, "gib": gib, "tensors": count, "timeout": args.timeout}
    print(done.stdout.replace(RESULT_PREFIX, "   result: ", 1)[:4000] if done.returncode else "", end="")
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not lines:
        print(done.stdout, done.stderr, flush=True)
        raise RuntimeError(f"{kind} {gib} GiB {count} tensors failed with exit code {done.returncode}")
    for line in done.stdout.splitlines():
        if not line.startswith(RESULT_PREFIX):
            print(line, flush=True)
    record = json.loads(lines[-1][len(RESULT_PREFIX) :])
    record["gib"] = gib
    record["wall"] = time.perf_counter() - started
    return record


def summarise(record: dict[str, Any]) -> dict[str, Any]:
    """First and warm-median blocking/total, floors' medians, writer RSS of one record."""
    if "timeout" in record:
        return record
    warm = [s for s in record["saves"] if not s["first"]]
    firsts = [s for s in record["saves"] if s["first"]]  # more than one with --first-repeats
    out = {
        **{k: record[k] for k in ("kind", "bytes", "tensors", "gib")},
        "first_saves": len(firsts),
        "first_blocking": statistics.median(s["blocking"] for s in firsts),
        "first_total": statistics.median(s["total"] for s in firsts),
        "first_plan": statistics.median(s["timings"].get("plan", 0.0) for s in firsts),
        "warm_blocking": statistics.median(s["blocking"] for s in warm),
        "warm_total": statistics.median(s["total"] for s in warm),
        "warm_plan": statistics.median(s["timings"].get("plan", 0.0) for s in warm),
        "writer_rss": record.get("writer", {}).get("VmRSS"),
        "writer_hwm": record.get("writer", {}).get("VmHWM"),
    }
    if record["floors"]:
        warm_floors = record["floors"][1:]
        out["copy_floor"] = statistics.median(f["copy"]["floor"] for f in warm_floors)
        out["write_floor"] = statistics.median(f["write"]["floor"] for f in warm_floors)
        out["blocking_vs_copy"] = statistics.median(
            s["blocking"] / f["copy"]["floor"] for s, f in zip(warm, warm_floors, strict=True)
        )
        out["total_vs_write"] = statistics.median(
            s["total"] / f["write"]["floor"] for s, f in zip(warm, warm_floors, strict=True)
        )
    return out


def per_tensor(counts: list[dict[str, Any]], attr: str) -> float | None:
    """Seconds per added tensor of ``attr`` between the smallest and the largest finished count."""
    done = sorted((r for r in counts if "timeout" not in r), key=lambda r: r["tensors"])
    if len(done) < 2:
        return None
    low, high = done[0], done[-1]
    return (high[attr] - low[attr]) / (high["tensors"] - low["tensors"])


def format_table(rows: list[dict[str, Any]]) -> str:
    """The Markdown table of every configuration."""
    from bench_save import markdown_table

    header = [
        "scan", "GiB", "tensors", "first blocking s", "first total s", "first plan s", "warm blocking s",
        "warm total s", "warm plan s", "copy floor s", "write floor s", "writer RSS MiB", "writer peak RSS MiB",
    ]  # fmt: skip

    def num(value: Any, fmt: str = "{:.3f}") -> str:
        return "-" if value is None else fmt.format(value)

    lines = []
    for r in rows:
        if "timeout" in r:
            lines.append(
                [r["kind"], f"{r['gib']:.2f}", str(r["tensors"]), f"> {r['timeout']:.0f} (stopped)"] + ["-"] * 9
            )
            continue
        lines.append(
            [
                r["kind"],
                f"{r['bytes'] / GIB:.3f}",
                str(r["tensors"]),
                num(r["first_blocking"]),
                num(r["first_total"]),
                num(r["first_plan"]),
                num(r["warm_blocking"]),
                num(r["warm_total"]),
                num(r["warm_plan"]),
                num(r.get("copy_floor")),
                num(r.get("write_floor")),
                num(r["writer_rss"] and r["writer_rss"] / MIB, "{:.0f}"),
                num(r["writer_hwm"] and r["writer_hwm"] / MIB, "{:.0f}"),
            ]
        )
    return markdown_table(header, lines, left_aligned={0})


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """Two panels: times and writer RSS against the state size; times against the tensor count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r for r in rows if r["kind"] == "size" and "timeout" not in r]
    counts = [r for r in rows if r["kind"] == "count" and "timeout" not in r]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    gib = [r["bytes"] / GIB for r in sizes]
    for attr, label, style in (
        ("warm_blocking", "warm blocking", "o-"),
        ("copy_floor", "copy floor", "o:"),
        ("warm_total", "warm total (to committed)", "s-"),
        ("write_floor", "write floor", "s:"),
        ("first_total", "first save total (constructor incl.)", "^-"),
    ):
        if sizes and all(r.get(attr) is not None for r in sizes):
            left.plot(gib, [r[attr] for r in sizes], style, label=label)
    left.set_xlabel("state size (GiB, 301 tensors)")
    left.set_ylabel("seconds")
    left.set_title("vs state size")
    rss = left.twinx()
    if sizes:
        rss.plot(gib, [(r["writer_hwm"] or 0) / GIB for r in sizes], "x--", color="grey", label="writer peak RSS")
    rss.set_ylabel("writer peak RSS (GiB)")
    lines, labels = left.get_legend_handles_labels()
    more, more_labels = rss.get_legend_handles_labels()
    left.legend(lines + more, labels + more_labels, fontsize=8, loc="upper left")
    n = [r["tensors"] for r in counts]
    for attr, label, style in (
        ("warm_blocking", "warm blocking", "o-"),
        ("warm_total", "warm total", "s-"),
        ("first_total", "first save total", "^-"),
        ("warm_plan", "warm plan (CPU only)", "d:"),
        ("first_plan", "first plan", "v:"),
    ):
        if counts:
            right.plot(n, [r[attr] for r in counts], style, label=label)
    right.set_xscale("log")
    right.set_yscale("log")
    gib_count = counts[0]["bytes"] / GIB if counts else 0
    right.set_xlabel(f"tensor count ({gib_count:.2f} GiB in all)")
    right.set_ylabel("seconds")
    right.set_title("vs tensor count")
    stopped = [r for r in rows if r["kind"] == "count" and "timeout" in r]
    for r in stopped:
        right.axvline(
            r["tensors"], color="red", linestyle=":", label=f"{r['tensors']}: first save > {r['timeout']:.0f} s"
        )
    right.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="0.25,0.5,1", help="state sizes in GiB (default 0.25,0.5,1)")
    parser.add_argument("--counts", default="300,3000,30000", help="tensor counts (default 300,3000,30000)")
    parser.add_argument("--count-gib", type=float, default=0.25, help="total size of the count scan (default 0.25)")
    parser.add_argument("--repeats", type=int, default=3, help="warm saves per configuration (default 3)")
    parser.add_argument(
        "--first-repeats",
        type=int,
        default=3,
        help="first saves per tensor count, each in a fresh process, rounds interleaved (default 3)",
    )
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds per configuration (default 150)")
    parser.add_argument("--dir", default="/work", help="parent of the benchmark directories (default /work)")
    parser.add_argument(
        "--settle",
        type=float,
        default=1.0,
        help="seconds of sync + pause before every timed write, floors and saves alike (default 1.0; 0 = none)",
    )
    parser.add_argument("--plot", metavar="PNG", help="write the plot here (needs matplotlib)")
    parser.add_argument("--json", metavar="PATH", help="also write every record as JSON")
    parser.add_argument("--one", nargs=3, metavar=("KIND", "GIB", "COUNT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < (0 if args.one else 1) or args.first_repeats < 1 or args.settle < 0:
        parser.error("--repeats and --first-repeats must be >= 1 and --settle >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.one:
        kind, gib, count = args.one[0], float(args.one[1]), int(args.one[2])
        record = run_one(kind, gib, count, args.repeats, args.dir, args.settle)
        print(RESULT_PREFIX + json.dumps(record), flush=True)
        return 0
    from bench_save import dump_json, machine_info

    command = shlex.join([sys.executable, *sys.argv])
    machine = machine_info(args.dir)
    print("command:", command)
    print("machine:", ", ".join(f"{k}={v}" for k, v in machine.items()))
    wall = time.perf_counter()
    # An empty list skips its scan (--sizes "" measures only the tensor counts).
    records = [run_child("size", float(g), 0, args) for g in args.sizes.split(",") if g]
    counts_wanted = [int(c) for c in args.counts.split(",") if c]
    by_count = {c: run_child("count", args.count_gib, c, args) for c in counts_wanted}
    # More first saves per count (a first save is one draw on a noisy disk), each in a fresh
    # process with no warm save, the counts interleaved round by round.
    for _ in range(args.first_repeats - 1):
        for c in counts_wanted:
            record = by_count[c]
            if "timeout" in record:
                continue
            extra = run_child("count", args.count_gib, c, args, repeats=0)
            if "timeout" not in extra:
                record["saves"].extend(extra["saves"])
    records += list(by_count.values())
    rows = [summarise(r) for r in records]
    counts = [r for r in rows if r["kind"] == "count"]
    overhead = {attr: per_tensor(counts, attr) for attr in ("warm_blocking", "warm_total", "first_total")}
    print(f"\n== results ({args.repeats} warm saves per configuration; times are medians)")
    print(format_table(rows))
    for attr, value in overhead.items():
        text = "-" if value is None else f"{value * 1e6:.1f} us"
        print(f"per-tensor overhead, {attr}: {text}")
    if args.plot:
        title = (
            f"ckptd {machine.get('ckptd', '')}; {machine.get('nproc')} cores; medians of {args.repeats} warm saves; "
            f"load average at the end {os.getloadavg()[0]:.1f}"
        )
        plot(rows, args.plot, title)
    if args.json:
        dump_json(
            args.json,
            {
                "command": command,
                "machine": machine,
                "rows": rows,
                "records": records,
                "per_tensor": overhead,
                "wall_seconds": time.perf_counter() - wall,
            },
        )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
