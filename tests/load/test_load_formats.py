"""Loading: format detection, corruption and truncation, unsafe paths, pickle refusal."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import assert_same

import ckptd
from ckptd.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    KeyMismatchError,
    UnsafeCheckpointError,
)

safetensors_torch = pytest.importorskip("safetensors.torch")


def weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "embed.weight": torch.randn(10, 4),
        "layer.weight": torch.randn(4, 4).bfloat16(),
        "layer.bias": torch.randn(4),
        "steps": torch.tensor(3),
    }


def write_hf_sharded(directory, tensors, per_file: int = 2) -> None:
    os.makedirs(directory, exist_ok=True)
    keys = list(tensors)
    groups = [keys[i : i + per_file] for i in range(0, len(keys), per_file)]
    weight_map = {}
    for n, group in enumerate(groups, start=1):
        name = f"model-{n:05d}-of-{len(groups):05d}.safetensors"
        safetensors_torch.save_file({k: tensors[k] for k in group}, os.path.join(directory, name))
        weight_map.update(dict.fromkeys(group, name))
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)


def test_hf_sharded_checkpoint_loads_fully_and_by_keys(tmp_path):
    tensors = weights()
    write_hf_sharded(tmp_path, tensors)
    assert_same(tensors, ckptd.load_checkpoint(str(tmp_path)))
    os.remove(tmp_path / "model-00001-of-00002.safetensors")  # only the keys' shard is opened
    subset = ckptd.load_checkpoint(str(tmp_path), keys={"layer.bias", "steps"})
    assert_same({"layer.bias": tensors["layer.bias"], "steps": tensors["steps"]}, subset)


def test_single_safetensors_file_and_file_path(tmp_path):
    tensors = weights()
    safetensors_torch.save_file(tensors, str(tmp_path / "model.safetensors"))
    assert_same(tensors, ckptd.load_checkpoint(str(tmp_path)))
    assert_same(tensors, ckptd.load_sharded_state_dict(tmp_path / "model.safetensors"))
    assert ckptd.is_in_safetensors_format(str(tmp_path))


def test_pytorch_bin_single_and_sharded_load_with_weights_only(tmp_path):
    tensors = weights()
    single = tmp_path / "single"
    single.mkdir()
    torch.save(tensors, single / "pytorch_model.bin")
    assert_same(tensors, ckptd.load_checkpoint(str(single)))
    assert not ckptd.is_in_safetensors_format(str(single))

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    torch.save({k: tensors[k] for k in list(tensors)[:2]}, sharded / "pytorch_model-00001-of-00002.bin")
    torch.save({k: tensors[k] for k in list(tensors)[2:]}, sharded / "pytorch_model-00002-of-00002.bin")
    weight_map = {k: f"pytorch_model-0000{1 if i < 2 else 2}-of-00002.bin" for i, k in enumerate(tensors)}
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert_same(tensors, ckptd.load_checkpoint(str(sharded)))
    assert ckptd.get_checkpoint_metadata(str(sharded)) == ckptd.CheckpointMeta(
        "pytorch_model.bin.index.json", True, False
    )


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_pickled_objects_in_bin_files_are_refused(tmp_path):
    torch.save({"w": torch.ones(1), "evil": Evil()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(UnsafeCheckpointError, match="weights_only"):
        ckptd.load_checkpoint(str(tmp_path))


def test_index_names_outside_the_directory_are_refused(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"w": "../secret.safetensors"}})
    )
    with pytest.raises(UnsafeCheckpointError, match="secret"):
        ckptd.load_checkpoint(str(tmp_path))


def test_symlinked_shard_pointing_outside_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    safetensors_torch.save_file({"w": torch.ones(2)}, str(outside / "real.safetensors"))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    os.symlink(outside / "real.safetensors", ckpt / "model.safetensors")
    with pytest.raises(UnsafeCheckpointError, match="outside the checkpoint directory"):
        ckptd.load_checkpoint(str(ckpt))


def test_missing_or_unknown_directory_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="no such"):
        ckptd.load_checkpoint(str(tmp_path / "nope"))
    with pytest.raises(CheckpointNotFoundError, match="looked for"):
        ckptd.load_checkpoint(str(tmp_path))


def saved(checkpointer) -> tuple[str, str, dict[str, torch.Tensor]]:
    tensors = weights()
    result = checkpointer.save(1, {"model": tensors})
    return result.path, os.path.join(result.path, "model-00001-of-00001.safetensors"), tensors


def test_corrupted_byte_is_caught_by_verify_naming_the_file(checkpointer):
    path, shard, _ = saved(checkpointer)
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) - 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(CorruptCheckpointError, match=r"model-00001-of-00001\.safetensors.*CRC32C"):
        checkpointer.load(1, verify=True)
    with pytest.raises(CorruptCheckpointError, match="CRC32C"):
        ckptd.CheckpointReader.open(path).verify()
    from ckptd.cli import main
    from ckptd.cli.output import EXIT_CORRUPT

    assert main(["verify", path]) == EXIT_CORRUPT  # issue 11: corruption has its own exit code (4)


@pytest.mark.parametrize("how", ["checkpointer", "functional", "into", "keys"])
def test_truncated_shard_is_a_clear_error_on_any_load(checkpointer, how):
    path, shard, _ = saved(checkpointer)
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 10)
    with pytest.raises(CorruptCheckpointError, match=r"model-00001-of-00001\.safetensors.*(truncated|bytes)"):
        if how == "checkpointer":
            checkpointer.load(1)
        elif how == "functional":
            ckptd.load_checkpoint(path)
        elif how == "into":
            checkpointer.load(1, into={"model": {}})
        else:
            checkpointer.load(1, keys=["model.steps"])


def test_truncated_hf_shard_is_a_clear_error(tmp_path):
    write_hf_sharded(tmp_path, weights())
    shard = tmp_path / "model-00002-of-00002.safetensors"
    os.truncate(shard, os.path.getsize(shard) - 4)
    with pytest.raises(CorruptCheckpointError, match=r"model-00002-of-00002\.safetensors.*truncated"):
        ckptd.load_checkpoint(str(tmp_path))
    assert not ckptd.validate_checkpoint(str(tmp_path))


def test_garbage_manifest_is_not_a_checkpoint(checkpointer):
    path, _, _ = saved(checkpointer)
    with open(os.path.join(path, "checkpoint_manifest.json"), "w") as f:
        f.write('{"format": "ckptd", "format_version": 1')
    assert checkpointer.steps() == []
    with pytest.raises(CorruptCheckpointError, match="manifest"):
        checkpointer.load(1)


def test_load_into_module_strict_and_missing_keys(checkpointer):
    module = torch.nn.Linear(4, 3)
    checkpointer.save(1, {"model": {"weight": torch.ones(3, 4)}})
    with pytest.raises(KeyMismatchError, match="missing 'bias'"):
        checkpointer.load(1, into={"model": module})
    checkpointer.load(1, into={"model": module}, strict=False)
    assert_same(torch.ones(3, 4), module.weight.detach())
    other = torch.nn.Linear(5, 3)
    with pytest.raises(KeyMismatchError, match="size mismatch for 'weight'"):
        checkpointer.load(1, into={"model": other}, strict=False)


def test_load_converts_dtype_into_existing_module_and_supports_assign(checkpointer):
    module = torch.nn.Linear(4, 2)
    state = {"weight": torch.randn(2, 4).bfloat16(), "bias": torch.randn(2).bfloat16()}
    checkpointer.save(1, {"model": state})
    checkpointer.load(1, into={"model": module})
    assert module.weight.dtype == torch.float32
    assert_same(state["weight"].float(), module.weight.detach())
    assigned = torch.nn.Linear(4, 2)
    checkpointer.load(1, into={"model": assigned}, assign=True)
    assert assigned.weight.dtype == torch.bfloat16
    assert_same(state["weight"], assigned.weight.detach())


def test_verify_also_checks_the_state_file(checkpointer):
    result = checkpointer.save(1, {"model": {"w": torch.ones(2)}, "data": {"position": 12345}})
    path = os.path.join(result.path, "state.json")
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(text.replace("12345", "54321"))
    # The state file is small: its CRC32C is checked on every load, not only with verify=True.
    with pytest.raises(CorruptCheckpointError, match=r"state\.json.*CRC32C"):
        checkpointer.load(1)
    with pytest.raises(CorruptCheckpointError, match=r"state\.json.*CRC32C"):
        checkpointer.load(1, verify=True)


def test_many_small_and_a_few_sliced_tensors_load_exactly(tmp_path, monkeypatch):
    """Small tensors are read in batches and large ones in slices (both made tiny here, so a
    few thousand tensors exercise every path): every byte still lands in its own tensor."""
    import ckptd.load.direct as direct

    monkeypatch.setattr(direct, "DIRECT_RUN", 4096)
    monkeypatch.setattr(direct, "_CACHED_BATCH", 4096)
    state = {f"t{i}": torch.arange(i % 50, dtype=torch.float32) + i for i in range(3000)}
    state["big"] = torch.randn(5000, dtype=torch.float64)  # 40,000 bytes: ten slices
    state["empty"] = torch.zeros(0, 3)
    ckpt = ckptd.Checkpointer(str(tmp_path / "ckpts"))
    try:
        ckpt.save(1, {"model": state})
        loaded = ckpt.load(1)["model"]
        targets = {k: torch.full_like(v, -1) for k, v in state.items()}
        ckpt.load(1, {"model": targets})
    finally:
        ckpt.close()
    assert set(loaded) == set(state)
    for key, value in state.items():
        for got in (loaded[key], targets[key]):
            assert got.dtype == value.dtype and got.shape == value.shape and torch.equal(got, value), key
