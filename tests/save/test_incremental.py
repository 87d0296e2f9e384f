"""Incremental saves: unchanged files are referenced, not rewritten."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch
from conftest import assert_same

import ckptd


class LoRAish(torch.nn.Module):
    """A frozen base (embedding + projection) and a small trainable adapter."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(512, 64)
        self.base = torch.nn.Linear(64, 64)
        self.adapter = torch.nn.Linear(64, 64)
        for p in [*self.embed.parameters(), *self.base.parameters()]:
            p.requires_grad_(False)


def manifest_of(path: str) -> dict:
    with open(os.path.join(path, "checkpoint_manifest.json")) as f:
        return json.load(f)


def test_frozen_parameters_are_written_once_and_referenced_after(root):
    torch.manual_seed(0)
    model = LoRAish()
    with ckptd.Checkpointer(root, incremental=True) as ckpt:
        first = ckpt.save(1, {"model": model})
        with torch.no_grad():
            model.adapter.weight.add_(1.0)
        second = ckpt.save(2, {"model": model})
        assert second.bytes_reused > 0 and second.bytes_reused > 4 * second.bytes_written
        assert first.bytes_reused == 0
        files = manifest_of(second.path)["files"]
        reused = {n for n, f in files.items() if f.get("checkpoint") == "checkpoint-1"}
        assert reused and all(not os.path.exists(os.path.join(second.path, n)) for n in reused)
        assert_same(model.state_dict(), ckpt.load(2)["model"])
        ckpt.load(2, verify=True)
        fresh = LoRAish()
        ckpt.load(2, into={"model": fresh})
        assert_same(model.state_dict(), fresh.state_dict())
        third = ckpt.save(3, {"model": model})
        assert {f.get("checkpoint") for f in manifest_of(third.path)["files"].values()} >= {"checkpoint-1"}


def test_retention_keeps_referenced_checkpoints_and_consolidate_materialises(root, tmp_path):
    torch.manual_seed(0)
    model = LoRAish()
    with ckptd.Checkpointer(root, incremental=True, keep_last=1) as ckpt:
        for step in range(1, 4):
            with torch.no_grad():
                model.adapter.bias.add_(1.0)
            ckpt.save(step, {"model": model})
        assert ckpt.steps() == [1, 3], "step 1 holds the frozen files step 3 references"
        out = str(tmp_path / "standalone")
        ckptd.consolidate(ckpt.path_for(3), out)
    assert all("checkpoint" not in f for f in manifest_of(out)["files"].values())
    assert_same(model.state_dict(), ckptd.load_checkpoint(out))


def test_declared_frozen_keys_and_hash_mode(root):
    state = {"table": torch.randn(256, 256), "head": torch.randn(256)}
    frozen = {"model": ["tab*"]}
    with ckptd.Checkpointer(root, incremental="hash", max_shard_size="100KB") as ckpt:
        ckpt.save(1, {"model": state, "extra": {"static": torch.arange(50000)}}, frozen=frozen)
        state["head"].add_(1)
        result = ckpt.save(2, {"model": state, "extra": {"static": torch.arange(50000)}}, frozen=frozen)
        files = manifest_of(result.path)["files"]
        by_reference = {n: f.get("checkpoint") for n, f in files.items()}
        assert by_reference["extra-00001-of-00001.safetensors"] == "checkpoint-1", "unchanged: found by hash"
        assert any(n.startswith("model-") and r == "checkpoint-1" for n, r in by_reference.items())
        assert any(n.startswith("model-") and r is None for n, r in by_reference.items()), "the changed file"
        loaded = ckpt.load(2)
        assert_same(state, loaded["model"])
        assert_same(torch.arange(50000), loaded["extra"]["static"])


def test_incremental_option_is_validated(root):
    with pytest.raises(ckptd.errors.ConfigError, match="incremental"):
        ckptd.Checkpointer(root, incremental="sometimes")


def gate_type(name: str) -> type:
    """A tensor type whose copy waits on its own gate: it holds one background staging open."""
    gate = threading.Event()

    def torch_function(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_ and any(isinstance(a, cls) for a in args[1:2]):
            if not gate.wait(30):
                raise RuntimeError("gate never opened")
        return super(cls, cls).__torch_function__(func, types, args, kwargs or {})

    return type(name, (torch.Tensor,), {"gate": gate, "__torch_function__": classmethod(torch_function)})


def test_retention_keeps_what_a_queued_save_will_reference(root):
    torch.manual_seed(0)
    model = LoRAish()
    first_gate, second_gate = gate_type("First"), gate_type("Second")
    with ckptd.Checkpointer(root, incremental=True, keep_last=1, max_in_flight=2, staging="background") as ckpt:
        one = ckpt.async_save(100, {"model": model, "hold": {"x": torch.ones(4).as_subclass(first_gate)}})
        two = ckpt.async_save(200, {"model": model, "hold": {"x": torch.ones(4).as_subclass(second_gate)}})
        first_gate.gate.set()
        one.wait(60)
        three = ckpt.async_save(300, {"model": model})  # planned after 100 committed: reuses its files
        second_gate.gate.set()  # 200 (which reuses nothing) commits while 300 is queued: retention runs
        two.wait(60)
        assert 100 in ckpt.steps(), "100 holds files the queued save 300 references"
        assert three.wait(60).bytes_reused > 0
        assert_same(model.state_dict(), ckpt.load(300, verify=True)["model"])


def test_overwriting_an_incremental_step_keeps_it_loadable_and_referenced_steps_are_protected(root):
    torch.manual_seed(0)
    model = LoRAish()
    with ckptd.Checkpointer(root, incremental=True) as ckpt:
        ckpt.save(100, {"model": model})
        ckpt.save(100, {"model": model}, overwrite=True)  # must not reference itself
        assert_same(model.state_dict(), ckpt.load(100, verify=True)["model"])
        ckpt.save(200, {"model": model})  # references 100's frozen files
        with pytest.raises(ckptd.errors.ReferencedCheckpointError, match="reference"):
            ckpt.save(100, {"model": model}, overwrite=True)
        assert_same(model.state_dict(), ckpt.load(200, verify=True)["model"])


def test_a_referenced_sibling_that_is_a_symlink_is_refused(root, tmp_path):
    model = LoRAish()
    with ckptd.Checkpointer(root, incremental=True) as ckpt:
        ckpt.save(1, {"model": model})
        second = ckpt.save(2, {"model": model})
        holder = ckpt.path_for(1)
        elsewhere = str(tmp_path / "elsewhere")
        os.rename(holder, elsewhere)
        os.symlink(elsewhere, holder)
        with pytest.raises(ckptd.errors.UnsafeCheckpointError, match="beside"):
            ckpt.load(2)
    assert second.bytes_reused > 0
