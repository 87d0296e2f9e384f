"""A load needs only the files it reads: ``components=``, ``keys=`` and ``into=`` loads of part of
a checkpoint touch, check and require only the shards holding what was asked (and the state
file), while a full load and ``verify`` still refuse a missing, truncated or corrupt file."""

from __future__ import annotations

import glob
import os

import pytest
import torch

import ckptd
from ckptd.errors import CorruptCheckpointError
from ckptd.load.reader import CheckpointReader


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def _trained(model: torch.nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 6)).sum().backward()
    optimizer.step()
    return optimizer


@pytest.fixture
def saved(tmp_path):
    """A committed checkpoint of a model and its optimizer, each in its own shard."""
    model = _model()
    optimizer = _trained(model)
    with ckptd.Checkpointer(tmp_path / "run") as checkpointer:
        checkpointer.save(20, {"model": model, "optimizer": optimizer})
    directory = tmp_path / "run" / "checkpoint-20"
    (optimizer_shard,) = glob.glob(str(directory / "optimizer-*.safetensors"))
    (model_shard,) = glob.glob(str(directory / "model-*.safetensors"))
    return tmp_path / "run", model, optimizer_shard, model_shard


def _assert_model(loaded: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    expected = model.state_dict()
    assert sorted(loaded) == sorted(expected)
    for key, tensor in expected.items():
        assert loaded[key].dtype == tensor.dtype and loaded[key].shape == tensor.shape
        assert torch.equal(loaded[key], tensor), key


def _flip_last_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))


@pytest.mark.parametrize("damage", ["removed", "truncated"])
def test_partial_loads_do_without_an_unrelated_shard(saved, damage):
    root, model, optimizer_shard, _ = saved
    if damage == "removed":
        os.remove(optimizer_shard)
    else:
        os.truncate(optimizer_shard, os.path.getsize(optimizer_shard) - 4)
    with ckptd.Checkpointer(root) as checkpointer:
        _assert_model(checkpointer.load(20, components=["model"])["model"], model)
        _assert_model(checkpointer.load(20, components=["model"], verify=True)["model"], model)
        by_key = checkpointer.load(20, keys=["model.0.bias", "model.2.weight"])
        assert torch.equal(by_key["model"]["0.bias"], model.state_dict()["0.bias"])
        assert torch.equal(by_key["model"]["2.weight"], model.state_dict()["2.weight"])
        target = _model()
        with torch.no_grad():
            for p in target.parameters():
                p.zero_()
        checkpointer.load(20, into={"model": target})
        _assert_model(target.state_dict(), model)

        # A full load still needs every file, and says which one is wrong.
        with pytest.raises(CorruptCheckpointError, match=os.path.basename(optimizer_shard)):
            checkpointer.load(20)
        with pytest.raises(CorruptCheckpointError, match=os.path.basename(optimizer_shard)):
            checkpointer.load(20, into={"model": _model(), "optimizer": _trained(_model())})
        with pytest.raises(CorruptCheckpointError, match=os.path.basename(optimizer_shard)):
            checkpointer.load(20, components=["optimizer"])
    with CheckpointReader.open(root / "checkpoint-20") as reader:
        with pytest.raises(CorruptCheckpointError, match="missing" if damage == "removed" else "truncated"):
            reader.verify()


def test_partial_load_with_verify_ignores_a_corrupt_unrelated_shard(saved):
    root, model, optimizer_shard, _ = saved
    _flip_last_byte(optimizer_shard)
    with ckptd.Checkpointer(root) as checkpointer:
        _assert_model(checkpointer.load(20, components=["model"], verify=True)["model"], model)
        with pytest.raises(CorruptCheckpointError, match="CRC32C mismatch"):
            checkpointer.load(20, verify=True)


def test_a_missing_shard_of_the_asked_component_fails_before_a_byte_lands(saved):
    """The check of the files a load reads runs before any of them is read: a module loaded in
    place keeps its own values when one of its shards is gone."""
    root, _, _, model_shard = saved
    os.remove(model_shard)
    target = _model()
    with torch.no_grad():
        for p in target.parameters():
            p.fill_(7.0)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with ckptd.Checkpointer(root) as checkpointer:
        with pytest.raises(CorruptCheckpointError, match="listed in the manifest but missing"):
            checkpointer.load(20, into={"model": target})
        with pytest.raises(CorruptCheckpointError, match="listed in the manifest but missing"):
            checkpointer.load(20, keys=["model.0.bias"])
    for key, tensor in target.state_dict().items():
        assert torch.equal(tensor, before[key]), key


def test_a_reader_checks_each_file_once_and_check_complete_checks_all(saved):
    root, model, optimizer_shard, _ = saved
    with CheckpointReader.open(root / "checkpoint-20") as reader:
        os.remove(optimizer_shard)  # after open: the reader's pinned directory sees it too
        loaded = reader.read("model")
        _assert_model(loaded, model)
        with pytest.raises(CorruptCheckpointError, match="listed in the manifest but missing"):
            reader.check_complete()
