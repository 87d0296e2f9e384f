"""Multi-rank saves and loads on real gloo process groups (world sizes 2-4, several processes)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import time

import pytest
import torch
import torch.distributed as dist
from conftest import assert_same, bytes_read, writers_strike
from distributed import run_ranks

import ckptd
from ckptd.errors import DistributedSaveError, ShardingError

pytestmark = [pytest.mark.multiprocess, pytest.mark.distributed]

ROWS, COLS = 10, 6  # 10 rows split over 4 ranks is uneven (3, 3, 2, 2) and over 3 too


def full_weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    return {
        "rows": torch.randn(ROWS, COLS, generator=generator),
        "cols": torch.randn(ROWS, COLS, generator=generator).bfloat16(),
        "bias": torch.randn(COLS, generator=generator),
        "steps": torch.tensor(7),
    }


def split(size: int, parts: int, index: int) -> tuple[int, int]:
    """Start and length of piece ``index`` when ``size`` is split as evenly as possible."""
    base, extra = divmod(size, parts)
    start = index * base + min(index, extra)
    return start, base + (1 if index < extra else 0)


def sharded_state(rank: int, world: int, weights: dict[str, torch.Tensor]) -> dict[str, object]:
    """rows: sharded on dim 0 (uneven), cols: sharded on dim 1, bias/steps: replicated."""
    r0, rn = split(ROWS, world, rank)
    c0, cn = split(COLS, world, rank)
    return {
        "rows": ckptd.ShardedTensor("rows", weights["rows"][r0 : r0 + rn].clone(), (ROWS, COLS), (r0, 0)),
        "cols": ckptd.ShardedTensor("cols", weights["cols"][:, c0 : c0 + cn].clone(), (ROWS, COLS), (0, c0)),
        "bias": weights["bias"].clone(),
        "steps": weights["steps"].clone(),
    }


# ---- save at N, load at M --------------------------------------------------------------------


def save_sharded(rank: int, world: int, root: str) -> dict[str, object]:
    weights = full_weights()
    with ckptd.Checkpointer(root, dist_timeout=60) as ckpt:
        result = ckpt.async_save(1, {"model": sharded_state(rank, world, weights)}).wait(120)
        written = ckpt._saver.last_rank_plan.bytes
    return {"path": result.path, "written": written}


def load_resharded(rank: int, world: int, root: str) -> dict[str, object]:
    weights = full_weights()
    targets = sharded_state(rank, world, {k: torch.zeros_like(v) for k, v in weights.items()})
    with ckptd.Checkpointer(root, dist_timeout=60) as ckpt:
        manifest = ckpt.manifest(1)
        before = bytes_read()
        ckpt.load(1, into={"model": targets})
        read = bytes_read() - before
    expected = sharded_state(rank, world, weights)
    for key in ("rows", "cols"):
        assert_same(expected[key].data, targets[key].data, key)
    assert_same(expected["bias"], targets["bias"], "bias")
    overlap = sum(t.data.numel() * t.data.element_size() for t in (targets["rows"], targets["cols"]))
    overlap += sum(targets[k].numel() * targets[k].element_size() for k in ("bias", "steps"))
    small_files = sum(f.size for name, f in manifest.files.items() if name.endswith(".json"))
    return {"read": read, "overlap": overlap, "small_files": small_files}


@pytest.mark.parametrize(("save_world", "load_world"), [(4, 2), (2, 4), (3, 1)])
def test_sharded_save_loads_at_another_world_size_reading_only_overlaps(tmp_path, save_world, load_world):
    root = str(tmp_path / "ckpts")
    saved = run_ranks(save_world, save_sharded, root)
    path = saved[0]["path"]
    assert all(r["written"] > 0 for r in saved.values()), "every rank writes its own pieces"
    assert sorted(os.listdir(path)) == sorted(
        ["model-00001-of-00001.safetensors", "model.safetensors.index.json", "state.json", "checkpoint_manifest.json"]
    )
    loaded = run_ranks(load_world, load_resharded, root) if load_world > 1 else {0: None}
    for rank, stats in loaded.items():
        if stats is not None:
            # exactly the overlapping bytes, plus the manifest and state file (and a little slack)
            assert stats["overlap"] <= stats["read"] <= stats["overlap"] + stats["small_files"] + 8192, (rank, stats)
    # at one rank (this process): whole tensors, bit-exact
    with ckptd.Checkpointer(root) as ckpt:
        assert_same(full_weights(), ckpt.load(1)["model"])
    manifest = json.loads(open(os.path.join(path, "checkpoint_manifest.json")).read())
    assert manifest["world_size"] == save_world
    tensors = manifest["components"]["model"]["tensors"]
    assert "file" in tensors["rows"], "dim-0 pieces are written into one whole tensor"
    assert len(tensors["cols"]["chunks"]) == save_world
    ckptd.CheckpointReader.open(path).verify()


# ---- spread key layout over several ranks ------------------------------------------------------

_SPREAD_SHARD = re.compile(r"^[0-9a-f]{2}/model-\d{5}-of-\d{5}\.safetensors$")


def save_spread(rank: int, world: int, root: str) -> dict[str, object]:
    """A sharded save with every shard file under a hashed subdirectory; 200-byte shards so
    that the tensors land in several files (the coordinator makes the subdirectories, then
    every rank writes its pieces into them)."""
    weights = full_weights()
    with ckptd.Checkpointer(root, dist_timeout=60, key_layout="spread", max_shard_size=200) as ckpt:
        result = ckpt.async_save(1, {"model": sharded_state(rank, world, weights)}).wait(120)
        written = ckpt._saver.last_rank_plan.bytes
    return {"path": result.path, "written": written}


def test_spread_layout_sharded_save_on_three_ranks_loads_resharded_on_two(tmp_path):
    root = str(tmp_path / "ckpts")
    saved = run_ranks(3, save_spread, root)
    path = saved[0]["path"]
    assert all(r["written"] > 0 for r in saved.values()), "every rank writes its own pieces"
    manifest = json.loads(open(os.path.join(path, "checkpoint_manifest.json")).read())
    shards = [name for name in manifest["files"] if name.endswith(".safetensors")]
    assert len(shards) >= 2, shards
    assert all(_SPREAD_SHARD.match(name) for name in shards), shards
    assert all(os.path.isfile(os.path.join(path, *name.split("/"))) for name in shards)
    assert not [n for n in os.listdir(path) if n.endswith(".safetensors")], "no shard beside the manifest"
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        assert set(json.load(f)["weight_map"].values()) == set(shards)
    ckptd.CheckpointReader.open(path).verify()
    run_ranks(2, load_resharded, root)  # each rank checks its pieces bit for bit
    with ckptd.Checkpointer(root) as ckpt:
        assert_same(full_weights(), ckpt.load(1)["model"])


# ---- replicated (DDP) ------------------------------------------------------------------------


def save_replicated_and_rng(rank: int, world: int, root: str) -> dict[str, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(6)))
    torch.manual_seed(100 + rank)
    with ckptd.Checkpointer(root, dist_timeout=60) as ckpt:
        result = ckpt.save(3, {"model": model, "rng": ckptd.RNGState()}, sharing={"rng": "per_rank"})
        after_save = torch.rand(3)
        torch.manual_seed(999)
        ckpt.load(3, into={"rng": ckptd.RNGState()})
        assert_same(after_save, torch.rand(3), f"rank {rank} rng")
        written = ckpt._saver.last_rank_plan.bytes
    return {"path": result.path, "written": written, "state": model.state_dict()}


def test_ddp_replicated_save_writes_each_tensor_once_and_balances_ranks(tmp_path):
    root = str(tmp_path / "ckpts")
    results = run_ranks(4, save_replicated_and_rng, root)
    path = results[0]["path"]
    manifest = json.loads(open(os.path.join(path, "checkpoint_manifest.json")).read())
    model_files = {n: f["size"] for n, f in manifest["files"].items() if n.startswith("model-")}
    tensor_bytes = sum(t.numel() * t.element_size() for t in results[0]["state"].values())
    headers = sum(model_files.values()) - tensor_bytes
    assert 0 < headers < 8192 * len(model_files), "each tensor is stored exactly once"
    written = [r["written"] for r in results.values()]
    assert all(w > 0 for w in written) and max(written) < 0.5 * sum(written), written
    assert sorted(n for n in os.listdir(path) if n.startswith("rng@")) == sorted(
        [f"rng@rank{r}-00001-of-00001.safetensors" for r in range(4)]
        + [f"rng@rank{r}.safetensors.index.json" for r in range(4)]
    )
    fresh = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(6)))
    with ckptd.Checkpointer(root) as ckpt:
        ckpt.load(3, into={"model": fresh})
    assert_same(results[0]["state"], fresh.state_dict())


# ---- FSDP2 (DTensor): HF output, optimizer resharding ------------------------------------------


def tiny_gpt2_config():
    import transformers

    return transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=32)


def fsdp_model(config):
    import transformers
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    return model


def train_once(model, optimizer) -> None:
    tokens = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(5))
    model(tokens, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def full_state(value):
    """Whole tensors of a (possibly DTensor) state, for comparisons."""
    if ckptd.dist.sharding.is_dtensor(value):
        return value.full_tensor()
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: full_state(v) for k, v in value.items()}
    if isinstance(value, list):
        return [full_state(v) for v in value]
    return value


def save_fsdp(rank: int, world: int, root: str) -> dict[str, object]:
    config = tiny_gpt2_config()
    model = fsdp_model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_once(model, optimizer)
    with ckptd.Checkpointer(root, dist_timeout=60) as ckpt:
        result = ckpt.save(5, {"model": model, "optimizer": optimizer})
    if rank == 0:
        config.save_pretrained(result.path)
    return {
        "path": result.path,
        "model": full_state(model.state_dict()),
        "optimizer": full_state(optimizer.state_dict()),
    }


def load_fsdp(rank: int, world: int, root: str) -> dict[str, object]:
    model = fsdp_model(tiny_gpt2_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {k: v.to_local().data_ptr() for k, v in model.state_dict().items()}
    with ckptd.Checkpointer(root, dist_timeout=60) as ckpt:
        ckpt.load(5, into={"model": model, "optimizer": optimizer})
    after = {k: v.to_local().data_ptr() for k, v in model.state_dict().items()}
    assert before == after, "the model's shards are filled in place"
    train_once(model, optimizer)  # the restored optimizer keeps training
    return {"model": full_state(model.state_dict()), "optimizer": full_state(optimizer.state_dict())}


@pytest.mark.hf
def test_fsdp_save_is_read_by_from_pretrained_and_optimizer_reshards(tmp_path):
    transformers = pytest.importorskip("transformers")
    root = str(tmp_path / "ckpts")
    saved = run_ranks(4, save_fsdp, root)[0]
    path = saved["path"]
    manifest = json.loads(open(os.path.join(path, "checkpoint_manifest.json")).read())
    assert all("file" in t for t in manifest["components"]["model"]["tensors"].values()), "whole tensors"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path)
    for key, value in saved["model"].items():
        assert_same(value, loaded.state_dict()[key], key)
    # FSDP at 4 ranks -> FSDP at 2 ranks: model and Adam state equal the saved ones
    restored = run_ranks(2, load_fsdp, root)
    reference = run_ranks(1, load_fsdp, root)[0]
    for key, value in saved["model"].items():
        assert_same(value, ckptd.load_checkpoint(path)[key], key)
    assert_same(restored[0]["model"], reference["model"])
    assert_same(restored[0]["optimizer"]["state"], reference["optimizer"]["state"])
    with ckptd.Checkpointer(root) as ckpt:
        state = ckpt.load(5)
    assert_same(saved["optimizer"]["state"], state["optimizer"]["state"])


# ---- failures --------------------------------------------------------------------------------


def fail_writer_on_rank_one(rank: int, world: int, root: str) -> dict[str, object]:
    weights = full_weights()
    # Rank 1's writer SIGKILLs itself once it has written bytes of its per-rank file of step 2.
    arming = writers_strike("write", r"big@rank1") if rank == 1 else contextlib.nullcontext()
    with arming:
        ckpt = ckptd.Checkpointer(root, dist_timeout=30, chunk_size="256KiB")
        ckpt.health_check()
    with ckpt:
        ckpt.save(1, {"model": sharded_state(rank, world, weights)})
        writer_pid = ckpt.writer_pid
        state = {
            "model": sharded_state(rank, world, {k: v + 1 for k, v in weights.items()}),
            "big": {"w": torch.randn(8 * 1024 * 1024)},
        }
        request = ckpt.async_save(2, state, sharing={"big": "per_rank"})
        started = time.monotonic()
        with pytest.raises(DistributedSaveError) as info:
            request.wait(60)
        elapsed = time.monotonic() - started
        assert ckpt.steps() == [1]
        if rank == 1:  # the writer died at the armed point, and not earlier
            assert ckpt.health_check()["writer_pid"] != writer_pid
        targets = sharded_state(rank, world, {k: torch.zeros_like(v) for k, v in weights.items()})
        ckpt.load("latest", into={"model": targets})
        assert_same(sharded_state(rank, world, weights)["rows"].data, targets["rows"].data)
    return {"ranks": info.value.ranks, "message": str(info.value), "elapsed": elapsed}


def test_one_rank_writer_killed_fails_every_rank_and_keeps_the_last_checkpoint(tmp_path):
    root = str(tmp_path / "ckpts")
    results = run_ranks(3, fail_writer_on_rank_one, root)
    for rank, outcome in results.items():
        assert outcome["ranks"] == [1], (rank, outcome)
        assert "SIGKILL" in outcome["message"] and "rank 1" in outcome["message"]
        assert outcome["elapsed"] < 30
    assert [n for n in os.listdir(root) if n.startswith(".checkpoint-")] == []


class ExplodingTensor(torch.Tensor):
    """A tensor whose copy fails: staging it raises on the rank that holds it."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_ and any(isinstance(a, ExplodingTensor) for a in args):
            raise RuntimeError("cannot copy this tensor (test)")
        return super().__torch_function__(func, types, args, kwargs or {})


def fail_staging_on_rank_two(rank: int, world: int, root: str) -> dict[str, object]:
    state = {"w": torch.ones(4) * rank if rank != 2 else torch.ones(4).as_subclass(ExplodingTensor)}
    with ckptd.Checkpointer(root, dist_timeout=30) as ckpt:
        if rank == 2:
            # The failing rank raises what the others raise; its own error is the cause.
            with pytest.raises(DistributedSaveError, match=r"rank\(s\) \[2\].*RuntimeError: cannot copy") as info:
                ckpt.async_save(1, {"model": {"shared": torch.zeros(3)}, "mine": state}, sharing={"mine": "per_rank"})
            assert isinstance(info.value.__cause__, RuntimeError) and "cannot copy" in str(info.value.__cause__)
            return {"ranks": info.value.ranks}
        request = ckpt.async_save(1, {"model": {"shared": torch.zeros(3)}, "mine": state}, sharing={"mine": "per_rank"})
        with pytest.raises(DistributedSaveError, match="cannot copy") as info:
            request.wait(60)
        assert ckpt.steps() == []
    return {"ranks": info.value.ranks}


def test_one_rank_raising_during_staging_fails_every_rank(tmp_path):
    root = str(tmp_path / "ckpts")
    results = run_ranks(3, fail_staging_on_rank_two, root)
    assert all(r["ranks"] == [2] for r in results.values()), results
    assert not any(n.startswith("checkpoint-") or n.startswith(".checkpoint-") for n in os.listdir(root))


def die_on_rank_one(rank: int, world: int, root: str) -> dict[str, object]:
    with ckptd.Checkpointer(root, dist_timeout=8) as ckpt:
        ckpt.health_check()
        if rank == 1:
            os.kill(ckpt.writer_pid, signal.SIGSTOP)
        request = ckpt.async_save(1, {"model": {"w": torch.ones(1000) * rank}}, sharing={"model": "per_rank"})
        if rank == 1:
            os.kill(ckpt.writer_pid, signal.SIGCONT)  # a stopped writer could never see its parent die
            os._exit(3)  # the whole rank dies mid-save
        with pytest.raises(DistributedSaveError, match=r"rank 1.*did not report") as info:
            request.wait(60)
        assert ckpt.steps() == []
    return {"ranks": info.value.ranks}


def test_a_dead_rank_is_reported_within_the_timeout(tmp_path):
    root = str(tmp_path / "ckpts")
    results = run_ranks(3, die_on_rank_one, root, expect_dead={1})
    assert results[0]["ranks"] == [1] and results[2]["ranks"] == [1]


def invalid_sharding(rank: int, world: int, root: str, case: str) -> str:
    if case == "gap":
        piece = ckptd.ShardedTensor("w", torch.ones(2, 4), (6, 4), (rank * 2, 0))  # rows 4-5 missing
    elif case == "overlap":
        piece = ckptd.ShardedTensor("w", torch.ones(3, 4), (4, 4), (rank, 0))  # rows 1-2 twice
    else:
        piece = ckptd.ShardedTensor("w", torch.ones(2, 4), (4, 4 + rank), (rank * 2, 0))
    with ckptd.Checkpointer(root, dist_timeout=30) as ckpt:
        with pytest.raises(ShardingError) as info:
            ckpt.async_save(1, {"model": {"w": piece}})
    return str(info.value)


@pytest.mark.parametrize(
    ("case", "message"),
    [("gap", r"cover 16 of 24 elements; element \[4, 0\]"), ("overlap", "overlap at offset"), ("shapes", "disagree")],
)
def test_invalid_sharding_is_refused_before_any_byte_is_written(tmp_path, case, message):
    import re

    root = str(tmp_path / "ckpts")
    results = run_ranks(2, invalid_sharding, root, case)
    for text in results.values():
        assert re.search(message, text) and "'model.w'" in text, text
    assert os.listdir(root) == []


# ---- consolidation, metadata, per-rank key loads ------------------------------------------------


def save_then_load_keys(rank: int, world: int, root: str) -> dict[str, object]:
    weights = full_weights()
    with ckptd.Checkpointer(root, dist_timeout=60) as ckpt:
        path = ckpt.save(1, {"model": sharded_state(rank, world, weights)}).path
    wanted = ["rows", "bias"] if rank == 0 else ["cols"]
    return {"path": path, "keys": ckptd.load_sharded_state_dict(path, keys_to_load=wanted)}


def test_consolidate_metadata_and_per_rank_keys(tmp_path):
    from safetensors.torch import load_file

    root = str(tmp_path / "ckpts")
    results = run_ranks(2, save_then_load_keys, root)
    weights = full_weights()
    assert_same({"rows": weights["rows"], "bias": weights["bias"]}, results[0]["keys"])
    assert_same({"cols": weights["cols"]}, results[1]["keys"])
    path = results[0]["path"]
    metadata = ckptd.load_tensors_metadata(path)["model"]
    assert metadata["cols"] == ckptd.TensorInfo(torch.bfloat16, (ROWS, COLS))
    assert metadata["rows"] == ckptd.TensorInfo(torch.float32, (ROWS, COLS))
    out = str(tmp_path / "consolidated")
    from ckptd.cli import main

    assert main(["consolidate", path, out, "--verify"]) == 0
    index = json.loads(open(os.path.join(out, "model.safetensors.index.json")).read())
    assert set(index["weight_map"]) == set(weights)
    merged = {}
    for name in set(index["weight_map"].values()):
        merged.update(load_file(os.path.join(out, name)))
    assert_same(weights, merged)
    ckptd.CheckpointReader.open(out).verify()


# ---- Megatron-style: explicit ShardedTensors for model and optimizer ---------------------------


def megatron_state(rank: int, world: int, train: bool):
    """A column-parallel linear layer (weight split on dim 1) with a plain Adam on the local piece."""
    torch.manual_seed(0)
    full = torch.nn.Linear(8, 6, bias=True)
    c0, cn = split(8, world, rank)
    local = torch.nn.Parameter(full.weight.detach()[:, c0 : c0 + cn].clone())
    bias = torch.nn.Parameter(full.bias.detach().clone())
    optimizer = torch.optim.Adam([local, bias], lr=0.1)
    if train:
        (local.sum() * 2 + bias.sum()).backward()
        optimizer.step()
    else:  # a step with zero gradients creates state of the right shapes
        local.grad, bias.grad = torch.zeros_like(local), torch.zeros_like(bias)
        optimizer.step()
    model = {
        "weight": ckptd.ShardedTensor("layer.weight", local.detach(), (6, 8), (0, c0)),
        "bias": ckptd.ShardedTensor("layer.bias", bias.detach(), (6,), (0,), replica_id=rank),
    }
    optim_state = optimizer.state_dict()
    mapping = ckptd.get_param_id_to_sharded_param_map(model, [local, bias])
    ckptd.optim_state_to_sharding_state(optim_state, mapping)
    return model, optim_state


def save_megatron(rank: int, world: int, root: str) -> None:
    model, optim_state = megatron_state(rank, world, train=True)
    with ckptd.Checkpointer(root, dist_timeout=60) as ckpt:
        ckpt.save(1, {"model": model, "optimizer": optim_state})


def load_megatron(rank: int, world: int, root: str) -> dict[str, object]:
    model, optim_state = megatron_state(rank, world, train=False)
    with ckptd.Checkpointer(root, dist_timeout=60) as ckpt:
        ckpt.load(1, into={"model": model, "optimizer": optim_state})
    return {
        "weight": model["weight"].data.clone(),
        "exp_avg": optim_state["state"][0]["exp_avg"].data.clone(),
        "step": optim_state["state"][0]["step"],
    }


def test_megatron_style_optimizer_state_follows_parameter_sharding(tmp_path):
    root = str(tmp_path / "ckpts")
    run_ranks(2, save_megatron, root)
    loaded = run_ranks(4, load_megatron, root)
    with ckptd.Checkpointer(root) as ckpt:
        whole = ckpt.load(1)  # the saved structure, with whole tensors
        path = ckpt.path_for(1)
    full_weight = whole["model"]["weight"]
    assert full_weight.shape == (6, 8)
    # stored under the ShardedTensor keys: what key-based loaders see
    assert_same(full_weight, ckptd.load_sharded_state_dict(path, ["layer.weight"])["layer.weight"])
    full_moment = whole["optimizer"]["state"][0]["exp_avg"]
    assert full_moment.shape == (6, 8)
    for rank, outcome in loaded.items():
        c0, cn = split(8, 4, rank)
        assert_same(full_weight[:, c0 : c0 + cn].contiguous(), outcome["weight"])
        assert_same(full_moment[:, c0 : c0 + cn].contiguous(), outcome["exp_avg"])
        assert float(outcome["step"]) == 1.0


def test_runs_under_torchrun(tmp_path):
    import subprocess
    import sys
    import textwrap

    root = str(tmp_path / "ckpts")
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import torch, torch.distributed as dist, ckptd
            dist.init_process_group("gloo")
            rank = dist.get_rank()
            piece = ckptd.ShardedTensor("w", torch.full((2, 3), float(rank)), (4, 3), (2 * rank, 0))
            with ckptd.Checkpointer({root!r}, dist_timeout=60) as ckpt:
                ckpt.async_save(1, {{"model": {{"w": piece}}, "rng": ckptd.RNGState()}}, sharing={{"rng": "per_rank"}})
            dist.destroy_process_group()
            """
        )
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    out = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    with ckptd.Checkpointer(root) as ckpt:
        assert ckpt.manifest(1).world_size == 2
        assert_same(torch.tensor([[0.0] * 3] * 2 + [[1.0] * 3] * 2), ckpt.load(1)["model"]["w"])


# ---- sharing patterns: GLOBAL and PER_GROUP (Forgather's names) ---------------------------------


def save_and_load_patterns(rank: int, world: int, root: str) -> dict[str, object]:
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    state = {
        "stage": {"w": torch.full((4,), float(rank // 2))},  # one copy per pipeline stage
        "scheduler": {"lr": 0.1 * (rank + 1)},  # the coordinator's copy is the one saved
        "rng": {"seed": torch.tensor(rank)},
    }
    sharing = {"stage": ("PER_GROUP", mine), "scheduler": "GLOBAL", "rng": "PER_RANK"}
    with ckptd.Checkpointer(root, dist_timeout=60) as ckpt:
        path = ckpt.save(1, state, sharing=sharing).path
        loaded = ckpt.load(1, sharing={"stage": ("PER_GROUP", mine)})
    return {"path": path, "stage": loaded["stage"]["w"], "lr": loaded["scheduler"]["lr"], "seed": loaded["rng"]["seed"]}


def test_global_per_group_and_per_rank_sharing(tmp_path):
    root = str(tmp_path / "ckpts")
    results = run_ranks(4, save_and_load_patterns, root)
    for rank, outcome in results.items():
        assert_same(torch.full((4,), float(rank // 2)), outcome["stage"], f"rank {rank}")
        assert outcome["lr"] == 0.1 and int(outcome["seed"]) == rank
    manifest = json.loads(open(os.path.join(results[0]["path"], "checkpoint_manifest.json")).read())
    assert set(manifest["components"]) >= {"stage@group0", "stage@group2", "rng@rank3", "scheduler"}
    assert manifest["components"]["stage@group2"]["sharing"] == "per_group"
    assert manifest["components"]["scheduler"]["sharing"] == "global"


def incremental_two_saves(rank: int, world: int, root: str) -> dict[str, object]:
    torch.manual_seed(0)
    frozen = torch.nn.Embedding(256, 64)
    frozen.weight.requires_grad_(False)
    model = torch.nn.ModuleDict({"embed": frozen, "head": torch.nn.Linear(64, 8)})
    rows = torch.arange(8 * 16, dtype=torch.float32).reshape(8, 16)
    piece = ckptd.ShardedTensor("table.rows", rows[rank * 4 : rank * 4 + 4].clone(), (8, 16), (rank * 4, 0))
    frozen_keys = {"sharded": ["table.*"]}
    with ckptd.Checkpointer(root, dist_timeout=60, incremental=True) as ckpt:
        ckpt.save(1, {"model": model, "sharded": {"piece": piece}}, frozen=frozen_keys)
        with torch.no_grad():
            model["head"].bias.add_(1)
        second = ckpt.save(2, {"model": model, "sharded": {"piece": piece}}, frozen=frozen_keys)
        torch.distributed.barrier()
        if rank == 0:
            shutil.rmtree(os.path.join(root, "checkpoint-1"))  # checkpoint-2 holds every file itself
        torch.distributed.barrier()
        loaded = ckpt.load(2)
    assert_same(model.state_dict(), loaded["model"])
    assert_same(rows, loaded["sharded"]["piece"])
    return {"linked": second.bytes_linked, "path": second.path}


def test_incremental_saves_across_ranks_link_files_several_ranks_wrote(tmp_path):
    """The frozen sharded table's file was written by both ranks (row blocks); the rank holding
    its first bytes links it into the next checkpoint, the other skips its piece."""
    root = str(tmp_path / "ckpts")
    results = run_ranks(2, incremental_two_saves, root)
    assert results[0]["linked"] >= 256 * 64 * 4 + 8 * 16 * 4
    manifest = json.loads(open(os.path.join(results[0]["path"], "checkpoint_manifest.json")).read())
    assert not any("checkpoint" in f for f in manifest["files"].values())
    linked = {n for n, f in manifest["files"].items() if f.get("reused") == "link"}
    assert any(n.startswith("sharded-") for n in linked) and any(n.startswith("model-") for n in linked)


def save_from_rank_zero_only(rank: int, world: int, root: str) -> int | None:
    if rank != 0:
        return None
    with ckptd.Checkpointer(root, no_dist=True) as ckpt:
        ckpt.save(1, {"model": {"w": torch.ones(3)}})
        return ckpt.manifest(1).world_size


def test_no_dist_saves_from_one_rank_without_collectives(tmp_path):
    results = run_ranks(2, save_from_rank_zero_only, str(tmp_path / "ckpts"))
    assert results[0] == 1 and results[1] is None


def resave_step_on_s3(rank: int, world: int, url: str, options: dict) -> dict[str, object]:
    state = {"model": {"w": torch.arange(8.0)}}
    with ckptd.Checkpointer(url, storage_options=options, dist_timeout=60) as ckpt:
        ckpt.save(1, state)
        try:
            ckpt.save(1, {"model": {"w": torch.zeros(8)}})
            outcome = "saved"
        except (ckptd.errors.CheckpointExistsError, DistributedSaveError) as e:
            outcome = type(e).__name__
        loaded = ckpt.load(1, verify=True)["model"]["w"]
    return {"outcome": outcome, "loaded": loaded}


@pytest.mark.objectstore
def test_resaving_a_step_on_s3_from_two_ranks_keeps_the_committed_one(s3):
    pytest.importorskip("s3fs")
    results = run_ranks(2, resave_step_on_s3, s3.url(), s3.options())
    assert results[0]["outcome"] == "CheckpointExistsError"
    assert results[1]["outcome"] == "DistributedSaveError"
    for outcome in results.values():
        assert_same(torch.arange(8.0), outcome["loaded"])


# ---- one root, several spellings -------------------------------------------------------------


def save_with_own_spelling(rank: int, world: int, parent: str) -> dict[str, object]:
    os.chdir(parent)  # rank 1 names the root relative to its working directory
    root = os.path.join(parent, "run") + "/" if rank == 0 else "run"
    weights = full_weights()
    targets = sharded_state(rank, world, {k: torch.zeros_like(v) for k, v in weights.items()})
    with ckptd.Checkpointer(root, dist_timeout=30) as ckpt:
        result = ckpt.save(1, {"model": sharded_state(rank, world, weights)})
        ckpt.load(1, into={"model": targets})
    return {"path": result.path, "root": ckpt.root, "loaded": targets}


def test_ranks_spelling_one_root_differently_save_one_checkpoint(tmp_path):
    outcomes = run_ranks(2, save_with_own_spelling, str(tmp_path))
    expected = os.path.join(str(tmp_path), "run")
    assert outcomes[0]["root"] == outcomes[1]["root"] == expected
    assert outcomes[0]["path"] == outcomes[1]["path"] == os.path.join(expected, "checkpoint-1")
    assert sorted(os.listdir(expected)) == ["checkpoint-1"]
    weights = full_weights()
    for rank in (0, 1):
        assert_same(sharded_state(rank, 2, weights)["bias"], outcomes[rank]["loaded"]["bias"])
