"""ckptd against the real Megatron-Core (``megatron-core``, the ``[megatron]`` extra).

Bridge A: checkpoints written by real ``dist_checkpointing.save`` (``torch_dist``) in 2 gloo
ranks are read by ckptd in one process (world size 1) through torch's DCP reader.  Bridge B:
ckptd's ``SaveStrategy`` / ``LoadStrategy`` plugged into the real ``dist_checkpointing.save`` /
``load`` (2 ranks save, 2 ranks and 1 process load).  No mock of Megatron; the only stubs are
its two CUDA calls, in the processes that save (tests/compat/megatron_fixtures.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("psutil")

import torch.distributed as dist
from conftest import assert_same
from distributed import free_port
from megatron_fixtures import (
    COMMON,
    LAYERS,
    WORLD,
    assert_whole_layout_loaded,
    expected_for_rank,
    expected_objects,
    expected_tensors,
    generate,
    whole_layout,
)

import ckptd
from ckptd.compat import megatron as mcore
from ckptd.errors import ConfigError

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

REPO = str(Path(__file__).resolve().parents[2])


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[int, dict[str, Any]]]:
    """Both fixtures, written once by real Megatron in 2 spawned gloo ranks."""
    root = tmp_path_factory.mktemp("megatron")
    return str(root), generate(str(root))


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    """A gloo group of world size 1 in this process (Megatron's load gathers metadata)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        yield
    finally:
        dist.destroy_process_group()


# ---- what real Megatron wrote -------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.slow
def test_megatron_wrote_both_formats(generated):
    root, results = generated
    torch_dist, through_ckptd = os.path.join(root, "torch_dist"), os.path.join(root, "ckptd")
    assert {"metadata.json", "common.pt", ".metadata"} <= set(results[0]["files:torch_dist"])
    assert any(n.endswith(".distcp") for n in os.listdir(torch_dist))
    assert results[0]["files:ckptd"] == ["ckptd", "common.pt", "metadata.json"]
    config = json.loads(Path(through_ckptd, "metadata.json").read_text())
    assert (config["sharded_backend"], config["sharded_backend_version"]) == ("ckptd", 1)
    assert mcore.megatron_backend(torch_dist) == "torch_dist"
    # the sharded part is a committed ckptd checkpoint: manifest, safetensors, nothing staged
    part = os.path.join(through_ckptd, "ckptd")
    assert ckptd.validate_checkpoint(part)
    assert not [n for n in os.listdir(through_ckptd) if n.startswith(".")]
    assert ckptd.CheckpointReader.open(part).kind == "ckptd"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_ranks_load_their_pieces_back(generated):
    _, results = generated
    # async_sharded_save=True: Megatron's AsyncCallsQueue finalizes; metadata.json only after ckptd's commit
    assert (results[0]["async:before"], results[0]["async:after"], results[0]["async:finalized"]) == (False, True, [0])
    for rank in range(WORLD):
        expected = expected_for_rank(rank)
        assert_same(expected, results[rank]["megatron<-torch_dist"], f"rank {rank} megatron<-torch_dist")
        assert_same(expected, results[rank]["ckptd<-ckptd"], f"rank {rank} LoadStrategy<-SaveStrategy")
        assert_same(expected, results[rank]["ckptd<-ckptd_async"], f"rank {rank} LoadStrategy<-async SaveStrategy")
        assert_same(expected, results[rank]["ckptd<-torch_dist"], f"rank {rank} LoadStrategy<-torch_dist")


# ---- bridge A: ckptd reads torch_dist at world size 1 -------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.slow
def test_ckptd_loads_a_torch_dist_checkpoint(generated):
    directory = os.path.join(generated[0], "torch_dist")
    tensors = expected_tensors()
    assert ckptd.CheckpointReader.open(directory).kind == "dcp"
    assert_same(tensors, ckptd.load_checkpoint(directory))
    with ckptd.Checkpointer(os.path.join(generated[0], "unused")) as checkpointer:
        assert_same(tensors, checkpointer.load(directory)["model"])

    assert_same(COMMON, mcore.load_common_state_dict(directory))  # args: an argparse.Namespace
    assert argparse.Namespace in torch.serialization.get_safe_globals(), "Megatron's registration is kept"
    assert_same(tensors, mcore.load_plain_tensors(directory))
    infos = mcore.load_tensors_metadata(directory)["model"]
    assert infos == {k: mcore.TensorInfo(v.dtype, tuple(v.shape)) for k, v in tensors.items()}
    metadata = mcore.load_sharded_metadata(directory)
    assert metadata["layers.mlp.weight"].global_shape == (2, 3, 4)
    assert metadata["embedding.weight"].dtype == torch.bfloat16
    assert {k for k in metadata if "/shard_" in k} == set(expected_objects())

    assert_whole_layout_loaded(mcore.load(whole_layout(mcore), directory))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_convert_a_torch_dist_checkpoint_to_safetensors(generated, tmp_path):
    from safetensors.torch import load_file

    directory = os.path.join(generated[0], "torch_dist")
    out = subprocess.run(
        [sys.executable, "-m", "ckptd", "convert", directory, str(tmp_path / "hf"), "--to", "hf"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")},
    )
    assert out.returncode == 0, out.stderr
    (shard,) = [n for n in os.listdir(tmp_path / "hf") if n.endswith(".safetensors")]
    assert_same(expected_tensors(), load_file(str(tmp_path / "hf" / shard)))


def _write_integrity_json(directory: str) -> None:
    """Megatron 0.18+'s integrity.json (sha256 of every top-level file), written here by hand."""
    import hashlib

    files = {
        n: hashlib.sha256(Path(directory, n).read_bytes()).hexdigest()
        for n in sorted(os.listdir(directory))
        if Path(directory, n).is_file()
    }
    Path(directory, "integrity.json").write_text(json.dumps({"algorithm": "sha256", "files": files}))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_integrity_json_and_common_state_inside_dcp(generated, tmp_path):
    """What Megatron 0.18/0.19 add to torch_dist, made by hand from a 0.16 checkpoint (the
    CKPTD_MEGATRON_SRC tests run the real 0.19): integrity.json, and the common state as the
    'common_state' DCP entry instead of common.pt."""
    import io

    import torch.distributed.checkpoint as dcp

    class RawBytesPlanner(dcp.DefaultSavePlanner):
        """Bytes entries stored as they are (what Megatron's MCoreSavePlanner does)."""

        def transform_object(self, write_item, object):
            return object

    directory = str(tmp_path / "td")
    shutil.copytree(os.path.join(generated[0], "torch_dist"), directory)
    _write_integrity_json(directory)
    assert mcore.verify_integrity(directory, required=True)
    assert_whole_layout_loaded(mcore.load(whole_layout(mcore), directory, verify_integrity=True))
    name = sorted(n for n in os.listdir(directory) if n.endswith(".distcp"))[0]
    data = bytearray(Path(directory, name).read_bytes())
    data[len(data) // 2] ^= 1
    Path(directory, name).write_bytes(bytes(data))
    with pytest.raises(ckptd.errors.CorruptCheckpointError, match=name):
        mcore.load(whole_layout(mcore), directory)

    # a DCP checkpoint holding the common state as Megatron 0.19 does (torch.save([common]) bytes)
    bare = str(tmp_path / "common_inside")
    blob = io.BytesIO()
    torch.save([COMMON], blob)
    blob.seek(0)
    state = {"w": torch.ones(2), "common_state/shard_0_1": blob}
    dcp.save(state, checkpoint_id=bare, planner=RawBytesPlanner(), no_dist=True)
    Path(bare, "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    assert_same(COMMON, mcore.load_common_state_dict(bare))
    assert mcore.load_sharded_metadata(bare).keys() == {"w"}


# ---- bridge B: ckptd as Megatron's strategy, loaded in one process -------------------------------


@pytest.mark.multiprocess
@pytest.mark.slow
def test_megatron_load_with_ckptd_strategy_in_one_process(generated):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import mapping

    directory = os.path.join(generated[0], "ckptd")
    with one_rank_group():
        result = dist_checkpointing.load(
            whole_layout(mapping, megatron=True), directory, sharded_strategy=mcore.LoadStrategy()
        )
        assert_whole_layout_loaded(result)
        # registered as Megatron's default for the "ckptd" backend: no strategy argument needed
        plain = dist_checkpointing.load_plain_tensors(directory)  # Megatron merges the common state in
        assert_same(expected_tensors(), {k: plain[k] for k in expected_tensors()})
        assert_whole_layout_loaded(dist_checkpointing.load(whole_layout(mapping, megatron=True), directory))
        shapes = dist_checkpointing.load_tensors_metadata(directory)
        assert {k: v.global_shape for k, v in shapes.items()} == {
            k: tuple(v.shape) for k, v in expected_tensors().items()
        }
    # and ckptd's own entry points read the same directory
    assert_same(COMMON, mcore.load_common_state_dict(directory))
    assert_whole_layout_loaded(mcore.load(whole_layout(mcore), directory))


def test_strategies_subclass_megatrons_and_check_the_backend():
    from megatron.core.dist_checkpointing.strategies.base import AsyncSaveShardedStrategy, LoadShardedStrategy

    assert isinstance(mcore.SaveStrategy(), AsyncSaveShardedStrategy)
    load = mcore.LoadStrategy()
    assert isinstance(load, LoadShardedStrategy) and load.can_handle_sharded_objects
    load.check_backend_compatibility("ckptd")
    load.check_backend_compatibility("torch_dist")
    with pytest.raises(ConfigError, match="zarr"):
        load.check_backend_compatibility("zarr")
    with pytest.raises(ConfigError, match="version"):
        load.check_version_compatibility(2)


def test_the_default_strategy_factories_of_megatron_019_give_ckptds_strategies(tmp_path):
    """0.19's ``get_default_{save,load}_sharded_strategy`` names give ckptd's strategies."""
    save = mcore.get_default_save_sharded_strategy()
    load = mcore.get_default_load_sharded_strategy(str(tmp_path))
    assert type(save) is mcore.SaveStrategy and type(load) is mcore.LoadStrategy
    with pytest.raises(ConfigError, match="torch_dist"):
        mcore.get_default_save_sharded_strategy("torch_dist")


# ---- Megatron's ShardedTensor arguments ---------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "offsets", "prepend"),
    [
        ((4, 6), [(0, 1, 2)], 0),
        ((4, 6), [(1, 2, 3), (0, 0, 2)], 0),
        ((3, 4), [(0, 1, 2)], 1),  # a layer of a stacked [layers, 3, 4] tensor
        ((3, 4), [(0, 2, 4), (2, 1, 2)], 1),
        ((5,), [(1, 0, 2), (0, 1, 3)], 1),
        ((2, 2), [], 2),
    ],
)
def test_sharded_tensor_places_pieces_as_megatron_does(shape, offsets, prepend):
    from megatron.core.dist_checkpointing import ShardedTensor as MegatronShardedTensor

    data = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    theirs = MegatronShardedTensor.from_rank_offsets("w", data, *offsets, replica_id=1, prepend_axis_num=prepend)
    ours = mcore.ShardedTensor.from_rank_offsets("w", data, *offsets, replica_id=1, prepend_axis_num=prepend)
    assert ours.global_shape == theirs.global_shape
    assert ours.global_offset == theirs.global_offset
    assert ours.local_shape == theirs.local_shape
    assert ours.axis_fragmentations == theirs.axis_fragmentations
    assert ours.prepend_axis_num == theirs.prepend_axis_num
    assert ours.box.offset == tuple(s.start if isinstance(s, slice) else s for s in theirs.global_slice())


def test_flattened_range_is_honoured_where_megatron_016_refuses_it(tmp_path):
    from megatron.core.dist_checkpointing import ShardedTensor as MegatronShardedTensor
    from megatron.core.dist_checkpointing.core import CheckpointingException

    whole = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    with pytest.raises(CheckpointingException, match="flattened_range"):
        MegatronShardedTensor(
            "w", whole[3], torch.float32, (2, 6), (4, 6), (2, 0), (2, 1), flattened_range=slice(6, 12)
        )
    (tmp_path / "c").mkdir()
    mcore.save({"w": mcore.ShardedTensor.from_rank_offsets("w", whole)}, str(tmp_path / "c"))
    # rows 2-3 are this rank's piece; its flat elements [6, 12) are the piece's second row
    row = mcore.ShardedTensor.from_rank_offsets_flat(
        "w", torch.zeros(6), (2, 6), (0, 1, 2), flattened_range=slice(6, 12)
    )
    assert row.box.offset == (3, 0) and row.box.shape == (1, 6)
    inside = mcore.ShardedTensor.from_rank_offsets_flat(
        "w", torch.zeros(3), (2, 6), (0, 1, 2), flattened_range=slice(7, 10)
    )
    loaded = mcore.load({"row": row, "inside": inside}, str(tmp_path / "c"))
    assert_same(whole[3], loaded["row"])
    assert_same(whole[3, 1:4], loaded["inside"])
    with pytest.raises(ckptd.errors.ShardingError, match="not a box"):
        mcore.ShardedTensor.from_rank_offsets_flat("w", torch.zeros(6), (2, 6), (0, 1, 2), flattened_range=slice(3, 9))
    with pytest.raises(ckptd.errors.ShardingError, match="1-D with 6"):
        mcore.ShardedTensor.from_rank_offsets_flat("w", torch.zeros(5), (2, 6), (0, 1, 2), flattened_range=slice(0, 6))


def test_prepend_axis_num_saves_and_loads_layer_slices(tmp_path):
    (tmp_path / "c").mkdir()
    layers = [mcore.ShardedTensor.from_rank_offsets(f"l{i}", LAYERS[i]) for i in range(2)]
    stacked = mcore.ShardedTensor.from_rank_offsets("stacked", LAYERS[0].clone(), (0, 0, 1), prepend_axis_num=1)
    mcore.save({"layers": layers, "stacked": stacked}, str(tmp_path / "c"))
    assert ckptd.load_tensors_metadata(str(tmp_path / "c"))["sharded"]["stacked"].shape == (1, 3, 4)
    target = mcore.ShardedTensor.from_rank_offsets("stacked", torch.zeros(3, 4, dtype=LAYERS.dtype), prepend_axis_num=1)
    assert_same(LAYERS[0], mcore.load({"t": target}, str(tmp_path / "c"))["t"])
    with pytest.raises(ckptd.errors.ShardingError, match="multiple of the local size"):
        mcore.ShardedTensor("w", torch.zeros(2), (4,), (1,), axis_fragmentations=(2,))
