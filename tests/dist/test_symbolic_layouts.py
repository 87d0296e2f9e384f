"""FSDP2 and HSDP DTensors on real gloo groups: every rank of the mesh sends one shared layout
(its coordinate apart), the coordinator learns one description, and the checkpoint is the same
HF-compatible file of whole tensors, bit-exact, loadable at another world size."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from conftest import assert_same, bytes_read
from distributed import run_ranks

import ckptd
from ckptd.load.reader import CheckpointReader

pytestmark = [pytest.mark.multiprocess, pytest.mark.distributed]

SHAPES = {"wq": (7, 5), "tiny": (2, 3), "bias": (9,), "conv": (6, 2, 2)}  # uneven rows, empty pieces


def full_tensors(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return {k: torch.randn(shape, generator=generator) for k, shape in SHAPES.items()}


def state(step: int, mesh, placements) -> dict[str, object]:
    from torch.distributed.tensor import distribute_tensor

    model = {k: distribute_tensor(v, mesh, placements) for k, v in full_tensors(step).items()}
    model["norm"] = torch.full((4,), float(step))  # plain, replicated
    rank = torch.distributed.get_rank()
    return {"model": model, "rng": {"seed": torch.tensor([rank, step])}}


def save_with_mesh(rank: int, world: int, root: str, mesh_shape: tuple[int, ...], hsdp: bool) -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    mesh = init_device_mesh("cpu", mesh_shape)
    placements = [Replicate(), Shard(0)] if hsdp else [Shard(0)]
    out: dict[str, object] = {}
    with ckptd.Checkpointer(root, dist_timeout=60) as ckpt:
        exchange = ckpt._saver.exchange
        for step in (1, 2):
            ckpt.save(step, state(step, mesh, placements), sharing={"rng": "per_rank"})
            if rank == 0:
                out.setdefault("descriptions", []).append(len(exchange.book.descriptions))
                out.setdefault("plans", []).append(exchange.book.plans_made)
        targets = state(0, mesh, placements)
        ckpt.load(2, into=targets, sharing={"rng": "per_rank"})
        for key, value in full_tensors(2).items():
            assert_same(value, targets["model"][key].full_tensor(), key)
        assert_same(torch.tensor([rank, 2]), targets["rng"]["seed"])
    return out


@pytest.mark.parametrize(("world", "mesh_shape", "hsdp"), [(3, (3,), False), (4, (2, 2), True)], ids=["fsdp", "hsdp"])
def test_a_mesh_saves_one_shared_layout_and_whole_tensors(tmp_path, world, mesh_shape, hsdp):
    root = str(tmp_path / "ckpts")
    coordinator = run_ranks(world, save_with_mesh, root, mesh_shape, hsdp)[0]
    # model (one layout for every rank) + one per-rank rng component per rank
    assert coordinator["descriptions"] == [1 + world, 1 + world], "one model description, not one per rank"
    assert coordinator["plans"] == [1, 1], "the second save reused the plan"
    path = os.path.join(root, "checkpoint-2")
    manifest = json.loads(open(os.path.join(path, "checkpoint_manifest.json")).read())
    records = manifest["components"]["model"]["tensors"]
    assert all("file" in records[k] for k in SHAPES), "whole tensors, one entry each: no chunks"
    loaded = ckptd.load_checkpoint(path)
    for key, value in full_tensors(2).items():
        assert_same(value, loaded[key], key)
    assert_same(torch.full((4,), 2.0), loaded["norm"])
    # Every rank wrote row blocks of the shared files and reported one CRC32C per file (folded):
    # the combined CRC32Cs match the bytes on disk.
    with CheckpointReader.open(path) as reader:
        reader.verify()


def load_on_two(rank: int, world: int, root: str) -> dict[str, int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (world,))
    targets = {"model": state(0, mesh, [Shard(0)])["model"]}
    with ckptd.Checkpointer(root, dist_timeout=60) as ckpt:
        manifest = ckpt.manifest(2)
        before = bytes_read()
        ckpt.load(2, into=targets)
        read = bytes_read() - before
    for key, value in full_tensors(2).items():
        assert_same(value, targets["model"][key].full_tensor(), key)
    local = sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes for t in targets["model"].values())
    small_files = sum(f.size for name, f in manifest.files.items() if name.endswith(".json"))
    return {"read": read, "overlap": local, "small_files": small_files}


def test_an_fsdp_save_at_three_ranks_loads_at_two_reading_only_overlaps(tmp_path):
    root = str(tmp_path / "ckpts")
    run_ranks(3, save_with_mesh, root, (3,), False)
    for rank, stats in run_ranks(2, load_on_two, root).items():
        # each rank's rows of every tensor (and the plain one), the manifest and state files, and a little slack
        assert stats["overlap"] <= stats["read"] <= stats["overlap"] + stats["small_files"] + 8192, (rank, stats)


def save_fsdp_to_s3(rank: int, world: int, url: str, options: dict) -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (world,))
    with ckptd.Checkpointer(url, storage_options=options, dist_timeout=60) as ckpt:
        ckpt.save(2, state(2, mesh, [Shard(0)]), sharing={"rng": "per_rank"})
        descriptions = len(ckpt._saver.exchange.book.descriptions)
        targets = state(0, mesh, [Shard(0)])
        ckpt.load(2, into=targets, sharing={"rng": "per_rank"})
    for key, value in full_tensors(2).items():
        assert_same(value, targets["model"][key].full_tensor(), key)
    return {"descriptions": descriptions}


def test_an_fsdp_save_to_an_object_store_stores_row_chunks_and_skips_empty_pieces(s3):
    """One writer per object: the pieces are chunks, described explicitly (a layout per rank).
    'tiny' has 2 rows on 3 ranks: the third rank's piece is empty and is not stored."""
    pytest.importorskip("s3fs")
    coordinator = run_ranks(3, save_fsdp_to_s3, s3.url(), s3.options())[0]
    assert coordinator["descriptions"] == 3 + 3, "explicit boxes: a model description per rank"
    with ckptd.Checkpointer(s3.url(), storage_options=s3.options()) as ckpt:
        manifest = ckpt.manifest(2)
        loaded = ckpt.load(2)["model"]
    for key, value in full_tensors(2).items():
        assert_same(value, loaded[key], key)
    assert len(manifest.components["model"].tensors["tiny"].chunks) == 2


def incremental_with_a_frozen_grid_table(rank: int, world: int, root: str) -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    table = torch.arange(9 * 16, dtype=torch.float32).reshape(9, 16)  # 9 rows on 2 ranks: 5 + 4
    head = torch.zeros(4)
    state_of = {"sharded": {"table": distribute_tensor(table, mesh, [Shard(0)])}, "head": {"b": head}}
    frozen = {"sharded": ["table"]}
    with ckptd.Checkpointer(root, dist_timeout=60, incremental=True) as ckpt:
        ckpt.save(1, state_of, frozen=frozen)
        head.add_(1)
        second = ckpt.save(2, state_of, frozen=frozen)
        plans = ckpt._saver.exchange.book.plans_made if rank == 0 else None
        torch.distributed.barrier()
        if rank == 0:
            shutil.rmtree(os.path.join(root, "checkpoint-1"))  # checkpoint-2 holds every file itself
        torch.distributed.barrier()
        loaded = ckpt.load(2)
    assert_same(table, loaded["sharded"]["table"])
    assert_same(torch.ones(4), loaded["head"]["b"])
    return {"linked": second.bytes_linked, "path": second.path, "plans": plans}


def test_an_incremental_save_links_a_frozen_file_the_mesh_wrote_in_row_blocks(tmp_path):
    """Both ranks derived row blocks of the frozen table's file; the rank holding its first bytes
    links it into the next checkpoint, the other skips its rows."""
    root = str(tmp_path / "ckpts")
    results = run_ranks(2, incremental_with_a_frozen_grid_table, root)
    assert results[0]["linked"] >= 9 * 16 * 4
    assert results[0]["plans"] == 1
    manifest = json.loads(open(os.path.join(results[0]["path"], "checkpoint_manifest.json")).read())
    linked = {n for n, f in manifest["files"].items() if f.get("reused") == "link"}
    assert any(n.startswith("sharded-") for n in linked), manifest["files"]


def save_rows_and_columns(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    placements = {"rows": [Shard(0)], "columns": [Shard(1)], "copy": [Replicate()]}

    def mixed(step: int) -> dict[str, object]:
        full = full_tensors(step)
        return {
            "model": {
                name: distribute_tensor(full["wq"] + i, mesh, p) for i, (name, p) in enumerate(placements.items())
            }
        }

    with ckptd.Checkpointer(root, dist_timeout=60) as ckpt:
        for step in (1, 2):
            ckpt.save(step, mixed(step))
        targets = mixed(0)
        ckpt.load(2, into=targets)
    for i, name in enumerate(placements):
        assert_same(full_tensors(2)["wq"] + i, targets["model"][name].full_tensor(), name)


def test_row_blocks_beside_column_shards_are_all_described_by_boxes(tmp_path):
    """A ``Shard(1)`` DTensor is described by explicit boxes, which makes every rank's layout its
    own; grids beside it were then planned whole by each rank ("the pieces of rank 0 and rank 1
    overlap", found by a randomized pass): a state with both is now described by boxes alone."""
    root = str(tmp_path / "ckpts")
    run_ranks(2, save_rows_and_columns, root)
    path = os.path.join(root, "checkpoint-2")
    with CheckpointReader.open(path) as reader:
        reader.verify()
    loaded = ckptd.load_checkpoint(path)
    for i, name in enumerate(("rows", "columns", "copy")):
        assert_same(full_tensors(2)["wq"] + i, loaded[name], name)
