"""The seed-compatible functional API (Forgather sharded_checkpoint, ModelOpt helpers)."""

from __future__ import annotations

import inspect
import json
import os

import pytest
import torch
from conftest import TinyLM, assert_same

import ckptd
from ckptd.errors import KeyMismatchError


def test_signatures_match_the_seed_api():
    def params(fn):
        return [(p.name, p.default) for p in inspect.signature(fn).parameters.values() if p.kind != p.KEYWORD_ONLY]

    assert params(ckptd.save_checkpoint) == [
        ("output_dir", inspect.Parameter.empty),
        ("module", inspect.Parameter.empty),
        ("metadata", None),
        ("safetensors", False),
        ("max_shard_size", 2**31),
        ("debug", False),
        ("include_param_sharing", True),
        ("param_sharing_metadata", None),
    ]
    assert params(ckptd.load_checkpoint) == [
        ("model_dir", inspect.Parameter.empty),
        ("module", None),
        ("device", "cpu"),
        ("strict", True),
        ("assign", False),
        ("keys", None),
    ]
    assert params(ckptd.load_sharded_state_dict) == [
        ("model_name_or_path", inspect.Parameter.empty),
        ("keys_to_load", None),
        ("device", "cpu"),
    ]
    assert ckptd.index_file_name(True) == "model.safetensors.index.json"
    assert ckptd.index_file_name(False) == "pytorch_model.bin.index.json"


@pytest.mark.parametrize("use_safetensors", [True, False])
def test_save_and_load_module_with_tied_parameters(tmp_path, use_safetensors):
    torch.manual_seed(0)
    model = TinyLM()
    ckptd.save_checkpoint(
        str(tmp_path), model, metadata={"note": "x"}, safetensors=use_safetensors, max_shard_size=1500
    )
    index_name = ckptd.index_file_name(use_safetensors)
    index = json.loads((tmp_path / index_name).read_text())
    assert index["metadata"]["note"] == "x"
    assert index["metadata"]["param_sharing"] == [["embed.weight", "head.weight"]]
    assert "head.weight" not in index["weight_map"]
    assert len(set(index["weight_map"].values())) > 1
    assert ckptd.validate_checkpoint(str(tmp_path))
    meta = ckptd.get_checkpoint_metadata(str(tmp_path))
    assert meta == ckptd.CheckpointMeta(index_name, True, use_safetensors)
    assert ckptd.is_in_safetensors_format(str(tmp_path)) is use_safetensors

    fresh = TinyLM()
    fresh.head.weight = torch.nn.Parameter(torch.zeros_like(fresh.head.weight))  # untied
    ckptd.load_checkpoint(str(tmp_path), fresh)
    assert fresh.head.weight is fresh.embed.weight, "tied parameters must be re-tied on load"
    assert_same(model.state_dict(), fresh.state_dict())

    as_dict = ckptd.load_checkpoint(str(tmp_path))
    assert_same(model.state_dict(), as_dict)
    assert ckptd.CheckpointReader.open(str(tmp_path)).verify() is None


def test_dict_mode_keys_and_modelopt_keys_to_load(tmp_path):
    state = {f"block.{i}.weight": torch.full((64,), float(i)) for i in range(5)}
    ckptd.save_checkpoint(str(tmp_path), state, safetensors=True, max_shard_size=256)
    subset = ckptd.load_checkpoint(str(tmp_path), keys={"block.3.weight"})
    assert list(subset) == ["block.3.weight"]
    assert_same(state["block.3.weight"], subset["block.3.weight"])
    assert_same(
        {"block.1.weight": state["block.1.weight"]}, ckptd.load_sharded_state_dict(tmp_path, ["block.1.weight"])
    )
    # ModelOpt's semantics (checked against the real library in test_modelopt_interop.py): keys
    # not stored are skipped, e.g. the tied lm_head.weight its loader asks for
    assert_same(
        {"block.2.weight": state["block.2.weight"]},
        ckptd.load_sharded_state_dict(tmp_path, ["block.9.weight", "block.2.weight"]),
    )


def test_include_param_sharing_false_stores_every_key(tmp_path):
    model = TinyLM()
    ckptd.save_checkpoint(str(tmp_path), model, safetensors=True, include_param_sharing=False)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert "head.weight" in index["weight_map"] and "param_sharing" not in index["metadata"]
    assert_same(model.state_dict(), ckptd.load_checkpoint(str(tmp_path)))


def test_resaving_removes_stale_shards_and_old_manifest_is_replaced(tmp_path):
    big = {f"w{i}": torch.randn(100) for i in range(6)}
    ckptd.save_checkpoint(str(tmp_path), big, safetensors=True, max_shard_size=400)
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".safetensors")]) == 6
    small = {"w0": torch.randn(100)}
    ckptd.save_checkpoint(str(tmp_path), small, safetensors=True)
    assert sorted(n for n in os.listdir(tmp_path) if n.endswith(".safetensors")) == ["model-00001-of-00001.safetensors"]
    assert_same(small, ckptd.load_checkpoint(str(tmp_path)))


def test_multi_rank_style_shard_index_save_and_load(tmp_path):
    torch.manual_seed(0)
    shards = [{"a.weight": torch.randn(4, 4), "a.bias": torch.randn(4)}, {"b.weight": torch.randn(2, 4)}]
    index = ckptd.make_shard_index(shards, safetensors=True)
    assert set(index["weight_map"].values()) == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    assert index["metadata"]["total_size"] == (16 + 4 + 8) * 4
    ckptd.save_shard_index(index, str(tmp_path), ckptd.index_file_name(True))
    for shard in shards:  # each "rank" writes its own files
        ckptd.save_sharded_checkpoint(str(tmp_path), index, shard, safetensors=True)
    loaded_index = ckptd.load_shard_index(str(tmp_path), ckptd.index_file_name(True))
    assert loaded_index == index
    merged = {**shards[0], **shards[1]}
    assert_same(merged, ckptd.load_sharded_checkpoint(str(tmp_path), loaded_index, safetensors=True))
    module = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 4), "b": torch.nn.Linear(4, 2, bias=False)})
    unloaded = ckptd.load_sharded_checkpoint(str(tmp_path), loaded_index, module, safetensors=True)
    assert unloaded == set()
    assert_same(merged["a.weight"], module.a.weight.detach())
    with pytest.raises(KeyMismatchError, match="lacks"):
        ckptd.save_sharded_checkpoint(str(tmp_path), index, {"a.weight": torch.randn(4, 4)}, safetensors=True)


def test_sharing_metadata_helpers():
    model = TinyLM()
    groups = ckptd.create_sharing_metadata(model)
    assert groups == [["embed.weight", "head.weight"]]
    model.head.weight = torch.nn.Parameter(model.head.weight.detach().clone())
    assert ckptd.create_sharing_metadata(model) == []
    ckptd.retie_parameters(model, groups)
    assert model.head.weight is model.embed.weight


def test_save_sharded_model_writes_modelopts_shard_and_index(tmp_path):
    model = TinyLM()
    out = tmp_path / "export" / "model.safetensors"
    ckptd.save_sharded_model(model, str(out))  # no process group: shard 1 of 1, as one rank of ModelOpt
    assert sorted(os.listdir(out.parent)) == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    loaded = ckptd.load_sharded_state_dict(tmp_path / "export")
    expected = {k: v for k, v in model.state_dict().items() if k != "head.weight"}
    assert_same(expected, loaded)


def test_checkpoint_management_helpers(tmp_path):
    model_dir = str(tmp_path)
    paths = []
    for step in (10, 20, 30):
        path = ckptd.next_checkpoint_path(model_dir, step)
        ckptd.save_checkpoint(path, {"w": torch.full((2,), float(step))}, safetensors=True)
        paths.append(path)
    assert ckptd.find_latest_checkpoint(model_dir) == paths[-1]
    ckptd.save_checkpoint_metrics(paths[0], {"loss": 0.5})
    assert ckptd.load_checkpoint_metrics(paths[0]) == {"loss": 0.5}
    assert ckptd.load_checkpoint_metrics(paths[1]) is None
    # Forgather's rule: three checkpoints, keep two; the oldest unpreserved one goes.
    ckptd.maybe_delete_oldest_checkpoint(model_dir, 2, best_checkpoint=paths[0])
    remaining = sorted(os.listdir(os.path.join(model_dir, "checkpoints")))
    assert remaining == [os.path.basename(paths[0]), os.path.basename(paths[2])]
    shard = next(n for n in os.listdir(paths[2]) if n.endswith(".safetensors"))
    os.remove(os.path.join(paths[2], shard))  # incomplete: skipped
    assert ckptd.find_latest_checkpoint(model_dir) == paths[0]
