"""On-disk format: golden header bytes, every dtype, odd shapes, alignment, safetensors interop."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from conftest import assert_same

import ckptd
from ckptd.errors import CorruptCheckpointError
from ckptd.formats.safetensors import TensorEntry, build_header, parse_header
from ckptd.save.plan import LocalTensor, WriteItem, bucket_items, plan_save

safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

ALL_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    base = torch.randn(shape, dtype=torch.float32) * 3
    if dtype == torch.bool:
        return base > 0
    if dtype == torch.complex64:
        return torch.complex(base, -base)
    if not dtype.is_floating_point:
        return base.abs().to(torch.int64).to(dtype)
    return base.to(dtype)


def test_golden_header_bytes():
    local = [
        LocalTensor("model", "b", "F16", (2,), (0,), (2,)),
        LocalTensor("model", "a", "F32", (1, 2), (0, 0), (1, 2)),
    ]
    plan = plan_save([local], 2**30)
    (file,) = plan.files
    body = (
        b'{"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[1,2],"data_offsets":[0,8]},'
        b'"b":{"dtype":"F16","shape":[2],"data_offsets":[8,12]}}'
    )
    body += b" " * (-len(body) % 8)
    header = struct.pack("<Q", len(body)) + body
    assert file.file_name == "model-00001-of-00001.safetensors" and file.size == len(header) + 12
    (piece,) = plan.ranks[0].pieces
    assert piece.whole_file and piece.file_offset == 0 and piece.size == file.size
    assert piece.parts[0].header == header
    assert [p.key for p in piece.parts[1:]] == ["a", "b"], "wider dtypes first keeps every tensor aligned"
    record = plan.tensors["model"]["a"]
    assert (record.file, record.start, record.end) == (file.file_name, len(header), len(header) + 8)


def test_bucketing_follows_hf_rules():
    items = [WriteItem("m", f"t{i}", "U8", (n,)) for i, n in enumerate([4, 4, 10, 1, 1])]
    buckets = bucket_items(items, 8)
    assert [[i.key for i in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3", "t4"]]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_round_trips_and_reads_with_safetensors(checkpointer, dtype):
    tensors = {
        "matrix": sample(dtype, (5, 7)),
        "scalar": sample(dtype, ()),
        "empty": sample(dtype, (0, 3)),
        "view": sample(dtype, (6, 4)).t()[1:3],
    }
    result = checkpointer.save(1, {"model": tensors})
    assert_same({k: v.contiguous() for k, v in tensors.items()}, checkpointer.load(1)["model"])
    shard = os.path.join(result.path, "model-00001-of-00001.safetensors")
    with safe_open(shard, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        for key, tensor in tensors.items():
            assert_same(tensor.contiguous(), f.get_tensor(key), key)


def test_mixed_dtypes_are_aligned_and_load_file_reads_shards(checkpointer):
    tensors = {
        "a_u8": torch.arange(3, dtype=torch.uint8),
        "b_f64": torch.randn(3, dtype=torch.float64),
        "c_bf16": torch.randn(5).bfloat16(),
        "d_i32": torch.arange(7, dtype=torch.int32),
    }
    result = checkpointer.save(1, {"model": tensors})
    path = os.path.join(result.path, "model-00001-of-00001.safetensors")
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    assert (8 + length) % 8 == 0
    for key, info in header.items():
        if key != "__metadata__":
            assert info["data_offsets"][0] % tensors[key].element_size() == 0, key
    assert_same(tensors, load_file(path))


def test_manifest_golden_shape(checkpointer):
    result = checkpointer.save(2, {"model": {"w": torch.zeros(2, 2)}, "data": {"pos": 1}}, metadata={"k": "v"})
    with open(os.path.join(result.path, "checkpoint_manifest.json")) as f:
        body = json.load(f)
    assert set(body) == {
        "format",
        "format_version",
        "library_version",
        "step",
        "created_utc",
        "world_size",
        "state_file",
        "components",
        "files",
        "timings",
        "metadata",
        "metrics",
        "checksum",
    }
    assert body["components"]["model"] == {
        "kind": "safetensors",
        "sharing": "replicated",
        "index": "model.safetensors.index.json",
        "tied": [],
        "tensors": {
            "w": {
                "dtype": "F32",
                "shape": [2, 2],
                "file": "model-00001-of-00001.safetensors",
                "offsets": [
                    body["components"]["model"]["tensors"]["w"]["offsets"][0],
                    body["components"]["model"]["tensors"]["w"]["offsets"][0] + 16,
                ],
            }
        },
    }
    assert body["components"]["data"] == {
        "kind": "state",
        "sharing": "replicated",
        "index": None,
        "tied": [],
        "tensors": {},
    }
    assert body["created_utc"].endswith("Z") and body["library_version"] == ckptd.__version__
    assert all(len(f["crc32c"]) == 8 for f in body["files"].values())
    with open(os.path.join(result.path, "state.json")) as f:
        assert json.load(f)["components"]["data"] == {"pos": 1}


def header_bytes(entries: dict) -> tuple[bytes, bytes]:
    body = json.dumps(entries).encode()
    return struct.pack("<Q", len(body)), body


@pytest.mark.parametrize(
    "entries, message",
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, "do not match"),
        ({"a": {"dtype": "XX", "shape": [1], "data_offsets": [0, 1]}}, "unknown dtype"),
        (
            {
                "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]},
            },
            "overlap",
        ),
        ({"a": {"dtype": "U8", "shape": [64], "data_offsets": [0, 64]}}, "truncated"),
    ],
)
def test_header_parser_rejects_malformed_headers(entries, message):
    prefix, body = header_bytes(entries)
    with pytest.raises(CorruptCheckpointError, match=message):
        parse_header(prefix, body, 8 + len(body) + 16, "x.safetensors")


def test_header_parser_rejects_bad_json():
    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        parse_header(struct.pack("<Q", 3), b"{no", None, "x.safetensors")


def test_built_header_parses_back():
    entries = [TensorEntry("w", "BF16", (3, 2), 0, 12), TensorEntry("s", "I64", (), 12, 20)]
    raw = build_header(entries)
    parsed = parse_header(raw[:8], raw[8:], len(raw) + 20, "x")
    assert parsed.data_start == len(raw)
    assert parsed.entries["w"] == entries[0] and parsed.entries["s"] == entries[1]
