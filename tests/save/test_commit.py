"""Publishing a checkpoint, removing one, and collecting what crashes leave (local disk)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
from conftest import assert_same

import ckptd
import ckptd.storage.local as local
import ckptd.storage.rename as rename
from ckptd.catalog import leftover_name, list_checkpoints, remove_checkpoint
from ckptd.errors import CheckpointExistsError
from ckptd.formats.names import host_label as _host
from ckptd.garbage import collect_garbage
from ckptd.storage.liveness import hold_new_directory
from ckptd.storage.local import LocalStorage, exchange_paths


def _state(value: float) -> dict[str, Any]:
    return {"model": {"w": torch.full((4, 4), value), "i": torch.arange(5) * int(value)}}


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _read(path: str) -> dict[str, Any]:
    from ckptd.load.reader import CheckpointReader

    reader = CheckpointReader.open(path)
    reader.verify()
    return {"model": reader.read("model")}


def _hidden(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("."))


def test_exchange_paths_swaps_two_directories(tmp_path: Any) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "which").write_text("a")
    (b / "which").write_text("b")
    if not exchange_paths(str(a), str(b)):
        pytest.skip(f"the filesystem of {tmp_path} cannot exchange (renameat2 RENAME_EXCHANGE)")
    assert (a / "which").read_text() == "b" and (b / "which").read_text() == "a"


def test_exchange_paths_of_a_missing_path_is_a_storage_error(tmp_path: Any) -> None:
    (tmp_path / "a").mkdir()
    if rename._load_renameat2() is None:
        pytest.skip("no renameat2 on this platform")
    with pytest.raises(ckptd.errors.StorageError, match="missing"):
        exchange_paths(str(tmp_path / "a"), str(tmp_path / "missing"))


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_overwrite_replaces_the_step_and_leaves_nothing(root: str, exchange: bool, monkeypatch: Any) -> None:
    if not exchange:
        monkeypatch.setattr(local, "exchange_paths", lambda a, b: False)
    with ckptd.Checkpointer(root) as ckpt:
        ckpt.save(1, _state(1.0))
        ckpt.save(1, _state(2.0), overwrite=True)
        assert ckpt.steps() == [1]
    assert_same(_read(os.path.join(root, "checkpoint-1")), _state(2.0))
    assert os.listdir(root) == ["checkpoint-1"]


def test_a_manifestless_step_directory_is_garbage_to_a_save(root: str) -> None:
    # What an interrupted deletion by an older version leaves: the manifest gone, shards left.
    with ckptd.Checkpointer(root) as ckpt:
        ckpt.save(5, _state(1.0))
        os.unlink(os.path.join(ckpt.path_for(5), "checkpoint_manifest.json"))
        assert ckpt.steps() == []
        ckpt.save(5, _state(3.0))  # not CheckpointExistsError
        assert ckpt.steps() == [5]
        with pytest.raises(CheckpointExistsError):
            ckpt.save(5, _state(4.0))  # a committed step still is refused
    assert_same(_read(os.path.join(root, "checkpoint-5")), _state(3.0))
    assert _hidden(root) == []


def test_remove_checkpoint_renames_aside_then_deletes(root: str) -> None:
    with ckptd.Checkpointer(root) as ckpt:
        ckpt.save(1, _state(1.0))
        ckpt.save(2, _state(2.0))
    remove_checkpoint(LocalStorage(), os.path.join(root, "checkpoint-1"))
    remove_checkpoint(LocalStorage(), os.path.join(root, "checkpoint-1"))  # already gone: fine
    assert os.listdir(root) == ["checkpoint-2"]


def _move(path: str, name: str) -> str:
    target = os.path.join(os.path.dirname(path), name)
    os.rename(path, target)
    return target


def test_gc_restores_a_replaced_step_and_publishes_a_committed_staging_directory(root: str) -> None:
    storage = LocalStorage()
    with ckptd.Checkpointer(root) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, _state(float(step)))
    dead = _dead_pid()
    # An overwrite by an older version crashed between its renames (no owner in the name).
    _move(os.path.join(root, "checkpoint-1"), ".checkpoint-1.replaced-0a1b2c3d")
    # A save crashed after its manifest, before its rename: the staging directory is complete.
    _move(os.path.join(root, "checkpoint-2"), f".checkpoint-2.tmp-{_host()}-{dead}-0a1b2c3d")
    # The same, but a shard is missing: not a checkpoint, removed.
    staging3 = _move(os.path.join(root, "checkpoint-3"), f".checkpoint-3.tmp-{_host()}-{dead}-0a1b2c3e")
    shard = next(n for n in os.listdir(staging3) if n.endswith(".safetensors"))
    os.unlink(os.path.join(staging3, shard))
    removed = collect_garbage(storage, root)
    assert [info.step for info in list_checkpoints(storage, root)] == [1, 2]
    assert removed == [staging3]
    for step in (1, 2):
        assert_same(_read(os.path.join(root, f"checkpoint-{step}")), _state(float(step)))
    assert _hidden(root) == []


def test_gc_prefers_the_new_copy_and_never_deletes_a_committed_staging_directory_alone(root: str) -> None:
    storage = LocalStorage()
    with ckptd.Checkpointer(root) as ckpt:
        ckpt.save(1, _state(9.0))
        new = ckpt.path_for(1) + "-new"
        shutil.copytree(ckpt.path_for(1), new)  # the new, committed copy
        ckpt.save(1, _state(1.0), overwrite=True)  # the old one
    dead = _dead_pid()
    # The overwrite crashed between its two renames: old aside, new (committed) in staging.
    _move(os.path.join(root, "checkpoint-1"), f".checkpoint-1.replaced-{_host()}-{dead}-00000001")
    _move(new, f".checkpoint-1.tmp-{_host()}-{dead}-00000002")
    collect_garbage(storage, root)
    assert_same(_read(os.path.join(root, "checkpoint-1")), _state(9.0))
    assert _hidden(root) == []


def test_gc_removes_every_leftover_kind_but_not_a_live_owners(root: str) -> None:
    storage = LocalStorage()
    with ckptd.Checkpointer(root) as ckpt:
        ckpt.save(1, _state(1.0))
    dead = _dead_pid()
    kept = os.path.join(root, leftover_name("checkpoint-2", "tmp"))  # this process: alive
    held = hold_new_directory(kept, os.mkdir)  # a live save's staging directory: locked
    leftovers = [
        f".checkpoint-1.replaced-{_host()}-{dead}-0000000a",  # checkpoint-1 exists: old copy
        f".checkpoint-1.deleting-{_host()}-{dead}-0000000b",  # half-deleted
        f".checkpoint-1.deleting-{_host()}-{os.getpid()}-0000000c",  # the owner may still be deleting
        f".consolidated.tmp-{_host()}-{dead}-0000000d",  # consolidation's staging directory
        ".model.safetensors.tmp-0000000e",  # a write_stream temporary of an older version
    ]
    for name in leftovers[:-1]:
        os.mkdir(os.path.join(root, name))
        with open(os.path.join(root, name, "x"), "wb") as f:
            f.write(b"x")
    with open(os.path.join(root, leftovers[-1]), "wb") as f:
        f.write(b"x")
    old = time.time() - 3600
    os.utime(os.path.join(root, leftovers[-1]), (old, old))
    collect_garbage(storage, root, older_than=60)
    assert _hidden(root) == sorted([os.path.basename(kept), leftovers[2]])
    assert [info.step for info in list_checkpoints(storage, root)] == [1]
    held.release()
