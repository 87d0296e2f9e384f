"""The indexes and the state file are written while the shards are, not after them.

They depend on the plan only, so the coordinator writes (and fsyncs) them on its describe thread
while its writer process writes the shards; the commit then only writes the manifest and
publishes.  These tests stop the real writer process to see the order, and make the early write
fail to check that the save fails cleanly.
"""

from __future__ import annotations

import json
import os
import resource
import signal

import pytest
import torch
from conftest import assert_same, staging_dirs, wait_for

import ckptd
from ckptd.errors import StorageError


def test_indexes_and_state_are_written_before_any_shard_byte(root: str) -> None:
    ckpt = ckptd.Checkpointer(root)
    pid = 0
    try:
        ckpt.save(1, {"model": {"w": torch.zeros(16)}, "optimizer": {"m": torch.zeros(16)}})
        pid = ckpt.writer_pid
        os.kill(pid, signal.SIGSTOP)  # the writer cannot write a byte until it is continued
        state = {
            "model": {"w": torch.randn(4096), "b": torch.arange(10, dtype=torch.int64)},
            "optimizer": {"m": torch.randn(4096)},
            "trainer": {"epoch": 3, "note": "early"},
        }
        request = ckpt.async_save(2, state)

        def described() -> bool:
            names = {n for d in staging_dirs(root) for n in os.listdir(d)}
            return {"model.safetensors.index.json", "optimizer.safetensors.index.json", "state.json"} <= names

        wait_for(described)
        (staging,) = staging_dirs(root)
        shard_bytes = {
            n: os.path.getsize(os.path.join(staging, n)) for n in os.listdir(staging) if n.endswith(".safetensors")
        }
        assert all(size == 0 for size in shard_bytes.values()), shard_bytes
        assert not os.path.exists(os.path.join(staging, "checkpoint_manifest.json"))
        index = json.loads(open(os.path.join(staging, "model.safetensors.index.json")).read())
        assert sorted(index["weight_map"]) == ["b", "w"]
        assert not request.done()
        os.kill(pid, signal.SIGCONT)
        pid = 0
        result = request.result(timeout=60)
        assert result.step == 2 and ckpt.steps() == [1, 2]
        loaded = ckpt.load(2, verify=True)
        for component in ("model", "optimizer"):
            for key, tensor in state[component].items():
                assert_same(tensor, loaded[component][key])
        assert loaded["trainer"] == {"epoch": 3, "note": "early"}
        files = ckpt.manifest(2).files
        assert {"model.safetensors.index.json", "optimizer.safetensors.index.json", "state.json"} <= set(files)
    finally:
        if pid:
            os.kill(pid, signal.SIGCONT)
        ckpt.close(wait=False)


def test_a_failed_early_write_fails_the_save_and_keeps_the_last_checkpoint(root: str) -> None:
    ckpt = ckptd.Checkpointer(root)
    try:
        ckpt.save(1, {"model": {"w": torch.zeros(16)}, "trainer": {"note": "small"}})
        ckpt.health_check()  # the writer runs already: the limit below is this process's alone
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, hard))  # Python ignores SIGXFSZ: EFBIG
        try:
            with pytest.raises(StorageError, match=r"state\.json"):
                ckpt.save(2, {"model": {"w": torch.ones(16)}, "trainer": {"note": "x" * (1024 * 1024)}})
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        assert ckpt.steps() == [1]
        wait_for(lambda: staging_dirs(root) == [])
        assert_same(torch.zeros(16), ckpt.load()["model"]["w"])
        ckpt.save(3, {"model": {"w": torch.ones(16)}, "trainer": {"note": "after"}})
        assert ckpt.load(3)["trainer"] == {"note": "after"}
    finally:
        ckpt.close(wait=False)
