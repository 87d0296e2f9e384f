"""Checkpoints written by DCP's real ``HuggingFaceStorageWriter`` (part of torch) read by ckptd:
its rank-0 output (HF index + ``model-*`` files), its per-rank shards (``save_distributed=True``:
``shard-<rank>-model-*.safetensors`` with ``DCP_SHARDING_INFO``, at 1 rank without a process
group and at 2 ranks on a real gloo group with DTensors sharded on different dims) and its
consolidated output (``enable_consolidation=True``), through ``CheckpointReader``,
``load_checkpoint``, ``convert`` and ``ckptd info``; tensors compared bit for bit.  Corrupt
shards (truncated, missing sharding info, overlapping pieces) raise ckptd errors naming the file.
"""

from __future__ import annotations

import json
import os
import struct
import warnings
from pathlib import Path

import pytest
import torch
from distributed import run_ranks

import ckptd
from ckptd.cli import main as cli_main
from ckptd.errors import CorruptCheckpointError

pytest.importorskip("safetensors")  # the writer serializes with it
hf_storage = pytest.importorskip("torch.distributed.checkpoint.hf_storage")


def reference_state() -> dict[str, torch.Tensor]:
    """Tensors of several dtypes and ranks, identical in every process (seeded)."""
    generator = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(8, 6, generator=generator),
        "layers.0.weight": torch.randn(6, 4, generator=generator).to(torch.bfloat16),
        "layers.0.bias": torch.arange(6, dtype=torch.float16),
        "counts": torch.arange(10, dtype=torch.int64).reshape(2, 5),
        "scale": torch.tensor(3.5),
    }


def consolidatable(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What torch 2.13's consolidation writes correctly: it calls ``torch.finfo`` on every dtype
    (a TypeError for integer tensors) and writes 0-dim tensors as zeros (safetensors' own
    ``load_file`` reads 0.0 back), so floating-point tensors of one dimension or more."""
    return {k: v for k, v in state.items() if v.is_floating_point() and v.dim() > 0}


def save(directory: Path, state: dict[str, torch.Tensor], **writer_options: object) -> None:
    import torch.distributed.checkpoint as dcp

    writer = hf_storage.HuggingFaceStorageWriter(str(directory), **writer_options)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.save(state, storage_writer=writer, no_dist=True)


def assert_bitwise(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(loaded) == sorted(expected)
    for key, tensor in expected.items():
        got = loaded[key]
        assert got.dtype == tensor.dtype, key
        assert got.shape == tensor.shape, key
        assert torch.equal(got, tensor), key


def test_rank0_output_is_an_hf_checkpoint(tmp_path):
    state = reference_state()
    save(tmp_path / "out", state, fqn_to_index_mapping={k: 1 + i % 2 for i, k in enumerate(state)})
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    with ckptd.CheckpointReader.open(tmp_path / "out") as reader:
        assert reader.kind == "hf_sharded"
        assert_bitwise(reader.read(), state)


def test_sharded_output_without_process_group(tmp_path):
    state = reference_state()
    save(tmp_path / "out", state, save_distributed=True)
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == ["shard-00001-model-00001-of-00001.safetensors"]
    with ckptd.CheckpointReader.open(tmp_path / "out") as reader:
        assert reader.kind == "hf_dcp_sharded"
        assert_bitwise(reader.read(), state)
    assert_bitwise(ckptd.load_checkpoint(str(tmp_path / "out")), state)


def test_consolidated_output(tmp_path):
    state = consolidatable(reference_state())
    save(tmp_path / "out", state, save_distributed=True, enable_consolidation=True)
    assert (tmp_path / "out" / "sharded").is_dir()
    with ckptd.CheckpointReader.open(tmp_path / "out") as reader:
        assert reader.kind == "hf_sharded"
        assert_bitwise(reader.read(), state)
    with ckptd.CheckpointReader.open(tmp_path / "out" / "sharded") as reader:
        assert reader.kind == "hf_dcp_sharded"
        assert_bitwise(reader.read(), state)


def _save_two_ranks(rank: int, world: int, directory: str, consolidate: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = consolidatable(reference_state()) if consolidate else reference_state()
    placements = {"embed.weight": Shard(0), "layers.0.weight": Shard(1), "counts": Shard(1)}
    state = {k: distribute_tensor(v, mesh, [placements.get(k, Replicate())]) for k, v in full.items()}
    writer = hf_storage.HuggingFaceStorageWriter(directory, save_distributed=True, enable_consolidation=consolidate)
    dcp.save(state, storage_writer=writer)


@pytest.mark.distributed
@pytest.mark.multiprocess
def test_two_rank_dtensor_shards_are_reassembled(tmp_path):
    out = tmp_path / "out"
    run_ranks(2, _save_two_ranks, str(out), False)
    names = sorted(p.name for p in out.iterdir())
    assert names == ["shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"]
    expected = reference_state()
    with ckptd.CheckpointReader.open(out) as reader:
        assert reader.kind == "hf_dcp_sharded"
        assert len(reader.record("model", "embed.weight").chunks) == 2
        assert_bitwise(reader.read(), expected)
        some = reader.read(keys=["counts"])  # one tensor: only its pieces are read
        assert_bitwise(some, {"counts": expected["counts"]})

    converted = tmp_path / "converted"
    result = ckptd.convert(out, converted)
    assert result.format == "ckptd" and result.tensors == len(expected)
    assert_bitwise(ckptd.load_checkpoint(str(converted)), expected)
    hf = tmp_path / "hf"
    ckptd.convert(out, hf, to="hf")
    assert_bitwise(ckptd.load_checkpoint(str(hf)), expected)


@pytest.mark.distributed
@pytest.mark.multiprocess
def test_two_rank_consolidated_output(tmp_path):
    out = tmp_path / "out"
    run_ranks(2, _save_two_ranks, str(out), True)
    expected = consolidatable(reference_state())
    with ckptd.CheckpointReader.open(out) as reader:
        assert reader.kind == "hf_sharded"
        assert_bitwise(reader.read(), expected)
    with ckptd.CheckpointReader.open(out / "sharded") as reader:
        assert reader.kind == "hf_dcp_sharded"
        assert_bitwise(reader.read(), expected)


def test_info_reports_sharded_output(tmp_path, capsys):
    state = reference_state()
    save(tmp_path / "out", state, save_distributed=True)
    assert cli_main(["info", str(tmp_path / "out"), "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["format"] == "hf_dcp_sharded"
    assert body["tensor_count"] == len(state)
    assert body["tensor_bytes"] == sum(t.nbytes for t in state.values())


def _shard(directory: Path) -> Path:
    return next(directory.glob("shard-*.safetensors"))


def _rewrite_header(path: Path, change) -> None:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    change(header)
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    path.write_bytes(struct.pack("<Q", len(body)) + body + data[8 + length :])


def test_truncated_shard_is_corrupt(tmp_path):
    save(tmp_path / "out", reference_state(), save_distributed=True)
    shard = _shard(tmp_path / "out")
    os.truncate(shard, shard.stat().st_size - 16)
    with pytest.raises(CorruptCheckpointError, match=shard.name):
        ckptd.CheckpointReader.open(tmp_path / "out")


def test_shard_without_sharding_info_is_corrupt(tmp_path):
    save(tmp_path / "out", reference_state(), save_distributed=True)
    shard = _shard(tmp_path / "out")
    _rewrite_header(shard, lambda h: h["__metadata__"].pop("DCP_SHARDING_INFO"))
    with pytest.raises(CorruptCheckpointError, match=rf"{shard.name}.*DCP_SHARDING_INFO"):
        ckptd.CheckpointReader.open(tmp_path / "out")


def test_overlapping_pieces_are_corrupt(tmp_path):
    save(tmp_path / "out", {"w": torch.zeros(4, 2)}, save_distributed=True)
    first = _shard(tmp_path / "out")
    second = first.with_name("shard-00002-model-00001-of-00001.safetensors")
    second.write_bytes(first.read_bytes())  # the same piece twice: [0:4] covered twice, [4:8] never

    def shift(header):
        info = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
        info["w"]["saved_offsets"] = [0, 0]
        header["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(info)

    _rewrite_header(second, shift)
    with pytest.raises(CorruptCheckpointError, match="tensor 'w'"):
        ckptd.CheckpointReader.open(tmp_path / "out")
