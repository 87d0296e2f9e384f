"""torch_checkpointing (meta-pytorch) checkpoints read by ckptd.

Tests marked ``interop`` save with the real library (``pip install ckptd[torch_checkpointing]``;
skipped without it): its default ``CheckpointManager`` (background staging into shared memory, a
spawned writer process), with and without a resharder (which adds ``metadata.pkl``), read back
through ``CheckpointReader``, ``load_checkpoint``, ``convert`` and ``ckptd info``, bit for bit.
The others build the same layout with ``torch.save`` and a crafted ``metadata.pkl`` to check the
refusals: a pickle that asks to run code, a file path leading out of the directory, a truncated
item file, an item saved by several ranks with nothing saying how.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd.cli import main as cli_main
from ckptd.errors import CorruptCheckpointError, ShardingError, UnsafeCheckpointError


def trained_state() -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model.state_dict(), optimizer.state_dict()


def extra_tensors() -> dict[str, torch.Tensor]:
    return {"bf16": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "ids": torch.arange(4, dtype=torch.int32)}


def assert_bitwise(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(loaded) == sorted(expected)
    for key, tensor in expected.items():
        assert loaded[key].dtype == tensor.dtype, key
        assert loaded[key].shape == tensor.shape, key
        assert torch.equal(loaded[key], tensor), key


def optimizer_tensors(state: dict[str, object]) -> dict[str, torch.Tensor]:
    """An optimizer state dict's tensors under the dotted paths ckptd gives them."""
    return {
        f"state.{pid}.{name}": value
        for pid, per_param in state["state"].items()  # type: ignore[attr-defined]
        for name, value in per_param.items()
        if isinstance(value, torch.Tensor)
    }


# ---- with the real library ------------------------------------------------------------------


def _manager(resharded: bool):
    real = pytest.importorskip("torch_checkpointing")
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    # O_DIRECT is its default and fails (EINVAL on close) for files whose size is not a multiple
    # of the block size on ext4 here: torch_checkpointing 0.1.1 falls back only when open() fails.
    storage = LocalFileSystemStorageConfig(use_direct_io=False)
    items = {}
    if resharded:
        from torch_checkpointing.default_resharder import DefaultResharder

        items = {"model": real.ItemSpec(resharder=DefaultResharder())}
    return real.CheckpointManager(real.CheckpointManager.Config(storage_config=storage, items=items))


def _save_real(path: Path, payload: dict[str, object], resharded: bool) -> None:
    manager = _manager(resharded)
    try:
        manager.save(str(path), payload).result(timeout=240)
    finally:
        manager.close()


@pytest.fixture(scope="module")
def real_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("torch_checkpointing")
    model, optimizer = trained_state()
    payload = {"model": model, "optimizer": optimizer, "extra": extra_tensors(), "step": 7}
    _save_real(root / "plain", payload, resharded=False)
    _save_real(root / "resharded", {"model": model}, resharded=True)
    return {"plain": root / "plain", "resharded": root / "resharded"}


@pytest.mark.interop
@pytest.mark.multiprocess
def test_default_save_is_read_bit_for_bit(real_checkpoints):
    model, optimizer = trained_state()
    path = real_checkpoints["plain"]
    assert sorted(os.listdir(path)) == ["extra_0.pt", "model_0.pt", "optimizer_0.pt", "step_0.pt"]
    with ckptd.CheckpointReader.open(path) as reader:
        assert reader.kind == "torch_checkpointing"
        assert sorted(reader.components()) == ["extra", "model", "optimizer"]  # step holds no tensor
        assert_bitwise(reader.read("model"), model)
        assert_bitwise(reader.read("optimizer"), optimizer_tensors(optimizer))
        assert_bitwise(reader.read("extra"), extra_tensors())
    assert_bitwise(ckptd.load_checkpoint(str(path)), model)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    ckptd.load_checkpoint(str(path), fresh)
    assert_bitwise(fresh.state_dict(), model)


@pytest.mark.interop
@pytest.mark.multiprocess
def test_metadata_pkl_is_read_without_pickle(real_checkpoints):
    path = real_checkpoints["resharded"]
    assert (path / "metadata.pkl").exists()
    with ckptd.CheckpointReader.open(path) as reader:
        assert reader.components() == ["model"]
        assert_bitwise(reader.read("model"), trained_state()[0])


@pytest.mark.interop
@pytest.mark.multiprocess
def test_convert_and_info(real_checkpoints, tmp_path, capsys):
    model, optimizer = trained_state()
    result = ckptd.convert(real_checkpoints["plain"], tmp_path / "ckptd")
    assert result.format == "ckptd" and result.tensors == len(model)
    assert_bitwise(ckptd.load_checkpoint(str(tmp_path / "ckptd")), model)
    ckptd.convert(real_checkpoints["plain"], tmp_path / "opt", component="optimizer")
    with ckptd.CheckpointReader.open(tmp_path / "opt") as reader:
        assert_bitwise(reader.read(reader.default_component()), optimizer_tensors(optimizer))
    assert cli_main(["info", str(real_checkpoints["plain"]), "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["format"] == "torch_checkpointing"
    assert {c["name"]: c["tensors"] for c in body["components"]} == {"extra": 2, "model": 4, "optimizer": 12}


# ---- crafted layouts: what is refused --------------------------------------------------------


def _layout(directory: Path, world_size: int = 1, **layout_info: object) -> Path:
    """A checkpoint laid out as torch_checkpointing does it (``model_0.pt`` and a
    ``metadata.pkl`` of plain data, as ``DistributedMetadata.to_dict()`` gives it)."""
    directory.mkdir()
    torch.save(trained_state()[0], directory / "model_0.pt")
    replicated = {"type": "DTensorShardingMetadata", "data": {"placements": [{"type": "Replicate"}]}}
    item = {
        "nested_path_to_metadata": {'["0.weight"]': [{"sharding_metadata": replicated, "ranks": (0,)}]},
        "rank_to_layout_info": {0: layout_info or None},
    }
    metadata = {"metadata": {"model": item}, "world_size": world_size, "version": "2.0"}
    (directory / "metadata.pkl").write_bytes(pickle.dumps(metadata))
    return directory


def test_crafted_layout_reads(tmp_path):
    with ckptd.CheckpointReader.open(_layout(tmp_path / "ok")) as reader:
        assert_bitwise(reader.read("model"), trained_state()[0])


class _RunsCode:
    def __reduce__(self):
        return (os.mkdir, (str(_MARKER),))


_MARKER = Path("/nonexistent")  # set per test below


def test_metadata_that_runs_code_is_refused(tmp_path):
    global _MARKER
    _MARKER = tmp_path / "code-ran"
    directory = _layout(tmp_path / "evil")
    (directory / "metadata.pkl").write_bytes(pickle.dumps({"metadata": {"model": _RunsCode()}, "world_size": 1}))
    with pytest.raises(UnsafeCheckpointError, match=r"metadata\.pkl: refused to unpickle.*torch_checkpointing itself"):
        ckptd.CheckpointReader.open(directory)
    assert not _MARKER.exists()


def test_file_path_outside_the_checkpoint_is_refused(tmp_path):
    torch.save(trained_state()[0], tmp_path / "outside.pt")
    layout = {"file_path": "../outside.pt", "serialization_format": {"type": "TorchSerialization"}}
    directory = _layout(tmp_path / "escape", **layout)
    with pytest.raises(UnsafeCheckpointError, match=r"'\.\./outside\.pt' is not a plain name"):
        ckptd.CheckpointReader.open(directory)


def test_custom_file_path_inside_is_followed(tmp_path):
    layout = {"file_path": "rank_0/weights.pt", "serialization_format": {"type": "TorchSerialization"}}
    directory = _layout(tmp_path / "custom", **layout)
    (directory / "rank_0").mkdir()
    os.rename(directory / "model_0.pt", directory / "rank_0" / "weights.pt")
    with ckptd.CheckpointReader.open(directory) as reader:
        assert_bitwise(reader.read("model"), trained_state()[0])


def test_truncated_item_file_is_corrupt(tmp_path):
    directory = _layout(tmp_path / "truncated")
    data = (directory / "model_0.pt").read_bytes()
    (directory / "model_0.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match=r"model_0\.pt: cannot read PyTorch checkpoint"):
        ckptd.CheckpointReader.open(directory)


def test_garbled_metadata_is_corrupt(tmp_path):
    directory = _layout(tmp_path / "garbled")
    (directory / "metadata.pkl").write_bytes(pickle.dumps({"metadata": {}})[:-3])
    with pytest.raises(CorruptCheckpointError, match=r"metadata\.pkl: not a readable metadata pickle"):
        ckptd.CheckpointReader.open(directory)


def test_several_ranks_need_metadata(tmp_path):
    directory = tmp_path / "ranks"
    directory.mkdir()
    for rank in (0, 1):
        torch.save({"w": torch.zeros(2)}, directory / f"model_{rank}.pt")
    with pytest.raises(ShardingError, match="saved by 2 ranks"):
        ckptd.CheckpointReader.open(directory)


def test_sharded_items_are_refused(tmp_path):
    directory = _layout(tmp_path / "sharded", world_size=2)
    metadata = pickle.loads((directory / "metadata.pkl").read_bytes())
    group = metadata["metadata"]["model"]["nested_path_to_metadata"]['["0.weight"]'][0]
    group["sharding_metadata"]["data"]["placements"] = [{"type": "Shard", "dim": 0}]
    (directory / "metadata.pkl").write_bytes(pickle.dumps(metadata))
    with pytest.raises(ShardingError, match="sharded across 2 ranks"):
        ckptd.CheckpointReader.open(directory)


def test_bare_tensor_item_is_keyed_by_its_name(tmp_path):
    directory = tmp_path / "bare"
    directory.mkdir()
    buffer = io.BytesIO()
    torch.save(torch.arange(3), buffer)
    (directory / "table_0.pt").write_bytes(buffer.getvalue())
    with ckptd.CheckpointReader.open(directory) as reader:
        assert_bitwise(reader.read("table"), {"table": torch.arange(3)})
