"""A staging budget (``staging_memory``): a state larger than the budget still saves whole and
bit-exact, streamed through one arena of the budget's size that the copy refills as the writer
frees it; the arenas never hold more than the budget; a writer that dies or a disk that fills
mid-stream fails the save without hanging the caller, and the last checkpoint stays loadable.

Small sizes keep the ring turning many times: 1 MiB chunks through a 4 MiB budget.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from conftest import assert_same, staging_dirs, wait_for, writers_fail, writers_strike
from distributed import run_ranks
from safetensors.torch import load_file

import ckptd
from ckptd.errors import CheckpointExistsError, ConfigError, StorageError, WriterError

MIB = 1024 * 1024
BUDGET = 4 * MIB
SMALL = {"staging_memory": "4MiB", "chunk_size": "1MiB"}


def big_state(seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """About 13 MiB: one tensor twice the budget, and the dtypes and layouts that stage
    differently (bf16, int64, a transposed view, 0-dim, bool, empty)."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "big": torch.randn(2 * MIB, generator=generator),  # 8 MiB
            "bf16": torch.randn(1024, 777, generator=generator).bfloat16(),
            "ids": torch.randint(0, 1 << 40, (100_003,), generator=generator),
            "transposed": torch.randn(300, 400, generator=generator).t(),
            "scale": torch.tensor(3.25),
            "flag": torch.tensor(True),
            "empty": torch.zeros(0, 5),
        },
        "optimizer": {"m": torch.randn(700_001, generator=generator)},
    }


def state_bytes(state: dict[str, dict[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for tree in state.values() for t in tree.values())


def arena_bytes(ckpt: ckptd.Checkpointer) -> int:
    return int(ckpt.health_check()["arena_bytes"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("staging", ["blocking", "pipelined", "background"])
def test_a_state_larger_than_the_budget_saves_whole_through_one_arena_of_the_budget(root, staging):
    state = big_state()
    assert state_bytes(state) > 3 * BUDGET
    with ckptd.Checkpointer(root, max_shard_size="5MB", **SMALL) as ckpt:
        result = ckpt.async_save(1, state, staging=staging).result(60)
        assert arena_bytes(ckpt) == BUDGET
        assert result.bytes_written > 3 * BUDGET
        assert_same(state, ckpt.load(1))
        ckptd.CheckpointReader.open(result.path).verify()  # the CRC32C the writer took of each file
        # HF tools read the shards as they would any ckptd checkpoint.
        shards = sorted(n for n in os.listdir(result.path) if n.startswith("model-"))
        assert len(shards) >= 2
        from_files: dict[str, torch.Tensor] = {}
        for name in shards:
            from_files.update(load_file(os.path.join(result.path, name)))
        assert_same({k: v.contiguous() for k, v in state["model"].items()}, from_files)


@pytest.mark.timeout(120)
def test_the_ring_is_reused_by_the_next_save_and_a_state_that_fits_is_not_streamed(root):
    with ckptd.Checkpointer(root, max_shard_size="5MB", **SMALL) as ckpt:
        state = big_state()
        ckpt.save(1, state)
        arena = ckpt._pool._arenas[0]
        for tree in state.values():
            for tensor in tree.values():
                if tensor.numel() and tensor.dtype != torch.bool:
                    tensor.add_(1)
        ckpt.save(2, state)
        assert ckpt._pool._arenas == [arena] and arena_bytes(ckpt) == BUDGET
        assert arena.streamed
        assert_same(state, ckpt.load(2))
        small = {"model": {"w": torch.arange(MIB // 2, dtype=torch.float32)}}  # 2 MiB: fits
        ckpt.save(3, small)
        assert arena_bytes(ckpt) <= BUDGET
        assert not ckpt._pool._arenas[0].streamed
        assert_same(small, ckpt.load(3))
        assert_same(state, ckpt.load(2))


@pytest.mark.timeout(120)
def test_a_background_streamed_save_holds_the_next_optimizer_step_until_every_byte_is_staged(root):
    model = torch.nn.Linear(1024, 1536)  # 6 MiB of weights: larger than the budget
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model(torch.randn(4, 1024)).sum().backward()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with ckptd.Checkpointer(root, **SMALL) as ckpt:
        request = ckpt.async_save(1, {"model": model.state_dict()}, staging="background")
        optimizer.step()  # waits for the copy, which waits for the writer to free the ring
        assert request.staged.is_set()
        request.result(60)
        assert not torch.equal(model.weight.detach(), before["weight"])
        assert_same(before, ckpt.load(1)["model"])


@pytest.mark.timeout(120)
def test_a_writer_killed_mid_stream_fails_the_save_and_the_last_checkpoint_loads(root):
    first, second = big_state(1), big_state(2)
    with writers_strike("write", r"checkpoint-2.*model-00002", whom="self"):
        ckpt = ckptd.Checkpointer(root, max_shard_size="5MB", **SMALL)
        ckpt.health_check()  # the writer starts inside the block
    try:
        ckpt.save(1, first)
        pid = ckpt.writer_pid
        request = ckpt.async_save(2, second, staging="background")
        with pytest.raises(WriterError, match=f"writer process {pid} killed by SIGKILL"):
            request.result(60)
        assert ckpt.steps() == [1]
        assert staging_dirs(root) == []
        assert_same(first, ckpt.load(1))
        ckpt.save(3, second)  # a new writer streams the next save
        assert ckpt.writer_pid != pid
        assert_same(second, ckpt.load(3))
        assert arena_bytes(ckpt) == BUDGET
    finally:
        ckpt.close(wait=False)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("staging", ["blocking", "background"])
def test_a_full_disk_mid_stream_is_a_storage_error_naming_the_file_and_nothing_is_lost(root, staging):
    first = big_state(1)
    with writers_fail("write", r"checkpoint-2.*model-00002", 28):  # ENOSPC
        ckpt = ckptd.Checkpointer(root, max_shard_size="5MB", **SMALL)
        ckpt.health_check()  # the writer starts inside the block
    try:
        ckpt.save(1, first)
        with pytest.raises(StorageError, match="model-00002") as raised:
            ckpt.async_save(2, big_state(2), staging=staging).result(60)
        assert raised.value.errno == 28
        assert ckpt.steps() == [1]
        assert staging_dirs(root) == []
        assert_same(first, ckpt.load(1))
        assert arena_bytes(ckpt) == BUDGET
    finally:
        ckpt.close(wait=False)


@pytest.mark.timeout(120)
def test_close_without_wait_stops_a_streamed_copy_that_waits_for_a_stuck_writer(root):
    """A copy into an arena of its own always ends; a streamed one waits for the writer.  With
    the writer stopped, ``close(wait=False)`` fails that save instead of letting the copy go on
    whenever the writer comes back (and commit a save the caller no longer waits for)."""
    state = big_state()
    ckpt = ckptd.Checkpointer(root, max_shard_size="5MB", **SMALL)
    ckpt.save(1, state)
    pid = ckpt.writer_pid
    os.kill(pid, signal.SIGSTOP)
    try:
        request = ckpt.async_save(2, big_state(2), staging="background")
        wait_for(lambda: any(room.waits for room in ckpt._saver._streams))  # the ring is full
        closer = threading.Thread(target=ckpt.close, kwargs={"wait": False}, daemon=True)
        closer.start()
        time.sleep(1.0)
    finally:
        os.kill(pid, signal.SIGCONT)
    closer.join(60)
    assert not closer.is_alive()
    with pytest.raises(WriterError, match="closed with wait=False"):
        request.result(30)
    assert sorted(os.listdir(root)) == ["checkpoint-1"]


@pytest.mark.timeout(120)
def test_the_in_process_writer_streams_to_memory(tmp_path):
    state = big_state()
    with ckptd.Checkpointer(f"memory://budget-{tmp_path.name}", max_shard_size="5MB", **SMALL) as ckpt:
        ckpt.save(1, state)
        assert arena_bytes(ckpt) == BUDGET
        assert_same(state, ckpt.load(1))


@pytest.mark.timeout(180)
@pytest.mark.objectstore
def test_s3_uploads_several_parts_of_a_streamed_file_at_once_and_leaves_no_upload(s3):
    generator = torch.Generator().manual_seed(3)
    state = {"model": {"w": torch.randn(6 * MIB, generator=generator), "b": torch.randn(1000, generator=generator)}}
    options = {"staging_memory": "24MiB", "chunk_size": "1MiB", "part_size": "5MiB"}
    url = s3.url("run")
    with ckptd.Checkpointer(url, storage_options=s3.options(), **options) as ckpt:
        ckpt.save(1, state)  # one 24 MiB file in 5 MiB parts, through a 24 MiB ring
        assert arena_bytes(ckpt) == 24 * MIB
        assert_same(state, ckpt.load(1))
        # An object store learns that the step exists when the save claims it, after the copy
        # started: the caller gets that error, not the copy's.
        with pytest.raises(CheckpointExistsError, match="checkpoint-1"):
            ckpt.async_save(1, state)
        assert_same(state, ckpt.load(1))
    assert s3.uploads() == []
    with ckptd.Checkpointer(url, storage_options=s3.options(), staging_memory="16MiB", chunk_size="1MiB") as ckpt:
        with pytest.raises(ConfigError, match="parts of 16777216 bytes"):
            ckpt.save(2, state)  # 16 MiB parts (the default) need a 64 MiB ring
        assert ckpt.steps() == [1]
    assert not [key for key in s3.keys() if "checkpoint-2" in key]


@pytest.mark.timeout(120)
def test_incremental_hash_saves_streamed_files_whole_and_loads_them(root):
    state = big_state()
    with ckptd.Checkpointer(root, max_shard_size="5MB", incremental="hash", **SMALL) as ckpt:
        ckpt.save(1, state)
        result = ckpt.async_save(2, state).result(60)
        assert result.bytes_written > 3 * BUDGET  # nothing compared: every file written again
        assert_same(state, ckpt.load(2))
        ckptd.CheckpointReader.open(result.path).verify()


@pytest.mark.timeout(120)
def test_two_saves_in_flight_never_hold_more_than_the_budget_together(root):
    generator = torch.Generator().manual_seed(5)
    state = {"model": {"w": torch.randn(MIB + 1, generator=generator)}}  # a 6 MiB arena each (2 MiB steps)
    with ckptd.Checkpointer(root, max_in_flight=2, staging_memory="8MiB", chunk_size="1MiB") as ckpt:
        first = ckpt.async_save(1, state, staging="background")
        assert arena_bytes(ckpt) <= 8 * MIB
        second = ckpt.async_save(2, state, staging="background")  # waits for the first arena
        assert arena_bytes(ckpt) <= 8 * MIB
        first.result(60)
        second.result(60)
        assert len(ckpt._pool._arenas) == 1
        assert_same(state, ckpt.load(1))
        assert_same(state, ckpt.load(2))


def ranks_weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    return {"w": torch.randn(4096, 1024, generator=generator), "bias": torch.randn(MIB, generator=generator)}


def save_streamed_ranks(rank: int, world: int, root: str) -> int:
    full = ranks_weights()
    rows = full["w"].shape[0] // world
    state = {
        "model": {
            "w": ckptd.ShardedTensor(
                "w", full["w"][rank * rows : (rank + 1) * rows].clone(), (2 * rows, 1024), (rank * rows, 0)
            ),
            "bias": full["bias"].clone(),  # replicated: one rank writes it
        }
    }
    with ckptd.Checkpointer(root, dist_timeout=60, max_shard_size="5MB", **SMALL) as ckpt:
        ckpt.save(1, state)
        return arena_bytes(ckpt)


@pytest.mark.timeout(240)
@pytest.mark.multiprocess
@pytest.mark.distributed
def test_two_gloo_ranks_stream_their_pieces_into_shared_files(tmp_path):
    root = str(tmp_path / "ckpts")
    arenas = run_ranks(2, save_streamed_ranks, root)
    assert arenas == {0: BUDGET, 1: BUDGET}
    with ckptd.Checkpointer(root) as ckpt:
        assert_same(ranks_weights(), ckpt.load(1)["model"])  # 16 MiB in 8 MiB halves, and 4 MiB
    ckptd.CheckpointReader.open(os.path.join(root, "checkpoint-1")).verify()


def test_staging_memory_is_a_size_from_arguments_or_the_environment(monkeypatch):
    options = ckptd.CheckpointerOptions(staging_memory="256MiB")
    assert options.staging_budget == 256 * MIB
    monkeypatch.setenv("CKPTD_STAGING_MEMORY", "1GiB")
    assert ckptd.CheckpointerOptions.from_env().staging_budget == 1024 * MIB
    assert ckptd.CheckpointerOptions().staging_budget is None
    with pytest.raises(ConfigError, match="at least 4 x chunk_size"):
        ckptd.CheckpointerOptions(staging_memory="32MiB")  # chunk_size 16 MiB
    with pytest.raises(ConfigError, match="staging_memory"):
        ckptd.CheckpointerOptions(staging_memory="lots")
