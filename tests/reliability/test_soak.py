"""Soak: 500 saves with ``keep_last=2`` while the writer process is SIGKILLed about every 20 saves.

The kills come at seeded random moments: some while a save is in flight (right after
``async_save`` returned, after a random delay of 0-8 ms), the others between two saves.  A save
in flight when its writer dies may fail with :class:`ckptd.errors.WriterError` (counted); once
the killed writer has exited, the next save must work (the Checkpointer starts a new writer).
Throughout and at the end:

* no committed step is lost: after every save, each step whose ``result()`` returned is either
  listed by ``steps()`` or was removed by retention because two newer successful saves exist;
  the listing never holds more than ``keep_last`` steps, nor one whose save failed;
* after each kill, and at the end, the newest steps load bit-exactly (``torch.equal``);
* the test process's memory stays flat: VmRSS after save 500 is within 64 MiB of VmRSS after
  save 50 (and the open file descriptors and threads do not grow with the restarts);
* nothing is left under the root after ``close()`` + ``collect_garbage``: exactly the two
  newest checkpoint directories, no hidden ``.checkpoint-*`` entries anywhere;
* no writer process outlives the Checkpointer: every writer pid ever seen is gone (not even a
  zombie: ``os.kill(pid, 0)`` raises ``ProcessLookupError``).
"""

from __future__ import annotations

import functools
import os
import random
import signal
import threading
import time
from typing import Any

import pytest
import torch
from conftest import assert_same, clone_state, wait_for

import ckptd
from ckptd.garbage import collect_garbage

pytestmark = pytest.mark.slow

SAVES = 500
KEEP_LAST = 2
SEED = 20261122
RSS_BASELINE_AFTER = 50
# Why 64 MiB: the state is ~1 KiB and its staging arena a few KiB, so a steady state needs no
# new memory at all; what can leak is per save (a mapped arena or a request record: 450 saves
# x >= 4 KiB page = >= 1.8 MiB, plus Python objects) or per writer restart (a mapped arena, a
# socket buffer, reader threads with 8 MiB stacks: ~25 restarts x 8 MiB = 200 MiB).  64 MiB is
# well above the allocator's noise for 450 tiny saves (measured: under 1 MiB here) and well
# below what a leaked thread stack or arena per restart would add.
RSS_GROWTH_LIMIT = 64 * 2**20
# Descriptors and threads must not grow with the ~25 restarts (a leaked socket, memfd or
# reader thread per restart would); a little slack for threads that are just ending.
FD_GROWTH_LIMIT = 8
THREAD_GROWTH_LIMIT = 4


def _state(step: int) -> dict[str, Any]:
    """A small state that changes every save: a few tensors of several dtypes and the step."""
    g = torch.Generator().manual_seed(step)
    return {
        "model": {
            "w": torch.randn(8, 8, generator=g),
            "b": torch.randn(8, generator=g).to(torch.bfloat16),
            "ids": torch.randint(0, 2**40, (5,), generator=g, dtype=torch.int64),
        },
        "trainer": {"step": step, "seen": torch.tensor([step, step * 3], dtype=torch.int32)},
    }


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _exited(pid: int) -> bool:
    """True once every thread of ``pid`` has exited (a zombie, reaped or not).

    A SIGKILLed multi-threaded process shows its main thread as a zombie while its other
    threads are still exiting; until they are gone it cannot be reaped and its sockets may
    still be open, so a save sent then is a save in flight as the writer dies.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        return zombie and len(os.listdir(f"/proc/{pid}/task")) <= 1
    except (FileNotFoundError, ProcessLookupError):
        return True


def _hidden_entries(root: str) -> list[str]:
    found = []
    for directory, dirs, files in os.walk(root):
        found += [os.path.join(directory, n) for n in dirs + files if n.startswith(".")]
    return sorted(found)


def test_soak_500_saves_with_writer_kills(tmp_path: Any) -> None:
    root = str(tmp_path / "ckpts")
    rng = random.Random(SEED)
    ckpt = ckptd.Checkpointer(root, keep_last=KEEP_LAST)
    writer_pids: set[int] = set()
    succeeded: list[int] = []  # steps whose result() returned, in order
    failed: list[tuple[int, str]] = []  # (step, error) of saves that raised WriterError
    expected: dict[int, dict[str, Any]] = {}  # clones of the last few successful states only
    kills_in_flight = kills_between = 0
    next_kill = rng.randint(10, 30)
    baseline: tuple[int, int, int] | None = None
    started = time.monotonic()

    def counts() -> str:
        return (
            f"after {len(succeeded) + len(failed)}/{SAVES} saves: {len(succeeded)} succeeded, "
            f"{len(failed)} failed with WriterError, {kills_in_flight + kills_between} writer kills "
            f"({kills_in_flight} in flight, {kills_between} between saves), {len(writer_pids)} writer pids"
        )

    def kill_writer() -> None:
        pid = ckpt.writer_pid
        assert pid is not None, f"no writer pid to kill; {counts()}"
        writer_pids.add(pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        # Fully exited (not necessarily reaped by the Checkpointer yet) before the next save.
        wait_for(lambda: _exited(pid), timeout=10, interval=0.001)

    def check_catalog(where: str) -> None:
        listed = ckpt.steps()
        newest = succeeded[-KEEP_LAST:]
        lost = [s for s in succeeded if s not in listed and sum(t > s for t in succeeded) < KEEP_LAST]
        assert not lost, f"{where}: committed steps {lost} are gone (listed {listed}); {counts()}"
        assert all(s in listed for s in newest), f"{where}: newest {newest} not all in {listed}; {counts()}"
        assert len(listed) <= KEEP_LAST, f"{where}: retention kept {listed}; {counts()}"
        phantom = [s for s in listed if s not in succeeded]
        assert not phantom, f"{where}: steps {phantom} are listed but their save failed ({failed}); {counts()}"

    def check_loads(where: str) -> None:
        for step in succeeded[-KEEP_LAST:]:
            loaded = ckpt.load(step)
            assert_same(expected[step], loaded, f"{where}: step {step}")

    try:
        for step in range(SAVES):
            state = _state(step)
            kill_now = step == next_kill
            in_flight = kill_now and rng.random() < 0.5
            request = ckpt.async_save(step, state)
            if in_flight:
                time.sleep(rng.uniform(0.0, 0.008))
                kill_writer()
                kills_in_flight += 1
            try:
                request.result(timeout=120)
            except ckptd.errors.WriterError as e:
                assert in_flight, f"save of step {step} failed without a kill in flight: {e!r}; {counts()}"
                failed.append((step, str(e).splitlines()[0]))
            else:
                succeeded.append(step)
                expected[step] = clone_state(state)
                for old in [s for s in expected if s not in succeeded[-KEEP_LAST:]]:
                    del expected[old]
            if ckpt.writer_pid is not None:
                writer_pids.add(ckpt.writer_pid)
            check_catalog(f"after save {step}")
            if kill_now:
                if not in_flight:
                    kill_writer()
                    kills_between += 1
                check_loads(f"after the kill at save {step}")
                next_kill = step + rng.randint(10, 30)
            if step + 1 == RSS_BASELINE_AFTER:
                baseline = (_rss_bytes(), _open_fds(), threading.active_count())

        assert baseline is not None
        rss, fds, threads = _rss_bytes(), _open_fds(), threading.active_count()
        check_loads("at the end")
        final_steps = ckpt.steps()
        newest = succeeded[-KEEP_LAST:]
        assert final_steps == newest, f"steps() is {final_steps}, expected the newest successful {newest}; {counts()}"
        files = {s: sorted(os.listdir(ckpt.path_for(s))) for s in newest}
    finally:
        if ckpt.writer_pid is not None:
            writer_pids.add(ckpt.writer_pid)
        ckpt.close()
    elapsed = time.monotonic() - started

    kills = kills_in_flight + kills_between
    assert len(succeeded) + len(failed) == SAVES, counts()
    assert kills >= SAVES // 30 and kills_in_flight > 0 and kills_between > 0, counts()
    # The save after each kill works: a failure is only ever the save the kill hit.
    assert len(failed) <= kills_in_flight, f"{counts()}; failed: {failed}"
    assert len(writer_pids) >= kills, f"{len(writer_pids)} writer pids seen for {kills} kills; {counts()}"

    growth = rss - baseline[0]
    assert growth < RSS_GROWTH_LIMIT, (
        f"VmRSS grew by {growth / 2**20:.1f} MiB from save {RSS_BASELINE_AFTER} "
        f"({baseline[0] / 2**20:.1f} MiB) to save {SAVES} ({rss / 2**20:.1f} MiB); {counts()}"
    )
    assert fds - baseline[1] <= FD_GROWTH_LIMIT, f"open fds {baseline[1]} -> {fds}; {counts()}"
    assert threads - baseline[2] <= THREAD_GROWTH_LIMIT, f"threads {baseline[2]} -> {threads}; {counts()}"

    collect_garbage(ckpt.storage, ckpt.root)
    assert _hidden_entries(root) == [], f"leftovers after close + gc: {_hidden_entries(root)}; {counts()}"
    names = sorted(os.listdir(root))
    assert names == sorted(os.path.basename(ckpt.path_for(s)) for s in newest), f"root holds {names}; {counts()}"
    assert {s: sorted(os.listdir(ckpt.path_for(s))) for s in newest} == files, f"gc changed {newest}; {counts()}"

    deadline = time.monotonic() + 10
    while not all(_gone(pid) for pid in writer_pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = sorted(pid for pid in writer_pids if not _gone(pid))
    assert not alive, f"writer processes still exist after close: {alive}; {counts()}"
    print(f"soak: {counts()}; {elapsed:.1f}s; RSS growth {growth / 2**20:.2f} MiB")


def test_save_right_after_idle_writer_exit(tmp_path: Any) -> None:
    """The writer is SIGKILLed between saves; as soon as it has exited (before the Checkpointer
    has necessarily reaped it), the next save must restart it and succeed."""
    cycles = 20
    failures = []
    with ckptd.Checkpointer(str(tmp_path / "ckpts"), keep_last=KEEP_LAST) as ckpt:
        for cycle in range(cycles):
            ckpt.save(2 * cycle, _state(2 * cycle))
            pid = ckpt.writer_pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            wait_for(functools.partial(_exited, pid), timeout=10, interval=0.0005)
            try:
                ckpt.save(2 * cycle + 1, _state(2 * cycle + 1))
            except ckptd.errors.WriterError as e:
                failures.append((2 * cycle + 1, str(e).splitlines()[0]))
            wait_for(functools.partial(_gone, pid), timeout=10)
        assert ckpt.steps() == [2 * cycles - 2, 2 * cycles - 1]
    assert not failures, f"{len(failures)} of {cycles} saves right after the writer exited failed: {failures}"


def test_save_while_another_thread_reaps_the_dead_writer(tmp_path: Any) -> None:
    """The race behind the save above, made certain: while a thread reaps the killed writer,
    ``Popen.poll()`` cannot tell it has exited (it answers "running"), so the save finds a
    dead socket.  Nothing reached the writer: it is restarted and the save goes through."""
    with ckptd.Checkpointer(str(tmp_path / "ckpts")) as ckpt:
        ckpt.save(0, _state(0))
        process = ckpt._writer._process
        assert process is not None
        reaping = process._waitpid_lock  # what Popen.wait() holds while it reaps
        reaping.acquire()
        release = threading.Timer(1.0, reaping.release)  # lets the restart reap it a moment later
        try:
            os.kill(process.pid, signal.SIGKILL)
            wait_for(functools.partial(_exited, process.pid), timeout=10, interval=0.001)
            assert process.poll() is None  # the lie: the writer is dead, poll() cannot say so
        finally:
            release.start()
        ckpt.save(1, _state(1))
        release.join()
        assert ckpt.writer_pid not in (None, process.pid)
        assert ckpt.steps() == [0, 1]
        assert_same(ckpt.load(1), _state(1))
