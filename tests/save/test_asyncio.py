"""asyncio callers: ``await request`` and ``await checkpointer.aload(...)`` leave the event loop
running, a cancelled awaiting task leaves the save whole, and failures come out of the ``await``.

The loop's responsiveness is measured by a heartbeat task on the same loop (5 ms sleeps, each
wake-up's delay past its due time), counted only for sleeps that began and ended while the
``await`` was pending.  The staging copy of ``async_save`` runs on the caller's thread by design
(the snapshot is taken before the call returns), so it blocks the loop and is reported apart
(150-550 ms for 256 MiB on the 2-core VM); ``staging="background"`` moves it to a thread.

An ``await`` that blocked the loop would let no heartbeat sleep begin and end inside it: the tick
count decides that.  The lag is the issue's number: under 20 ms while a save is awaited (measured
1-10 ms here, beside two busy processes on the 2 cores: the writer is another process at nice 10).
While a copy or a load runs in this process (background staging, ``aload``), its threads compete
with the loop's for the two cores (a load reads with several threads in the kernel's copy): a
second process measured 35-46 ms stalls during the same loads, so there the bound is relative:
no stall as long as half the await.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass, field

import pytest
import torch
from conftest import assert_same, process_stopped, staging_dirs, wait_for, writers_strike

import ckptd
from ckptd.errors import CheckpointNotFoundError, CkptdError, WriterError

pytestmark = pytest.mark.asyncio

SIZE = 256 * 1024 * 1024
PERIOD = 0.005
LAG_BOUND = 0.020
"""The issue's bound on the loop's lag while a save or load is awaited.  An ``await`` that blocked
the loop would show the whole write (about a second here) as one late wake-up; what the bound
allows is the GIL switch interval (5 ms) behind the commit thread plus the scheduling noise of a
loaded 2-core VM."""


@dataclass
class Heartbeat:
    """A task on the loop: sleeps ``PERIOD`` again and again and records (start, lag) per sleep."""

    ticks: list[tuple[float, float, float]] = field(default_factory=list)  # (began, woke, lag)
    stop: bool = False

    async def run(self) -> None:
        while not self.stop:
            began = time.perf_counter()
            await asyncio.sleep(PERIOD)
            woke = time.perf_counter()
            self.ticks.append((began, woke, woke - began - PERIOD))

    def lags_within(self, start: float, end: float) -> list[float]:
        return [lag for began, woke, lag in self.ticks if began >= start and woke <= end]


@pytest.fixture
def state() -> dict[str, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    return {"model": {"w": torch.randn(SIZE // 4)}}


async def with_heartbeat(awaitable_factory):  # type: ignore[no-untyped-def]
    """Run ``awaitable_factory()`` (called on the loop) beside a heartbeat; returns (result,
    seconds the factory call itself blocked the loop, the lags measured during the await, the
    await's seconds)."""
    beat = Heartbeat()
    ticking = asyncio.ensure_future(beat.run())
    try:
        await asyncio.sleep(0.05)  # the heartbeat is running
        called = time.perf_counter()
        awaitable = awaitable_factory()
        returned = time.perf_counter()
        result = await awaitable
        ended = time.perf_counter()
    finally:
        beat.stop = True
        await ticking
    return result, returned - called, beat.lags_within(returned, ended), ended - returned


def report(what: str, blocked: float, lags: list[float], awaited: float) -> None:
    print(
        f"\n{what}: call blocked the loop {blocked * 1e3:.1f} ms; await {awaited * 1e3:.0f} ms, "
        f"{len(lags)} ticks, max lag {max(lags) * 1e3:.2f} ms, "
        f"p50 {sorted(lags)[len(lags) // 2] * 1e3:.2f} ms"
    )


async def test_awaiting_a_save_keeps_the_loop_running(root, state):
    with ckptd.Checkpointer(root) as ckpt:
        result, blocked, lags, awaited = await with_heartbeat(lambda: ckpt.async_save(1, state))
        report("await async_save (staging=blocking)", blocked, lags, awaited)
        assert result.step == 1 and result.bytes_written >= SIZE
        assert len(lags) >= 10, "the heartbeat hardly ran while the save was awaited"
        assert max(lags) < LAG_BOUND
        assert_same(state["model"]["w"], ckpt.load(1)["model"]["w"])


async def test_background_staging_blocks_the_loop_only_for_the_plan(root, state):
    staged_at_return = []

    def start() -> ckptd.SaveRequest:
        request = ckpt.async_save(1, state, staging="background")
        staged_at_return.append(request.staged.is_set())
        return request

    with ckptd.Checkpointer(root) as ckpt:
        ckpt.prepare(state)  # the arena exists: the call plans and hands the copy to a thread
        result, blocked, lags, awaited = await with_heartbeat(start)
        report("await async_save (staging=background)", blocked, lags, awaited)
        assert result.step == 1
        assert staged_at_return == [False]  # the copy ran off the loop's thread
        assert len(lags) >= 3 and max(lags) < awaited / 2
        assert_same(state["model"]["w"], ckpt.load(1)["model"]["w"])


async def test_aload_keeps_the_loop_running_and_returns_what_load_does(root, state):
    with ckptd.Checkpointer(root) as ckpt:
        ckpt.save(1, state)
        loaded, blocked, lags, awaited = await with_heartbeat(lambda: ckpt.aload(1))
        report("await aload", blocked, lags, awaited)
        assert len(lags) >= 3, "the heartbeat hardly ran while the load was awaited"
        assert max(lags) < awaited / 2
        assert_same(state["model"]["w"], loaded["model"]["w"])
        module = torch.nn.Linear(4, 4)
        target = torch.nn.Linear(4, 4)
        ckpt.save(2, {"model": module})
        assert await ckpt.aload(2, into={"model": target}) is None
        assert_same(module.state_dict(), target.state_dict())


FIRST_WRITE_OF_STEP_2 = r"/\.checkpoint-2\.tmp-[^/]+/model-[^/]*\.safetensors$"


async def test_cancelling_the_awaiting_task_leaves_the_save_whole(root, state):
    with writers_strike("write", FIRST_WRITE_OF_STEP_2, whom="stop"):  # frozen mid-save
        ckpt = ckptd.Checkpointer(root, chunk_size="1MiB")
        ckpt.health_check()
    try:
        ckpt.save(1, {"model": {"w": torch.zeros(4)}})
        request = ckpt.async_save(2, state)
        waiting = asyncio.ensure_future(_await(request))
        await asyncio.sleep(0)
        wait_for(lambda: process_stopped(ckpt.writer_pid))
        assert not waiting.done() and staging_dirs(root)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        os.kill(ckpt.writer_pid, signal.SIGCONT)  # the save goes on, nobody awaiting it
        result = await asyncio.wait_for(_await(request), 120)  # awaitable again, same outcome
        assert result.step == 2 and request.exception() is None
        assert ckpt.steps() == [1, 2] and staging_dirs(root) == []
        assert_same(state["model"]["w"], ckpt.load(2)["model"]["w"])
        later = {"model": {"w": torch.arange(1000.0)}}
        assert (await ckpt.async_save(3, later)).step == 3  # the commit thread is alive
        assert_same(later["model"]["w"], ckpt.load(3)["model"]["w"])
    finally:
        ckpt.close(wait=False)


async def _await(request: ckptd.SaveRequest) -> ckptd.SaveResult:
    return await request


async def test_cancelling_aload_returns_once_the_load_has_finished(root):
    module = torch.nn.Linear(512, 512)
    target = torch.nn.Linear(512, 512)
    with ckptd.Checkpointer(root) as ckpt:
        ckpt.save(1, {"model": module})
        loading = asyncio.ensure_future(ckpt.aload(1, into={"model": target}))
        await asyncio.sleep(0)  # the load thread has started
        loading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loading
        # Raised only after the thread was done: nothing writes into the module any more.
        assert_same(module.state_dict(), target.state_dict())


async def test_errors_come_out_of_the_await_as_ckptd_errors(root, state):
    with ckptd.Checkpointer(root) as ckpt:
        with pytest.raises(CheckpointNotFoundError):
            await ckpt.aload(99)
    with writers_strike("write", FIRST_WRITE_OF_STEP_2, whom="self"):  # the writer dies mid-file
        ckpt = ckptd.Checkpointer(root)
        ckpt.health_check()
    try:
        ckpt.save(1, {"model": {"w": torch.zeros(4)}})
        with pytest.raises(WriterError, match="SIGKILL") as info:
            await ckpt.async_save(2, state)
        assert isinstance(info.value, CkptdError)
        assert ckpt.steps() == [1]
        wait_for(lambda: staging_dirs(root) == [])
    finally:
        ckpt.close(wait=False)
