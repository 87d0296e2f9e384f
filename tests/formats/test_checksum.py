"""CRC32C (``ckptd.formats.checksum``): the fast implementation (fastcrc) is the one in use, and it
agrees bit for bit with an independent one (the ``crc32c`` package) on the standard check value,
on every length around the SIMD block sizes, at unaligned offsets, chained piece by piece, and
on memoryviews of a mapping (how the writer and the loads call it)."""

from __future__ import annotations

import mmap
import random

import crc32c as reference
import pytest

from ckptd import _crc32c
from ckptd.formats.checksum import crc32c, crc32c_concat, crc32c_of_view, crc32c_overlay, crc32c_spread, crc32c_zeros


def test_the_fast_implementation_is_in_use():
    fastcrc = pytest.importorskip("fastcrc.crc32")
    assert _crc32c._IMPLEMENTATION is fastcrc.iscsi


def test_the_standard_check_value():
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0


def test_every_length_around_the_block_sizes_and_unaligned_offsets_agree_with_an_independent_implementation():
    data = random.Random(7).randbytes(1 << 20)
    view = memoryview(data)
    lengths = sorted({*range(0, 300), *(b + d for b in (512, 4096, 16384, 65536, 1 << 20) for d in (-1, 0, 1))})
    for length in lengths:
        for offset in (0, 1, 3, 7, 64):
            if offset + length <= len(data):
                piece = view[offset : offset + length]
                assert crc32c(piece) == reference.crc32c(piece), (offset, length)


def test_a_running_value_chained_piece_by_piece_equals_the_whole():
    data = random.Random(8).randbytes(3 * 1024 * 1024 + 17)
    whole = reference.crc32c(data)
    rng = random.Random(9)
    value, offset = 0, 0
    while offset < len(data):
        step = rng.choice((1, 13, 4096, 65537, 1 << 20))
        value = crc32c(data[offset : offset + step], value)
        offset += step
    assert value == whole
    pieces = [data[i : i + 100_003] for i in range(0, len(data), 100_003)]
    assert crc32c_concat((crc32c(p), len(p)) for p in pieces) == whole


def test_a_mapping_checksummed_in_chunks_as_the_writer_does():
    data = random.Random(10).randbytes(5 * 1024 * 1024 + 5)
    mapping = mmap.mmap(-1, len(data))
    try:
        mapping[:] = data
        view = memoryview(mapping)
        assert crc32c_of_view(view, chunk=1 << 20) == reference.crc32c(data)
        view.release()
    finally:
        mapping.close()


def test_zeros_without_the_bytes():
    for length in (0, 1, 7, 4096, 123_457, 1 << 22):
        assert crc32c_zeros(length) == reference.crc32c(bytes(length)), length


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 7])
def test_files_written_in_parts_by_several_ranks_combine_from_one_spread_per_rank(ranks):
    """A file cut into runs dealt to ``ranks`` owners at random: each owner's runs fold into one
    spread, and the spreads (odd and even counts) give the CRC32C of the whole file."""
    rng = random.Random(ranks)
    for _ in range(40):
        size = rng.randrange(1, 20_000)
        cuts = sorted(rng.sample(range(1, size), min(size - 1, rng.randrange(0, 16)))) if size > 1 else []
        bounds = [0, *cuts, size]
        data = rng.randbytes(size)
        owners = [rng.randrange(ranks) for _ in bounds[1:]]
        spreads = []
        for owner in range(ranks):
            runs = [
                (a, crc32c(data[a:b]), b - a)
                for a, b, o in zip(bounds[:-1], bounds[1:], owners, strict=True)
                if o == owner
            ]
            if runs:
                spreads.append(crc32c_spread(runs))
        assert crc32c_overlay(spreads, size) == reference.crc32c(data)


def test_a_spread_refuses_runs_out_of_order_and_an_overlay_parts_beyond_the_file():
    with pytest.raises(ValueError, match="overlap or are out of order"):
        crc32c_spread([(10, 0, 5), (12, 0, 5)])
    assert crc32c_spread([]) == (0, 0)
    with pytest.raises(ValueError, match="beyond"):
        crc32c_overlay([(0, 11)], 10)
