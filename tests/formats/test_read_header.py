"""read_header: the one function every load path reads a safetensors header with."""

from __future__ import annotations

import struct

import pytest

from ckptd.errors import CorruptCheckpointError
from ckptd.formats.safetensors import MAX_HEADER_SIZE, TensorEntry, build_header, read_header


def _file(count: int) -> bytes:
    entries = [TensorEntry(f"t{i}", "F32", (2,), 8 * i, 8 * i + 8) for i in range(count)]
    return build_header(entries) + bytes(8 * count)


class _Reads:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.calls: list[tuple[int, int]] = []

    def __call__(self, offset: int, length: int) -> bytes:
        self.calls.append((offset, length))
        return self.data[offset : offset + length]


def test_a_small_header_costs_one_read():
    data = _file(3)
    reads = _Reads(data)
    header = read_header(reads, len(data), "x.safetensors")
    assert reads.calls == [(0, len(data))]
    assert sorted(header.entries) == ["t0", "t1", "t2"]
    assert header.data_start + header.data_size == len(data)


def test_a_header_longer_than_the_prefetch_costs_a_second_read():
    data = _file(50)
    reads = _Reads(data)
    header = read_header(reads, len(data), "x.safetensors", prefetch=64)
    (length,) = struct.unpack("<Q", data[:8])
    assert reads.calls == [(0, 64), (8, length)]
    assert len(header.entries) == 50


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\x01\x02", "too short"),
        (struct.pack("<Q", 1000) + b"{}", "exceeds the file"),
        (struct.pack("<Q", MAX_HEADER_SIZE + 8) + bytes(16), "exceeds the file"),
    ],
)
def test_bad_prefixes_name_the_file(data, message):
    with pytest.raises(CorruptCheckpointError, match=rf"x\.safetensors: .*{message}"):
        read_header(_Reads(data), len(data), "x.safetensors")


def test_a_file_shorter_than_its_size_claims_is_truncated():
    data = _file(50)
    with pytest.raises(CorruptCheckpointError, match="truncated inside the safetensors header"):
        read_header(_Reads(data[:100]), len(data), "x.safetensors", prefetch=64)
