#!/usr/bin/env python
"""Run every ckptd benchmark and print one table of the performance targets.

Each benchmark runs as its own process (so memory figures and DCP's daemon do not leak from one
into the next) with ``--json``; this script reads those files and checks the targets.  Floors
(``floors.py``) are measured in the same run as ckptd, alternating with it, and ratios against a
floor are medians of the per-pair ratios.  User-facing baselines (DCP, safetensors, boto3) are
reported beside them and labelled so.

* S: ``bench_save.py``: warm blocking vs the copy floor (defaults, ``pipelined``, ``prepare``, background
  staging); warm ``async_save`` -> committed vs the write floor; the first save of each run
  (constructor and writer start included) vs the cold floor, as a reference (one sample; F decides);
  DCP ``async_save`` (process mode);
* F: ``bench_first_save.py``: a first save (constructor included) in fresh processes, 8 per
  configuration, against the cold floor each one measured just before (a ``copy_`` into freshly
  mapped memory + the write floor): the median excess <= 0.2 s;
* I: ``bench_interference.py``: median training step while a save is written vs without one,
  for each step shape, with ckptd's defaults (adaptive throttle on) and with ``throttle=False``; as references, the
  interference floor (``raw_writer.py``: the write floor's bare ``O_DIRECT`` writes of the same
  bytes in a process of its own) and DCP process mode;
* M: ``bench_memory.py``: extra PSS per in-flight save; peak RSS and ``/dev/shm`` over the soak;
* L: ``bench_load.py``: full loads into preallocated tensors vs the read floor, warm and cold;
  ``safe_open`` + ``copy_`` beside; bytes read by a ``keys=`` load of 10% of the tensors;
* O: ``bench_s3.py`` (loopback moto server): upload throughput vs boto3's best configuration;
  requests per file and bytes fetched by a load, counted on the server; load time vs boto3
  ranged GETs and vs DCP's ``FsspecReader``;
* G: ``bench_scaling.py``: growth of blocking, total and writer RSS with the state size;
  per-tensor overhead between tensor counts of the same bytes;
* B: ``bench_staging_budget.py``: a 2 GiB state through ``staging_memory="256MiB"`` (``--quick``:
  256 MiB through 64 MiB): peak extra memory vs the budget + 64 MiB, committed vs the write floor,
  blocking as it is, and the same save without a budget for reference;
* C: ``bench_coordination.py`` (simulated ranks, no I/O): FSDP2 and HSDP mixes at 16,384 ranks x
  1,000 tensors: first-save coordination < 2 s and < 200 MB traced on the coordinator, cached
  saves < 0.5 s, the manifest the same size at every world size;
* P: ``bench_peers.py``: ckptd beside DCP, torch_checkpointing, torchsnapshot, ByteCheckpoint,
  ``torch.save`` and safetensors (reference rows: the peers installed by
  ``benchmarks/install_peers.sh``; one that is missing is a row saying why), and ckptd's
  checkpoint bit-exact after every tensor changed right after ``async_save`` returned.

The table is printed in Markdown (target, ours, baseline, ratio, limit, pass/fail); the exit code
is 1 when a target fails or a script fails, else 0.

Example::

    python benchmarks/run_all.py --quick --scaling-plot docs/scaling.png --json all.json
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
from bench_save import (  # the sibling script (its heavy imports are torch's only)
    bootstrap_interval,
    ensure_bytecode,
    markdown_table,
)

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
    if name == "coordination":  # no I/O, seconds: the same in quick and full runs
        return ["--mix", "fsdp,hsdp", "--tensors", "1000", "--worlds", "8,64,512,4096,16384"]
    common = ["--dir", args.dir]
    if name == "s3":
        quick = ["--quick"] if args.quick else []
        return ["--gib", str(args.s3_gib), "--repeats", str(args.s3_repeats or args.repeats), *quick, *common]
    if name == "scaling":
        plot = ["--plot", args.scaling_plot] if args.scaling_plot else []
        sizes = ["--sizes", args.scaling_sizes, "--counts", args.scaling_counts, "--timeout", str(args.scaling_timeout)]
        return ["--repeats", str(args.repeats), *sizes, *plot, *common]
    if name == "budget":
        size = ["--quick"] if args.quick else ["--gib", "2", "--budget", "256MiB", "--rounds", "8"]
        return [*size, "--compare-unbudgeted", *common]
    if name == "save":
        return ["--gib", str(args.gib), "--repeats", str(args.save_repeats), *common]
    if name == "first":
        return [*(["--quick"] if args.quick else ["--gib", str(args.gib), "--rounds", "8"]), *common]
    if name == "peers":
        return [*(["--quick"] if args.quick else ["--gib", str(args.gib), "--rounds", "4"]), *common]
    sized = ["--gib", str(args.gib), "--repeats", str(args.repeats), *common]
    if name == "memory":
        return [*sized, "--saves", str(args.soak_saves)]
    if name == "interference":
        return [*sized, "--unthrottled", *(["--skip-dcp"] if args.quick else [])]
    return sized


SCRIPTS = {
    "save": "bench_save.py",
    "first": "bench_first_save.py",
    "interference": "bench_interference.py",
    "memory": "bench_memory.py",
    "load": "bench_load.py",
    "s3": "bench_s3.py",
    "scaling": "bench_scaling.py",
    "budget": "bench_staging_budget.py",
    "peers": "bench_peers.py",
    "coordination": "bench_coordination.py",
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
    name: str,
    ours: float,
    baseline: float,
    limit: float | None,
    fmt: Callable[[float], str] = seconds_text,
    pair_ratios: list[float] | None = None,
) -> Target:
    """A row passing when ``ours / baseline <= limit`` (times, bytes: lower is better).

    With ``pair_ratios`` (floor, ours, floor, ours), the ratio is their median.  ``limit=None``
    makes a reference row (no verdict).
    """
    ratio = median(pair_ratios) if pair_ratios else ours / baseline
    text = f"{ratio:.2f}x"
    if pair_ratios:
        text += f" (median of {len(pair_ratios)} pairs"
        if len(pair_ratios) >= 3:
            low, high = bootstrap_interval(pair_ratios)
            text += f"; 95% bootstrap {low:.2f}-{high:.2f}"
        text += ")"
    if limit is None:
        return Target(name, fmt(ours), fmt(baseline), text, "reference", None)
    return Target(name, fmt(ours), fmt(baseline), text, f"<= {limit:.2f}x", ratio <= limit)


def pair_ratios(run: Results, attr: str, floor: str, first: bool) -> list[float]:
    """``ours / floor`` per save of a ``bench_save.py`` run, each against the floor measured right before it."""
    return [
        detail[attr] / floors[floor]["floor"]
        for detail, floors in zip(run["details"], run.get("floors", []), strict=False)
        if detail["first"] == first
    ]


# ---- targets per script --------------------------------------------------------------------


def save_targets(data: Results) -> list[Target]:
    """Targets of the save section (issue items 1 and 2) from ``bench_save.py``'s JSON."""
    floors = data["floors"]
    copy = median(floors["copy floor"]["values"])
    write = median(floors["write floor"]["values"])
    runs = {run["label"]: run for run in data["runs"]}
    ckptd, dcp = runs.get("ckptd"), next((r for label, r in runs.items() if label.startswith("DCP")), None)
    background, prepared = runs.get("ckptd[background]"), runs.get("ckptd[prepare]")
    pipelined = runs.get("ckptd[pipelined]")
    rows: list[Target] = []
    for label, run in (
        ("defaults (writer starts after the copy)", ckptd),
        ('staging="pipelined"', pipelined),
        ("prepare(state) first", prepared),
    ):
        if run:
            rows.append(
                ratio_target(
                    f"S1. warm blocking, {label} (vs copy floor)",
                    median(run["warm_blocking"]["values"]),
                    copy,
                    1.05,
                    pair_ratios=pair_ratios(run, "blocking", "copy", False),
                )
            )
    if background:
        rows.append(
            ratio_target(
                'S1. warm blocking, staging="background" (vs copy floor)',
                median(background["warm_blocking"]["values"]),
                copy,
                0.1,
                pair_ratios=pair_ratios(background, "blocking", "copy", False),
            )
        )
    for label, run in (("defaults", ckptd), ('staging="pipelined"', pipelined), ('staging="background"', background)):
        if run:
            rows.append(
                ratio_target(
                    f"S2. warm async_save -> committed, {label} (vs write floor)",
                    median(run["warm_total"]["values"]),
                    write,
                    1.05,
                    pair_ratios=pair_ratios(run, "total", "write", False),
                )
            )
    for label, run in (
        ("no prepare", ckptd),
        ('staging="pipelined"', pipelined),
        ("prepare(state) first, counted", prepared),
        ('staging="background"', background),
    ):
        if run is None:
            continue
        first = median(run["first_total"]["values"])
        pairs = [f for d, f in zip(run["details"], run.get("floors", []), strict=False) if d["first"]]
        if not pairs or "cold" not in pairs[0]["copy"]:
            continue
        floor = pairs[0]["copy"]["cold"] + pairs[0]["write"]["floor"]
        rows.append(
            Target(
                f"S3. first save incl. constructor + writer start, {label} (vs the cold floor just before: "
                "copy into fresh memory + write floor; one sample: F1 decides the target)",
                seconds_text(first),
                seconds_text(floor),
                f"{first / floor:.2f}x ({first - floor:+.2f} s)",
                "<= floor + 0.20 s",
                None,  # a reference: one process has one first save; F1 has 8 (bench_first_save.py)
            )
        )
    if prepared:
        first_call = [d["call_total"] for d in prepared["details"] if d["first"] and "call_total" in d]
        warm = median(prepared["warm_total"]["values"]) if prepared["warm_total"]["values"] else 0.0
        if first_call and warm:
            rows.append(
                ratio_target(
                    "S5. with prepare(state): the first async_save -> committed (vs a warm one of the same run)",
                    first_call[0],
                    warm,
                    1.05,
                )
            )
    if ckptd and dcp:
        rows.append(
            ratio_target(
                f"S4. warm async_save -> committed (vs {dcp['label']} async_save, process mode; user-facing baseline)",
                median(ckptd["warm_total"]["values"]),
                median(dcp["warm_total"]["values"]),
                1.0,
            )
        )
        rows.append(
            ratio_target(
                f"S4. first save total (vs {dcp['label']} first async_save, process mode; user-facing baseline)",
                median(ckptd["first_total"]["values"]),
                median(dcp["first_total"]["values"]),
                1.0,
            )
        )
    if ckptd and "safetensors" in data.get("baselines", {}):
        rows.append(
            ratio_target(
                "S4. warm async_save -> committed (vs safetensors save_file+fsync; user-facing baseline)",
                median(ckptd["warm_total"]["values"]),
                median(data["baselines"]["safetensors"]["values"]),
                None,
            )
        )
    return rows


def interference_targets(data: Results) -> list[Target]:
    """Target 3 from ``bench_interference.py``'s JSON."""
    rows: list[Target] = []
    for result in data["results"]:
        during, baseline = result["during_median"], result["baseline_median"]
        label = result["label"]
        is_floor = label.startswith("write floor")
        reference = is_floor or label.startswith("DCP")
        if is_floor:
            name = f"I1. median step during the interference floor's write, {label} (vs no write) [reference]"
        else:
            name = f"I1. median step during a save's write, {label} (vs no save, same saver)"
            name += " [reference]" if reference else ""
        if during is None:
            rows.append(Target(name, "no step ran", f"{baseline * 1e3:.1f} ms", "-", "<= 1.10x", None))
            continue
        ratio = during / baseline
        rows.append(
            Target(
                name,
                f"{during * 1e3:.1f} ms",
                f"{baseline * 1e3:.1f} ms",
                f"{ratio:.2f}x",
                "reference" if reference else "<= 1.10x",
                None if reference else ratio <= 1.1,
            )
        )
    rows += commit_under_steps_targets(data)
    return rows


def commit_under_steps_targets(data: Results) -> list[Target]:
    """I2: each ckptd saver's commit while the steps run, against the interference floor's write
    under the same step shape (issue 29: a slow commit is not a fix for interference)."""
    rows: list[Target] = []
    floors = {
        json.dumps(r["shape"], sort_keys=True): r for r in data["results"] if r["label"].startswith("write floor")
    }
    for result in data["results"]:
        floor = floors.get(json.dumps(result["shape"], sort_keys=True))
        if floor is None or result is floor or not result["label"].startswith("ckptd"):
            continue
        ours = median([s["seconds_to_done"] for s in result["saves"]])
        base = median([s["seconds_to_done"] for s in floor["saves"]])
        rows.append(
            ratio_target(
                f"I2. commit while the steps run, {result['label']} (vs the interference floor's write, same steps)",
                ours,
                base,
                1.5,
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
            "M1. extra PSS (main + writer) after warm saves, max (vs state bytes)",
            steady["extra_max_warm"],
            steady["state_bytes"],
            1.05,
            gib,
        )
    ]
    for proc in ("main", "writer"):
        rows.append(
            ratio_target(
                f"M2. peak RSS of the {proc} process at save {last_step} (vs at save {early_step})",
                last[proc]["VmHWM"],
                early[proc]["VmHWM"],
                1.05,
                mib,
            )
        )
    shm = (soak["shm_before"], early["shm_entries"], last["shm_entries"], soak["shm_after_close"])
    rows.append(
        Target(
            f"M3. /dev/shm entries at save {early_step} / {last_step} / after close (vs before)",
            f"{shm[1]} / {shm[2]} / {shm[3]}",
            str(shm[0]),
            "-",
            "no growth",
            shm[2] <= shm[1] and shm[3] <= shm[0],
        )
    )
    return rows


def load_targets(data: Results) -> list[Target]:
    """Load targets (issue item 3) from ``bench_load.py``'s JSON."""
    samples = data["full"]["samples"]
    rows: list[Target] = []
    methods = data["full"].get("floor_methods", {})
    for kind in ("warm", "cold"):
        ours, floor = samples[f"ckptd {kind}"]["values"], samples[f"read floor {kind}"]["values"]
        method = f": {methods[kind].removeprefix('read floor ')}" if kind in methods else ""
        rows.append(
            ratio_target(
                f"L1. full load into preallocated tensors, {kind} (vs {kind} read floor{method})",
                median(ours),
                median(floor),
                1.1,
                pair_ratios=[a / b for a, b in zip(ours, floor, strict=True)],
            )
        )
        fastest = samples.get(f"read floor per-repeat min {kind}")
        if fastest is not None:
            rows.append(
                ratio_target(
                    f"L1. full load, {kind} (vs the fastest read-floor method of each repeat) [reference]",
                    median(ours),
                    median(fastest["values"]),
                    None,
                    pair_ratios=[a / b for a, b in zip(ours, fastest["values"], strict=True)],
                )
            )
    for kind in ("warm", "cold"):
        rows.append(
            ratio_target(
                f"L2. full load, {kind} (vs safe_open + copy_; user-facing baseline)",
                median(samples[f"ckptd {kind}"]["values"]),
                median(samples[f"safetensors {kind}"]["values"]),
                None,
            )
        )
    partial = data["partial"]
    rows.append(
        ratio_target(
            f"L3. bytes read (rchar) by keys= load of {partial['tensors']}/{partial['of']} tensors (vs their bytes)",
            median(partial["rchar"]),
            partial["wanted_bytes"],
            1.05,
            lambda v: f"{v / MIB:.1f} MiB",
        )
    )
    return rows


def s3_targets(data: Results) -> list[Target]:
    """S3 targets (issue item 5) from ``bench_s3.py``'s JSON (throughput: higher is better)."""
    rows: list[Target] = []
    uploads, loads = data["uploads"], data["loads"]
    best = [uploads[k] for k in ("boto3-par", "boto3-best") if k in uploads]
    if "ckptd" in uploads and best:

        def rate(m: Results) -> float:
            return m["nbytes"] / GB / median(m["warm"]["values"])

        ours, base = rate(uploads["ckptd"]), max(rate(m) for m in best)
        rows.append(
            Target(
                "O1. S3 upload throughput, warm, async_save to committed (vs boto3 best: files at once, parts each)",
                f"{ours:.3f} GB/s",
                f"{base:.3f} GB/s",
                f"{ours / base:.2f}x",
                ">= 1.00x",
                ours / base >= 1.0,
            )
        )
    counts = data.get("save_counts") or []
    if counts:
        worst = max(
            ((f["requests"] - f["limit"], name, f) for c in counts for name, f in c["files"].items()),
            key=lambda t: t[0],
        )
        others = max(c["other_requests"] for c in counts)
        rows.append(
            Target(
                f"O2. S3 requests per file of a save, worst file over {len(counts)} saves ({worst[1]}); "
                f"requests not tied to a file: {others}",
                str(worst[2]["requests"]),
                f"ceil({worst[2]['bytes']} / {counts[0]['part_size']}) + 2",
                f"{worst[2]['requests']} / {worst[2]['limit']}",
                "<= ceil(size/part) + 2",
                all(c["passed"] for c in counts),
            )
        )
    load_counts = (data.get("load_counts") or {}).get("ckptd") or []
    if load_counts:
        fetched = max(c["fetched_bytes"] for c in load_counts)
        rows.append(
            ratio_target(
                "O3. bytes fetched by a full S3 load, max over loads (vs the tensor bytes it needs)",
                fetched,
                data["payload_bytes"],
                1.05,
                lambda v: f"{v / MIB:.1f} MiB",
            )
        )
    if "ckptd" in loads and "boto3" in loads:
        ours = median(loads["ckptd"]["samples"]["values"])
        base = median(loads["boto3"]["samples"]["values"])
        rows.append(
            ratio_target(
                "O4. S3 full load time (vs boto3 parallel ranged GETs of the same files, bytes only)",
                ours,
                base,
                None,
            )
        )
    if "ckptd" in loads and "DCP" in loads:
        ours = median(loads["ckptd"]["samples"]["values"])
        base = median(loads["DCP"]["samples"]["values"])
        rows.append(
            Target(
                "O5. S3 load time (vs DCP FsspecReader load; ratio = speed-up; reference: a loopback server "
                "cannot show a network's latency)",
                seconds_text(ours),
                seconds_text(base),
                f"{base / ours:.1f}x",
                "reference",
                None,
            )
        )
    return rows


def scaling_targets(data: Results) -> list[Target]:
    """Scaling targets (issue item 6) from ``bench_scaling.py``'s JSON."""
    rows: list[Target] = []
    sizes = sorted((r for r in data["rows"] if r["kind"] == "size" and "timeout" not in r), key=lambda r: r["bytes"])
    if len(sizes) >= 2:
        low, high = sizes[0], sizes[-1]
        grow = high["bytes"] / low["bytes"]
        for attr, label in (
            ("warm_blocking", "warm blocking"),
            ("warm_total", "warm total"),
            ("writer_hwm", "writer peak RSS"),
        ):
            if not low.get(attr) or not high.get(attr):
                continue
            factor = (high[attr] / low[attr]) / grow
            rows.append(
                Target(
                    f"G1. {label} growth from {low['bytes'] / GIB:.2f} to {high['bytes'] / GIB:.2f} GiB, "
                    "per unit of size (1.00 = linear)",
                    f"{high[attr] / low[attr]:.2f}x",
                    f"{grow:.2f}x",
                    f"{factor:.2f}",
                    "<= 1.20 (not faster than linear)",
                    factor <= 1.2,
                )
            )
    for r in data["rows"]:
        if r["kind"] == "count" and "timeout" in r:
            rows.append(
                Target(
                    f"G2. {r['tensors']} tensors of {r['gib']:.2f} GiB: every save finished",
                    f"stopped after {r['timeout']:.0f} s",
                    "-",
                    "-",
                    "finishes",
                    False,
                )
            )
    counts = [r for r in data["rows"] if r["kind"] == "count" and "timeout" not in r]
    if len(counts) >= 2:
        low = min(counts, key=lambda r: r["tensors"])
        high = max(counts, key=lambda r: r["tensors"])
        firsts = min(low.get("first_saves", 1), high.get("first_saves", 1))
        for attr, label in (
            ("warm_blocking", "warm blocking"),
            ("warm_total", "warm total"),
            ("warm_plan", "warm plan (CPU only, least noisy)"),
            ("first_total", f"first save total, median of {firsts}"),
        ):
            value = (high[attr] - low[attr]) / (high["tensors"] - low["tensors"])
            rows.append(
                Target(
                    f"G3. per-tensor overhead, {label} ({low['tensors']} -> {high['tensors']} tensors, same bytes)",
                    f"{value * 1e6:.1f} us",
                    f"{low[attr]:.3f} s -> {high[attr]:.3f} s",
                    "-" if value >= 0 else "negative: noise decides it",
                    "<= 20 us",
                    None if value < 0 else value <= 20e-6,
                )
            )
    return rows


def budget_targets(data: Results) -> list[Target]:
    """Issue 29's bounded-memory targets from ``bench_staging_budget.py``'s JSON."""
    summary, budget = data["summary"], data["budget"]
    limit = budget + 64 * MIB
    low, high = summary["budget_committed_interval"]

    def mib(value: float) -> str:
        return f"{value / MIB:.0f} MiB"

    rows = [
        Target(
            f"B1. peak extra PSS (trainer + writer) saving {data['state_bytes'] / GIB:.2f} GiB through "
            f"staging_memory={mib(budget)} (vs the budget + 64 MiB)",
            mib(summary["budget_peak_extra"]),
            mib(limit),
            f"{summary['budget_peak_extra'] / limit:.2f}",
            "<= 1.00",
            summary["budget_peak_extra"] <= limit,
        ),
        Target(
            "B2. committed through the budget (vs the write floor; 95% bootstrap interval of the median)",
            seconds_text(summary["budget_committed"]),
            seconds_text(summary["floor"]),
            f"{summary['budget_committed_ratio']:.2f} ({low:.2f}-{high:.2f})",
            "<= 1.15",
            summary["budget_committed_ratio"] <= 1.15,
        ),
        Target(
            "B3. blocking through the budget (reference: all but the budget's bytes written first)",
            seconds_text(summary["budget_blocking"]),
            seconds_text(summary["full_blocking"]) + " (no budget)" if "full_blocking" in summary else "-",
            "-",
            "reported",
            None,
        ),
    ]
    if "full_peak_extra" in summary:
        rows.append(
            Target(
                "B4. the same save without a budget (reference): peak extra PSS, committed vs the write floor",
                mib(summary["full_peak_extra"]),
                "-",
                f"{summary['full_committed_ratio']:.2f}",
                "reported",
                None,
            )
        )
    return rows


def peer_targets(data: Results) -> list[Target]:
    """``bench_peers.py``: ckptd's exactness (a target) and one reference row per peer."""
    peers = {p["name"]: p for p in data["peers"]}
    ours = peers.get("ckptd", {})

    def text(peer: Results) -> str:
        if peer.get("unavailable"):
            return f"cannot run here: {peer['unavailable']}"[:120]
        parts = [
            f"{label} {median(peer[key]):.2f} s"
            for label, key in (("blocking", "blocking"), ("committed", "committed"), ("load", "load"))
            if peer.get(key)
        ]
        if "first_committed" in peer.get("first", {}):
            parts.append(f"first {peer['first']['first_committed']:.2f} s")
        if peer.get("sync_calls") is not None:
            parts.append(f"{sum(peer['sync_calls'].values())} sync calls")
        return ", ".join(parts) or "-"

    def committed_ratio(peer: Results) -> str:
        if not ours.get("committed") or not peer.get("committed"):
            return "-"
        return f"{median(ours['committed']) / median(peer['committed']):.2f}"

    exact = ours.get("first", {}).get("exact")
    rows = [
        Target(
            "P0. ckptd: the checkpoint is the state as saved though every tensor changed once async_save returned",
            "-"
            if exact is None
            else "bit-exact"
            if exact
            else f"{ours['first'].get('differing_count')} tensors differ",
            "-",
            "-",
            "bit-exact",
            exact,
        )
    ]
    for name, peer in peers.items():
        if name == "ckptd":
            continue
        rows.append(
            Target(
                f"P. {name} (reference; ratio = ckptd's committed / the peer's)",
                text(ours),
                text(peer),
                committed_ratio(peer),
                "reported",
                None,
            )
        )
    return rows


def coordination_targets(data: Results) -> list[Target]:
    """``bench_coordination.py``: the FSDP2/HSDP targets of the largest simulated world."""
    rows = []
    for mix, result in data["mixes"].items():
        measures = result["measures"]
        largest = max(m["world"] for m in measures)
        first = next(m for m in measures if m["world"] == largest and m["phase"] == "first")
        cached = next(m for m in measures if m["world"] == largest and m["phase"] == "cached")
        where = f"{mix}, {largest:,} ranks x {data['tensors']:,} tensors"
        manifests = [m["manifest_bytes"] for m in measures if m["phase"] == "cached"]
        spread = max(manifests) - min(manifests)  # the digits of the world size differ
        rows += [
            Target(
                f"C1. {where}: first-save coordination",
                f"{first['plan_seconds']:.2f} s",
                "-",
                "-",
                "< 2 s",
                first["plan_seconds"] < 2,
            ),
            Target(
                f"C2. {where}: coordinator planning memory (tracemalloc peak)",
                f"{first['plan_peak'] / MIB:.0f} MiB",
                "-",
                "-",
                "< 200 MB",
                first["plan_peak"] < 200e6,
            ),
            Target(
                f"C3. {where}: cached save's coordination",
                f"{cached['plan_seconds']:.2f} s",
                "-",
                "-",
                "< 0.5 s",
                cached["plan_seconds"] < 0.5,
            ),
            Target(
                f"C4. {mix}: manifest size from 8 to {largest:,} ranks",
                f"{min(manifests):,}-{max(manifests):,} bytes",
                "-",
                f"+{spread} bytes",
                "independent of W (± 16 bytes)",
                spread <= 16,
            ),
        ]
    return rows


def first_save_targets(results: Results) -> list[Target]:
    """F rows (issue 29, item 4) from ``bench_first_save.py``'s JSON: each configuration's median
    first save against the median cold floor, decided on the median of the per-process excess."""
    labels = {"default": "defaults", "pipelined": 'staging="pipelined"', "prepare": "prepare(state) first, counted"}
    rows = []
    for config, r in results["results"].items():
        low, high = r["excess_interval"]
        rows.append(
            Target(
                f"F1. first save incl. constructor + writer start, {labels.get(config, config)}, median of "
                f"{r['samples']} fresh processes (vs the cold floor each measured: copy into fresh memory + write "
                f"floor; excess 95% interval {low:+.2f} to {high:+.2f} s)",
                seconds_text(r["total"]),
                seconds_text(r["cold_floor"]),
                f"{r['ratio']:.2f}x ({r['excess']:+.2f} s)",
                "<= floor + 0.20 s",
                r["passes"],  # bench_first_save.py's verdict on the median excess (TARGET_SECONDS)
            )
        )
    return rows


TARGETS: dict[str, Callable[[Results], list[Target]]] = {
    "save": save_targets,
    "first": first_save_targets,
    "interference": interference_targets,
    "memory": memory_targets,
    "load": load_targets,
    "s3": s3_targets,
    "scaling": scaling_targets,
    "budget": budget_targets,
    "peers": peer_targets,
    "coordination": coordination_targets,
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
    parser.add_argument("--gib", type=float, default=None, help="local state size in GiB (default 1; --quick 0.5)")
    parser.add_argument("--repeats", type=int, default=None, help="repeats per measurement (default 3; --quick 2)")
    parser.add_argument(
        "--s3-gib", type=float, default=None, help="state size of bench_s3.py in GiB (default 0.5; --quick 0.25)"
    )
    parser.add_argument(
        "--save-repeats",
        type=int,
        default=None,
        help="warm saves per run of bench_save.py: its blocking and committed rows are decided on the median of "
        "as many floor/save pairs (default 8; --quick 3)",
    )
    parser.add_argument("--s3-repeats", type=int, default=None, help="warm repeats of bench_s3.py (default --repeats)")
    parser.add_argument(
        "--soak-saves", type=int, default=None, help="saves of bench_memory.py's soak (default 200; --quick 50)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smaller sizes and fewer repeats (about 10 minutes on 2 cores); no DCP in the interference run, "
        "no s3fs rows, scaling sizes 0.25,0.5",
    )
    parser.add_argument("--scaling-sizes", default=None, help="bench_scaling.py --sizes (default 0.25,0.5,1)")
    parser.add_argument("--scaling-counts", default="300,3000,30000", help="bench_scaling.py --counts")
    parser.add_argument("--scaling-timeout", type=float, default=None, help="seconds per scaling configuration")
    parser.add_argument("--scaling-plot", metavar="PNG", help="bench_scaling.py --plot")
    parser.add_argument("--dir", default="/work", help="parent of the benchmark directories (default /work; not tmpfs)")
    parser.add_argument(
        "--only", default=",".join(SCRIPTS), help=f"comma-separated subset of {','.join(SCRIPTS)} (default: all)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the targets and every script's JSON here")
    args = parser.parse_args(argv)
    quick = args.quick

    def default(name: str, normal: Any, fast: Any) -> None:
        if getattr(args, name) is None:
            setattr(args, name, fast if quick else normal)

    default("gib", 1.0, 0.5)
    default("repeats", 3, 2)
    default("save_repeats", 8, 3)
    default("s3_gib", 0.5, 0.25)
    default("soak_saves", 200, 50)
    default("scaling_sizes", "0.25,0.5,1", "0.25,0.5")
    default("scaling_timeout", 150.0, 90.0)
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
    print(ensure_bytecode(), flush=True)
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
    from floors import METHODS

    for name, method in METHODS.items():
        print(f"{name} floor: {method}")
    print(
        "ratio = ours / baseline (lower is better; with floors: the median of per-pair ratios, floor and ours "
        "measured alternately) except on the O1/O5 rows, where higher is better (throughput ratio; DCP's load "
        "time / ours)"
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
