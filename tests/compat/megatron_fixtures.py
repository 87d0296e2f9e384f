"""Checkpoints written by the real ``megatron.core.dist_checkpointing.save`` on CPU, in real gloo
ranks, and the values they hold (so a test compares what ckptd reads with what was saved).

Megatron's save path calls ``torch.cuda.synchronize()`` and ``torch.cuda.current_device()``;
:func:`stub_cuda_for_megatron_save` replaces only those two, only in the generating processes
(spawned by :func:`distributed.run_ranks`), never in the process that runs ckptd's reads.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

WORLD = 2
# Whole tensors as saved; rank r holds the pieces described in mcore_state().
DECODER = torch.arange(32, dtype=torch.float32).reshape(8, 4) / 8  # split by rows
EMBED = torch.arange(24, dtype=torch.bfloat16).reshape(6, 4)  # split by columns (2-D shards)
NORM = torch.linspace(-1.0, 1.0, 5)  # replicated: rank 1 holds replica 1
LAYERS = torch.arange(24, dtype=torch.float16).reshape(2, 3, 4)  # prepend_axis_num=1: a layer per rank
COUNTS = torch.arange(6, dtype=torch.int64) * 3  # split in halves
# Megatron-LM keeps its argparse.Namespace in the common state
COMMON = {"iteration": 7, "args": argparse.Namespace(lr=0.5, name="gpt"), "plain": torch.ones(3)}


def expected_tensors() -> dict[str, torch.Tensor]:
    """Every ShardedTensor key of the fixture and its whole global value."""
    return {
        "decoder.weight": DECODER,
        "embedding.weight": EMBED,
        "final_norm.weight": NORM,
        "layers.mlp.weight": LAYERS,
        "counts": COUNTS,
    }


def expected_objects() -> dict[str, Any]:
    """The ShardedObject pieces by unique key and the data each holds."""
    return {f"optimizer.extra/shard_{r}_{WORLD}": {"rank": r, "lr": 0.1 * (r + 1)} for r in range(WORLD)}


def assert_whole_layout_loaded(result: dict[str, Any]) -> None:
    """A load of the whole layout: every tensor, the layer, the objects and the common state."""
    from conftest import assert_same  # the test process only: rank processes never call this

    assert_same(expected_tensors(), result["model"])
    if "layer1" in result:
        assert_same(LAYERS[1], result["layer1"])
    if "extra0" in result:
        assert result["extra0"] == expected_objects()[f"optimizer.extra/shard_0_{WORLD}"]
    assert result["extra"] == expected_objects()[f"optimizer.extra/shard_1_{WORLD}"]
    assert_same(COMMON, {k: result[k] for k in COMMON})


def stub_cuda_for_megatron_save() -> None:
    """Let Megatron's save path run on CPU: its two CUDA calls become no-ops (this process only)."""
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"  # used as a device for a 1-element flag tensor


def mcore_state(rank: int, world: int = WORLD, *, empty: bool = False) -> dict[str, Any]:
    """Rank ``rank``'s sharded state dict built with Megatron's own mapping classes
    (``empty``: zero-filled tensors and no object data, a load target)."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    def piece(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(t) if empty else t.clone()

    rows, cols, half = DECODER.shape[0] // world, EMBED.shape[1] // world, COUNTS.shape[0] // world
    return {
        "model": {
            "decoder": ShardedTensor.from_rank_offsets(
                "decoder.weight", piece(DECODER[rank * rows : (rank + 1) * rows]), (0, rank, world)
            ),
            "embedding": ShardedTensor.from_rank_offsets(
                "embedding.weight", piece(EMBED[:, rank * cols : (rank + 1) * cols]), (1, rank, world)
            ),
            "norm": ShardedTensor.from_rank_offsets("final_norm.weight", piece(NORM), replica_id=rank),
            "mlp": ShardedTensor.from_rank_offsets(
                "layers.mlp.weight", piece(LAYERS[rank]), (0, rank, world), prepend_axis_num=1
            ),
            "counts": ShardedTensor.from_rank_offsets(
                "counts", piece(COUNTS[rank * half : (rank + 1) * half]), (0, rank, world)
            ),
        },
        "extra": ShardedObject(
            "optimizer.extra",
            None if empty else expected_objects()[f"optimizer.extra/shard_{rank}_{world}"],
            (world,),
            (rank,),
        ),
        **({} if empty else {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in COMMON.items()}),
    }


def expected_for_rank(rank: int) -> dict[str, Any]:
    """What a rank of the 2-rank layout must get back from a load: its own pieces."""
    state = mcore_state(rank, WORLD)
    return {
        **COMMON,
        "model": {name: sh.data for name, sh in state["model"].items()},
        "extra": expected_objects()[f"optimizer.extra/shard_{rank}_{WORLD}"],
    }


def whole_layout(factory: Any, megatron: bool = False) -> dict[str, Any]:
    """World size 1: every tensor whole, layer 1 of the stacked tensor alone (prepend_axis_num)
    and rank 1's object piece (objects keep their saved sharding).  For Megatron's own load,
    which checks that one process reads every object piece and refuses two local shapes of one
    key on a rank: both object pieces, no layer slice."""
    tensors = expected_tensors()
    state = {
        "model": {
            key: factory.ShardedTensor.from_rank_offsets(key, torch.zeros_like(value), replica_id=0)
            for key, value in tensors.items()
        },
        "layer1": factory.ShardedTensor.from_rank_offsets(
            "layers.mlp.weight", torch.zeros_like(LAYERS[1]), (0, 1, WORLD), prepend_axis_num=1
        ),
        "extra": factory.ShardedObject("optimizer.extra", None, (WORLD,), (1,)),
    }
    if megatron:
        del state["layer1"]
        state["extra0"] = factory.ShardedObject("optimizer.extra", None, (WORLD,), (0,))
    return state


def _strategies(strategy: str | None) -> tuple[Any, Any]:
    if strategy != "ckptd":
        return None, None
    from ckptd.compat.megatron import LoadStrategy, SaveStrategy

    return SaveStrategy(), LoadStrategy()


def megatron_save_on_rank(rank: int, world: int, directory: str, strategy: str | None = None) -> None:
    """The real ``dist_checkpointing.save`` of this rank's state (Megatron's default
    ``torch_dist`` strategy, or ckptd's with ``strategy='ckptd'``)."""
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(mcore_state(rank, world), directory, sharded_strategy=_strategies(strategy)[0])


def megatron_load_on_rank(rank: int, world: int, directory: str, strategy: str | None = None) -> dict[str, Any]:
    """The real ``dist_checkpointing.load`` into this rank's layout (zero-filled targets)."""
    from megatron.core import dist_checkpointing

    state = mcore_state(rank, world, empty=True)
    return dist_checkpointing.load(state, directory, sharded_strategy=_strategies(strategy)[1])


def async_save_on_rank(rank: int, world: int, directory: str) -> dict[str, Any]:
    """``save(..., async_sharded_save=True)`` through ckptd's SaveStrategy, completed by
    Megatron's own ``AsyncCallsQueue``; returns whether ``metadata.json`` existed before and
    after the finalization."""
    import os

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from ckptd.compat.megatron import SaveStrategy

    os.makedirs(directory, exist_ok=True)
    request = dist_checkpointing.save(
        mcore_state(rank, world), directory, sharded_strategy=SaveStrategy(), async_sharded_save=True
    )
    config = os.path.join(directory, "metadata.json")
    before = os.path.exists(config)
    queue = AsyncCallsQueue()
    queue.schedule_async_request(request)
    finalized = queue.maybe_finalize_async_calls(blocking=True)
    return {"async:before": before, "async:after": os.path.exists(config), "async:finalized": finalized}


def generate_on_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    """Run by each of the :data:`WORLD` gloo ranks: Megatron's default save into
    ``root/torch_dist``, a save through ckptd's SaveStrategy into ``root/ckptd``, then loads at
    the same world size (ckptd's LoadStrategy of both, Megatron's default of its own)."""
    import os

    stub_cuda_for_megatron_save()
    out: dict[str, Any] = {}
    for name, strategy in (("torch_dist", None), ("ckptd", "ckptd")):
        directory = os.path.join(root, name)
        os.makedirs(directory, exist_ok=True)
        megatron_save_on_rank(rank, world, directory, strategy)
        out[f"files:{name}"] = sorted(os.listdir(directory))
    out.update(async_save_on_rank(rank, world, os.path.join(root, "ckptd_async")))
    out["ckptd<-ckptd"] = megatron_load_on_rank(rank, world, os.path.join(root, "ckptd"), "ckptd")
    out["ckptd<-ckptd_async"] = megatron_load_on_rank(rank, world, os.path.join(root, "ckptd_async"), "ckptd")
    out["ckptd<-torch_dist"] = megatron_load_on_rank(rank, world, os.path.join(root, "torch_dist"), "ckptd")
    out["megatron<-torch_dist"] = megatron_load_on_rank(rank, world, os.path.join(root, "torch_dist"))
    return out


def generate(root: str) -> dict[int, dict[str, Any]]:
    """Write both fixtures under ``root`` with real Megatron in :data:`WORLD` spawned gloo ranks;
    returns each rank's listings and loads (see :func:`generate_on_rank`)."""
    from distributed import run_ranks

    return run_ranks(WORLD, generate_on_rank, root)
