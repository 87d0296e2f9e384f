"""The manifest, its checksummed canonical form and the HF index are what ``json.dumps`` writes,
byte for byte.

They are written without ``json`` encoding a dict per tensor (seconds for 100,000 tensors); these
tests compare the fast writers with ``json.dumps`` on varied records: whole and chunked tensors,
0-d and empty shapes, keys and file names that need escaping and sort differently, empty maps,
and user metadata that looks like the writers' placeholders.
"""

from __future__ import annotations

import json
import random

from ckptd.formats.checksum import crc32c, format_crc
from ckptd.formats.manifest import (
    ChunkRecord,
    ComponentRecord,
    FileRecord,
    Manifest,
    TensorRecord,
    _canonical,
    hf_index,
)
from ckptd.formats.manifest_text import canonical_text, indented_text


def _tensors(rng: random.Random) -> dict[str, TensorRecord]:
    out = {}
    for i in range(rng.randint(0, 6)):
        shape = tuple(rng.randint(0, 4) for _ in range(rng.randint(0, 3)))
        key = rng.choice(["a", 'é"x', "k\\n", "\u2603", "w\n", "B", "a.b", "\U0001f600"]) + str(i)
        if rng.random() < 0.7:
            file = rng.choice(["m.safetensors", "ü/x.safetensors", "3f/model-00001-of-00002.safetensors"])
            record = TensorRecord.whole(rng.choice(["F32", "BF16"]), shape, file, 8, 20)
        else:
            chunks = (ChunkRecord("f", 0, 8, (0,), (2,)), ChunkRecord("g", 0, 8, (2,), (2,)))
            record = TensorRecord("F32", (4,), chunks)
        out[key] = record
    return out


def test_manifest_texts_are_json_dumps_indented_and_canonical():
    rng = random.Random(0)
    for _ in range(300):
        tensors = {f"c{c}": _tensors(rng) for c in rng.sample(range(5), rng.randint(0, 3))}
        outline = {
            "format": "ckptd",
            "step": 1,
            "components": {
                name: {
                    "kind": "safetensors",
                    "sharing": "replicated",
                    "index": None,
                    "tied": [["a", "b"]],
                    "tensors": None,
                }
                for name in tensors
            },
            "files": {"f": {"size": 1, "crc32c": "00000000"}},
            "metadata": {"x": [1, {"y": None}], "tensors": "tensors", "z": '"tensors 0"'},
        }
        if rng.random() < 0.5:
            outline["checksum"] = "00000000"
        body = {
            **outline,
            "components": {
                name: {**c, "tensors": {k: r.to_json() for k, r in tensors[name].items()}}
                for name, c in outline["components"].items()
            },
        }
        assert indented_text(outline, tensors) == json.dumps(body, indent=1, ensure_ascii=False)
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        assert canonical_text(outline, tensors) == canonical


def test_manifest_checksum_covers_the_canonical_json_of_its_body():
    tensors = {
        'w"é': TensorRecord.whole("F32", (2,), "m.safetensors", 8, 16),
        "b": TensorRecord.whole("BF16", (), "m.safetensors", 16, 18),
        "A": TensorRecord(
            "F32",
            (4,),
            (ChunkRecord("m.safetensors", 24, 32, (0,), (2,)), ChunkRecord("n.safetensors", 0, 8, (2,), (2,))),
        ),
    }
    files = {"m.safetensors": FileRecord(64, "00000000"), "n.safetensors": FileRecord(8, "00000000")}
    manifest = Manifest(
        step=3,
        created_utc="2026-11-23T00:00:00Z",
        world_size=1,
        library_version="0",
        components={"model": ComponentRecord("safetensors", tensors)},
        files=files,
    )
    text = manifest.to_json()
    body = json.loads(text)
    assert body["checksum"] == format_crc(crc32c(_canonical(body)))
    assert Manifest.from_json(text, "m").components["model"].tensors == tensors


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
