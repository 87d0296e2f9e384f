"""Durability: every file, the staging directory, and the directory holding each rename are
fsynced in the order that makes a commit survive a power cut.

The save runs in a fresh process (and its writer process) under the OS-call recorder of
``oshook``: every fsync, rename and mkdir is logged with the path it touched.  Each assertion
fails when the corresponding fsync in ``ckptd/storage/local.py`` is removed.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from crashsim import Call, read_calls, run, stop_zygote
from scenario import state_for

import ckptd


@pytest.fixture(scope="module", autouse=True)
def _forking_server() -> Any:
    yield
    stop_zygote()


def _first(calls: list[Call], op: str, path: str, after: int = -1) -> int:
    """Index of the first ``op`` on ``path`` (first path of the call) after index ``after``."""
    for index, call in enumerate(calls):
        if index > after and call.op == op and call.paths[0] == path:
            return index
    raise AssertionError(f"no {op} of {path} after call #{after}:\n" + "\n".join(map(str, calls[after + 1 :])))


def _rename(calls: list[Call], target: str) -> tuple[int, str]:
    """Index and source of the rename onto ``target``."""
    for index, call in enumerate(calls):
        if call.op == "rename" and call.paths[1] == target:
            return index, call.paths[0]
    raise AssertionError(f"nothing was renamed to {target}")


def _recorded(tmp_path: Any, action: str, args: dict[str, Any]) -> list[Call]:
    log = str(tmp_path / "calls.log")
    if os.path.exists(log):
        os.unlink(log)
    run(action, args, record=log)
    return read_calls(log)


def test_save_fsyncs_every_file_the_staging_directory_and_the_parent(tmp_path: Any) -> None:
    root = str(tmp_path / "new" / "deeper" / "ckpts")  # three directories the save creates
    calls = _recorded(tmp_path, "save", {"root": root, "steps": [1]})
    final = os.path.join(root, "checkpoint-1")
    renamed, staging = _rename(calls, final)
    files = sorted(os.listdir(final))
    assert any(name.endswith(".safetensors") for name in files) and "checkpoint_manifest.json" in files
    last_file_sync = -1
    for name in files:  # shards (the writer process), indexes, state, manifest (the trainer)
        synced = _first(calls, "fsync", os.path.join(staging, name))
        assert synced < renamed, f"{name} was fsynced after the commit rename"
        last_file_sync = max(last_file_sync, synced)
    staging_synced = _first(calls, "fsync", staging, after=last_file_sync)
    assert staging_synced < renamed, "the staging directory was not fsynced before the rename"
    for name in files:  # every entry existed when the directory was fsynced
        created = _first(calls, "create", os.path.join(staging, name))
        assert created < staging_synced, f"{name} was created after the staging directory's fsync"
    _first(calls, "fsync", root, after=renamed)  # the rename itself made durable
    for created in (str(tmp_path / "new"), str(tmp_path / "new" / "deeper"), root):
        made = _first(calls, "mkdir", created)
        _first(calls, "fsync", os.path.dirname(created), after=made)  # a new directory's entry


def test_shard_fsyncs_run_behind_the_writing_and_descriptions_beside_it(tmp_path: Any) -> None:
    """With several shards, each one's fsync runs on the writer's fsync thread while the next
    shard is written; the indexes and the state file are written and fsynced by the trainer's
    describe thread, which starts before the shards are written; the manifest after both."""
    root = str(tmp_path / "ckpts")
    calls = _recorded(tmp_path, "save", {"root": root, "steps": [1]})
    renamed, staging = _rename(calls, os.path.join(root, "checkpoint-1"))
    files = sorted(os.listdir(os.path.join(root, "checkpoint-1")))
    shards = [name for name in files if name.endswith(".safetensors")]
    assert len(shards) >= 2, f"the scenario must write several shards, got {shards}"
    for name in shards:
        synced = calls[_first(calls, "fsync", os.path.join(staging, name))]
        assert synced.thread.startswith("ckptd-fsync"), f"{name} was fsynced by thread {synced.thread}"
    described = [name for name in files if name.endswith(".index.json") or name == "state.json"]
    assert len(described) == 2, files
    for name in described:
        synced = calls[_first(calls, "fsync", os.path.join(staging, name))]
        assert synced.thread == "ckptd-describe", f"{name} was fsynced by thread {synced.thread}"
    manifest = _first(calls, "fsync", os.path.join(staging, "checkpoint_manifest.json"))
    last_shard = max(_first(calls, "fsync", os.path.join(staging, name)) for name in shards)
    assert last_shard < manifest < renamed


def test_write_stream_fsyncs_the_file_and_then_its_directory(tmp_path: Any) -> None:
    root = str(tmp_path / "ckpts")
    with ckptd.Checkpointer(root) as ckpt:
        path = ckpt.save(1, state_for(1)).path
    calls = _recorded(tmp_path, "metrics", {"path": path})  # save_checkpoint_metrics -> write_stream
    renamed, temporary = _rename(calls, os.path.join(path, "eval_metrics.json"))
    assert _first(calls, "fsync", temporary) < renamed, "the temporary file was not fsynced before its rename"
    _first(calls, "fsync", path, after=renamed)


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_overwrite_and_removal_make_each_rename_durable(tmp_path: Any, exchange: bool) -> None:
    root = str(tmp_path / "ckpts")
    with ckptd.Checkpointer(root) as ckpt:
        ckpt.save(1, state_for(1))
        ckpt.save(2, state_for(2))
    args = {"root": root, "steps": [2], "overwrite": True, "variant": 1, "keep_last": 1, "no_exchange": not exchange}
    calls = _recorded(tmp_path, "save", args)
    final = os.path.join(root, "checkpoint-2")
    manifest_synced = max(i for i, c in enumerate(calls) if c.op == "fsync" and c.paths[0].endswith("manifest.json"))
    staging = os.path.dirname(calls[manifest_synced].paths[0])
    staging_synced = _first(calls, "fsync", staging, after=manifest_synced)
    if exchange:  # renameat2 is not an os.* call: the parent fsync after the staging one is the swap's
        assert not [c for c in calls if c.op == "rename" and c.paths[1] == final], "exchanged by renames"
        swapped = _first(calls, "fsync", root, after=staging_synced)
        old_removed = next(i for i, c in enumerate(calls) if c.op == "rename" and c.paths[0] == staging)
        assert swapped < old_removed, "the swap was not made durable before the old checkpoint was removed"
    else:
        aside = next(i for i, c in enumerate(calls) if c.op == "rename" and c.paths[0] == final)
        renamed, _ = _rename(calls, final)
        assert _first(calls, "fsync", root, after=aside) < renamed  # the old one is aside, durably, before ...
        _first(calls, "fsync", root, after=renamed)  # ... the new one is in, durably
    removal = next(
        i
        for i, c in enumerate(calls)
        if c.op == "rename" and c.paths[0] == os.path.join(root, "checkpoint-1")  # retention, keep_last=1
    )
    assert ".checkpoint-1.deleting-" in calls[removal].paths[1]
    _first(calls, "fsync", root, after=removal)
    assert sorted(os.listdir(root)) == ["checkpoint-2"]
