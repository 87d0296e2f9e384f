"""ModelOpt's generic helpers: set_submodule and load_state_dict_to_shards (one process and a
real 2-rank gloo group), next to the loaders tested in test_api_seed.py."""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import TinyLM, assert_same
from distributed import run_ranks

import ckptd
from ckptd.compat import modelopt
from ckptd.errors import ConfigError


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
