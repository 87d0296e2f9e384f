"""Slower tiers (``Checkpointer(tiers=[Tier(...)])``): committed checkpoints copied in the
background to other roots with their own cadence and retention, and loads that take the newest
step from the fastest tier holding a good copy.  Real storage throughout: local directories and
the loopback S3 server (through the fault proxy where a promotion must be caught mid-way)."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from conftest import S3Place, assert_same, bytes_read, wait_for

import ckptd
from ckptd.errors import CheckpointNotFoundError, CheckpointReplacedError, ConfigError, CorruptCheckpointError
from ckptd.storage import storage_for
from ckptd.tiers import COPY_PIECE, PromotionStopped, promote_checkpoint


def _state(step: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(64, 32, generator=generator), "b": torch.full((32,), float(step))},
        "progress": {"step": step},
    }


def _shard(path: str) -> str:
    return next(os.path.join(path, n) for n in sorted(os.listdir(path)) if n.endswith(".safetensors"))


def _flip_a_tensor_byte(path: str) -> None:
    """Damage a byte of tensor data (past the safetensors header), keeping the file's size."""
    shard = _shard(path)
    with open(shard, "r+b") as f:
        header = int.from_bytes(f.read(8), "little")
        f.seek(8 + header + 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_each_tier_keeps_its_own_cadence_and_retention_and_its_copies_load_on_their_own(tmp_path):
    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    with ckptd.Checkpointer(fast, keep_last=2, tiers=[ckptd.Tier(slow, every=3, keep_last=2)]) as ckpt:
        for step in range(1, 11):
            ckpt.save(step, _state(step))
        assert ckpt.wait_promotions(60)
        promoted = [(p.step, p.tier, p.error) for p in ckpt.promotions()]
        assert ckpt.latest_step() == 10
    assert promoted == [(3, 1, None), (6, 1, None), (9, 1, None)]
    assert sorted(os.listdir(fast)) == [".ckptd-tiers.json", "checkpoint-10", "checkpoint-9"]  # + the record for ls
    assert sorted(os.listdir(slow)) == ["checkpoint-6", "checkpoint-9"]
    with ckptd.Checkpointer(slow) as tier:  # a tier is an ordinary root: no link back to the fast one
        for step in (6, 9):
            assert_same(_state(step), tier.load(step, verify=True))
            assert tier.manifest(step).metadata["promoted_from"] == os.path.join(fast, f"checkpoint-{step}")
        assert all(f.reused is None for f in tier.manifest(9).files.values())


def test_latest_is_the_newest_step_of_any_tier_and_last_load_names_the_copy(tmp_path):
    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    with ckptd.Checkpointer(fast, tiers=[ckptd.Tier(slow, every=2)]) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save(step, _state(step))
        ckpt.wait_promotions(60)
        assert_same(_state(4), ckpt.load())
        assert (ckpt.last_load.step, ckpt.last_load.tier) == (4, 0)
        ckpt.close()
    for step in (3, 4):  # the fast tier lost its newest checkpoints (a node replaced, say)
        ckptd_root_rm(fast, step)
    with ckptd.Checkpointer(fast, tiers=[ckptd.Tier(slow, every=2)]) as ckpt:
        assert ckpt.latest_step() == 4
        model = {"w": torch.zeros(64, 32), "b": torch.zeros(32)}
        progress: dict[str, Any] = {}
        ckpt.load(into={"model": model, "progress": progress})
        assert_same(_state(4), {"model": model, "progress": progress})
        assert (ckpt.last_load.step, ckpt.last_load.tier) == (4, 1)
        assert_same(_state(2), ckpt.load(2))
        assert ckpt.last_load.tier == 0  # step 2 is in both: the fast copy is read
        with pytest.raises(CheckpointNotFoundError, match="step 3"):
            ckpt.load(3)


def ckptd_root_rm(root: str, step: int) -> None:
    import shutil

    shutil.rmtree(os.path.join(root, f"checkpoint-{step}"))


def test_a_damaged_fast_copy_is_skipped_for_the_slower_tiers_good_one(tmp_path, caplog):
    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    with ckptd.Checkpointer(fast, tiers=[ckptd.Tier(slow)]) as ckpt:
        path = ckpt.save(5, _state(5)).path
        ckpt.wait_promotions(60)
        _flip_a_tensor_byte(path)  # same size: only the checksum can tell
        with caplog.at_level(logging.WARNING, logger="ckptd"):
            loaded = ckpt.load()
        assert_same(_state(5), loaded)  # the damaged bytes never reached the caller
        assert (ckpt.last_load.step, ckpt.last_load.tier) == (5, 1)
        assert "cannot load step 5 from tier 0" in caplog.text
        _flip_a_tensor_byte(os.path.join(slow, "checkpoint-5"))
        with pytest.raises(CorruptCheckpointError, match="no tier holds a loadable copy"):
            ckpt.load()


def test_a_damaged_fast_copy_read_with_verify_inline_is_overwritten_by_the_next_tiers(tmp_path):
    """``verify="inline"`` checks the fast copy as it lands in the live tensors: the damaged copy
    is found, the slower tier's copy is read over it, and the tensors end bit-exact."""
    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    with ckptd.Checkpointer(fast, tiers=[ckptd.Tier(slow)]) as ckpt:
        path = ckpt.save(5, _state(5)).path
        ckpt.wait_promotions(60)
        _flip_a_tensor_byte(path)
        live = {"w": torch.zeros(64, 32), "b": torch.zeros(32)}
        ckpt.load(into={"model": live}, verify="inline")
        assert (ckpt.last_load.step, ckpt.last_load.tier) == (5, 1)
        assert_same(_state(5)["model"], live)


@pytest.mark.parametrize("fast_tier", ["disk", "held memory"])
def test_a_damaged_source_is_never_promoted_and_leaves_nothing(tmp_path, fast_tier):
    # from disk and from held memory (whose files a save staged into): the last piece is never
    # handed to the target when the file's CRC32C is wrong
    fast = str(tmp_path / "fast") if fast_tier == "disk" else f"shm://promote-{os.getpid()}"
    slow = str(tmp_path / "slow")
    try:
        with ckptd.Checkpointer(fast, hold_after_exit=300) as ckpt:
            path = ckpt.save(5, _state(5)).path
        good = os.path.join(slow, "good")
        os.makedirs(slow)
        storage = storage_for(slow)
        promote_checkpoint(storage_for(path), path, storage, good)  # whole: loads bit for bit
        with ckptd.Checkpointer(slow) as copy:
            assert_same(_state(5), copy.load(good, verify=True))
        _flip_a_tensor_byte(path)
        with pytest.raises(CorruptCheckpointError, match="CRC32C"):
            promote_checkpoint(storage_for(path), path, storage, os.path.join(slow, "checkpoint-5"))
        assert os.listdir(slow) == ["good"]
    finally:
        if fast_tier == "held memory":
            ckptd.drop_held(fast, force=True)


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="counts the bytes read in /proc/self/io")
def test_a_copy_of_held_memory_to_a_local_tier_writes_the_trainers_staged_pages_and_still_checks_them(tmp_path):
    # the trainer's staging files are the held checkpoint: a copy to a local tier writes them
    # from the trainer's mapping (no read into a buffer first), checking every piece's CRC32C
    fast, slow = f"shm://mapped-{os.getpid()}", str(tmp_path / "slow")
    generator = torch.Generator().manual_seed(3)
    state = {"model": {f"w{i}": torch.randn(1024, 1024, generator=generator) for i in range(4)}}  # 16 MiB
    try:
        with ckptd.Checkpointer(fast, tiers=[ckptd.Tier(slow)], hold_after_exit=300) as ckpt:
            read_before = bytes_read()
            path = ckpt.save(1, state).path
            assert ckpt.wait_promotions(60)
            read = bytes_read() - read_before
            (copy,) = ckpt.promotions()
            assert copy.error is None and copy.bytes_copied > 16 * 2**20
            assert read < 2**20, f"{read} bytes read: the staged files were read, not written from the mapping"
            _flip_a_tensor_byte(path)  # the staged file itself, still mapped by this trainer
            damaged = os.path.join(slow, "damaged")
            with pytest.raises(CorruptCheckpointError, match="CRC32C"):
                promote_checkpoint(storage_for(path), path, storage_for(slow), damaged)
            assert not os.path.exists(damaged)
        with ckptd.Checkpointer(slow) as tier:
            assert tier.steps() == [1]
            assert_same(state, tier.load(1, verify=True))
    finally:
        ckptd.drop_held(fast, force=True)


@contextlib.contextmanager
def _over_and_over(retention: Callable[[], object]) -> Iterator[list[BaseException]]:
    """Run ``retention`` again and again on a thread of its own while the block runs; yields the
    errors it raised."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def loop() -> None:
        while not stop.is_set():
            try:
                retention()
            except BaseException as e:  # noqa: BLE001 - the test asserts there are none
                errors.append(e)

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        yield errors
    finally:
        stop.set()
        thread.join()


def test_keep_last_run_by_the_copying_thread_while_a_save_commits_never_deletes_that_save(tmp_path):
    # the promoter's thread applies keep_last after each copy, maybe while the next save is
    # published but not yet in the run's timeline (where it would rank as an older run's)
    fast = str(tmp_path / "fast")
    with ckptd.Checkpointer(fast, keep_last=1) as ckpt:
        ckpt.save(1, _state(1))
        with _over_and_over(ckpt._saver.apply_keep_last) as errors:  # what Promoter.after_release calls
            for step in range(2, 10):
                path = ckpt.save(step, _state(step)).path
                assert os.path.isdir(path), f"step {step} was deleted by the retention running meanwhile"
        assert not errors
        assert ckpt.steps() == [9]
        assert_same(_state(9), ckpt.load(9, verify=True))


def test_a_managers_retention_on_another_thread_never_deletes_a_save_being_committed(tmp_path):
    # CheckpointManager.apply_retention() is public and its own retention thread runs beside
    # the next save's commit: the same window as the promoter's
    fast = str(tmp_path / "fast")
    manager = ckptd.CheckpointManager(fast, ckptd.CheckpointPolicy(keep_last=1))
    try:
        with _over_and_over(manager.apply_retention) as errors:
            for step in range(1, 9):
                path = manager.save(step, _state(step)).result().path
                assert os.path.isdir(path), f"step {step} was deleted by the retention running meanwhile"
        manager.wait()
        assert not errors
        assert manager.steps() == [8]
        assert_same(_state(8), manager.load(8, verify=True))
    finally:
        manager.close()


def test_tiers_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="every"):
        ckptd.Tier(str(tmp_path / "slow"), every=0)
    with pytest.raises(ConfigError, match="keep_last"):
        ckptd.Tier(str(tmp_path / "slow"), keep_last=0)
    with pytest.raises(ConfigError, match="root of its own"):
        ckptd.Checkpointer(str(tmp_path / "fast"), tiers=[ckptd.Tier(str(tmp_path / "fast"))])


# ---- an object-store tier --------------------------------------------------------------------


def _is_shard_put(step: int) -> Any:
    return lambda method, path: method == "PUT" and f"checkpoint-{step}/model-" in path


@pytest.mark.objectstore
def test_an_s3_tier_receives_its_steps_and_close_waits_for_the_copy(s3: S3Place, tmp_path):
    pytest.importorskip("s3fs")
    fast = str(tmp_path / "fast")
    tier = ckptd.Tier(s3.url("tier"), every=2, keep_last=1, storage_options=s3.options())
    with ckptd.Checkpointer(fast, tiers=[tier]) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save(step, _state(step))
    # close() waited for the promotions: step 4 is there, step 2 was removed by the tier's keep_last
    with ckptd.Checkpointer(s3.url("tier"), storage_options=s3.options()) as remote:
        assert remote.steps() == [4]
        assert_same(_state(4), remote.load(4, verify=True))
    assert not s3.uploads()


@pytest.mark.objectstore
def test_a_checkpoint_being_promoted_is_kept_by_the_fast_tiers_retention(s3: S3Place, proxy, tmp_path):
    pytest.importorskip("s3fs")
    fast = str(tmp_path / "fast")
    proxy.inject("stall", 1, _is_shard_put(1))  # the promotion of step 1 hangs in its first upload
    # A long read timeout: the stalled upload is retried when the test lets it go, not before.
    options = {**s3.options(proxy.url), "config_kwargs": {"read_timeout": 300}}
    tier = ckptd.Tier(s3.url("tier"), storage_options=options)
    with ckptd.Checkpointer(fast, keep_last=1, tiers=[tier]) as ckpt:
        try:
            ckpt.save(1, _state(1))
            wait_for(lambda: proxy.injected, timeout=60)
            ckpt.save(2, _state(2))  # keep_last=1 would delete step 1 now, were it not being copied
            ckpt.save(3, _state(3))
            assert os.path.isdir(os.path.join(fast, "checkpoint-1"))
        finally:
            proxy.release_stalls()  # the upload is retried and the copy goes on from the files kept
        assert ckpt.wait_promotions(120)
        assert [p.error for p in ckpt.promotions()] == [None, None, None]
        # kept only for its copy: gone once the copies are done, without waiting for the next
        # commit (a held root's ring of staging files would be short of one until then)
        assert sorted(os.listdir(fast)) == [".ckptd-tiers.json", "checkpoint-3"]
        ckpt.save(4, _state(4))
        assert sorted(os.listdir(fast)) == [".ckptd-tiers.json", "checkpoint-4"]
    with ckptd.Checkpointer(s3.url("tier"), storage_options=s3.options()) as remote:
        assert remote.steps() == [1, 2, 3, 4]
        assert_same(_state(1), remote.load(1, verify=True))


def _save_then_hang(fast: str, tier_url: str, options: dict[str, Any]) -> None:
    with ckptd.Checkpointer(fast, tiers=[ckptd.Tier(tier_url, storage_options=options)]) as ckpt:
        ckpt.save(1, _state(1))
        ckpt.wait_promotions(120)
        ckpt.save(2, _state(2))  # its promotion stalls; the parent kills this process meanwhile
        signal.pause()


@pytest.mark.objectstore
@pytest.mark.multiprocess
def test_a_trainer_killed_mid_promotion_leaves_the_tiers_last_copy_whole(s3: S3Place, proxy, tmp_path):
    pytest.importorskip("s3fs")
    fast = str(tmp_path / "fast")
    proxy.inject("stall", 1, _is_shard_put(2))
    context = multiprocessing.get_context("spawn")
    trainer = context.Process(target=_save_then_hang, args=(fast, s3.url("tier"), s3.options(proxy.url)))
    trainer.start()
    try:
        wait_for(lambda: proxy.injected, timeout=120)
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.join(60)
    finally:
        if trainer.is_alive():
            trainer.kill()
            trainer.join()
        proxy.release_stalls()
    with ckptd.Checkpointer(s3.url("tier"), storage_options=s3.options()) as remote:
        assert remote.steps() == [1]  # step 2's objects hold no manifest: not a checkpoint
        assert_same(_state(1), remote.load(1, verify=True))
    with ckptd.Checkpointer(fast, tiers=[ckptd.Tier(s3.url("tier"), storage_options=s3.options())]) as ckpt:
        assert_same(_state(2), ckpt.load())  # the fast tier committed step 2 before the kill
        assert ckpt.last_load.tier == 0


def test_a_manager_resumes_from_the_slower_tier_when_the_fast_one_lost_its_copies(tmp_path):
    from ckptd.manager import CheckpointManager, CheckpointPolicy

    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    with CheckpointManager(fast, CheckpointPolicy(keep_last=1), tiers=[ckptd.Tier(slow, every=2)]) as manager:
        for step in (1, 2, 3):
            manager.save(step, _state(step))
        manager.checkpointer.wait_promotions(60)
    # (the fast tier may still hold step 2: kept while it was being copied, it goes at the next retention)
    assert "checkpoint-3" in os.listdir(fast) and sorted(os.listdir(slow)) == ["checkpoint-2"]
    for name in os.listdir(fast):  # the fast tier is lost (a replaced node's local disk)
        if name.startswith("checkpoint-"):
            ckptd_root_rm(fast, int(name.removeprefix("checkpoint-")))
    with CheckpointManager(fast, CheckpointPolicy(keep_last=1), tiers=[ckptd.Tier(slow, every=2)]) as manager:
        assert manager.latest() == 2
        assert_same(_state(2), manager.load("latest"))
        assert manager.checkpointer.last_load.tier == 1


# ---- under torch.distributed -----------------------------------------------------------------


def _save_two_ranks(rank: int, world: int, fast: str, slow: str) -> int:
    with ckptd.Checkpointer(fast, dist_timeout=60, tiers=[ckptd.Tier(slow, every=2)]) as ckpt:
        for step in (2, 4):
            mine = {"v": torch.full((5,), float(100 * rank + step))}
            ckpt.save(step, {"model": _state(step)["model"], "mine": mine}, sharing={"mine": "per_rank"})
        ckpt.wait_promotions(120)
    return 0


def _load_two_ranks(rank: int, world: int, fast: str, slow: str) -> dict[str, Any]:
    with ckptd.Checkpointer(fast, dist_timeout=60, tiers=[ckptd.Tier(slow, every=2)]) as ckpt:
        loaded = ckpt.load()
        return {"step": ckpt.last_load.step, "tier": ckpt.last_load.tier, "mine": loaded["mine"]["v"]}


@pytest.mark.distributed
@pytest.mark.multiprocess
def test_every_rank_loads_the_same_step_when_one_rank_cannot_load_the_newest(tmp_path):
    from distributed import run_ranks

    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    run_ranks(2, _save_two_ranks, fast, slow)
    for root in (fast, slow):  # rank 1's own file of step 4 is damaged in both tiers; rank 0's is whole
        shard = os.path.join(root, "checkpoint-4", "mine@rank1-00001-of-00001.safetensors")
        with open(shard, "r+b") as f:
            f.seek(-4, os.SEEK_END)
            f.write(b"\xff\xff\xff\xff")
    outcomes = run_ranks(2, _load_two_ranks, fast, slow)
    # Alone, rank 0 would take step 4 and rank 1 step 2: a job restarted from two different steps.
    assert [outcomes[r]["step"] for r in (0, 1)] == [2, 2]
    for rank in (0, 1):
        assert_same(torch.full((5,), float(100 * rank + 2)), outcomes[rank]["mine"])


def test_a_checkpointer_dropped_unclosed_still_finishes_its_copies_and_stops_its_thread(tmp_path):
    import gc
    import threading
    import warnings

    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    ckpt = ckptd.Checkpointer(fast, tiers=[ckptd.Tier(slow)])
    ckpt.save(1, _state(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        del ckpt
        gc.collect()
    wait_for(lambda: not any(t.name == "ckptd-promote" and t.is_alive() for t in threading.enumerate()), timeout=60)
    with ckptd.Checkpointer(slow) as tier:
        assert_same(_state(1), tier.load(1, verify=True))


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_an_overwrite_replaces_the_tiers_copy_of_that_step_too(backend, tmp_path, request):
    fast = str(tmp_path / "fast")
    if backend == "local":
        tier = ckptd.Tier(str(tmp_path / "slow"))
        read_back = {"root": str(tmp_path / "slow")}
    else:
        pytest.importorskip("s3fs")
        s3 = request.getfixturevalue("s3")
        tier = ckptd.Tier(s3.url("tier"), storage_options=s3.options())
        read_back = {"root": s3.url("tier"), "storage_options": s3.options()}
    with ckptd.Checkpointer(fast, tiers=[tier]) as ckpt:
        ckpt.save(3, _state(3))
        ckpt.save(3, _state(30), overwrite=True)  # a rollback saved step 3 again
        assert ckpt.wait_promotions(60)
        first, second = ckpt.promotions()
        # The first copy either finished before the overwrite or stopped at it, never mixing the two
        assert first.error is None or isinstance(first.error, CheckpointReplacedError), first.error
        assert second.error is None
    with ckptd.Checkpointer(**read_back) as copy:
        assert copy.steps() == [3]
        assert_same(_state(30), copy.load(3, verify=True))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities are Linux's")
def test_the_copies_run_at_the_writers_lower_priority(tmp_path):
    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with ckptd.Checkpointer(fast, writer_nice=5, tiers=[ckptd.Tier(slow)]) as ckpt:
        (copier,) = [t for t in threading.enumerate() if t.name == "ckptd-promote"]
        assert copier.native_id is not None
        wait_for(lambda: os.getpriority(os.PRIO_PROCESS, copier.native_id) == min(19, before + 5))
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before  # training keeps its own
        ckpt.save(1, _state(1))
        assert ckpt.wait_promotions(60)
    with ckptd.Checkpointer(slow) as tier:
        assert_same(_state(1), tier.load(1, verify=True))


def test_a_copy_stopped_mid_file_raises_between_pieces_and_publishes_nothing(tmp_path):
    # close(wait=False) asks the copy to stop: it must stop within the file being copied (a
    # multi-GiB shard to a slow tier would otherwise be copied whole first), not only between files
    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    state = {"model": {"w": torch.randn(3 * COPY_PIECE // 4)}}  # one shard of three pieces
    with ckptd.Checkpointer(fast) as ckpt:
        path = ckpt.save(1, state).path
    os.makedirs(slow)
    shard = max(os.listdir(path), key=lambda name: os.path.getsize(os.path.join(path, name)))
    seen: list[int] = []  # the bytes written under the tier each time the copy asked

    def stop() -> bool:  # stop as soon as the shard's copy has begun
        seen.append(sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(slow) for f in files))
        return seen[-1] > 0

    with pytest.raises(PromotionStopped):
        promote_checkpoint(storage_for(path), path, storage_for(slow), os.path.join(slow, "checkpoint-1"), stop=stop)
    assert 0 < max(seen) < os.path.getsize(os.path.join(path, shard)), f"stopped after {max(seen)} bytes"
    assert os.listdir(slow) == []
