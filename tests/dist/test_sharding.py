"""Sharding geometry, validation, CRC32C combination and sharing-pattern names (single process)."""

from __future__ import annotations

import enum
import itertools
import os
import random

import pytest
import torch

from ckptd.dist.coverage import ChunkInfo, validate_sharding
from ckptd.dist.group import Sharing, normalize_sharing
from ckptd.dist.sharding import Box, ShardedTensor, intersect, paired_runs
from ckptd.errors import ConfigError, ShardingError
from ckptd.formats.checksum import crc32c, crc32c_combine, crc32c_concat


def test_from_rank_offsets_matches_megatron_semantics():
    data = torch.ones(2, 3)
    piece = ShardedTensor.from_rank_offsets("w", data, (0, 1, 4), (1, 2, 3))
    assert piece.global_shape == (8, 9) and piece.global_offset == (2, 6) and piece.local_shape == (2, 3)
    with pytest.raises(ShardingError, match="rank offset 4"):
        ShardedTensor.from_rank_offsets("w", data, (0, 4, 4))
    with pytest.raises(ShardingError, match="exceeds the global size"):
        ShardedTensor("w", data, (2, 3), (1, 0))


@pytest.mark.parametrize(
    "source",
    [Box((0, 0), (6, 10)), Box((0, 5), (6, 5)), Box((2, 0), (3, 10)), Box((1, 2), (4, 7))],
)
@pytest.mark.parametrize(
    "target",
    [Box((0, 0), (6, 10)), Box((3, 0), (3, 10)), Box((0, 0), (6, 5)), Box((2, 3), (2, 2))],
)
def test_paired_runs_copy_exactly_the_overlap(source, target):
    whole = torch.arange(60).reshape(6, 10)
    part = intersect(source, target)
    if part is None:
        return
    src = whole[source.slices()].contiguous().reshape(-1)
    dst = torch.full((target.numel,), -1, dtype=whole.dtype)
    copied = 0
    for s, d, n in paired_runs(source, target, part):
        dst[d : d + n] = src[s : s + n]
        copied += n
    assert copied == part.numel
    dst = dst.reshape(target.shape)
    assert torch.equal(dst[part.slices(target.offset)], whole[part.slices()])
    outside = torch.ones(target.shape, dtype=torch.bool)
    outside[part.slices(target.offset)] = False
    assert bool((dst[outside] == -1).all()), "nothing outside the overlap is touched"


def chunk(rank, offset, shape, main=True, global_shape=(4, 4), dtype="F32"):
    return ChunkInfo(rank, "w", dtype, global_shape, Box(offset, shape), main)


def test_validate_sharding_accepts_exact_covers_and_ignores_replicas():
    validate_sharding([chunk(0, (0, 0), (2, 4)), chunk(1, (2, 0), (2, 4)), chunk(2, (0, 0), (2, 4), main=False)])
    validate_sharding([chunk(r, (r // 2 * 2, r % 2 * 2), (2, 2)) for r in range(4)])


@pytest.mark.parametrize(
    ("chunks", "message"),
    [
        ([chunk(0, (0, 0), (2, 4))], r"cover 8 of 16 elements; element \[2, 0\]"),
        ([chunk(0, (0, 0), (3, 4)), chunk(1, (2, 0), (2, 4))], "rank 0 and rank 1 overlap at offset"),
        # a long piece overlapping one several pieces later (the sweep must still compare them)
        (
            [chunk(0, (0, 0), (4, 1)), chunk(1, (0, 1), (1, 3)), chunk(2, (1, 1), (1, 3)), chunk(3, (3, 0), (1, 1))],
            r"rank 0 and rank 3 overlap at offset \[3, 0\]",
        ),
        ([chunk(1, (0, 0), (0, 4)), chunk(0, (0, 0), (4, 4)), chunk(2, (1, 0), (1, 4))], "rank 0 and rank 2 overlap"),
        ([chunk(0, (0, 0), (2, 4)), chunk(1, (2, 0), (2, 4), global_shape=(4, 5))], "disagree"),
        ([chunk(0, (0, 0), (2, 4)), chunk(1, (2, 0), (2, 4), dtype="BF16")], "disagree"),
    ],
)
def test_validate_sharding_names_gaps_overlaps_and_mismatches(chunks, message):
    with pytest.raises(ShardingError, match=message):
        validate_sharding(chunks)


def test_crc32c_combine_equals_the_checksum_of_the_whole():
    for sizes in [(0, 5), (1, 1), (1000, 4096), (7, 123457)]:
        a, b = os.urandom(sizes[0]), os.urandom(sizes[1])
        assert crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)
    pieces = [os.urandom(n) for n in (10, 0, 300, 5)]
    value = crc32c(pieces[0])
    for piece in pieces[1:]:
        value = crc32c_combine(value, crc32c(piece), len(piece))
    assert value == crc32c(b"".join(pieces))


def test_crc32c_combine_moves_past_every_power_of_two_and_mixed_lengths():
    """Every zero-byte operator the combine uses (one per set bit of the length, up to 64 MiB
    here) and lengths with many set bits, against the CRC32C of the bytes themselves."""
    rng = random.Random(5)
    head = os.urandom(29)
    zeros = bytes(1 << 26)
    lengths = (
        [1 << bit for bit in range(27)]
        + [(1 << 26) - 1, 0x2AAAAAA, 0x1555555]
        + [rng.randrange(1, 1 << 26) for _ in range(8)]
    )
    for length in lengths:
        tail = zeros[:length] if length > 4096 else os.urandom(length)
        expected = crc32c(tail, crc32c(head))
        assert crc32c_combine(crc32c(head), crc32c(tail), length) == expected, length


def test_crc32c_concat_folds_runs_in_order():
    runs = [os.urandom(n) for n in (0, 10, 0, 300, 5)]
    assert crc32c_concat((crc32c(run), len(run)) for run in runs) == crc32c(b"".join(runs))
    assert crc32c_concat((crc32c(run), len(run)) for run in reversed(runs)) == crc32c(b"".join(reversed(runs)))
    assert crc32c_concat([]) == crc32c(b"") == 0


class SharingPattern(enum.Enum):  # Forgather's enum, as user code would have it
    GLOBAL = "global"
    PER_RANK = "per_rank"
    REPLICATED = "replicated"
    PER_GROUP = "per_group"


def test_sharing_pattern_names_are_accepted():
    for value, expected in itertools.chain(
        [("REPLICATED", Sharing.REPLICATED), ("sharded", Sharing.REPLICATED), ("PER_RANK", Sharing.PER_RANK)],
        [(SharingPattern.GLOBAL, Sharing.GLOBAL), (SharingPattern.PER_RANK, Sharing.PER_RANK)],
    ):
        assert normalize_sharing(value)[0] == expected
    assert normalize_sharing((SharingPattern.PER_GROUP, "g")) == (Sharing.PER_GROUP, "g")
    with pytest.raises(ConfigError, match="needs a process group"):
        normalize_sharing("per_group")
    with pytest.raises(ConfigError, match="unknown sharing"):
        normalize_sharing("everywhere")
