#!/usr/bin/env python
"""Benchmark ckptd's asynchronous save against fair floors, user-facing baselines and DCP.

The script builds a transformer-shaped training state (bf16 weights, fp32 Adam moments, an int64
step) of about ``--gib`` GiB and measures, in one run:

* the fair floors of ``floors.py``, measured again right before every ckptd save (floor, ours,
  floor, ours) so each save has its own pair: the **copy floor** (``copy_`` into pre-faulted
  memfd-shared and anonymous memory, the faster) for the blocking time and the **write floor**
  (O_DIRECT from one page-aligned buffer + fsync, and buffered + fsync, the faster) for the time
  to committed; the ratios reported are medians of the per-pair ratios;
* before every timed copy and write (each floor method, each save of ckptd, safetensors and DCP):
  ``sync``, a pause of ``--settle`` seconds and 0.1 s of matrix products (``floors.settle_machine``),
  so that no side pays for the disk work of the measurement before it or starts on an idle CPU;
* user-facing baselines (what a user would otherwise do, not floors): ``copy_`` into
  ``torch.empty_like`` tensors, and ``safetensors.torch.save_file`` + ``fsync`` of the flat state;
* ckptd ``Checkpointer.async_save``: blocking time and time until the commit, first save
  (constructor, writer start, arena allocation) separately from warm saves (ckptd's modules are
  imported first, by a throwaway ``Checkpointer``, so every run's first save pays the same);
  then the same with ``async_save(staging="pipelined")`` (``ckptd[pipelined]``: the writer starts during the copy;
  the default starts it after), with ``ckpt.prepare(state)`` called after the constructor
  (``ckptd[prepare]``, its time counted in the first save) and with
  ``async_save(staging="background")`` (``ckptd[background]``), unless ``--skip-variants``;
  ``--order`` sets the order of these runs;
* DCP ``async_save`` in process mode with a reused ``DefaultStager``, first and warm saves
  (a user-facing baseline), unless ``--skip-dcp``.

Example::

    python benchmarks/bench_save.py --gib 1 --repeats 3 --json results.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import platform
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

GIB = 1024**3
MIB = 1024**2
VOCAB = 32_000
LAYERS = 11  # 1 + 9 * 11 = 100 weights -> 300 moments + 1 step = 301 tensors
HIDDEN_MULTIPLE = 64
BYTES_PER_PARAM = 2 + 4 + 4  # bf16 weight + fp32 exp_avg + fp32 exp_avg_sq

State = dict[str, dict[str, torch.Tensor]]


# ---- results -------------------------------------------------------------------------------


@dataclass
class Samples:
    """Seconds measured for one quantity, one value per repeat."""

    name: str
    values: list[float] = field(default_factory=list)

    def add(self, seconds: float) -> None:
        self.values.append(seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def low(self) -> float:
        return min(self.values)

    @property
    def high(self) -> float:
        return max(self.values)


@dataclass
class Row:
    """One line of the final table: a measurement, optionally compared with a reference."""

    what: str
    samples: Samples
    reference: Samples | None = None
    reference_label: str = ""
    pair_ratios: list[float] | None = None  # per-pair ratios; their median is the ratio when given

    @property
    def ratio(self) -> float | None:
        if self.pair_ratios:
            return statistics.median(self.pair_ratios)
        return None if self.reference is None else self.samples.median / self.reference.median

    @property
    def delta(self) -> float | None:
        return None if self.reference is None else self.samples.median - self.reference.median


# ---- machine and state ---------------------------------------------------------------------


def bootstrap_interval(values: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95% bootstrap interval of the median of ``values`` (percentiles of resampled medians)."""
    import random

    generator = random.Random(seed)
    medians = sorted(statistics.median(generator.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def machine_info(bench_dir: str) -> dict[str, Any]:
    """CPU count, RAM, CPU model, versions and the filesystem holding ``bench_dir``."""
    mem_kib = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    cpu_model = platform.processor() or "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    import safetensors

    import ckptd

    return {
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "ram_gib": round(mem_kib / 1024**2, 1),
        "cpu": cpu_model,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "ckptd": f"{ckptd.__version__} ({package_revision(os.path.dirname(ckptd.__file__))})",
        "torch_threads": torch.get_num_threads(),
        "bench_dir": bench_dir,
        "bench_fs": filesystem_of(bench_dir),
    }


def package_revision(package_dir: str) -> str:
    """``"git <short hash>[+local changes]"`` of a package's source tree, or ``"no git"``."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", package_dir, *args], capture_output=True, text=True, timeout=10)
        if done.returncode != 0:
            raise OSError(done.stderr.strip())
        return done.stdout.strip()

    try:
        revision = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--", ".")
    except (OSError, subprocess.SubprocessError):
        return "no git"
    return f"git {revision}{'+local changes' if dirty else ''}"


def filesystem_of(path: str) -> str:
    """``"<fstype> on <mountpoint> (<device>)"`` for the mount holding ``path`` (best effort)."""
    best = ("", "?", "?")
    real = os.path.realpath(path)
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            device, mount, fstype = line.split()[:3]
            inside = real == mount or real.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best[0]):
                best = (mount, fstype, device)
    return f"{best[1]} on {best[0] or '?'} ({best[2]})"


def hidden_size_for(gib: float) -> int:
    """The hidden size (a multiple of 64) whose weights + Adam moments come closest to ``gib`` GiB."""
    params = gib * GIB / BYTES_PER_PARAM
    # params(h) = VOCAB*h + LAYERS*(16*h*h + 2*h); solve the quadratic for h.
    a, b = 16 * LAYERS, VOCAB + 2 * LAYERS
    h = (-b + (b * b + 4 * a * params) ** 0.5) / (2 * a)
    return max(HIDDEN_MULTIPLE, round(h / HIDDEN_MULTIPLE) * HIDDEN_MULTIPLE)


def weight_shapes(hidden: int) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a decoder-only transformer's weights (Llama-style, untied head)."""
    h = hidden
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (VOCAB, h)}
    for i in range(LAYERS):
        p = f"layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"{p}.self_attn.{proj}.weight"] = (h, h)
        shapes[f"{p}.mlp.up_proj.weight"] = (4 * h, h)
        shapes[f"{p}.mlp.gate_proj.weight"] = (4 * h, h)
        shapes[f"{p}.mlp.down_proj.weight"] = (h, 4 * h)
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
    return shapes


def build_state(gib: float, seed: int = 0) -> State:
    """A ``{"model": ..., "optimizer": ...}`` state of about ``gib`` GiB filled with random data."""
    gen = torch.Generator().manual_seed(seed)
    model: dict[str, torch.Tensor] = {}
    optimizer: dict[str, torch.Tensor] = {}
    for name, shape in weight_shapes(hidden_size_for(gib)).items():
        model[name] = torch.randn(shape, generator=gen, dtype=torch.bfloat16)
        optimizer[f"state.{name}.exp_avg"] = torch.randn(shape, generator=gen, dtype=torch.float32)
        optimizer[f"state.{name}.exp_avg_sq"] = torch.rand(shape, generator=gen, dtype=torch.float32)
    optimizer["step"] = torch.randint(0, 1_000_000, (), generator=gen, dtype=torch.int64)
    return {"model": model, "optimizer": optimizer}


def iter_tensors(state: State) -> Iterator[tuple[str, torch.Tensor]]:
    """``("component.key", tensor)`` for every tensor of the state."""
    for component, tensors in state.items():
        for key, tensor in tensors.items():
            yield f"{component}.{key}", tensor


def state_bytes(state: State) -> int:
    """Total tensor payload of the state in bytes."""
    return sum(t.numel() * t.element_size() for _, t in iter_tensors(state))


def warm_up_ckptd(bench_dir: str) -> str:
    """Open and close one throwaway ``Checkpointer`` (untimed), so that ckptd's lazily imported
    modules are loaded before the first measured run: otherwise only the run that comes first
    pays for them (about 0.1 s here) in its first save, and the first saves of the runs could
    not be compared.  The first saves measured thus leave out that one-time import (a process's
    first ``Checkpointer`` pays it).  Returns a line for the log."""
    import ckptd

    started = time.perf_counter()
    with ckptd.Checkpointer(os.path.join(bench_dir, "warm-up")) as ckpt:
        ckpt.wait()
    shutil.rmtree(os.path.join(bench_dir, "warm-up"), ignore_errors=True)
    return f"warm-up: one throwaway Checkpointer opened and closed in {time.perf_counter() - started:.3f} s (untimed)"


def free_memory() -> None:
    """Collect garbage so freed buffers go back before the next phase."""
    gc.collect()


# ---- fair floors and user-facing baselines ---------------------------------------------------


class Floors:
    """The copy and write floors of ``floors.py`` for one state, measured on demand.

    Every call of :meth:`measure` copies the state into both kinds of memory and writes it with
    O_DIRECT and buffered, and returns ``{"copy": {...}, "write": {...}}`` (each with its
    ``"floor"``, the faster method).  Benchmarks call it right before each save they time.
    """

    def __init__(self, state: State, bench_dir: str, settle: float = 0.0) -> None:
        from floors import CopyFloor, WriteFloor

        self.copy = CopyFloor((t for _, t in iter_tensors(state)), settle)
        self.copy.measure()  # warm-up: first touches, allocator
        self.write = WriteFloor(self.copy.anonymous, self.copy.nbytes, bench_dir, settle=settle)
        self.write.measure()  # warm-up: the first large write of a process is slower on some machines
        self.history: list[dict[str, dict[str, float]]] = []

    def measure(self) -> dict[str, dict[str, float]]:
        out = {"copy": self.copy.measure(), "write": self.write.measure()}
        self.history.append(out)
        print(
            "  floors: copy "
            + " ".join(f"{k}={v:.3f}" for k, v in out["copy"].items())
            + "; write "
            + " ".join(f"{k}={v:.3f}" for k, v in out["write"].items()),
            flush=True,
        )
        return out

    def close(self) -> None:
        self.copy.close()


def bench_copy_baseline(state: State, repeats: int, settle: float = 0.0) -> Samples:
    """User-facing baseline: seconds to ``copy_`` every tensor into ``torch.empty_like`` tensors
    (each copy after ``floors.settle_machine``, as every timed copy)."""
    from floors import settle_machine

    pairs = [(src, torch.empty_like(src)) for _, src in iter_tensors(state)]
    for src, dst in pairs:  # warm-up: fault the destination pages in
        dst.copy_(src)
    samples = Samples("copy_ into empty_like")
    for _ in range(repeats):
        settle_machine(settle)
        started = time.perf_counter()
        for src, dst in pairs:
            dst.copy_(src)
        samples.add(time.perf_counter() - started)
    del pairs
    free_memory()
    return samples


def fsync_path(path: str) -> None:
    """fsync an existing file by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def bench_safetensors(state: State, bench_dir: str, repeats: int, settle: float = 0.0) -> Samples:
    """Seconds for ``safetensors.torch.save_file`` of the flat state plus an fsync."""
    from floors import settle_machine
    from safetensors.torch import save_file

    flat = dict(iter_tensors(state))
    path = os.path.join(bench_dir, "state.safetensors")
    samples = Samples("safetensors save_file+fsync")
    for _ in range(repeats):
        settle_machine(settle)
        started = time.perf_counter()
        save_file(flat, path)
        fsync_path(path)
        samples.add(time.perf_counter() - started)
        os.remove(path)
    del flat
    free_memory()
    return samples


# ---- ckptd ---------------------------------------------------------------------------------


@dataclass
class SaveRun:
    """Blocking and total seconds of a first save and of the warm saves after it."""

    label: str
    setup: Samples
    first_blocking: Samples
    first_total: Samples
    warm_blocking: Samples
    warm_total: Samples
    details: list[dict[str, Any]] = field(default_factory=list)
    note: str = ""
    # The floors measured right before each save (same order as details); empty without floors.
    floors: list[dict[str, dict[str, float]]] = field(default_factory=list)

    def pair_ratios(self, attr: str, floor: str, first: bool = False) -> list[float]:
        """``ours / floor`` of each save paired with the floor measured right before it."""
        out = []
        for detail, floors in zip(self.details, self.floors, strict=False):
            if detail["first"] == first:
                out.append(detail[attr] / floors[floor]["floor"])
        return out


def new_save_run(label: str) -> SaveRun:
    """An empty :class:`SaveRun` whose sample names start with ``label``."""
    return SaveRun(
        label=label,
        setup=Samples(f"{label} setup"),
        first_blocking=Samples(f"{label} first blocking"),
        first_total=Samples(f"{label} first total"),
        warm_blocking=Samples(f"{label} warm blocking"),
        warm_total=Samples(f"{label} warm total"),
    )


def format_timings(timings: dict[str, float]) -> str:
    """``plan=0.001 wait=0.000 ...`` in ckptd's phase order, then any other keys."""
    order = ["plan", "wait", "stage", "blocking", "write", "commit", "total"]
    keys = [k for k in order if k in timings] + sorted(k for k in timings if k not in order)
    return " ".join(f"{k}={timings[k]:.3f}" for k in keys)


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of this process (``pid=None``) or of process ``pid`` (its
    ``/proc/<pid>/stat``; 0.0 when it is gone)."""
    if pid is None:
        times = os.times()
        return times.user + times.system
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def watch_writer_start(ckpt: Any, started: float) -> dict[str, float]:
    """Note (in the returned dict, key ``"writer_ready"``) when the Checkpointer's background
    writer start has finished its handshake, in seconds after ``started``; polled every 5 ms on
    a daemon thread, so the first save is not delayed by the measurement."""
    import threading

    out: dict[str, float] = {}

    def watch() -> None:
        while ckpt._writer.info is None and time.perf_counter() - started < 120:
            time.sleep(0.005)
        out["writer_ready"] = time.perf_counter() - started

    threading.Thread(target=watch, name="bench-writer-watch", daemon=True).start()
    return out


def bench_ckptd(
    state: State,
    bench_dir: str,
    repeats: int,
    label: str = "ckptd",
    *,
    staging: str = "blocking",
    prepare: bool = False,
    floors: Floors | None = None,
    settle: float = 0.0,
) -> SaveRun:
    """First save (Checkpointer construction included in its total), then ``repeats`` warm saves.

    ``staging`` is passed to every ``async_save``. With ``prepare``, ``ckpt.prepare(state)`` runs
    right after the constructor and its time is counted in the setup (and so in the first total).
    With ``floors``, the floors are measured right before each save (before the constructor for
    the first one), so every save has its own floor pair.  ``settle`` seconds of
    ``floors.settle_machine`` come before each save's clock starts, as before each floor's write.
    """
    from floors import cold_copy, settle_machine

    import ckptd

    run = new_save_run(label)
    if floors is not None:
        run.floors.append(floors.measure())
        # The cold floor of the first save: the copy into memory no save faulted in yet.
        run.floors[0]["copy"]["cold"] = cold_copy((t for _, t in iter_tensors(state)), settle)
        print(f"  floors: cold copy {run.floors[0]['copy']['cold']:.3f} s (fresh mapping)", flush=True)
    settle_machine(settle)
    root = os.path.join(bench_dir, label.replace("[", "-").replace("]", ""))
    started = time.perf_counter()
    cpu_started = cpu_seconds()
    ckpt = ckptd.Checkpointer(root, max_shard_size="2GB")
    constructed = time.perf_counter() - started
    writer_ready = watch_writer_start(ckpt, started)
    if prepare:
        prepare_started = time.perf_counter()
        arena = ckpt.prepare(state)
        run.note = f"prepare(state): {time.perf_counter() - prepare_started:.3f} s, arena {arena / GIB:.3f} GiB"
        print(f"  {label} {run.note}", flush=True)
    run.setup.add(time.perf_counter() - started)
    if staging != "blocking":
        run.note = "; ".join(filter(None, [run.note, f"async_save(staging={staging!r})"]))
    try:
        for step in range(repeats + 1):
            first = step == 0
            if not first:
                if floors is not None:
                    run.floors.append(floors.measure())
                settle_machine(settle)
                started = time.perf_counter()
                cpu_started = cpu_seconds()
            writer_pid = ckpt.writer_pid
            writer_cpu = cpu_seconds(writer_pid) if writer_pid else 0.0  # the first save: 0 before it exists
            call_started = time.perf_counter()
            request = ckpt.async_save(step, state, staging=staging)
            blocking = time.perf_counter() - call_started
            result = request.result()
            total = time.perf_counter() - started
            call_total = time.perf_counter() - call_started  # the async_save call to committed
            # CPU seconds of the save: this process (all its threads) and the writer process
            # (from /proc; for the first save, its start-up included).
            cpu = {"trainer": cpu_seconds() - cpu_started, "writer": cpu_seconds(ckpt.writer_pid) - writer_cpu}
            (run.first_blocking if first else run.warm_blocking).add(blocking)
            (run.first_total if first else run.warm_total).add(total)
            kind = "first" if first else "warm "
            setup = ""
            if first:
                ready = writer_ready.get("writer_ready", -1.0)
                setup = f"; setup: constructor {constructed:.3f} s, writer ready at {ready:.3f} s"
            gib = result.bytes_written / GIB
            print(
                f"  {label} save {step} ({kind}): blocking {blocking:.3f} s, total {total:.3f} s, "
                f"{gib:.3f} GiB; timings {format_timings(request.timings)}; cpu trainer {cpu['trainer']:.3f} s, "
                f"writer {cpu['writer']:.3f} s ({cpu['writer'] / max(gib, 1e-9):.3f} s/GiB){setup}",
                flush=True,
            )
            run.details.append(
                {
                    "step": step,
                    "first": first,
                    "blocking": blocking,
                    "total": total,
                    "call_total": call_total,
                    "timings": dict(request.timings),
                    "cpu": cpu,
                    **({"constructor": constructed, **writer_ready} if first else {}),
                }
            )
            shutil.rmtree(result.path)
    finally:
        ckpt.close()
    free_memory()
    return run


# ---- torch.distributed.checkpoint ----------------------------------------------------------


def free_tcp_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_single_rank_group() -> bool:
    """Start a 1-rank gloo process group if none exists (DCP's process mode needs one).

    Returns True when this function created the group (the caller destroys it).
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    # The checkpoint process DCP spawns reads MASTER_ADDR (else it resolves the host's FQDN).
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_tcp_port()}", rank=0, world_size=1)
    return True


def stop_dcp_process() -> None:
    """Terminate the checkpoint daemon DCP's process mode keeps for the life of the trainer.

    DCP has no public call for this; its ``_AsyncCheckpointProcess`` sends TERMINATE and joins the
    child when it is garbage collected, so drop the module-level reference and collect.
    """
    from torch.distributed.checkpoint import _async_process_executor as executor

    process = executor._CHECKPOINT_PROCESS
    executor._CHECKPOINT_PROCESS = None
    del process
    gc.collect()


def dcp_upload_future(response: Any) -> Any:
    """The future that completes when DCP's write finished (``AsyncSaveResponse`` or a Future)."""
    return getattr(response, "upload_completion", response)


def dcp_staging_options() -> Any:
    """DCP's ``StagingOptions`` used by every benchmark: the fastest set that works on CPU.

    On CPU, pinned memory and non-blocking copies need an accelerator; async staging would only
    move the copy to a thread (the state must not change until it ends), so stage synchronously
    into cached shared-memory storages, which go to the checkpoint process without another copy.
    """
    from torch.distributed.checkpoint.staging import StagingOptions

    return StagingOptions(
        use_pinned_memory=False, use_shared_memory=True, use_async_staging=False, use_non_blocking_copy=False
    )


def bench_dcp(state: State, bench_dir: str, repeats: int, settle: float = 0.0) -> SaveRun:
    """DCP ``async_save`` (process mode, else thread mode) with a reused shared-memory stager."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from floors import settle_machine
    from torch.distributed.checkpoint.staging import DefaultStager
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    created_group = init_single_rank_group()
    mode = AsyncCheckpointerType.PROCESS
    run = new_save_run("DCP")
    options = dcp_staging_options()
    run.note = f"DefaultStager({options}), reused across saves; no_dist=True; 1-rank gloo group"
    stager: Any = None
    try:
        step = 0
        while step <= repeats:
            first = step == 0
            settle_machine(settle)
            started = time.perf_counter()
            if first:
                stager = DefaultStager(options)
                run.setup.add(time.perf_counter() - started)
            path = os.path.join(bench_dir, "dcp", f"step-{step}")
            call_started = time.perf_counter()
            try:
                response = dcp.async_save(
                    state, checkpoint_id=path, async_checkpointer_type=mode, async_stager=stager, no_dist=True
                )
                blocking = time.perf_counter() - call_started
                dcp_upload_future(response).result()
            except Exception:
                if mode is AsyncCheckpointerType.THREAD or not first:
                    raise
                print("  DCP process mode failed; falling back to THREAD mode:", flush=True)
                traceback.print_exc()
                stop_dcp_process()
                shutil.rmtree(path, ignore_errors=True)
                stager.close()
                mode = AsyncCheckpointerType.THREAD
                run = new_save_run("DCP[thread]")
                run.note = f"FALLBACK to thread mode; DefaultStager({options}), reused; no_dist=True"
                continue
            total = time.perf_counter() - started
            (run.first_blocking if first else run.warm_blocking).add(blocking)
            (run.first_total if first else run.warm_total).add(total)
            kind = "first" if first else "warm "
            print(f"  {run.label} save {step} ({kind}): blocking {blocking:.3f} s, total {total:.3f} s", flush=True)
            run.details.append({"step": step, "first": first, "blocking": blocking, "total": total})
            shutil.rmtree(path)
            step += 1
    finally:
        if stager is not None:
            stager.close()
        stop_dcp_process()
        if created_group:
            dist.destroy_process_group()
    run.note += f"; mode={mode.name}"
    free_memory()
    return run


# ---- report --------------------------------------------------------------------------------


def floor_samples(history: list[dict[str, dict[str, float]]]) -> dict[str, Samples]:
    """Samples of every floor method (``copy shared``, ..., ``write floor``) over ``history``."""
    out: dict[str, Samples] = {}
    for measured in history:
        for kind, methods in measured.items():
            for method, seconds in methods.items():
                out.setdefault(f"{kind} {method}", Samples(f"{kind} {method}")).add(seconds)
    return out


def build_rows(baselines: dict[str, Samples], floors: dict[str, Samples], runs: list[SaveRun]) -> list[Row]:
    """Table rows: floors, user-facing baselines, each async saver against the floors (median of
    per-pair ratios), then ckptd against DCP."""
    copy_floor, write_floor = floors["copy floor"], floors["write floor"]
    rows = [Row(f"floor: {name}", samples) for name, samples in floors.items()]
    rows.append(Row("user-facing baseline: copy_ into empty_like", baselines["copy"], copy_floor, "copy floor"))
    if "safetensors" in baselines:
        rows.append(
            Row(
                "user-facing baseline: safetensors save_file+fsync",
                baselines["safetensors"],
                write_floor,
                "write floor",
            )
        )
    for run in runs:
        name = run.label
        paired = bool(run.floors)
        rows += [
            Row(f"{name} setup (constructor)", run.setup),
            Row(
                f"{name} first blocking",
                run.first_blocking,
                copy_floor,
                "copy floor" + (" (pair)" if paired else ""),
                run.pair_ratios("blocking", "copy", True) if paired else None,
            ),
            Row(
                f"{name} first total (incl. setup)",
                run.first_total,
                write_floor,
                "write floor" + (" (pair)" if paired else ""),
                run.pair_ratios("total", "write", True) if paired else None,
            ),
            Row(
                f"{name} warm blocking",
                run.warm_blocking,
                copy_floor,
                "copy floor" + (" (pairs)" if paired else ""),
                run.pair_ratios("blocking", "copy") if paired else None,
            ),
            Row(
                f"{name} warm total",
                run.warm_total,
                write_floor,
                "write floor" + (" (pairs)" if paired else ""),
                run.pair_ratios("total", "write") if paired else None,
            ),
        ]
    ours = next((r for r in runs if r.label == "ckptd"), None)
    theirs = next((r for r in runs if r.label.startswith("DCP")), None)
    if ours is not None and theirs is not None:
        for attr in ("first_blocking", "first_total", "warm_blocking", "warm_total"):
            mine: Samples = getattr(ours, attr)
            other: Samples = getattr(theirs, attr)
            rows.append(Row(f"{mine.name} vs {other.name}", mine, other, f"{theirs.label} (user-facing baseline)"))
    return rows


def format_table(rows: list[Row]) -> str:
    """A fixed-width text table (also valid Markdown)."""
    header = ["what", "median s", "min s", "max s", "n", "ratio", "vs", "diff s"]
    lines = []
    for row in rows:
        s = row.samples
        lines.append(
            [
                row.what,
                f"{s.median:.3f}",
                f"{s.low:.3f}",
                f"{s.high:.3f}",
                str(len(s.values)),
                "" if row.ratio is None else f"{row.ratio:.2f}x",
                row.reference_label,
                "" if row.delta is None else f"{row.delta:+.3f}",
            ]
        )
    return markdown_table(header, lines, left_aligned={0, 6})


def markdown_table(header: list[str], lines: list[list[str]], left_aligned: set[int] | None = None) -> str:
    """A fixed-width Markdown table; columns in ``left_aligned`` (default: all) are left-aligned,
    the others (numbers) right-aligned.  Shared by the other benchmark scripts."""
    widths = [max(len(header[i]), *(len(line[i]) for line in lines)) for i in range(len(header))]
    left = set(range(len(header))) if left_aligned is None else left_aligned

    def fmt(cells: list[str]) -> str:
        padded = [
            cell.ljust(width) if i in left else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
        ]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([fmt(header), rule, *(fmt(line) for line in lines)])


def dump_json(path: str, payload: dict[str, Any]) -> None:
    """Write ``payload`` as indented JSON."""
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)
        f.write("\n")


def floor_methods() -> dict[str, str]:
    """One line per floor: how it is measured (from ``floors.py``)."""
    from floors import METHODS

    return dict(METHODS)


# ---- main ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.0, help="state size in GiB (default 2.0)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats per measurement (default 3)")
    parser.add_argument(
        "--dir",
        default="/work",
        help="parent directory of the fresh benchmark directory (default /work; avoid tmpfs such as /tmp)",
    )
    parser.add_argument("--skip-dcp", action="store_true", help="do not benchmark torch.distributed.checkpoint")
    parser.add_argument(
        "--skip-variants",
        action="store_true",
        help="only ckptd's default configuration (no ckptd[pipelined], ckptd[prepare] and ckptd[background] runs)",
    )
    parser.add_argument(
        "--order",
        default="defaults,pipelined,prepare,background",
        help="the ckptd runs, in this order (default defaults,pipelined,prepare,background): a slow stretch of the "
        "disk lands on whichever run comes then, so a difference between runs is worth checking in "
        "another order",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=1.0,
        help="seconds of sync + pause before every timed write, floors and savers alike (default 1.0; 0 = none)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write all samples and the table as JSON")
    args = parser.parse_args(argv)
    if args.gib <= 0 or args.repeats < 1 or args.settle < 0:
        parser.error("--gib must be > 0, --repeats >= 1 and --settle >= 0")
    args.variants = [v for v in args.order.split(",") if v]
    known = {"defaults", "pipelined", "prepare", "background"}
    if sorted(args.variants) != sorted(set(args.variants)) or not set(args.variants) <= known or not args.variants:
        parser.error(f"--order takes each of {sorted(known)} at most once, got {args.order!r}")
    return args


def timed_phase(title: str, fn: Callable[[], Any]) -> Any:
    """Run one phase, printing its title and wall time."""
    print(f"\n== {title}", flush=True)
    started = time.perf_counter()
    result = fn()
    print(f"   ({time.perf_counter() - started:.1f} s)", flush=True)
    return result


def ensure_bytecode() -> str:
    """Compile ckptd's modules into ``__pycache__`` (as ``pip install`` does for an installed
    package), so first saves do not include compiling ckptd from source, which the trainer
    and the writer process would do at every start under ``PYTHONDONTWRITEBYTECODE`` (set on
    this benchmark machine): about 0.1-0.2 s each.  Returns a line for the log."""
    import compileall

    import ckptd

    package = os.path.dirname(ckptd.__file__)
    ok = compileall.compile_dir(package, quiet=1)
    return f"bytecode: ckptd compiled into __pycache__ under {package} ({'ok' if ok else 'with errors'})"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(2)
    print(ensure_bytecode())
    os.makedirs(args.dir, exist_ok=True)
    bench_dir = tempfile.mkdtemp(prefix="ckptd-bench-", dir=args.dir)
    machine = machine_info(bench_dir)
    print("command:", shlex.join([sys.executable, *sys.argv]))
    print("machine:", ", ".join(f"{k}={v}" for k, v in machine.items()))
    try:
        state = timed_phase("building state", lambda: build_state(args.gib))
        total = state_bytes(state)
        count = sum(1 for _ in iter_tensors(state))
        hidden = hidden_size_for(args.gib)
        print(
            f"state: {total / GIB:.3f} GiB ({total} bytes), {count} tensors; vocab {VOCAB}, hidden {hidden}, "
            f"{LAYERS} layers; bf16 weights + fp32 Adam exp_avg/exp_avg_sq + int64 step"
        )
        baselines: dict[str, Samples] = {}
        baselines["copy"] = timed_phase(
            "user-facing baseline: copy_ into empty_like", lambda: bench_copy_baseline(state, args.repeats, args.settle)
        )
        baselines["safetensors"] = timed_phase(
            "user-facing baseline: safetensors save_file+fsync",
            lambda: bench_safetensors(state, bench_dir, args.repeats, args.settle),
        )
        floors = timed_phase("floors: allocating and warming up", lambda: Floors(state, bench_dir, args.settle))
        print(warm_up_ckptd(bench_dir), flush=True)
        # Every ckptd run: the same state, floors and settle; they differ in label and options.
        save_run = functools.partial(bench_ckptd, state, bench_dir, args.repeats, floors=floors, settle=args.settle)
        variants: dict[str, tuple[str, Callable[[], SaveRun]]] = {
            "defaults": ("ckptd async_save", save_run),
            "pipelined": (
                'ckptd async_save(staging="pipelined")',
                lambda: save_run("ckptd[pipelined]", staging="pipelined"),
            ),
            "prepare": ("ckptd async_save after ckpt.prepare(state)", lambda: save_run("ckptd[prepare]", prepare=True)),
            "background": (
                'ckptd async_save(staging="background")',
                lambda: save_run("ckptd[background]", staging="background"),
            ),
        }
        order = ["defaults"] if args.skip_variants else args.variants
        runs: list[SaveRun] = [timed_phase(*variants[name]) for name in order]
        floors.close()
        free_memory()
        if not args.skip_dcp:
            runs.append(timed_phase("DCP async_save", lambda: bench_dcp(state, bench_dir, args.repeats, args.settle)))
        floor_history = [f for run in runs for f in run.floors]
        floor_stats = floor_samples(floor_history)
        floor_stats = {
            "copy floor": floor_stats.pop("copy floor"),
            "write floor": floor_stats.pop("write floor"),
            **floor_stats,
        }
        for name in ("copy floor", "write floor"):
            print(f"   {name}: {total / GIB / floor_stats[name].median:.2f} GiB/s (median)")
        rows = build_rows(baselines, floor_stats, runs)
        print(f"\n== results: {total / GIB:.3f} GiB, {count} tensors; first save = 1, warm saves = {args.repeats}")
        for run in runs:
            if run.note:
                print(f"{run.label}: {run.note}")
        print(format_table(rows))
        if args.json:
            dump_json(
                args.json,
                {
                    "command": shlex.join([sys.executable, *sys.argv]),
                    "machine": machine,
                    "settle_seconds": args.settle,
                    "state": {"bytes": total, "tensors": count, "vocab": VOCAB, "hidden": hidden, "layers": LAYERS},
                    "floors": {k: asdict(v) for k, v in floor_stats.items()},
                    "floor_methods": floor_methods(),
                    "baselines": {k: asdict(v) for k, v in baselines.items()},
                    "runs": [asdict(r) for r in runs],
                    "table": [
                        {
                            "what": r.what,
                            "median": r.samples.median,
                            "min": r.samples.low,
                            "max": r.samples.high,
                            "n": len(r.samples.values),
                            "ratio": r.ratio,
                            "pair_ratios": r.pair_ratios,
                            "vs": r.reference_label,
                            "diff": r.delta,
                        }
                        for r in rows
                    ],
                },
            )
            print(f"wrote {args.json}")
    finally:
        shutil.rmtree(bench_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
