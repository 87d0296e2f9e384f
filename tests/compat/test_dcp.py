"""Reading PyTorch DCP checkpoints written by real ``torch.distributed.checkpoint.save``
(single process, no process group), through torch's own reader."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import TinyLM, assert_same, train_steps

import ckptd
from ckptd.errors import CorruptCheckpointError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def trained():
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    train_steps(model, optimizer)
    return model, optimizer


def save_dcp(path: str, state) -> str:
    dcp.save(state, checkpoint_id=path)
    assert {".metadata", "__0_0.distcp"} <= set(os.listdir(path))
    return path


def test_reader_groups_a_nested_dcp_save_into_components(tmp_path, trained):
    model, optimizer = trained
    path = save_dcp(str(tmp_path / "dcp"), {"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    reader = ckptd.CheckpointReader.open(path)
    assert reader.kind == "dcp"
    assert sorted(reader.components()) == ["model", "optimizer"]
    assert_same(model.state_dict(), reader.read("model"))
    first = optimizer.state_dict()["state"][0]
    some = reader.read("optimizer", ["state.0.exp_avg", "state.0.exp_avg_sq"])
    assert_same({"state.0.exp_avg": first["exp_avg"], "state.0.exp_avg_sq": first["exp_avg_sq"]}, some)
    reader.check_complete()


def test_checkpointer_load_of_a_dcp_directory(tmp_path, trained):
    model, optimizer = trained
    path = save_dcp(str(tmp_path / "dcp"), {"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    with ckptd.Checkpointer(str(tmp_path / "root")) as ckpt:
        state = ckpt.load(path)
        assert_same(model.state_dict(), state["model"])
        assert_same(optimizer.state_dict()["state"][1]["exp_avg"], state["optimizer"]["state.1.exp_avg"])
        fresh = TinyLM()
        ckpt.load(path, into={"model": fresh})
    assert_same(model.state_dict(), fresh.state_dict())
    assert fresh.head.weight is fresh.embed.weight, "the module's own tie survives an in-place load"


def test_load_checkpoint_of_a_flat_dcp_save(tmp_path, trained):
    model, _ = trained
    path = save_dcp(str(tmp_path / "flat"), model.state_dict())
    assert ckptd.CheckpointReader.open(path).components() == ["model"]
    assert ckptd.validate_checkpoint(path)
    assert_same(model.state_dict(), ckptd.load_checkpoint(path))
    assert_same({"norm.bias": model.norm.bias.detach()}, ckptd.load_checkpoint(path, keys={"norm.bias"}))
    fresh = TinyLM()
    ckptd.load_checkpoint(path, fresh, strict=True, assign=True)
    assert_same(model.state_dict(), fresh.state_dict())
    target = torch.empty_like(model.norm.weight)
    ckptd.CheckpointReader.open(path).read("model", ["norm.weight"], targets={"norm.weight": target})
    assert_same(model.norm.weight.detach(), target)


def test_damaged_dcp_metadata_is_corrupt(tmp_path, trained):
    model, _ = trained
    path = save_dcp(str(tmp_path / "flat"), model.state_dict())
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(b"not a pickle")
    with pytest.raises(CorruptCheckpointError, match=r"\.metadata"):
        ckptd.CheckpointReader.open(path)
    assert not ckptd.validate_checkpoint(path)


def test_tensor_metadata_of_a_dcp_checkpoint(tmp_path, trained):
    model, optimizer = trained
    path = save_dcp(str(tmp_path / "dcp"), {"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    infos = ckptd.load_tensors_metadata(path)
    assert infos["model"]["embed.weight"] == ckptd.TensorInfo(torch.float32, (64, 16))
    assert infos["optimizer"]["state.0.exp_avg"].shape == tuple(optimizer.state_dict()["state"][0]["exp_avg"].shape)
    assert set(infos["model"]) == set(model.state_dict())


def test_optimizer_with_param_groups_loads_from_dcp(tmp_path, trained):
    model, optimizer = trained
    optimizer.param_groups[0]["lr"] = 3e-4  # a value the fresh optimizer does not have
    path = save_dcp(str(tmp_path / "dcp"), {"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    fresh_model = TinyLM()
    fresh = torch.optim.Adam(fresh_model.parameters(), lr=1.0, betas=(0.5, 0.5))
    with ckptd.Checkpointer(str(tmp_path / "root")) as ckpt:
        ckpt.load(path, into={"model": fresh_model, "optimizer": fresh})
    saved, loaded = optimizer.state_dict(), fresh.state_dict()
    assert loaded["param_groups"] == saved["param_groups"]
    assert fresh.param_groups[0]["lr"] == 3e-4 and fresh.param_groups[0]["betas"] == (0.9, 0.999)
    assert_same(saved["state"], loaded["state"])
    assert_same(model.state_dict(), fresh_model.state_dict())


def test_dcp_entries_that_need_pickle_are_refused(tmp_path, trained):
    model, _ = trained
    path = save_dcp(str(tmp_path / "dcp"), {"model": model.state_dict(), "extra": {"when": Opaque()}})
    reader = ckptd.CheckpointReader.open(path)
    assert reader.dcp_layout().skipped == ("extra.when",)
    with pytest.raises(ckptd.errors.UnsafeCheckpointError, match=r"extra\.when"):
        reader.read_dcp_objects(["extra.when"])
    assert_same(model.state_dict(), reader.read("model"))


class Opaque:
    """A value torch.load(weights_only=True) refuses: DCP pickles it."""


def test_convert_reads_a_whole_dcp_state_without_pickle(tmp_path, trained):
    from ckptd.tools.tensor_sources import load_dcp

    model, optimizer = trained
    nested = save_dcp(str(tmp_path / "nested"), {"model": model.state_dict(), "optim": optimizer.state_dict()})
    state = load_dcp(nested)
    assert state["optim"]["param_groups"] == optimizer.state_dict()["param_groups"]
    assert_same(optimizer.state_dict()["state"][0]["exp_avg"], state["optim"]["state"]["0"]["exp_avg"])
    flat = save_dcp(str(tmp_path / "flat"), model.state_dict())
    assert_same({"model": model.state_dict()}, load_dcp(flat))  # a flat save is the model component
