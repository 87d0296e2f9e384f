#!/usr/bin/env python
"""Benchmark how much a checkpoint being written slows a CPU training loop.

A "training loop" is fixed CPU work per step, with torch's default threads (all cores), in one of
these step shapes (``--shapes``, default both):

* ``matmul``: ``x = tanh(x @ w)`` on 1024x1024 fp32 matrices, repeated so that one step takes
  about ``--step-ms`` milliseconds (one shape per value; default 5 and 30 ms);
* ``transformer``: one training step of a small transformer encoder (2 layers, d_model 256,
  4 heads, feed-forward 1024, dropout 0; batch 8 x 128 tokens, fixed seed): forward, MSE loss
  against a fixed random target, backward and an ``AdamW`` step (sized for roughly 50-80 ms
  on 2 idle cores; the row label gives the step time measured before the first save).

The checkpointed state is the same for every shape: the transformer-shaped state of
``bench_save.py`` (about ``--gib`` GiB), not the model being trained; only the training work
differs. For each step shape the script runs ``--repeats`` rounds; in each round every saver
in turn (the order rotates from round to round, so a drift of the machine's speed reaches all
savers alike) does:

1. ``--baseline-steps`` steps with no save running (the baseline of that saver and shape);
2. start one save of the state and run steps until the save is done.

The savers, each with one untimed warm-up save first (arena allocation, process start):

* the **interference floor** (``--skip-write-floor`` leaves it out): ``raw_writer.py``, a process
  of its own at ckptd's writer niceness, writes the state's bytes as the write floor of
  ``floors.py`` does (``O_DIRECT`` 16 MiB ``pwrite`` calls from one filled page-aligned buffer,
  then ``fsync``): no staging, no checksum, no format.  Whatever it slows steps by is the cost of
  the I/O itself on this machine; a saver's slowdown beyond it is the saver's own;
* ckptd ``async_save`` with default settings (blocking staging, so the bytes are in the staging
  arena when the call returns and the writer process writes them while the loop runs; the
  adaptive throttle on, whose step monitor keeps the last 16 step times as its baseline, so the
  other savers' rounds are out of it by the time its own save starts);
* with ``--unthrottled``, ckptd with its adaptive throttle off (``Checkpointer(throttle=False)``:
  the writer at full speed whatever the steps do);
* DCP ``async_save`` in process mode with a reused shared-memory ``DefaultStager`` (staging is
  synchronous, as in ``bench_save.py``); steps run while its upload future is not done.  Its
  rounds run after the others' (its checkpoint process and process group are set up once).

Reported per saver and step shape: median step time with no save, median step time while the
save is written, their ratio (the target is <= 1.10x), and the training time lost per save (the
step time spent beyond the no-save median by the steps run during the save, per save): a saver
that slows steps a lot for a short time can lose less than one that slows them a little for long.
The JSON gives each result's step shape (``shape``: its kind and sizes, and for ``matmul`` the
number of matmuls per step).

Example::

    python benchmarks/bench_interference.py --gib 2 --repeats 3 --json interference.json
    python benchmarks/bench_interference.py --shapes transformer --skip-dcp
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_save import (  # the sibling script, importable once its directory is on the path
    GIB,
    State,
    build_state,
    dcp_staging_options,
    dcp_upload_future,
    dump_json,
    free_memory,
    init_single_rank_group,
    iter_tensors,
    machine_info,
    state_bytes,
    stop_dcp_process,
    timed_phase,
)

MATRIX = 1024


class Pending(Protocol):
    """What a started save returns: a future-like object (ckptd ``SaveRequest``, DCP's Future)."""

    def done(self) -> bool: ...

    def result(self, timeout: float | None = None) -> Any: ...


# ---- the training loops --------------------------------------------------------------------

SHAPES = ("matmul", "transformer")

# The small transformer of the "transformer" step shape.
LAYERS = 2
D_MODEL = 256
HEADS = 4
FEED_FORWARD = 1024
SEQUENCE = 128
BATCH = 8


class StepLoop(Protocol):
    """A training loop: one ``step()`` of fixed work, a ``label`` for the rows and a JSON ``shape``."""

    label: str
    shape: dict[str, Any]

    def describe(self) -> str: ...

    def step(self) -> float: ...


def typical_step(step: Callable[[], float], warm_up: int, samples: int) -> float:
    """Seconds of one step after ``warm_up`` steps (allocator, thread pool, CPU clocks): the lowest
    of three medians of ``samples`` steps, so that a burst of load elsewhere does not decide it."""
    for _ in range(warm_up):
        step()
    return min(statistics.median(step() for _ in range(samples)) for _ in range(3))


class MatmulLoop:
    """Fixed CPU work per step: ``x = tanh(x @ w)`` ``matmuls`` times on 1024x1024 fp32."""

    def __init__(self, step_seconds: float, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(MATRIX, MATRIX, generator=gen)
        self.w = torch.randn(MATRIX, MATRIX, generator=gen) / MATRIX**0.5
        self.matmuls = 1
        self.on_step: Callable[[], None] | None = None
        one = typical_step(self.step, warm_up=10, samples=10)
        self.matmuls = max(1, round(step_seconds / one))
        self.label = f"matmul step ~{step_seconds * 1e3:.0f} ms ({self.matmuls} matmul(s) here)"
        self.shape = {
            "kind": "matmul",
            "target_ms": step_seconds * 1e3,
            "matrix": MATRIX,
            "matmuls": self.matmuls,
            "one_matmul_ms": one * 1e3,
        }

    def describe(self) -> str:
        return f"{self.matmuls} x tanh(x @ w), 1024x1024 fp32"

    def step(self) -> float:
        """Run one step; returns its wall time in seconds."""
        if self.on_step is not None:
            self.on_step()  # no torch optimizer here: tell ckptd's adaptive throttle a step began
        started = time.perf_counter()
        x = self.x
        for _ in range(self.matmuls):
            x = torch.tanh(x @ self.w)
        self.x = x
        return time.perf_counter() - started


class TransformerLoop:
    """One training step of a small transformer encoder: forward, MSE loss, backward, ``AdamW`` step."""

    def __init__(self, seed: int = 0) -> None:
        from torch import nn

        with torch.random.fork_rng(devices=[]):  # seeded weights without moving the global generator
            torch.manual_seed(seed)
            layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, FEED_FORWARD, dropout=0.0, batch_first=True)
            self.model = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        gen = torch.Generator().manual_seed(seed + 1)
        self.inputs = torch.randn(BATCH, SEQUENCE, D_MODEL, generator=gen)
        self.targets = torch.randn(BATCH, SEQUENCE, D_MODEL, generator=gen)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.loss = float("nan")
        typical = typical_step(self.step, warm_up=5, samples=5)
        self.label = f"small transformer fwd+bwd+AdamW (~{typical * 1e3:.0f} ms)"
        parameters = sum(p.numel() for p in self.model.parameters())
        self.shape = {
            "kind": "transformer",
            "layers": LAYERS,
            "d_model": D_MODEL,
            "heads": HEADS,
            "feed_forward": FEED_FORWARD,
            "sequence": SEQUENCE,
            "batch": BATCH,
            "parameters": parameters,
            "optimizer": "AdamW(lr=1e-4)",
            "step_ms_at_start": typical * 1e3,
        }

    def describe(self) -> str:
        params = self.shape["parameters"] / 1e6
        return (
            f"TransformerEncoder {LAYERS} layers, d_model {D_MODEL}, {HEADS} heads, feed-forward {FEED_FORWARD}, "
            f"{params:.2f} M parameters; batch {BATCH} x {SEQUENCE} tokens; forward + MSE + backward + AdamW"
        )

    def step(self) -> float:
        """Run one training step; returns its wall time in seconds."""
        started = time.perf_counter()
        loss = torch.nn.functional.mse_loss(self.model(self.inputs), self.targets)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.loss = loss.item()
        return time.perf_counter() - started


# ---- measurement ---------------------------------------------------------------------------


@dataclass
class Interference:
    """Step times of one saver: without a save, and while a save was being written."""

    label: str
    baseline: list[float] = field(default_factory=list)
    during: list[float] = field(default_factory=list)
    saves: list[dict[str, Any]] = field(default_factory=list)
    note: str = ""
    shape: dict[str, Any] = field(default_factory=dict)

    @property
    def baseline_median(self) -> float:
        return statistics.median(self.baseline)

    @property
    def during_median(self) -> float | None:
        return statistics.median(self.during) if self.during else None

    @property
    def ratio(self) -> float | None:
        during = self.during_median
        return None if during is None else during / self.baseline_median

    @property
    def lost_per_save(self) -> float:
        """Training time lost per save: step time during saves beyond the no-save median, averaged."""
        return (sum(self.during) - len(self.during) * self.baseline_median) / len(self.saves)


@dataclass
class Saver:
    """One saver under test: ``start(i)`` starts save ``i`` and returns its future,
    ``finish(i, result)`` cleans up after it (untimed); ``on_step`` is what the matmul loops call
    at each step while this saver's round runs (ckptd's ``mark_step``, for its throttle)."""

    label: str
    start: Callable[[int], Pending]
    finish: Callable[[int, Any], None]
    note: str = ""
    on_step: Callable[[], None] | None = None


def measure_one_save(measured: Interference, loop: StepLoop, saver: Saver, i: int, baseline_steps: int) -> None:
    """Baseline steps with no save, then save ``i`` with steps run until it is done."""
    if isinstance(loop, MatmulLoop):
        loop.on_step = saver.on_step
    try:
        measured.baseline += [loop.step() for _ in range(baseline_steps)]
        started = time.perf_counter()
        pending = saver.start(i)
        blocking = time.perf_counter() - started
        steps: list[float] = []
        while not pending.done():
            steps.append(loop.step())
        seconds = time.perf_counter() - started
        result = pending.result()
    finally:
        if isinstance(loop, MatmulLoop):
            loop.on_step = None
    measured.during += steps
    summary: dict[str, Any] = {
        "blocking": blocking,
        "seconds_to_done": seconds,
        "steps": len(steps),
        "median_step": statistics.median(steps) if steps else None,
    }
    timings = getattr(pending, "timings", None)
    if timings:
        summary["timings"] = dict(timings)
    measured.saves.append(summary)
    median = f"{summary['median_step'] * 1e3:.1f} ms" if steps else "-"
    print(
        f"  {saver.label} save {i}: blocking {blocking:.3f} s, done after {seconds:.3f} s, "
        f"{len(steps)} steps during it (median {median}); "
        f"baseline median so far {measured.baseline_median * 1e3:.1f} ms",
        flush=True,
    )
    saver.finish(i, result)


def measure_interleaved(loop: StepLoop, savers: list[Saver], repeats: int, baseline_steps: int) -> list[Interference]:
    """``repeats`` rounds; in each, every saver in turn runs baseline steps and then one save
    (the order rotates from round to round), so that a drift of this machine's speed reaches
    every saver alike instead of the one that happened to run last."""
    measured = [Interference(s.label, note=s.note, shape=dict(loop.shape)) for s in savers]
    for i in range(repeats):
        shift = i % len(savers)
        for k in [*range(shift, len(savers)), *range(shift)]:
            measure_one_save(measured[k], loop, savers[k], i, baseline_steps)
    free_memory()
    return measured


# ---- savers --------------------------------------------------------------------------------


def ckptd_saver(stack: ExitStack, label: str, state: State, bench_dir: str, **options: Any) -> Saver:
    """ckptd ``async_save`` (default blocking staging) of a Checkpointer that ``stack`` closes;
    ``options`` go to the Checkpointer.  One untimed save first (arena allocation, writer start)."""
    import ckptd

    root = os.path.join(bench_dir, label.replace("=", "").replace(" ", "-").replace(",", ""))
    ckpt = stack.enter_context(ckptd.Checkpointer(root, **options))
    shutil.rmtree(ckpt.save(0, state).path)

    def start(i: int) -> Pending:
        return ckpt.async_save(i + 1, state)

    def finish(i: int, result: Any) -> None:
        shutil.rmtree(result.path)

    note = f"Checkpointer({', '.join(f'{k}={v!r}' for k, v in options.items()) or 'defaults: adaptive throttle on'})"
    # The matmul loops tell the throttle where steps begin; the transformer's AdamW steps are
    # timed by ckptd's optimizer hook.
    return Saver(label, start, finish, note, on_step=ckpt.mark_step)


class RawWrite:
    """One write of ``raw_writer.py`` in its own process, started by a line on its stdin."""

    def __init__(self, nbytes: int, path: str, nice: int) -> None:
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "raw_writer.py")
        command = [sys.executable, script, "--bytes", str(nbytes), "--path", path, "--nice", str(nice)]
        self.path = path
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self._line() != "ready":  # the buffer is filled: from here on the process only writes
            self.close()
            raise RuntimeError(f"raw_writer.py did not start (exit code {self.process.returncode})")

    def _line(self) -> str:
        assert self.process.stdout is not None
        return self.process.stdout.readline().strip()

    def start(self) -> RawWrite:
        assert self.process.stdin is not None
        self.process.stdin.write("go\n")
        self.process.stdin.flush()
        return self

    def done(self) -> bool:
        return self.process.poll() is not None

    def result(self, timeout: float | None = None) -> float:
        """Seconds the write took, as the writer measured it."""
        line = self._line()
        if self.process.wait(timeout) != 0 or not line:
            raise RuntimeError(f"raw_writer.py failed (exit code {self.process.returncode})")
        return float(line)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()
        if os.path.exists(self.path):
            os.remove(self.path)


def write_floor_saver(stack: ExitStack, nbytes: int, bench_dir: str, repeats: int, nice: int = 10) -> Saver:
    """The interference floor: ``raw_writer.py`` writes ``nbytes`` as the write floor does
    (``O_DIRECT`` + ``fsync``; no staging, no checksum, no format) at ckptd's writer niceness.
    The process of the next write (of ``repeats``) is started, and its buffer filled, when a
    write is cleaned up."""
    path = os.path.join(bench_dir, "raw-writer.bin")
    writes = [RawWrite(nbytes, path, nice)]
    stack.callback(lambda: writes[-1].close())

    def start(i: int) -> Pending:
        return writes[-1].start()

    def finish(i: int, result: Any) -> None:
        writes[-1].close()
        if i + 1 < repeats:
            writes.append(RawWrite(nbytes, path, nice))

    note = f"raw_writer.py: the write floor's O_DIRECT 16 MiB pwrites + fsync in its own process, nice {nice}"
    return Saver("write floor", start, finish, note)


def dcp_saver(stack: ExitStack, state: State, bench_dir: str, repeats: int) -> Saver:
    """DCP ``async_save`` in process mode with a reused shared-memory stager (one untimed save
    first: it spawns the checkpoint process and faults the stager in)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    if init_single_rank_group():
        stack.callback(dist.destroy_process_group)
    stack.callback(stop_dcp_process)
    stager = DefaultStager(dcp_staging_options())
    stack.callback(stager.close)

    def start(i: int) -> Pending:
        response = dcp.async_save(
            state,
            checkpoint_id=os.path.join(bench_dir, "dcp", f"step-{i}"),
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            async_stager=stager,
            no_dist=True,
        )
        return dcp_upload_future(response)

    def finish(i: int, result: Any) -> None:
        shutil.rmtree(os.path.join(bench_dir, "dcp", f"step-{i}"))

    start(repeats).result()
    finish(repeats, None)
    note = "dcp.async_save(async_checkpointer_type=PROCESS, DefaultStager(shared memory)), no_dist=True"
    return Saver("DCP async_save (process)", start, finish, note)


# ---- report --------------------------------------------------------------------------------


def format_table(results: list[Interference]) -> str:
    """A Markdown table: step medians without and during a save, their ratio, save stats."""
    lines = [
        "| saver | steps no save | median no save ms | steps during save | median during ms | ratio | mean during ms "
        "| save s (median) | lost per save s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        during = r.during_median
        save_s = statistics.median(s["seconds_to_done"] for s in r.saves)
        lines.append(
            f"| {r.label} | {len(r.baseline)} | {r.baseline_median * 1e3:.1f} | {len(r.during)} | "
            f"{'-' if during is None else f'{during * 1e3:.1f}'} | "
            f"{'-' if r.ratio is None else f'{r.ratio:.2f}x'} | "
            f"{'-' if not r.during else f'{statistics.mean(r.during) * 1e3:.1f}'} | {save_s:.3f} | "
            f"{r.lost_per_save:.3f} |"
        )
    return "\n".join(lines)


# ---- main ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.0, help="state size in GiB (default 2.0)")
    parser.add_argument("--repeats", type=int, default=3, help="saves per saver (default 3)")
    parser.add_argument(
        "--shapes",
        type=lambda v: [x.strip() for x in v.split(",") if x.strip()],
        default=list(SHAPES),
        help=f"comma-separated step shapes, of {','.join(SHAPES)} (default: all; matmul is one shape per --step-ms)",
    )
    parser.add_argument(
        "--step-ms",
        type=lambda v: [float(x) for x in v.split(",")],
        default=[5.0, 30.0],
        help="comma-separated target step times in ms of the matmul shapes, one shape each (default 5,30)",
    )
    parser.add_argument(
        "--baseline-steps", type=int, default=30, help="steps with no save before each save (default 30)"
    )
    parser.add_argument("--dir", default="/work", help="parent of the fresh benchmark directory (default /work)")
    parser.add_argument(
        "--unthrottled",
        action="store_true",
        help="also measure ckptd without its adaptive I/O throttle (Checkpointer(throttle=False)), one row per shape",
    )
    parser.add_argument("--skip-dcp", action="store_true", help="do not benchmark torch.distributed.checkpoint")
    parser.add_argument(
        "--skip-write-floor",
        action="store_true",
        help="do not measure the interference floor (raw_writer.py writing the same bytes)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write all samples as JSON")
    args = parser.parse_args(argv)
    if args.gib <= 0 or args.repeats < 1 or min(args.step_ms) <= 0 or args.baseline_steps < 1:
        parser.error("--gib and --step-ms must be > 0, --repeats and --baseline-steps >= 1")
    unknown = sorted(set(args.shapes) - set(SHAPES))
    if unknown or not args.shapes:
        parser.error(f"--shapes: unknown or no step shape(s) {unknown}; choose from {','.join(SHAPES)}")
    return args


def make_loops(args: argparse.Namespace) -> Iterator[StepLoop]:
    """The training loops of ``--shapes``, in order, each built (and its step timed) in turn."""
    for kind in args.shapes:
        if kind == "matmul":
            for step_ms in args.step_ms:
                yield MatmulLoop(step_ms / 1e3)
        else:
            yield TransformerLoop()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    bench_dir = tempfile.mkdtemp(prefix="ckptd-bench-interference-", dir=args.dir)
    machine = machine_info(bench_dir)
    command = shlex.join([sys.executable, *sys.argv])
    print("command:", command)
    print("machine:", ", ".join(f"{k}={v}" for k, v in machine.items()))
    try:
        # Every loop is built (and its step timed) first, on a quiet machine: a shape timed right
        # after the previous shape's saves met the host still busy with their writes (one
        # 1024^2 matmul took 20+ ms instead of 14 there, and "~30 ms" got 1 matmul instead of 2).
        loops = timed_phase("timing the step shapes", lambda: list(make_loops(args)))
        state = timed_phase("building state", lambda: build_state(args.gib))
        total = state_bytes(state)
        count = sum(1 for _ in iter_tensors(state))
        print(f"state: {total / GIB:.3f} GiB, {count} tensors")
        results: list[Interference] = []
        for loop in loops:
            shape = loop.label
            print(f"step: {shape}: {loop.describe()}, torch threads {torch.get_num_threads()}")
            with ExitStack() as stack:
                savers = []
                if not args.skip_write_floor:
                    savers.append(write_floor_saver(stack, total, bench_dir, args.repeats))
                savers.append(ckptd_saver(stack, "ckptd", state, bench_dir))
                if args.unthrottled:
                    savers.append(ckptd_saver(stack, "ckptd throttle=False", state, bench_dir, throttle=False))
                names = ", ".join(s.label for s in savers)
                measured = timed_phase(
                    f"{names}, interleaved, {shape}",
                    lambda lp=loop, sv=savers: measure_interleaved(lp, sv, args.repeats, args.baseline_steps),
                )
            if not args.skip_dcp:
                with ExitStack() as stack:
                    dcp = [dcp_saver(stack, state, bench_dir, args.repeats)]
                    measured += timed_phase(
                        f"DCP async_save, process mode, {shape}",
                        lambda lp=loop, sv=dcp: measure_interleaved(lp, sv, args.repeats, args.baseline_steps),
                    )
            for result in measured:
                result.label += f", {shape}"
            results += measured
            del loop
            free_memory()
        print(f"\n== results: {total / GIB:.3f} GiB state, {args.repeats} saves per saver")
        for r in results:
            print(f"{r.label}: {r.note}")
        print(format_table(results))
        if args.json:
            dump_json(
                args.json,
                {
                    "command": command,
                    "machine": machine,
                    "state": {"bytes": total, "tensors": count},
                    "torch_threads": torch.get_num_threads(),
                    "results": [
                        {
                            **asdict(r),
                            "baseline_median": r.baseline_median,
                            "during_median": r.during_median,
                            "ratio": r.ratio,
                            "lost_per_save": r.lost_per_save,
                        }
                        for r in results
                    ],
                },
            )
            print(f"wrote {args.json}")
    finally:
        shutil.rmtree(bench_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
