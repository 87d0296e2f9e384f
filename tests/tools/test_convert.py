"""ckptd.convert / ckptd.export_hf: conversions between ckptd, HF and DCP checkpoints from Python."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_same
from safetensors.torch import load_file

import ckptd
from ckptd.errors import CheckpointExistsError, CheckpointNotFoundError, ConfigError
from ckptd.tools.convert import source_format


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.body = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 64, bias=False)
        self.head.weight = self.embed.weight  # tied: stored once


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Tied, str]:
    torch.manual_seed(0)
    model = Tied().to(torch.bfloat16)
    with ckptd.Checkpointer(str(tmp_path / "runs")) as ckpt:
        path = ckpt.save(9, {"model": model, "extra": {"lr": 0.1}}).path
    return model, path


def hf_tensors(directory: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


def leftovers(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.startswith("."))


def test_a_ckptd_checkpoint_becomes_an_hf_directory_and_back_bit_for_bit(saved: Any, tmp_path: Path) -> None:
    model, path = saved
    seen: list[tuple[int, int]] = []
    hf = str(tmp_path / "hf")
    result = ckptd.convert(
        path, hf, max_shard_size="1KB", config=b'{"model_type": "toy"}', progress=lambda *a: seen.append(a)
    )
    assert (result.format, result.destination, result.config, result.replaced) == ("hf", hf, True, False)
    names = sorted(os.listdir(hf))
    shards = [n for n in names if n.startswith("model-")]
    assert len(shards) > 1 and result.files == len(names) and "config.json" in names
    assert Path(hf, "config.json").read_bytes() == b'{"model_type": "toy"}'
    index = json.loads(Path(hf, "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {"embed.weight", "body.weight", "body.bias"}  # the tied head once
    assert index["metadata"]["param_sharing"] == [["embed.weight", "head.weight"]]
    tensors = hf_tensors(hf)
    assert result.tensors == 3 and result.bytes == sum(os.path.getsize(os.path.join(hf, n)) for n in shards)
    for key in index["weight_map"]:
        assert_same(tensors[key], model.state_dict()[key], key)
    assert [done for done, _ in seen] == sorted(done for done, _ in seen)  # cumulative, one call per tensor
    assert len(seen) == 3 and seen[-1] == (sum(t.nbytes for t in tensors.values()),) * 2
    back = str(tmp_path / "back")
    again = ckptd.convert(hf, back, step=21)  # an HF directory becomes a ckptd checkpoint
    assert (again.format, again.tensors) == ("ckptd", 3)
    reader = ckptd.CheckpointReader.open(back)
    reader.verify()
    assert reader.kind == "ckptd" and reader.manifest.step == 21
    restored = Tied().to(torch.bfloat16)
    ckptd.Checkpointer(str(tmp_path / "unused")).load(back, into={"model": restored})
    assert_same(restored.state_dict(), model.state_dict())
    assert restored.head.weight is restored.embed.weight  # re-tied from the recorded sharing


def test_export_hf_takes_a_config_file_and_the_component_asked_for(saved: Any, tmp_path: Path) -> None:
    _model, path = saved
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "toy", "hidden_size": 16}')
    result = ckptd.export_hf(path, str(tmp_path / "hf"), config=str(config))
    assert result.format == "hf" and Path(result.destination, "config.json").read_bytes() == config.read_bytes()
    with pytest.raises(ConfigError, match="no tensor component 'optimizer'"):
        ckptd.export_hf(path, str(tmp_path / "hf2"), component="optimizer")
    with pytest.raises(CheckpointNotFoundError, match="no such config file"):
        ckptd.export_hf(path, str(tmp_path / "hf3"), config=str(tmp_path / "missing.json"))
    assert not os.path.exists(tmp_path / "hf2") and not os.path.exists(tmp_path / "hf3")
    assert leftovers(tmp_path) == []


def test_an_existing_destination_is_replaced_only_with_overwrite(saved: Any, tmp_path: Path) -> None:
    _model, path = saved
    hf = tmp_path / "hf"
    ckptd.export_hf(path, str(hf), max_shard_size="1KB")
    before = {name: (hf / name).read_bytes() for name in os.listdir(hf)}
    with pytest.raises(CheckpointExistsError, match="already exists"):
        ckptd.export_hf(path, str(hf))
    assert {name: (hf / name).read_bytes() for name in os.listdir(hf)} == before  # untouched
    result = ckptd.export_hf(path, str(hf), overwrite=True)  # one shard now
    assert result.replaced and len([n for n in os.listdir(hf) if n.startswith("model-")]) == 1
    assert leftovers(tmp_path) == []


def test_options_a_conversion_would_not_use_are_refused_before_any_write(saved: Any, tmp_path: Path) -> None:
    _model, path = saved
    out = str(tmp_path / "out")
    with pytest.raises(ConfigError, match="same"):
        ckptd.convert(path, path + "/")
    with pytest.raises(ConfigError, match="'onnx'"):
        ckptd.convert(path, out, to="onnx")
    with pytest.raises(ConfigError, match="config="):
        ckptd.convert(path, out, to="ckptd", config=b"{}")
    with pytest.raises(ConfigError, match="step="):
        ckptd.convert(path, out, to="hf", step=3)
    with pytest.raises(ConfigError, match="keeps all its components"):
        ckptd.convert(path, out, to="ckptd", component="model")
    assert not os.path.exists(out) and leftovers(tmp_path) == []
    consolidated = ckptd.convert(path, out, to="ckptd")  # a ckptd source to ckptd is consolidated
    assert consolidated.format == "ckptd" and consolidated.tensors == 3
    assert ckptd.CheckpointReader.open(out).manifest.step == 9


def test_a_failed_conversion_leaves_nothing_behind(saved: Any, tmp_path: Path) -> None:
    _model, path = saved

    def fail_at_the_first_tensor(done: int, total: int) -> None:
        raise RuntimeError("interrupted")

    for to in ("hf", "ckptd"):
        source = path if to == "hf" else ckptd.export_hf(path, str(tmp_path / "hf-source")).destination
        with pytest.raises(RuntimeError, match="interrupted"):
            ckptd.convert(source, str(tmp_path / f"out-{to}"), to=to, progress=fail_at_the_first_tensor)
        assert not os.path.exists(tmp_path / f"out-{to}")
    assert leftovers(tmp_path) == []


def test_a_dcp_checkpoint_converts_whole_to_ckptd_and_its_model_to_hf(tmp_path: Path, dcp_checkpoint: Any) -> None:
    model, optimizer, source = dcp_checkpoint
    assert source_format(source) == "dcp"
    whole = ckptd.convert(source, str(tmp_path / "ckptd"))
    assert whole.format == "ckptd"
    loaded = ckptd.Checkpointer(str(tmp_path / "unused")).load(whole.destination)
    assert loaded["step"] == 7
    assert_same(loaded["model"], model.state_dict())
    momentum = loaded["optim"]["state"]["0"]["momentum_buffer"]  # DCP's own loader keys state by "0"
    assert_same(momentum, optimizer.state_dict()["state"][0]["momentum_buffer"])
    with pytest.raises(ConfigError, match="no entry 'weights'"):
        ckptd.export_hf(source, str(tmp_path / "hf-missing"), component="weights")
    hf = ckptd.export_hf(source, str(tmp_path / "hf"))
    assert_same(hf_tensors(hf.destination), {k: v.detach() for k, v in model.state_dict().items()})


@pytest.mark.objectstore
def test_hf_export_to_an_object_store_and_back(saved: Any, s3: Any, tmp_path: Path) -> None:
    model, path = saved
    url = s3.url("exports/hf")
    result = ckptd.export_hf(path, url, storage_options=s3.options(), max_shard_size="1KB")
    assert result.destination == url
    keys = s3.keys("exports/hf/")
    assert "exports/hf/model.safetensors.index.json" in keys and len(keys) == result.files
    with pytest.raises(CheckpointExistsError):
        ckptd.export_hf(path, url, storage_options=s3.options())
    back = ckptd.convert(url, str(tmp_path / "back"), storage_options=s3.options())
    restored = Tied().to(torch.bfloat16)
    ckptd.Checkpointer(str(tmp_path / "unused")).load(back.destination, into={"model": restored})
    assert_same(restored.state_dict(), model.state_dict())
