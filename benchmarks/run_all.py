#!/usr/bin/env python
"""Run every ckptd benchmark and print one table of the performance targets.

Each benchmark runs as its own process (so memory figures and DCP's daemon do not leak from one
into the next) with ``--json``; this script reads those files and checks the targets:

1. ``bench_save.py``: warm blocking time of ``async_save`` vs the ``copy_`` floor, default and
   ``staging="background"``;
2. ``bench_save.py``: warm time to committed vs raw write+fsync and vs DCP ``async_save``
   (process mode, same run); first save (constructor + writer start, with and without
   ``prepare``) vs raw write+fsync + 1 s;
3. ``bench_interference.py``: median training step time while a save is written vs without one
   (ckptd defaults, ``writer_nice=10``; DCP process mode beside them);
4. ``bench_memory.py``: extra PSS per in-flight save; peak RSS and ``/dev/shm`` over 200 saves;
5. ``bench_load.py``: full loads into preallocated tensors vs ``safe_open`` + ``copy_``, warm and
   cold; bytes read by a ``keys=`` load of 10% of the tensors;
6. ``bench_s3.py`` (loopback moto server, ``--s3-gib``): upload throughput vs boto3
   ``upload_fileobj``; load time vs DCP's ``FsspecReader``.

The table is printed in Markdown (target, ours, baseline, ratio, limit, pass/fail); the exit code
is 1 when a target fails or a script fails, else 0.

Example::

    python benchmarks/run_all.py --gib 2 --repeats 3 --json all.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_save import markdown_table  # the sibling script (its heavy imports are torch's only)

HERE = os.path.dirname(os.path.abspath(__file__))
GIB = 1024**3
MIB = 1024**2
GB = 1000**3

Results = dict[str, Any]


@dataclass
class Target:
    """One row of the table: a target, our number, the baseline's, their ratio and the verdict."""

    target: str
    ours: str
    baseline: str
    ratio: str
    limit: str
    passed: bool | None  # None: a reference row, or not measured

    @property
    def verdict(self) -> str:
        return {True: "pass", False: "FAIL", None: "n/a"}[self.passed]


# ---- running the scripts -------------------------------------------------------------------


def script_argv(name: str, args: argparse.Namespace) -> list[str]:
    """The command-line arguments of benchmark ``name`` (``--json`` is added by the caller)."""
    common = ["--dir", args.dir]
    if name == "s3":
        return ["--gib", str(args.s3_gib), "--repeats", str(args.s3_repeats or args.repeats), *common]
    sized = ["--gib", str(args.gib), "--repeats", str(args.repeats), *common]
    if name == "memory":
        return [*sized, "--saves", str(args.soak_saves)]
    return sized


SCRIPTS = {
    "save": "bench_save.py",
    "interference": "bench_interference.py",
    "memory": "bench_memory.py",
    "load": "bench_load.py",
    "s3": "bench_s3.py",
}


@dataclass
class ScriptRun:
    """How one benchmark script ran: wall seconds, exit code, and CPU seconds of the machine.

    ``other_cpu`` is the machine's busy CPU time minus the script's own (its process tree, as far
    as its children were reaped): other processes, and kernel threads such as writeback, which
    the benchmark's own writes also cause. A large value means the run shared the cores.
    """

    seconds: float
    code: int
    own_cpu: float
    machine_cpu: float

    @property
    def other_cpu(self) -> float:
        return max(0.0, self.machine_cpu - self.own_cpu)


def machine_busy_cpu() -> float:
    """CPU seconds the whole machine spent not idle since boot (``/proc/stat``)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    busy = sum(fields[:8]) - idle  # user nice system idle iowait irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


def children_cpu() -> float:
    """User + system CPU seconds of this process's reaped children (and their reaped children)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_script(name: str, argv: list[str], json_path: str) -> tuple[Results | None, ScriptRun]:
    """Run one benchmark script (output streamed); returns its JSON (None on failure) and how it ran."""
    command = [sys.executable, os.path.join(HERE, SCRIPTS[name]), *argv, "--json", json_path]
    print(f"\n######## {name}: {shlex.join(command)}", flush=True)
    cpu_before, machine_before = children_cpu(), machine_busy_cpu()
    started = time.perf_counter()
    code = subprocess.run(command, check=False).returncode
    run = ScriptRun(
        seconds=time.perf_counter() - started,
        code=code,
        own_cpu=children_cpu() - cpu_before,
        machine_cpu=machine_busy_cpu() - machine_before,
    )
    print(
        f"######## {name}: exit code {code}, {run.seconds:.1f} s; CPU: own {run.own_cpu:.1f} s, "
        f"outside its processes {run.other_cpu:.1f} s",
        flush=True,
    )
    if code != 0 or not os.path.exists(json_path):
        return None, run
    with open(json_path) as f:
        return json.load(f), run


# ---- numbers -------------------------------------------------------------------------------


def median(values: list[float]) -> float:
    """The median of a non-empty list."""
    return statistics.median(values)


def seconds_text(value: float) -> str:
    """``0.123 s``."""
    return f"{value:.3f} s"


def ratio_target(
    name: str, ours: float, baseline: float, limit: float, fmt: Callable[[float], str] = seconds_text
) -> Target:
    """A row passing when ``ours / baseline <= limit`` (times, bytes: lower is better)."""
    ratio = ours / baseline
    return Target(name, fmt(ours), fmt(baseline), f"{ratio:.2f}x", f"<= {limit:.2f}x", ratio <= limit)


# ---- targets per script --------------------------------------------------------------------


def save_targets(data: Results) -> list[Target]:
    """Targets 1 and 2 from ``bench_save.py``'s JSON."""
    copy = median(data["floors"]["copy"]["values"])
    raw = median(data["floors"]["raw"]["values"])
    runs = {run["label"]: run for run in data["runs"]}
    ckptd, dcp = runs.get("ckptd"), next((r for label, r in runs.items() if label.startswith("DCP")), None)
    background, prepared = runs.get("ckptd[background]"), runs.get("ckptd[prepare]")
    rows: list[Target] = []
    if ckptd:
        rows.append(
            ratio_target(
                "1. warm blocking, defaults (vs copy_ floor)", median(ckptd["warm_blocking"]["values"]), copy, 1.2
            )
        )
    if background:
        rows.append(
            ratio_target(
                '1. warm blocking, staging="background" (vs copy_ floor)',
                median(background["warm_blocking"]["values"]),
                copy,
                0.1,
            )
        )
    if ckptd:
        rows.append(
            ratio_target(
                "2. warm total to committed (vs raw write+fsync)", median(ckptd["warm_total"]["values"]), raw, 1.15
            )
        )
    if ckptd and dcp:
        rows.append(
            ratio_target(
                f"2. warm total to committed (vs {dcp['label']} async_save, process mode)",
                median(ckptd["warm_total"]["values"]),
                median(dcp["warm_total"]["values"]),
                1.0,
            )
        )
        rows.append(
            ratio_target(
                f"2. first save total (vs {dcp['label']} first async_save, process mode)",
                median(ckptd["first_total"]["values"]),
                median(dcp["first_total"]["values"]),
                1.0,
            )
        )
    for label, run in (("no prepare", ckptd), ("prepare(state) first, counted", prepared)):
        if run is None:
            continue
        first = median(run["first_total"]["values"])
        rows.append(
            Target(
                f"2. first save incl. constructor + writer start, {label} (vs raw write+fsync)",
                seconds_text(first),
                seconds_text(raw),
                f"{first / raw:.2f}x ({first - raw:+.2f} s)",
                "<= raw + 1.00 s",
                first - raw <= 1.0,
            )
        )
    return rows


def interference_targets(data: Results) -> list[Target]:
    """Target 3 from ``bench_interference.py``'s JSON."""
    rows: list[Target] = []
    for result in data["results"]:
        during, baseline = result["during_median"], result["baseline_median"]
        is_dcp = result["label"].startswith("DCP")
        name = f"3. median step during a save's write, {result['label']} (vs no save)"
        if during is None:
            rows.append(Target(name, "no step ran", f"{baseline * 1e3:.1f} ms", "-", "<= 1.20x", None))
            continue
        ratio = during / baseline
        rows.append(
            Target(
                name + (" [reference]" if is_dcp else ""),
                f"{during * 1e3:.1f} ms",
                f"{baseline * 1e3:.1f} ms",
                f"{ratio:.2f}x",
                "reference" if is_dcp else "<= 1.20x",
                None if is_dcp else ratio <= 1.2,
            )
        )
    return rows


def memory_targets(data: Results) -> list[Target]:
    """Target 4 from ``bench_memory.py``'s JSON."""
    steady, soak = data["steady"], data["soak"]
    early_step = str(soak["early"])
    last_step = str(soak["saves"])
    early, last = soak["snapshots"][early_step], soak["snapshots"][last_step]

    def gib(value: float) -> str:
        return f"{value / GIB:.3f} GiB"

    def mib(value: float) -> str:
        return f"{value / MIB:.1f} MiB"

    rows = [
        ratio_target(
            "4. extra PSS (main + writer) after warm saves, max (vs state bytes)",
            steady["extra_max_warm"],
            steady["state_bytes"],
            1.05,
            gib,
        )
    ]
    for proc in ("main", "writer"):
        rows.append(
            ratio_target(
                f"4. peak RSS of the {proc} process at save {last_step} (vs at save {early_step})",
                last[proc]["VmHWM"],
                early[proc]["VmHWM"],
                1.05,
                mib,
            )
        )
    shm = (soak["shm_before"], early["shm_entries"], last["shm_entries"], soak["shm_after_close"])
    rows.append(
        Target(
            f"4. /dev/shm entries at save {early_step} / {last_step} / after close (vs before)",
            f"{shm[1]} / {shm[2]} / {shm[3]}",
            str(shm[0]),
            "-",
            "no growth",
            shm[2] <= shm[1] and shm[3] <= shm[0],
        )
    )
    return rows


def load_targets(data: Results) -> list[Target]:
    """Target 5 from ``bench_load.py``'s JSON."""
    samples = data["full"]["samples"]
    rows = [
        ratio_target(
            f"5. full load into preallocated tensors, {kind} (vs safe_open + copy_)",
            median(samples[f"ckptd {kind}"]["values"]),
            median(samples[f"safetensors {kind}"]["values"]),
            1.1,
        )
        for kind in ("warm", "cold")
    ]
    partial = data["partial"]
    rows.append(
        ratio_target(
            f"5. bytes read (rchar) by keys= load of {partial['tensors']}/{partial['of']} tensors (vs their bytes)",
            median(partial["rchar"]),
            partial["wanted_bytes"],
            1.2,
            lambda v: f"{v / MIB:.1f} MiB",
        )
    )
    return rows


def s3_targets(data: Results) -> list[Target]:
    """Target 6 from ``bench_s3.py``'s JSON (throughput: higher is better)."""
    rows: list[Target] = []
    uploads, loads = data["uploads"], data["loads"]
    if "ckptd" in uploads and "boto3" in uploads:
        ours = uploads["ckptd"]["nbytes"] / GB / median(uploads["ckptd"]["warm"]["values"])
        base = uploads["boto3"]["nbytes"] / GB / median(uploads["boto3"]["warm"]["values"])
        rows.append(
            Target(
                "6. S3 upload throughput, warm, async_save to committed "
                "(vs boto3 upload_fileobj, 4 threads, 64 MiB parts)",
                f"{ours:.3f} GB/s",
                f"{base:.3f} GB/s",
                f"{ours / base:.2f}x",
                ">= 1.00x",
                ours / base >= 1.0,
            )
        )
    if "ckptd" in loads and "DCP" in loads:
        ours = median(loads["ckptd"]["samples"]["values"])
        base = median(loads["DCP"]["samples"]["values"])
        rows.append(
            Target(
                "6. S3 load time (vs DCP FsspecReader load; ratio = speed-up)",
                seconds_text(ours),
                seconds_text(base),
                f"{base / ours:.1f}x",
                ">= 50x",
                base / ours >= 50,
            )
        )
    return rows


TARGETS: dict[str, Callable[[Results], list[Target]]] = {
    "save": save_targets,
    "interference": interference_targets,
    "memory": memory_targets,
    "load": load_targets,
    "s3": s3_targets,
}


# ---- report --------------------------------------------------------------------------------


def format_table(rows: list[Target]) -> str:
    """The Markdown table: target, ours, baseline, ratio, limit, pass/fail."""
    header = ["target", "ours", "baseline", "ratio", "limit", "pass/fail"]
    cells = [[r.target, r.ours, r.baseline, r.ratio, r.limit, r.verdict] for r in rows]
    return markdown_table(header, cells)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.0, help="local state size in GiB (default 2.0)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats per measurement (default 3)")
    parser.add_argument("--s3-gib", type=float, default=0.5, help="state size of bench_s3.py in GiB (default 0.5)")
    parser.add_argument("--s3-repeats", type=int, default=None, help="warm repeats of bench_s3.py (default --repeats)")
    parser.add_argument("--soak-saves", type=int, default=200, help="saves of bench_memory.py's soak (default 200)")
    parser.add_argument("--dir", default="/work", help="parent of the benchmark directories (default /work; not tmpfs)")
    parser.add_argument(
        "--only", default=",".join(SCRIPTS), help=f"comma-separated subset of {','.join(SCRIPTS)} (default: all)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the targets and every script's JSON here")
    args = parser.parse_args(argv)
    args.only = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(args.only) - set(SCRIPTS))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {list(SCRIPTS)}")
    if args.gib <= 0 or args.s3_gib <= 0 or args.repeats < 1:
        parser.error("--gib and --s3-gib must be > 0 and --repeats >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join([sys.executable, *sys.argv])
    print("command:", command, flush=True)
    wall = time.perf_counter()
    os.makedirs(args.dir, exist_ok=True)
    json_dir = tempfile.mkdtemp(prefix="ckptd-run-all-", dir=args.dir)
    results: dict[str, Results | None] = {}
    runs: dict[str, ScriptRun] = {}
    rows: list[Target] = []
    try:
        for name in args.only:
            data, runs[name] = run_script(name, script_argv(name, args), os.path.join(json_dir, f"{name}.json"))
            results[name] = data
            if data is None:
                rows.append(Target(f"{SCRIPTS[name]} failed (exit code {runs[name].code})", "-", "-", "-", "-", False))
                continue
            try:
                rows += TARGETS[name](data)
            except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
                rows.append(Target(f"{SCRIPTS[name]}: unexpected JSON ({e!r})", "-", "-", "-", "-", False))
    finally:
        shutil.rmtree(json_dir, ignore_errors=True)
    total = time.perf_counter() - wall
    machine: dict[str, Any] = next((d["machine"] for d in results.values() if d and "machine" in d), {})
    print("\n======== targets")
    print("command:", command)
    print("machine:", ", ".join(f"{k}={v}" for k, v in machine.items() if k != "bench_dir"))
    print("script wall times:", ", ".join(f"{SCRIPTS[n]} {r.seconds:.0f} s" for n, r in runs.items()))
    print(
        "CPU seconds outside the benchmark's processes (other processes, kernel writeback; 2 cores x wall is the max):",
        ", ".join(f"{SCRIPTS[n]} {r.other_cpu:.1f} s" for n, r in runs.items()),
    )
    print(
        "ratio = ours / baseline (lower is better) except on the S3 rows, where higher is better "
        "(throughput ratio; DCP's load time / ours)"
    )
    print(format_table(rows))
    failed = [r.target for r in rows if r.passed is False]
    print(f"{len(rows) - len(failed)} of {len(rows)} rows not failing; {len(failed)} FAIL; whole run {total:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            payload = {
                "command": command,
                "machine": machine,
                "wall_seconds": total,
                "scripts": {n: {**asdict(r), "other_cpu": r.other_cpu} for n, r in runs.items()},
                "targets": [{**asdict(r), "verdict": r.verdict} for r in rows],
                "results": results,
            }
            json.dump(payload, f, indent=2, default=str)
            f.write("\n")
        print(f"wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
