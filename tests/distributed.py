"""Run a function on several ranks of a real torch.distributed (gloo) process group."""

from __future__ import annotations

import io
import os
import queue as queue_module
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}", timeout=timedelta(seconds=120)
    )
    try:
        outcome = io.BytesIO()
        torch.save(fn(rank, world, *args), outcome)  # by value: the process may exit before it is read
        results.put((rank, "ok", outcome.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the test process
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def run_ranks(
    world: int, fn: Callable[..., Any], *args: Any, timeout: float = 240.0, expect_dead: set[int] | None = None
) -> dict[int, Any]:
    """Start ``world`` processes running ``fn(rank, world, *args)`` in one gloo group; return each
    rank's result.  A rank that raises fails the test with its traceback.  Ranks in
    ``expect_dead`` may die without reporting."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_entry, args=(r, world, port, fn, args, results)) for r in range(world)]
    for process in processes:
        process.start()
    outcome: dict[int, Any] = {}
    errors: dict[int, str] = {}
    expected = world - len(expect_dead or ())
    try:
        while len(outcome) + len(errors) < expected:
            try:
                rank, status, value = results.get(timeout=timeout)
            except queue_module.Empty:
                raise AssertionError(
                    f"ranks {sorted(set(range(world)) - set(outcome) - set(errors))} did not finish"
                ) from None
            if status == "ok":
                outcome[rank] = torch.load(io.BytesIO(value), weights_only=False)  # our own test data
            else:
                errors[rank] = value
    finally:
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
    if errors:
        raise AssertionError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
    return outcome
