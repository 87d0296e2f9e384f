"""Pipelined saves: with background or pipelined staging the writer writes the first shard files
(and the first chunks of a file) while the staging copy is still filling the arena; with blocking
staging (the default) it writes nothing until the copy is over, unless the arena is new memory (a
first save without ``prepare()``), whose copy is the slower half.  A copy that fails or a writer
that dies mid-pipeline abandons the save cleanly.

Overlap is observed without timing: a staging hook (``StagingPool.after_copy``) holds the copy
before the last tensor, and the writer's byte counter (``health_check``) must reach the first
file's size meanwhile.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import assert_same, staging_dirs, wait_for

import ckptd
from ckptd.errors import CkptdError, WriterError

MIB = 1024 * 1024


def make_state(count: int = 3) -> dict[str, dict[str, torch.Tensor]]:
    """``count`` tensors of 4 MiB with distinct contents, one per shard file at 5 MB shards."""
    return {"model": {f"w{i}": torch.arange(MIB, dtype=torch.float32) + i for i in range(count)}}


class Hold:
    """A staging hook that stops the copy after ``key`` until released, or raises there."""

    def __init__(self, key: str, error: BaseException | None = None) -> None:
        self.key = key
        self.error = error
        self.reached = threading.Event()
        self.release = threading.Event()

    def __call__(self, component: str, key: str) -> None:
        if key != self.key:
            return
        self.reached.set()
        if self.error is not None:
            raise self.error
        if not self.release.wait(60):
            raise AssertionError("the test never released the staging hook")


@pytest.fixture
def hold_after_w1(root: str) -> Iterator[tuple[ckptd.Checkpointer, Hold]]:
    ckpt = ckptd.Checkpointer(root, max_shard_size="5MB")
    hold = Hold("w1")
    ckpt._pool.after_copy = hold
    try:
        yield ckpt, hold
    finally:
        hold.release.set()
        ckpt.close(wait=False)


def staging_entries(root: str) -> list[str]:
    return sorted(name for name in os.listdir(root) if not name.startswith("checkpoint-"))


def written(ckpt: ckptd.Checkpointer) -> int:
    return int(ckpt.health_check()["bytes_written"])


def save_in_thread(
    ckpt: ckptd.Checkpointer, state: Any, step: int = 1, **kwargs: Any
) -> tuple[threading.Thread, list[Any]]:
    """``ckpt.async_save(step, state, **kwargs)`` on a thread of its own (it blocks while the
    copy is held); the list receives its request."""
    returned: list[Any] = []
    caller = threading.Thread(target=lambda: returned.append(ckpt.async_save(step, state, **kwargs)), daemon=True)
    caller.start()
    return caller, returned


@pytest.mark.timeout(120)
def test_the_writer_writes_the_first_file_while_the_last_is_still_being_staged(hold_after_w1):
    ckpt, hold = hold_after_w1
    state = make_state()
    before = written(ckpt)
    request = ckpt.async_save(1, state, staging="background")
    assert hold.reached.wait(30), "the staging copy never reached w1"
    # The copy waits after w1 (w2 is not in the arena): the writer has written file 1 anyway.
    wait_for(lambda: written(ckpt) - before >= 4 * MIB)
    assert not request.staged.is_set()
    assert not request.done()
    hold.release.set()
    result = request.result(60)
    assert result.bytes_written > 3 * 4 * MIB
    assert_same(state["model"], ckpt.load(1)["model"])
    assert len(ckpt.manifest(1).files) >= 3


def description_files(root: str) -> list[str]:
    """The JSON files (HF indexes, state file) in the staging directories under ``root``."""
    return [name for directory in staging_dirs(root) for name in os.listdir(directory) if name.endswith(".json")]


@pytest.mark.timeout(120)
def test_the_indexes_and_state_file_are_written_once_the_copy_is_over(hold_after_w1, root):
    # Encoding them holds the GIL the copy loop needs: they wait for the copy, not the writer.
    ckpt, hold = hold_after_w1
    state = {**make_state(), "trainer": {"epoch": 1}}
    before = written(ckpt)
    request = ckpt.async_save(1, state, staging="background")
    assert hold.reached.wait(30)
    wait_for(lambda: written(ckpt) - before >= 4 * MIB)  # the shards are being written meanwhile
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:  # given time, they still do not appear
        assert description_files(root) == []
        time.sleep(0.05)
    hold.release.set()
    request.result(60)
    assert {"model.safetensors.index.json", "state.json"} <= set(ckpt.manifest(1).files)
    assert ckpt.load(1)["trainer"] == {"epoch": 1}


@pytest.mark.timeout(120)
def test_a_single_file_is_written_chunk_by_chunk_as_it_is_staged(root):
    # One shard file: the writer starts on its first chunks while the copy holds after w1.
    ckpt = ckptd.Checkpointer(root, chunk_size="1MiB")
    hold = Hold("w1")
    ckpt._pool.after_copy = hold
    try:
        state = make_state(4)
        before = written(ckpt)
        request = ckpt.async_save(1, state, staging="background")
        assert hold.reached.wait(30)
        wait_for(lambda: written(ckpt) - before >= 4 * MIB)  # w0 (and the header) of the one file
        assert not request.done()
        hold.release.set()
        request.result(60)
        shards = [name for name in ckpt.manifest(1).files if name.endswith(".safetensors")]
        assert shards == ["model-00001-of-00001.safetensors"]
        assert_same(state["model"], ckpt.load(1)["model"])
    finally:
        hold.release.set()
        ckpt.close(wait=False)


@pytest.mark.timeout(120)
def test_a_copy_failing_after_the_first_file_was_handed_over_commits_nothing(root):
    ckpt = ckptd.Checkpointer(root, max_shard_size="5MB")
    try:
        state = make_state()
        ckpt.save(1, state)
        entries = staging_entries(root)
        hold = Hold("w1", error=RuntimeError("device lost while copying w1"))
        ckpt._pool.after_copy = hold
        request = ckpt.async_save(2, make_state(), staging="background")
        with pytest.raises(CkptdError, match="device lost while copying w1") as raised:
            request.result(60)
        assert isinstance(raised.value, WriterError)
        assert isinstance(raised.value.__cause__, RuntimeError)
        assert ckpt.steps() == [1]
        assert not os.path.exists(ckpt.path_for(2))
        ckpt.wait()
        assert staging_entries(root) == entries  # the abort removed the staging directory
        assert_same(state["model"], ckpt.load(1)["model"])
        # The arena went back to the pool: the next save reuses it and commits.
        ckpt._pool.after_copy = None
        arenas = ckpt.health_check()["arena_bytes"]
        ckpt.async_save(3, state, staging="background").result(60)
        assert ckpt.health_check()["arena_bytes"] == arenas
        assert ckpt.steps() == [1, 3]
    finally:
        ckpt.close(wait=False)


@pytest.mark.timeout(120)
def test_a_writer_killed_mid_pipeline_fails_the_save_and_the_previous_checkpoint_loads(hold_after_w1):
    ckpt, hold = hold_after_w1
    state = make_state()
    ckpt._pool.after_copy = None
    ckpt.save(1, state)
    entries = staging_entries(ckpt.root)
    ckpt._pool.after_copy = hold
    before = written(ckpt)
    request = ckpt.async_save(2, make_state(), staging="background")
    assert hold.reached.wait(30)
    wait_for(lambda: written(ckpt) - before >= 4 * MIB)  # the writer is inside the pipelined request
    pid = ckpt.writer_pid
    os.kill(pid, signal.SIGKILL)
    hold.release.set()
    with pytest.raises(WriterError, match=f"writer process {pid} killed by SIGKILL"):
        request.result(60)
    assert ckpt.steps() == [1]
    assert staging_entries(ckpt.root) == entries
    assert_same(state["model"], ckpt.load(1)["model"])
    # A new writer takes the next save.
    ckpt._pool.after_copy = None
    ckpt.async_save(3, state, staging="background").result(60)
    assert ckpt.steps() == [1, 3]
    assert ckpt.health_check()["writer_pid"] != pid


@pytest.mark.timeout(120)
def test_the_in_process_writer_pipelines_whole_files(tmp_path):
    ckpt = ckptd.Checkpointer(f"memory://pipeline-{tmp_path.name}", max_shard_size="5MB")
    hold = Hold("w1")
    ckpt._pool.after_copy = hold
    try:
        state = make_state()
        request = ckpt.async_save(1, state, staging="background")
        assert hold.reached.wait(30)
        wait_for(lambda: written(ckpt) >= 4 * MIB)
        assert not request.done()
        hold.release.set()
        request.result(60)
        assert_same(state["model"], ckpt.load(1)["model"])
    finally:
        hold.release.set()
        ckpt.close(wait=False)


@pytest.mark.timeout(120)
def test_a_pipelined_save_writes_during_the_copy_and_returns_once_the_copy_is_done(hold_after_w1):
    ckpt, hold = hold_after_w1
    state = make_state()
    before = written(ckpt)
    caller, returned = save_in_thread(ckpt, state, staging="pipelined")
    assert hold.reached.wait(30)
    wait_for(lambda: written(ckpt) - before >= 4 * MIB)  # file 1 written while async_save still copies
    assert not returned and caller.is_alive()
    hold.release.set()
    caller.join(30)
    assert len(returned) == 1
    request = returned[0]
    assert request.staged.is_set()
    result = request.result(60)
    assert result.timings["blocking"] >= result.timings["stage"] > 0
    assert_same(state["model"], ckpt.load(1)["model"])


def warm_up(ckpt: ckptd.Checkpointer, hold: Hold, state: Any, *, prepare: bool) -> None:
    """Fault the arena's pages in (``prepare()``, or a save of step 0) before the held save."""
    ckpt._pool.after_copy = None
    if prepare:
        ckpt.prepare(state)
    else:
        ckpt.save(0, state)
    ckpt._pool.after_copy = hold


@pytest.mark.timeout(120)
@pytest.mark.parametrize("prepare", [False, True], ids=["after-a-save", "after-prepare"])
def test_a_blocking_save_writes_nothing_until_the_copy_is_over(hold_after_w1, prepare):
    """The default mode: the copy has the machine to itself, the writer starts after it (once
    the arena's memory is faulted in: see the next test)."""
    ckpt, hold = hold_after_w1
    state = make_state()
    warm_up(ckpt, hold, state, prepare=prepare)
    before = written(ckpt)
    caller, returned = save_in_thread(ckpt, state)
    assert hold.reached.wait(30)
    # The pipelined test above sees file 1 written in this state; here nothing may be.
    time.sleep(2.0)
    assert written(ckpt) == before
    assert not any(name.endswith(".safetensors") for d in staging_dirs(ckpt.root) for name in os.listdir(d))
    assert not returned and caller.is_alive()
    hold.release.set()
    caller.join(30)
    assert len(returned) == 1 and returned[0].staged.is_set()
    result = returned[0].result(60)
    assert result.bytes_written >= 3 * 4 * MIB
    assert_same(state["model"], ckpt.load(1)["model"])


@pytest.mark.timeout(120)
def test_a_blocking_save_into_new_staging_memory_writes_during_the_copy(hold_after_w1, root):
    """The first save without prepare(): its copy faults the arena's pages in, slower than the
    write, so the writer writes the chunks already copied; the call still returns after the copy."""
    ckpt, hold = hold_after_w1
    state = make_state()
    assert ckpt.health_check()["arena_bytes"] == 0  # no arena yet: this save creates it
    caller, returned = save_in_thread(ckpt, state)
    assert hold.reached.wait(30)
    wait_for(lambda: written(ckpt) >= 4 * MIB)  # file 1 written while async_save still copies
    assert not returned and caller.is_alive()
    hold.release.set()
    caller.join(30)
    assert len(returned) == 1 and returned[0].staged.is_set()
    returned[0].result(60)
    assert_same(state["model"], ckpt.load(1)["model"])
    # The next blocking save reuses the arena, now faulted in: it writes after the copy again.
    before = written(ckpt)
    hold.reached.clear()
    hold.release.clear()
    caller, returned = save_in_thread(ckpt, make_state(), step=2)
    assert hold.reached.wait(30)
    time.sleep(2.0)
    assert written(ckpt) == before
    hold.release.set()
    caller.join(30)
    assert len(returned) == 1
    returned[0].result(60)
    assert ckpt.steps() == [1, 2]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("staging", ["blocking", "pipelined"])
def test_a_blocking_copy_that_fails_raises_from_async_save_and_commits_nothing(root, staging):
    ckpt = ckptd.Checkpointer(root, max_shard_size="5MB", staging=staging)
    try:
        state = make_state()
        ckpt.save(1, state)
        entries = staging_entries(root)
        ckpt._pool.after_copy = Hold("w1", error=RuntimeError("device lost while copying w1"))
        with pytest.raises(RuntimeError, match="device lost while copying w1"):
            ckpt.async_save(2, make_state())
        # The queued half of the save (the writer may have started) fails too: nothing committed.
        wait_for(lambda: ckpt.stats().saves_failed == 1 and not ckpt.pending())
        assert "device lost while copying w1" in str(ckpt.stats().last.error)
        assert ckpt.steps() == [1]
        assert staging_entries(root) == entries
        assert_same(state["model"], ckpt.load(1)["model"])
        ckpt._pool.after_copy = None
        ckpt.save(3, state)
        assert ckpt.steps() == [1, 3]
    finally:
        ckpt.close(wait=False)


@pytest.mark.parametrize("staging", ["blocking", "pipelined", "background"])
def test_a_save_that_copies_nothing_reuses_every_file(root, staging):
    # Every file frozen: the rank's arena copy is empty, the writer writes nothing.
    with ckptd.Checkpointer(root, max_shard_size="5MB", incremental=True) as ckpt:
        state = make_state()
        ckpt.save(1, state, staging=staging)
        result = ckpt.async_save(2, state, staging=staging, frozen={"model": ["*"]}).result(60)
        assert result.bytes_written < 4096 and result.bytes_reused > 3 * 4 * MIB  # indexes, state.json
        assert_same(state["model"], ckpt.load(2)["model"])
