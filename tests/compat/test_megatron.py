"""Megatron-Core ``dist_checkpointing`` entry points on ckptd: save/load of sharded state dicts
(ShardedTensor, ShardedObject, LocalNonpersistentObject, ShardedTensorFactory), the async queue,
metadata and common-state readers, tensor removal and the integrity check.  Real files, real
writer process; the 2-rank case runs in a real gloo group."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import assert_same
from distributed import run_ranks

import ckptd
from ckptd.compat import megatron as mcore
from ckptd.compat.megatron import LocalNonpersistentObject, ShardedObject, ShardedTensor, ShardedTensorFactory
from ckptd.errors import CheckpointExistsError, CheckpointNotFoundError, KeyMismatchError, ShardingError

WEIGHT = torch.arange(24, dtype=torch.float32).reshape(6, 4)
EMBED = torch.arange(12, dtype=torch.bfloat16).reshape(6, 2)


def split_rows(key, data, replica_id):
    """A factory's build_fn: the tensor saved as two row halves under their own keys."""
    half = data.shape[0] // 2
    return {
        "top": ShardedTensor(f"{key}.top", data[:half], (half, *data.shape[1:]), (0,) * data.dim(), replica_id),
        "bottom": ShardedTensor(f"{key}.bottom", data[half:], (half, *data.shape[1:]), (0,) * data.dim(), replica_id),
    }


def join_rows(parts):
    return torch.cat([parts["top"], parts["bottom"]])


def sharded_state(rank: int, world: int, weight: torch.Tensor, embed: torch.Tensor, iteration: int = 7):
    """Column-parallel weight split over ``world`` ranks; everything else replicated."""
    cols = weight.shape[1] // world
    return {
        "model": {
            "linear.weight": ShardedTensor.from_rank_offsets(
                "linear.weight", weight[:, rank * cols : (rank + 1) * cols], (1, rank, world)
            ),
            "embedding": ShardedTensorFactory("embedding", embed, split_rows, join_rows, replica_id=rank),
        },
        "iteration": iteration,
        "args": {"lr": 0.5, "name": "gpt"},
        "plain": torch.ones(3),
        "rng": LocalNonpersistentObject(f"generator of rank {rank}"),
        "extra": ShardedObject("optimizer.extra", {"rank": rank}, (world,), (rank,)),
    }


def empty_like_state(rank: int, world: int):
    return sharded_state(rank, world, torch.zeros_like(WEIGHT), torch.zeros_like(EMBED), iteration=0)


def assert_loaded(result, rank: int, world: int) -> None:
    cols = WEIGHT.shape[1] // world
    assert_same(WEIGHT[:, rank * cols : (rank + 1) * cols], result["model"]["linear.weight"])
    assert_same(EMBED, result["model"]["embedding"])
    assert result["iteration"] == 7 and result["args"] == {"lr": 0.5, "name": "gpt"}
    assert_same(torch.ones(3), result["plain"])
    assert result["rng"] == f"generator of rank {rank}", "non-persistent values come from the caller"
    assert result["extra"] == {"rank": rank}


def test_save_load_round_trip(tmp_path):
    directory = tmp_path / "iter_7"
    directory.mkdir()
    state = sharded_state(0, 1, WEIGHT, EMBED)
    assert mcore.save(state, str(directory)) is None
    assert "checkpoint_manifest.json" in os.listdir(directory)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")], "no staging left beside it"
    assert isinstance(state["model"]["embedding"], ShardedTensorFactory), "the caller's dict is not modified"
    assert_loaded(mcore.load(empty_like_state(0, 1), str(directory)), 0, 1)

    common = mcore.load_common_state_dict(str(directory))
    assert set(common) == {"iteration", "args", "plain"}
    plain = mcore.load_plain_tensors(str(directory))
    assert_same({"linear.weight": WEIGHT, "embedding.top": EMBED[:3], "embedding.bottom": EMBED[3:]}, plain)
    meta = mcore.load_sharded_metadata(str(directory))
    assert meta["linear.weight"].global_shape == (6, 4) and meta["linear.weight"].dtype == torch.float32
    assert meta["embedding.top"].dtype == torch.bfloat16 and meta["embedding.top"].data is None
    assert meta["optimizer.extra/shard_0_1"].key == "optimizer.extra"


def test_save_refuses_missing_or_non_empty_directories(tmp_path):
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(2), (0, 0, 1))}
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        mcore.save(state, str(tmp_path / "missing"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(CheckpointExistsError, match="not empty"):
        mcore.save(state, str(tmp_path / "full"))
    with pytest.raises(ckptd.errors.ConfigError, match="strategy"):
        mcore.save(state, str(tmp_path), sharded_strategy=object())


def test_async_save_completes_through_the_queue(tmp_path):
    directory = tmp_path / "async"
    directory.mkdir()
    request = mcore.save(sharded_state(0, 1, WEIGHT, EMBED), str(directory), async_sharded_save=True)
    assert isinstance(request, mcore.AsyncRequest)
    finalized = []
    request.add_finalize_fn(lambda: finalized.append(True))
    queue = mcore.AsyncCallsQueue()
    assert queue.schedule_async_request(request) == 0
    assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    assert finalized == [True] and queue.get_num_unfinalized_calls() == 0
    assert_loaded(mcore.load(empty_like_state(0, 1), str(directory)), 0, 1)


def test_load_of_an_unknown_key_fails(tmp_path):
    mcore.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2), (0, 0, 1))}, str(tmp_path))
    wanted = {"v": ShardedTensor.from_rank_offsets("v", torch.zeros(2), (0, 0, 1))}
    with pytest.raises(KeyMismatchError, match="'v'"):
        mcore.load(wanted, str(tmp_path))


def test_remove_sharded_tensors(tmp_path):
    (tmp_path / "c").mkdir()
    mcore.save(sharded_state(0, 1, WEIGHT, EMBED), str(tmp_path / "c"))
    mcore.remove_sharded_tensors(str(tmp_path / "c"), "embedding.")
    plain = mcore.load_plain_tensors(str(tmp_path / "c"))
    assert_same({"linear.weight": WEIGHT}, plain)
    assert mcore.load_common_state_dict(str(tmp_path / "c"))["iteration"] == 7
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_validate_sharding_integrity():
    halves = [
        [ShardedTensor.from_rank_offsets("w", torch.ones(2, 2), (0, r, 2)), ShardedObject("o", 1, (2,), (r,))]
        for r in range(2)
    ]
    mcore.validate_sharding_integrity(halves)
    with pytest.raises(ShardingError, match="'w'"):
        mcore.validate_sharding_integrity(halves[:1])
    doubled = [[ShardedObject("o", 1, (1,), (0,))], [ShardedObject("o", 1, (1,), (0,))]]
    with pytest.raises(ShardingError, match="main replicas on ranks"):
        mcore.validate_sharding_integrity(doubled)
    replicas = [[ShardedObject("o", 1, (1,), (0,), replica_id=r)] for r in range(2)]
    mcore.validate_sharding_integrity(replicas)


def test_unique_keys_round_trip():
    piece = ShardedObject("opt.extra", None, (2, 3), (1, 2))
    assert piece.unique_key == "opt.extra/shard_1.2_2.3"
    back = ShardedObject.empty_from_unique_key(piece.unique_key)
    assert (back.key, back.global_shape, back.global_offset) == ("opt.extra", (2, 3), (1, 2))


def save_on_ranks(rank: int, world: int, directory: str) -> None:
    mcore.save(sharded_state(rank, world, WEIGHT, EMBED), directory)


def test_two_ranks_save_one_loads(tmp_path):
    directory = tmp_path / "iter"
    directory.mkdir()
    run_ranks(2, save_on_ranks, str(directory))
    assert_same(WEIGHT, mcore.load_plain_tensors(str(directory))["linear.weight"])
    state = empty_like_state(0, 1)
    state["extra"] = ShardedObject("optimizer.extra", None, (2,), (1,))  # rank 1's piece, read by rank 0
    result = mcore.load(state, str(directory))
    assert_same(WEIGHT, result["model"]["linear.weight"])
    assert_same(EMBED, result["model"]["embedding"])
    assert result["extra"] == {"rank": 1}


def test_top_level_names():
    for name in ("ShardedObject", "LocalNonpersistentObject", "ShardedTensorFactory", "validate_sharding_integrity"):
        assert getattr(ckptd, name) is getattr(mcore, name)
        assert name not in ckptd.__all__


def test_objects_that_would_need_pickle_are_refused(tmp_path):
    state = {"extra": ShardedObject("x", object(), (1,), (0,))}
    with pytest.raises(ckptd.errors.UnsupportedValueError):
        mcore.save(state, str(tmp_path))
    assert os.listdir(tmp_path) == [], "nothing written"


def test_ckptd_imports_without_megatron_core():
    """The strategies import megatron-core on first use only; without it they say what to install."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys; sys.modules['megatron'] = None\n"  # as if megatron-core were not installed
        "import ckptd, ckptd.compat.megatron as m\n"
        "assert m.ShardedTensor is ckptd.ShardedTensor\n"
        "try:\n    m.SaveStrategy\nexcept ImportError as e:\n    print(e)\n"
    )
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "pip install 'ckptd[megatron]'" in out.stdout
