"""Varied planning inputs, and a plan as plain JSON (for the pinned plans in ``data/``).

The inputs cover what the planner tells apart: plain tensors on one rank, tensors replicated on
every rank or on some (per-rank and per-group components), row-sharded tensors written in place
(``rows``) or stored as chunks (no shared files, or column shards), sharded tensors with replicas
and with one whole main piece, frozen tensors in files of their own, empty and 0-d tensors.
"""

from __future__ import annotations

import itertools
from typing import Any

from ckptd.formats.manifest import ChunkRecord
from ckptd.save.plan import LocalTensor, PiecePart, SavePlan

__all__ = ["PLAN_CASES", "plan_json"]


def _plain(component: str, key: str, dtype: str, shape: tuple[int, ...], frozen: bool = False) -> LocalTensor:
    return LocalTensor(component, key, dtype, shape, (0,) * len(shape), shape, frozen=frozen)


def _rows(component: str, key: str, dtype: str, shape: tuple[int, ...], bounds: list[int], main: bool = True) -> list:
    """Row blocks ``bounds[i]:bounds[i+1]`` of a tensor, one per rank."""
    return [
        LocalTensor(component, key, dtype, shape, (a, *(0,) * (len(shape) - 1)), (b - a, *shape[1:]), True, main)
        for a, b in itertools.pairwise(bounds)
    ]


def _columns(component: str, key: str, dtype: str, shape: tuple[int, int], bounds: list[int]) -> list:
    return [
        LocalTensor(component, key, dtype, shape, (0, a), (shape[0], b - a), sharded=True)
        for a, b in itertools.pairwise(bounds)
    ]


def _single_rank() -> list[list[LocalTensor]]:
    dtypes = ("F32", "BF16", "I64", "BOOL", "F64", "U8", "F16")
    model = [_plain("model", f"layers.{i}.w", dtypes[i % 7], (3,) if i % 5 else (2, i % 3)) for i in range(40)]
    model.append(_plain("model", "scalar", "F32", ()))
    optim = [_plain("optim", f"state.{i}.exp_avg", "F32", (4, 2)) for i in range(6)]
    return [model + optim]


def _fsdp(world: int) -> list[list[LocalTensor]]:
    ranks: list[list[LocalTensor]] = [[] for _ in range(world)]
    bounds = {2: [0, 3, 8], 3: [0, 3, 5, 8]}[world]
    for i in range(4):
        for rank, piece in enumerate(_rows("model", f"blocks.{i}.weight", ("F32", "BF16")[i % 2], (8, 3), bounds)):
            ranks[rank].append(piece)
    cols = _columns("model", "proj.weight", "F32", (2, 6), [0, 2, 6] if world == 2 else [0, 2, 4, 6])
    for rank, piece in enumerate(cols[:world]):
        ranks[rank].append(piece)
    for rank in range(world):
        ranks[rank].append(_plain("model", "step", "I64", ()))
        ranks[rank].append(_plain("model", "norm.weight", "F32", (5,)))
        ranks[rank].extend(_plain(f"rng@rank{rank}", f"s{j}", "U8", (rank + j + 1,)) for j in range(2))
    return ranks


def _hsdp() -> list[list[LocalTensor]]:
    """Two shards, each on two ranks (one main, one replica), plus a tensor whose main piece is
    whole (one rank) with a replica, and replicated tensors held by a group of ranks."""
    ranks: list[list[LocalTensor]] = [[] for _ in range(4)]
    for i in range(3):
        main = _rows("model", f"w{i}", "F32", (6, 2), [0, 3, 6])
        replica = _rows("model", f"w{i}", "F32", (6, 2), [0, 3, 6], main=False)
        ranks[0].append(main[0])
        ranks[1].append(main[1])
        ranks[2].append(replica[0])
        ranks[3].append(replica[1])
    ranks[1].append(LocalTensor("model", "head", "BF16", (4,), (0,), (4,), sharded=True))
    ranks[3].append(LocalTensor("model", "head", "BF16", (4,), (0,), (4,), sharded=True, main=False))
    for rank in (2, 3):
        ranks[rank].extend(_plain("extra@group2", f"g{j}", "F32", (j + 1, 2)) for j in range(5))
    for rank in range(4):
        ranks[rank].extend(_plain("model", f"bias{j}", "F16", (7,)) for j in range(3))
    return ranks


def _frozen(world: int) -> list[list[LocalTensor]]:
    tensors = [_plain("model", f"base.{i}", "BF16", (4, 4), frozen=True) for i in range(6)]
    tensors += [_plain("model", f"lora.{i}", "F32", (4, 1), frozen=i == 0) for i in range(4)]
    tensors += [_plain("optim", f"lora.{i}.m", "F32", (4, 1)) for i in range(4)]
    return [list(tensors) for _ in range(world)]


# (name, locals_by_rank, max_shard_size, shared_files, separate_frozen)
PLAN_CASES: list[tuple[str, list[list[LocalTensor]], int, bool, bool]] = [
    ("one_rank_small_shards", _single_rank(), 64, True, False),
    ("one_rank_one_file", _single_rank(), 10**9, True, False),
    ("fsdp_2_rows", _fsdp(2), 10**9, True, False),
    ("fsdp_3_rows_small_shards", _fsdp(3), 100, True, False),
    ("fsdp_3_chunks", _fsdp(3), 100, False, False),
    ("hsdp_4", _hsdp(), 60, True, False),
    ("hsdp_4_chunks", _hsdp(), 10**9, False, False),
    ("frozen_2", _frozen(2), 80, True, True),
    ("frozen_1_not_separate", _frozen(1), 80, True, False),
    ("replicated_3", _frozen(3), 40, False, True),
]


def plan_json(plan: SavePlan) -> dict[str, Any]:
    """Everything a plan says, as JSON values (headers in hex)."""
    return {
        "world_size": plan.world_size,
        "files": [[f.component, f.file_name, f.size, f.frozen] for f in plan.files],
        "ranks": [
            {
                "rank": r.rank,
                "arena_size": r.arena_size,
                "pieces": [
                    [
                        p.file_name,
                        p.file_offset,
                        p.size,
                        p.arena_offset,
                        p.whole_file,
                        [_part_json(q) for q in p.parts],
                    ]
                    for p in r.pieces
                ],
            }
            for r in plan.ranks
        ],
        "tensors": {
            component: {key: [t.dtype, list(t.shape), [_chunk_json(c) for c in t.chunks]] for key, t in records.items()}
            for component, records in plan.tensors.items()
        },
    }


def _part_json(part: PiecePart) -> list[Any]:
    return [part.offset, part.nbytes, part.header.hex(), part.component, part.key, part.dtype, list(part.shape)]


def _chunk_json(chunk: ChunkRecord) -> list[Any]:
    return [chunk.file, chunk.start, chunk.end, list(chunk.offset), list(chunk.shape)]
