"""Checkpoint directory names: ``checkpoint-<step>`` (HF Trainer / Forgather), and directories
written by older ckptd versions with zero-padded names (``checkpoint-000120``) still list, sort
by step and load."""

from __future__ import annotations

import os

import torch
from conftest import assert_same

import ckptd
from ckptd.catalog import checkpoint_dir_name, parse_step


def test_names_are_unpadded_and_both_spellings_parse():
    assert checkpoint_dir_name(120) == "checkpoint-120"
    assert checkpoint_dir_name(0) == "checkpoint-0"
    assert parse_step("checkpoint-120") == parse_step("checkpoint-000120") == 120
    assert parse_step("checkpoint-step_5") is None


def test_checkpointer_writes_unpadded_names(root):
    with ckptd.Checkpointer(root) as ckpt:
        result = ckpt.save(1000, {"model": {"w": torch.ones(2)}})
    assert os.path.basename(result.path) == "checkpoint-1000"
    assert sorted(n for n in os.listdir(root) if not n.startswith(".")) == ["checkpoint-1000"]


def legacy(root: str, step: int) -> str:
    """Rename ``checkpoint-<step>`` to the zero-padded name an older ckptd gave it."""
    padded = os.path.join(root, f"checkpoint-{step:06d}")
    os.rename(os.path.join(root, f"checkpoint-{step}"), padded)
    return padded


def test_zero_padded_directories_list_sort_and_load(root):
    tensors = {step: torch.full((3,), float(step)) for step in (9, 10, 100)}
    with ckptd.Checkpointer(root) as ckpt:
        for step, tensor in tensors.items():
            ckpt.save(step, {"model": {"w": tensor}})
    padded_9 = legacy(root, 9)
    padded_100 = legacy(root, 100)
    # By name, "checkpoint-000100" < "checkpoint-10" < "checkpoint-000009" sorts wrongly; by step it must not.
    with ckptd.Checkpointer(root) as ckpt:
        assert ckpt.steps() == [9, 10, 100]
        assert [c.path for c in ckpt.checkpoints()] == [padded_9, os.path.join(root, "checkpoint-10"), padded_100]
        assert ckpt.latest_step() == 100
        for step, tensor in tensors.items():
            assert_same(tensor, ckpt.load(step)["model"]["w"])
        assert_same(tensors[100], ckpt.load("latest")["model"]["w"])
        assert_same(tensors[9], ckpt.load(padded_9)["model"]["w"])
        ckpt.save(101, {"model": {"w": torch.zeros(3)}})
        assert ckpt.steps() == [9, 10, 100, 101]
    assert ckptd.validate_checkpoint(padded_100)
    assert_same(tensors[100], ckptd.load_checkpoint(padded_100)["w"])


def test_retention_counts_both_spellings_by_step(root):
    with ckptd.Checkpointer(root) as ckpt:
        for step in (8, 9):
            ckpt.save(step, {"model": {"w": torch.ones(1) * step}})
    legacy(root, 9)  # the newest step now has the name that sorts first
    with ckptd.Checkpointer(root, keep_last=2) as ckpt:
        ckpt.save(10, {"model": {"w": torch.ones(1)}})
        assert ckpt.steps() == [9, 10]
    assert sorted(n for n in os.listdir(root) if not n.startswith(".")) == ["checkpoint-000009", "checkpoint-10"]


def test_object_store_gc_keeps_checkpoints_other_tools_committed():
    """Garbage collection on object stores removes ``checkpoint-<step>`` prefixes without a
    ckptd manifest; one holding Forgather's manifest is a checkpoint, not garbage."""
    import json
    import uuid

    from ckptd.garbage import collect_garbage
    from ckptd.storage import storage_for

    root = f"memory://gc-{uuid.uuid4().hex}"
    storage = storage_for(root)
    for step, manifest in ((5, {"timestamp": "2026-01-01T00:00:00", "components": {}}), (6, None)):
        path = f"{root}/checkpoint-{step}"
        storage.makedirs(path)
        storage.write_stream(f"{path}/pytorch_model.bin", [memoryview(b"weights")])
        if manifest is not None:
            storage.write_stream(f"{path}/checkpoint_manifest.json", [memoryview(json.dumps(manifest).encode())])
    assert collect_garbage(storage, root) == [f"{root}/checkpoint-6"]
    assert storage.list_names(root) == ["checkpoint-5"]
