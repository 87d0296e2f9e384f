"""HF interoperability: transformers loads ckptd checkpoints with ckptd not involved."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import assert_same

import ckptd

pytestmark = pytest.mark.hf
transformers = pytest.importorskip("transformers")


def tiny_gpt2():
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64)
    torch.manual_seed(0)
    return config


@pytest.mark.parametrize("auto", ["AutoModel", "AutoModelForCausalLM"])
def test_from_pretrained_reads_an_async_saved_checkpoint(root, auto):
    config = tiny_gpt2()
    model = getattr(transformers, auto).from_config(config)
    optimizer = torch.optim.AdamW(model.parameters())
    with ckptd.Checkpointer(root, max_shard_size="60KB") as ckpt:
        result = ckpt.async_save(10, {"model": model, "optimizer": optimizer}).wait(120)
    config.save_pretrained(result.path)
    index = os.path.join(result.path, "model.safetensors.index.json")
    assert os.path.exists(index)
    assert len([n for n in os.listdir(result.path) if n.startswith("model-")]) > 1
    loaded = getattr(transformers, auto).from_pretrained(result.path)
    expected = model.state_dict()
    got = loaded.state_dict()
    assert set(expected) == set(got)
    for key in expected:
        assert_same(expected[key], got[key], key)
    if auto == "AutoModelForCausalLM":
        assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


def test_functional_save_checkpoint_is_loadable_by_from_pretrained(tmp_path):
    config = tiny_gpt2()
    model = transformers.AutoModelForCausalLM.from_config(config)
    ckptd.save_checkpoint(str(tmp_path), model, safetensors=True, max_shard_size=50_000)
    config.save_pretrained(str(tmp_path))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert_same(model.state_dict(), loaded.state_dict())


def test_ckptd_loads_what_save_pretrained_wrote(tmp_path):
    config = tiny_gpt2()
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(tmp_path), max_shard_size="50KB")
    fresh = transformers.AutoModelForCausalLM.from_config(config)
    ckptd.load_checkpoint(str(tmp_path), fresh)
    assert_same(model.state_dict(), fresh.state_dict())
