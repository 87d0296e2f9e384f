#!/usr/bin/env python
"""The device-to-host staging of ``async_save`` on a CUDA device, against a raw pinned-copy floor.

A state of ``--size-gib`` GiB in ``--tensors`` float32 tensors lives on the GPU.  In interleaved
rounds (floor, ckptd, floor, ckptd, ...):

* **floor**: ``copy_(non_blocking=True)`` of every tensor into one page-locked buffer allocated
  once (``torch.empty(pin_memory=True)``), on a side stream, until the stream is done: the same
  bytes over the same link, with no checkpoint around them.
* **ckptd, blocking**: ``async_save(staging="blocking")`` into its reused arena (shared memory
  registered with ``cudaHostRegister``): the wall time of the call (what training waits for) and
  the copy alone (``timings["stage"]``); then the commit (written, fsynced, renamed).
* **ckptd, background**: ``async_save(staging="background")``: how long the call blocks and when
  the copy is done (``request.staged``).
* **compute during staging**: a loop of bf16 matrix products on the default stream, alone and
  started at once after a background save (the copies run on a side stream, over the copy
  engines): the loop's time during the copies against alone.
* **load**: the checkpoint back onto the GPU, as new tensors (``device="cuda"``) and into the
  live ones (``into=``), and onto the CPU, against a floor that reads the same files with a
  thread per core into a page-locked buffer and copies each piece to the GPU as it arrives (the
  page cache holds the files for both).  The load onto the CPU is a reference, not a target: its
  time depends on whether the process's allocator has freed memory of that size before.
* **the next step**: one optimizer step of an MLP right after a background save (the step guard
  orders its kernels after the copies) against the same step alone.

The first ckptd save (the arena created, pre-faulted and registered) and the first floor (the
pinned buffer allocated) are reported apart.  PyTorch DCP's ``async_save`` runs beside it as a
peer row when it can.  Printed: medians, and medians of per-round ratios to the floor of the
same round; ``--json`` writes every figure.

Example (on a GPU machine)::

    python benchmarks/bench_gpu.py --size-gib 2 --tensors 128 --rounds 5 --json gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

import torch

import ckptd

GIB = 1024**3


def make_state(size_gib: float, tensors: int) -> dict[str, torch.Tensor]:
    """``tensors`` float32 tensors on the GPU, ``size_gib`` GiB together (sizes vary by 2x)."""
    total = int(size_gib * GIB) // 4
    weights = [1.0 + (i % 7) / 6 for i in range(tensors)]
    scale = total / sum(weights)
    generator = torch.Generator(device="cuda").manual_seed(0)
    return {
        f"layers.{i}.weight": torch.randn(int(w * scale), device="cuda", generator=generator)
        for i, w in enumerate(weights)
    }


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


class PinnedFloor:
    """The same copies into one page-locked buffer, on a side stream."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        started = time.perf_counter()
        self.buffer = torch.empty(nbytes(state), dtype=torch.uint8, pin_memory=True)
        self.allocate_seconds = time.perf_counter() - started
        self.views, offset = [], 0
        for tensor in state.values():
            size = tensor.numel() * tensor.element_size()
            self.views.append(self.buffer[offset : offset + size].view(tensor.dtype).view(tensor.shape))
            offset += size
        self.stream = torch.cuda.Stream()

    def copy(self, state: dict[str, torch.Tensor]) -> float:
        torch.cuda.synchronize()
        started = time.perf_counter()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for view, tensor in zip(self.views, state.values(), strict=True):
                view.copy_(tensor, non_blocking=True)
        self.stream.synchronize()
        return time.perf_counter() - started


def matmul_loop(a: torch.Tensor, b: torch.Tensor, count: int) -> float:
    """Seconds of ``count`` products on the default stream, timed by CUDA events."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(count):
        torch.mm(a, b)
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1000


class Trainer:
    """One MLP training step (forward, backward, AdamW step), timed to its end on the GPU."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(4096, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 4096)
        ).cuda()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.data = torch.randn(256, 4096, device="cuda")
        for _ in range(3):
            self.step()

    def step(self) -> float:
        torch.cuda.synchronize()
        started = time.perf_counter()
        self.model(self.data).pow(2).mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        torch.cuda.synchronize()
        return time.perf_counter() - started


def wait_staged(request: Any, started: float) -> float:
    request.staged.wait(600)
    return time.perf_counter() - started


def dcp_row(state: dict[str, torch.Tensor], where: str, rounds: int) -> dict[str, Any]:
    """PyTorch DCP's ``async_save`` of the same state: blocking and committed seconds."""
    try:
        import torch.distributed.checkpoint as dcp
    except ImportError as e:
        return {"error": f"torch.distributed.checkpoint: {e}"}
    blocking, committed = [], []
    try:
        for index in range(rounds):
            path = os.path.join(where, f"dcp-{index}")
            torch.cuda.synchronize()
            started = time.perf_counter()
            response: Any = dcp.async_save({"model": state}, checkpoint_id=path)
            blocking.append(time.perf_counter() - started)
            getattr(response, "upload_completion", response).result()  # a Future, or a response holding two
            committed.append(time.perf_counter() - started)
            shutil.rmtree(path, ignore_errors=True)
    except Exception as e:  # noqa: BLE001 - a peer that cannot run is a row that says why
        return {"error": f"{type(e).__name__}: {e}"[:300], "blocking": blocking, "committed": committed}
    return {"blocking": blocking, "committed": committed}


def budget_rows(state: dict[str, torch.Tensor], where: str, budget: str, rounds: int) -> dict[str, Any]:
    """Saves of ``state`` through a ``staging_memory`` budget (streamed through a pinned ring
    when the state is larger): blocking and committed, and with background staging the time
    until every byte is staged (what the next optimizer step waits for)."""
    out: dict[str, Any] = {k: [] for k in ("blocking", "committed", "background_blocking", "background_staged")}
    with ckptd.Checkpointer(os.path.join(where, "budget"), keep_last=2, staging_memory=budget) as ckpt:
        ckpt.save(0, {"model": state})
        out["streamed"] = all(arena.streamed and arena.pinned for arena in ckpt._pool._arenas)
        step = 0
        for _ in range(rounds):
            step += 1
            torch.cuda.synchronize()
            started = time.perf_counter()
            request = ckpt.async_save(step, {"model": state}, staging="blocking")
            out["blocking"].append(time.perf_counter() - started)
            out["committed"].append(request.wait(600).timings["total"])
            step += 1
            torch.cuda.synchronize()
            started = time.perf_counter()
            request = ckpt.async_save(step, {"model": state}, staging="background")
            out["background_blocking"].append(time.perf_counter() - started)
            out["background_staged"].append(wait_staged(request, started))
            request.wait(600)
    return out


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=2.0)
    parser.add_argument("--tensors", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    parser.add_argument("--json", default=None, help="write every figure here")
    parser.add_argument("--no-dcp", action="store_true", help="skip the DCP row")
    parser.add_argument(
        "--staging-memory", default=None, help="also save through this staging budget (e.g. 256MiB: streamed)"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA device")

    where = tempfile.mkdtemp(prefix="bench-gpu-", dir=args.dir)
    state = make_state(args.size_gib, args.tensors)
    size = nbytes(state)
    torch.cuda.synchronize()
    figures: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "bytes": size,
        "tensors": len(state),
        "rounds": args.rounds,
    }
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    matmul_loop(a, b, 5)
    trainer = Trainer()

    floor = PinnedFloor(state)
    load_floor = LoadFloor(size + (64 << 20))  # the files' headers and alignment on top of the tensors
    first_floor = floor.allocate_seconds + floor.copy(state)
    rows: dict[str, list[float]] = {
        k: []
        for k in (
            "floor",
            "blocking",
            "stage",
            "committed",
            "background_blocking",
            "background_staged",
            "loop_alone",
            "loop_during",
            "step_alone",
            "step_after_save",
            "load_floor",
            "load_new",
            "load_into",
            "load_cpu",
        )
    }
    try:
        with ckptd.Checkpointer(os.path.join(where, "ckptd"), keep_last=2) as ckpt:
            started = time.perf_counter()
            request = ckpt.async_save(0, {"model": state}, staging="blocking")
            first_blocking = time.perf_counter() - started
            request.wait(600)
            figures["first"] = {"ckptd_blocking": first_blocking, "floor": first_floor, "arena_pinned": None}
            figures["first"]["arena_pinned"] = all(arena.pinned for arena in ckpt._pool._arenas)
            floor_seconds = floor.copy(state)
            loop_count = max(4, round(floor_seconds / max(matmul_loop(a, b, 10) / 10, 1e-6)))
            figures["loop_products"] = loop_count
            step = 0
            for _ in range(args.rounds):
                rows["floor"].append(floor.copy(state))
                step += 1
                torch.cuda.synchronize()
                started = time.perf_counter()
                request = ckpt.async_save(step, {"model": state}, staging="blocking")
                rows["blocking"].append(time.perf_counter() - started)
                rows["stage"].append(request.timings["stage"])
                result = request.wait(600)
                rows["committed"].append(result.timings["total"])

                rows["loop_alone"].append(matmul_loop(a, b, loop_count))
                step += 1
                torch.cuda.synchronize()
                started = time.perf_counter()
                request = ckpt.async_save(step, {"model": state}, staging="background")
                rows["background_blocking"].append(time.perf_counter() - started)
                rows["loop_during"].append(matmul_loop(a, b, loop_count))
                rows["background_staged"].append(wait_staged(request, started))
                request.wait(600)

                rows["step_alone"].append(trainer.step())
                step += 1
                torch.cuda.synchronize()
                request = ckpt.async_save(step, {"model": trainer.model}, staging="background")
                rows["step_after_save"].append(trainer.step())
                request.wait(600)
            step += 1
            loaded_path = ckpt.save(step, {"model": state}).path
            load_floor.run(loaded_path)  # the writer dropped the files from the page cache: read warm from here on
            for _ in range(args.rounds):
                rows["load_floor"].append(load_floor.run(loaded_path))
                rows["load_new"].append(_timed(lambda: ckpt.load(step, device="cuda")))
                rows["load_into"].append(_timed(lambda: ckpt.load(step, into={"model": state})))
                rows["load_cpu"].append(_timed(lambda: ckpt.load(step)))
        if args.staging_memory:
            figures["budget"] = budget_rows(state, where, args.staging_memory, args.rounds)
        if not args.no_dcp:
            figures["dcp"] = dcp_row(state, where, min(args.rounds, 3))
    finally:
        shutil.rmtree(where, ignore_errors=True)

    figures["rows"] = rows
    ratio = lambda k, base: [x / y for x, y in zip(rows[k], rows[base], strict=True)]  # noqa: E731
    figures["ratios"] = {
        "blocking/floor": median(ratio("blocking", "floor")),
        "stage/floor": median(ratio("stage", "floor")),
        "background_staged/floor": median(ratio("background_staged", "floor")),
        "loop_during/loop_alone": median(ratio("loop_during", "loop_alone")),
        "step_after_save/step_alone": median(ratio("step_after_save", "step_alone")),
        "load_new/load_floor": median(ratio("load_new", "load_floor")),
        "load_into/load_floor": median(ratio("load_into", "load_floor")),
        "load_cpu/load_floor": median(ratio("load_cpu", "load_floor")),
    }
    gib = size / GIB
    print(f"{figures['device']}, torch {figures['torch']}: {gib:.2f} GiB in {len(state)} tensors, {args.rounds} rounds")
    floor_median = median(rows["floor"])
    print(f"  floor (pinned copy_, side stream) {floor_median:.4f} s = {gib / floor_median:.1f} GiB/s")
    for key in ("blocking", "stage", "committed", "background_blocking", "background_staged"):
        print(f"  ckptd {key:<22} {median(rows[key]):.4f} s")
    print(f"  first save: ckptd blocks {figures['first']['ckptd_blocking']:.3f} s, floor {first_floor:.3f} s")
    for key, value in figures["ratios"].items():
        print(f"  {key:<28} {value:.3f}")
    for key in ("load_floor", "load_new", "load_into", "load_cpu"):
        print(f"  {key:<22} {median(rows[key]):.4f} s")
    if "budget" in figures:
        budget = figures["budget"]
        print(f"  through staging_memory={args.staging_memory} (streamed: {budget['streamed']}):")
        for key in ("blocking", "committed", "background_blocking", "background_staged"):
            print(f"    ckptd {key:<20} {median(budget[key]):.4f} s")
    if "dcp" in figures:
        dcp = figures["dcp"]
        if "error" in dcp:
            print(f"  DCP async_save: could not run: {dcp['error']}")
        else:
            blocking, committed = median(dcp["blocking"]), median(dcp["committed"])
            print(f"  DCP async_save: blocking {blocking:.3f} s, committed {committed:.3f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


def _timed(load: Any) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    load()
    torch.cuda.synchronize()
    return time.perf_counter() - started


class LoadFloor:
    """Every tensor file of a checkpoint read into one page-locked buffer allocated once, by a
    pool of threads (``os.preadv`` of 32 MiB pieces, as many threads as cores, at most 16), each
    piece copied to a GPU buffer allocated once (``non_blocking``) as soon as it is read: the same
    bytes from the same page cache to the same device, with nothing parsed or allocated."""

    PIECE = 32 * 1024 * 1024

    def __init__(self, size: int) -> None:
        self.host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        self.device = torch.empty(size, dtype=torch.uint8, device="cuda")
        self.stream = torch.cuda.Stream()
        self.pool = ThreadPoolExecutor(min(16, os.cpu_count() or 1))

    def run(self, path: str) -> float:
        names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        view = self.host.numpy().data
        torch.cuda.synchronize()
        started = time.perf_counter()
        descriptors = [os.open(os.path.join(path, name), os.O_RDONLY) for name in names]
        try:
            pieces, offset = [], 0
            for fd in descriptors:
                size = os.fstat(fd).st_size
                if offset + size > self.host.numel():
                    raise SystemExit(f"load floor: {path} holds more than {self.host.numel()} bytes")
                pieces += [(fd, at, offset + at, min(self.PIECE, size - at)) for at in range(0, size, self.PIECE)]
                offset += size

            def read(piece: tuple[int, int, int, int]) -> tuple[int, int]:
                fd, at, where, length = piece
                got = 0
                while got < length:
                    got += os.preadv(fd, [view[where + got : where + length]], at + got)
                return where, length

            for future in as_completed([self.pool.submit(read, p) for p in pieces]):
                where, length = future.result()
                with torch.cuda.stream(self.stream):
                    self.device[where : where + length].copy_(self.host[where : where + length], non_blocking=True)
            self.stream.synchronize()
        finally:
            for fd in descriptors:
                os.close(fd)
        return time.perf_counter() - started


if __name__ == "__main__":
    main()
