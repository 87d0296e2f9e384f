"""ModelOpt's generic helpers: set_submodule and load_state_dict_to_shards (one process and a
real 2-rank gloo group), next to the loaders tested in test_api_seed.py."""

from __future__ import annotations

import inspect
import json
import os

import pytest
import torch
from conftest import TinyLM, assert_same
from distributed import run_ranks

import ckptd
from ckptd.compat import modelopt
from ckptd.errors import ConfigError, DistributedSaveError, KeyMismatchError


def test_signatures_match_modelopt():
    def spelled(fn):
        return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]

    empty = inspect.Parameter.empty
    assert spelled(modelopt.load_state_dict_to_shards) == [("model_shard", empty), ("loaded_state_dict", None)]
    assert spelled(modelopt.set_submodule) == [("model", empty), ("module_name", empty), ("new_submodule", empty)]
    assert spelled(modelopt.save_sharded_model) == [("model_shard", empty), ("out_path", empty)]
    assert spelled(modelopt.is_in_safetensors_format) == [("checkpoint_dir", empty)]
    assert ckptd.set_submodule is modelopt.set_submodule


def test_set_submodule():
    model = TinyLM()
    replacement = torch.nn.Linear(16, 16, bias=False)
    modelopt.set_submodule(model, "layers.1", replacement)
    assert model.layers[1] is replacement
    modelopt.set_submodule(model, "norm", torch.nn.Identity())
    assert isinstance(model.norm, torch.nn.Identity)
    with pytest.raises(AttributeError):
        modelopt.set_submodule(model, "nowhere.sub", replacement)


def test_load_state_dict_to_shards_in_one_process():
    torch.manual_seed(0)
    source = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    shard = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    compiled_names = {f"_orig_mod.{k}": v for k, v in source.state_dict().items()}
    modelopt.load_state_dict_to_shards(shard, compiled_names)
    assert_same(source.state_dict(), shard.state_dict())
    with pytest.raises(ConfigError, match="loaded_state_dict"):
        modelopt.load_state_dict_to_shards(shard)
    partial = {k: v for k, v in source.state_dict().items() if k != "1.bias"}
    with pytest.raises(KeyMismatchError, match=r"1\.bias"):
        modelopt.load_state_dict_to_shards(shard, partial)


def full_model() -> torch.nn.Sequential:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))


def receive_shard(rank: int, world: int) -> dict[str, torch.Tensor]:
    shard = torch.nn.Sequential(*[torch.nn.Linear(4, 4) if i < 2 else torch.nn.Linear(4, 2) for i in range(3)])
    for index in range(3):  # rank 0 owns layer 0, rank 1 layers 1 and 2
        if (index == 0) != (rank == 0):
            modelopt.set_submodule(shard, str(index), torch.nn.Identity())
    modelopt.load_state_dict_to_shards(shard, full_model().state_dict() if rank == 0 else None)
    return shard.state_dict()


def test_load_state_dict_to_shards_over_two_ranks():
    results = run_ranks(2, receive_shard)
    expected = full_model().state_dict()
    assert set(results[0]) == {"0.weight", "0.bias"}
    assert set(results[1]) == {"1.weight", "1.bias", "2.weight", "2.bias"}
    for part in results.values():
        assert_same({k: expected[k] for k in part}, part)


# ---- the descriptor-tied functions, with an owned-keys function for ModelOpt's descriptor ----------------------

GPT2_OWNED = modelopt.owned_keys_by_block(
    "transformer.h", first=["transformer.wte", "transformer.wpe"], last=["transformer.ln_f", "lm_head"]
)


def gpt2(layers: int = 3):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=layers, n_embd=32, n_head=2, vocab_size=128, n_positions=64)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def block_keys(model, blocks):
    return {k for k in model.state_dict() if any(k.startswith(f"transformer.h.{b}.") for b in blocks)}


def test_owned_keys_by_block_and_create_local_shard():
    model = gpt2()
    first_only = GPT2_OWNED(model, {0})
    assert first_only == block_keys(model, [0]) | {
        "transformer.wte.weight",
        "transformer.wpe.weight",
        "lm_head.weight",  # tied to wte: goes with it (ModelOpt keeps the tied head on the first rank)
    }
    last_only = GPT2_OWNED(model, {2})
    assert last_only == block_keys(model, [2]) | {
        "transformer.ln_f.weight",
        "transformer.ln_f.bias",
        "lm_head.weight",
        "transformer.wte.weight",  # kept to load the tied head, as ModelOpt does
    }
    assert GPT2_OWNED(model, {1}) == block_keys(model, [1])
    shard = modelopt.create_local_shard_(model, {1}, GPT2_OWNED, None)
    assert shard is model and set(model.state_dict()) == block_keys(model, [1])
    assert not hasattr(model.transformer.wte, "weight") and not hasattr(model.lm_head, "weight")
    with pytest.raises(KeyMismatchError, match=r"no\.such\.key"):
        modelopt.create_local_shard_(gpt2(), {0}, lambda model, blocks: {"no.such.key"}, None)
    with pytest.raises(ConfigError, match="decoder"):
        modelopt.owned_keys_by_block("decoder")(gpt2(), {0})


def test_create_sharded_model_on_meta_and_on_cpu():
    config = gpt2().config
    config.architectures = ["GPT2LMHeadModel"]
    on_meta = modelopt.create_sharded_model(None, GPT2_OWNED, config, {0, 1})
    assert type(on_meta).__name__ == "GPT2LMHeadModel"
    assert all(t.device.type == "meta" for t in on_meta.state_dict().values())
    assert "transformer.h.2.ln_1.weight" not in on_meta.state_dict()
    on_cpu = modelopt.create_sharded_model(None, GPT2_OWNED, config, {2}, device="cpu", dtype=torch.bfloat16)
    state = on_cpu.state_dict()
    assert set(state) == GPT2_OWNED(gpt2(), {2})
    assert all(t.device.type == "cpu" and t.dtype == torch.bfloat16 for t in state.values())


def test_auto_split_is_numpy_array_split():
    assert [modelopt._split(5, 2, r) for r in range(2)] == [{0, 1, 2}, {3, 4}]
    assert [modelopt._split(3, 4, r) for r in range(4)] == [{0}, {1}, {2}, set()]


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "bin"])
def test_load_and_shard_model_in_one_process(tmp_path, safe):
    model = gpt2()
    if safe:
        model.save_pretrained(tmp_path)
    else:  # transformers 5 writes only safetensors: the .bin layout HF used to write
        model.config.save_pretrained(tmp_path)
        stored = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied: stored once
        torch.save(stored, tmp_path / "pytorch_model.bin")
    assert (tmp_path / "model.safetensors").exists() == safe
    shard = modelopt.load_and_shard_model(GPT2_OWNED, tmp_path)
    expected = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    assert_same(expected, shard.state_dict())
    assert shard.lm_head.weight is shard.transformer.wte.weight
    tokens = torch.tensor([[1, 5, 9, 3]])
    assert torch.equal(shard.eval()(tokens).logits, model.to(torch.bfloat16).eval()(tokens).logits)


def load_gpt2_shard(rank: int, world: int, path: str) -> dict[str, torch.Tensor]:
    shard = modelopt.load_and_shard_model(GPT2_OWNED, path)
    state = shard.state_dict()
    if rank == 1:
        assert state["lm_head.weight"].data_ptr() != 0 and not hasattr(shard.transformer.wte, "weight")
    return state


def test_load_and_shard_model_over_two_ranks(tmp_path):
    model = gpt2()
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    results = run_ranks(2, load_gpt2_shard, str(tmp_path))
    expected = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    assert set(results[0]) == GPT2_OWNED(model, {0, 1})  # numpy.array_split(range(3), 2): [0, 1], [2]
    assert set(results[1]) == GPT2_OWNED(model, {2}) - {"transformer.wte.weight"}
    for part in results.values():
        assert_same({k: expected[k] for k in part}, part)


def save_part(rank: int, world: int, out: str, bad_rank: int | None) -> str:
    part = {f"layer.{rank}.weight": torch.full((4,), float(rank))}
    if rank == bad_rank:
        part["layer.extra"] = "not a tensor"  # type: ignore[assignment]
    try:
        modelopt.save_sharded_model(part, out)
    except DistributedSaveError as e:
        return f"{e.ranks}: {e}"
    return "saved"


@pytest.mark.distributed
def test_save_sharded_model_over_two_ranks_and_a_failing_rank(tmp_path):
    out = tmp_path / "good" / "model.safetensors"
    assert run_ranks(2, save_part, str(out), None) == {0: "saved", 1: "saved"}
    assert sorted(os.listdir(out.parent)) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    index = json.loads((out.parent / "model.safetensors.index.json").read_text())
    assert index == {
        "metadata": {"total_size": 32},
        "weight_map": {
            "layer.0.weight": "model-00001-of-00002.safetensors",
            "layer.1.weight": "model-00002-of-00002.safetensors",
        },
    }
    expected = {"layer.0.weight": torch.zeros(4), "layer.1.weight": torch.ones(4)}
    assert_same(expected, modelopt.load_sharded_state_dict(out.parent))

    bad = tmp_path / "bad" / "model.safetensors"
    outcomes = run_ranks(2, save_part, str(bad), 1)
    for outcome in outcomes.values():  # every rank raises, naming rank 1, the path and the cause
        assert outcome.startswith("[1]: ") and str(bad) in outcome and "layer.extra" in outcome
    assert "model.safetensors.index.json" not in os.listdir(bad.parent)  # no index naming a missing shard
