"""The manifest and HF index texts are what ``json.dumps`` with indentation writes, byte for byte.

Both are written without the standard library's indented encoder (pure Python, seconds for
100,000 tensors); these tests compare the fast writers with it on varied records: whole and
chunked tensors, 0-d and empty shapes, keys and file names that need escaping, empty maps.
"""

from __future__ import annotations

import json
import random

from ckptd.formats.manifest import ChunkRecord, TensorRecord, _indented, hf_index


def _tensors(rng: random.Random) -> dict[str, dict]:
    out = {}
    for i in range(rng.randint(0, 6)):
        shape = tuple(rng.randint(0, 4) for _ in range(rng.randint(0, 3)))
        key = rng.choice(["a", 'é"x', "k\\n", "\u2603", "w\n"]) + str(i)
        if rng.random() < 0.7:
            file = rng.choice(["m.safetensors", "ü/x.safetensors", "3f/model-00001-of-00002.safetensors"])
            record = TensorRecord.whole(rng.choice(["F32", "BF16"]), shape, file, 8, 20)
        else:
            chunks = (ChunkRecord("f", 0, 8, (0,), (2,)), ChunkRecord("g", 0, 8, (2,), (2,)))
            record = TensorRecord("F32", (4,), chunks)
        out[key] = record.to_json()
    return out


def test_manifest_text_is_json_dumps_indent_1():
    rng = random.Random(0)
    for _ in range(200):
        components = {
            f"c{c}": {
                "kind": "safetensors",
                "sharing": "replicated",
                "index": None,
                "tied": [["a", "b"]] if c else [],
                "tensors": _tensors(rng),
            }
            for c in range(rng.randint(0, 3))
        }
        body = {
            "format": "ckptd",
            "step": 1,
            "components": components,
            "files": {"f": {"size": 1, "crc32c": "00000000"}},
            "metadata": {"x": [1, {"y": None}], "tensors": "tensors"},
            "checksum": "00000000",
        }
        assert _indented(body) == json.dumps(body, indent=1, ensure_ascii=False)


def test_whole_records_are_written_as_their_json():
    record = TensorRecord.whole("BF16", (2, 0, 3), "model.safetensors", 64, 64)
    assert record == TensorRecord("BF16", (2, 0, 3), (ChunkRecord("model.safetensors", 64, 64, (0, 0, 0), (2, 0, 3)),))
    assert record.is_whole and record.chunks[0].offset == (0, 0, 0)


def test_hf_index_text_is_json_dumps_indent_2():
    cases = [({}, None), ({"a": "x.safetensors", 'é"': "ü"}, {"param_sharing": [["a", "b"]]}), ({"k": "3f/f"}, {})]
    for weight_map, extra in cases:
        metadata = {"total_size": 12, **(extra or {})}
        expected = json.dumps({"metadata": metadata, "weight_map": weight_map}, indent=2, ensure_ascii=False)
        assert hf_index(weight_map, 12, extra) == expected.encode()
