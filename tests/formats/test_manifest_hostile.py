"""Regression tests for issue 13, items 6-8: hostile manifests, state files and indexes; and for
items 11-12 of the adversarial pass: crafted manifests that pass their checksum.

One bad manifest must not break listing the root; an edited manifest must not load; every
malformed input raises a ckptd error (CorruptCheckpointError on load, UnsupportedValueError on save).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random

import pytest
import torch
from conftest import assert_same

import ckptd
from ckptd import cli
from ckptd.catalog import latest_checkpoint, list_checkpoints
from ckptd.errors import (
    CkptdError,
    CorruptCheckpointError,
    KeyMismatchError,
    UnsafeCheckpointError,
    UnsupportedValueError,
)
from ckptd.formats import manifest as manifest_module
from ckptd.formats.checksum import crc32c, format_crc
from ckptd.formats.json_files import parse_json, read_small_file
from ckptd.formats.manifest import ChunkRecord, ComponentRecord, FileRecord, Manifest, TensorRecord
from ckptd.load.reader import CheckpointReader
from ckptd.retention import apply_retention
from ckptd.storage import LocalStorage

MANIFEST = "checkpoint_manifest.json"


def read_manifest_json(path: str) -> dict:
    with open(os.path.join(path, MANIFEST)) as f:
        return json.load(f)


def write_legacy_manifest(path: str, body: dict) -> None:
    """Write a manifest as ckptd wrote them before the self-checksum (no ``checksum`` field)."""
    body = {k: v for k, v in body.items() if k != "checksum"}
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump(body, f, indent=1)


def replace_listed_file(path: str, name: str, data: bytes) -> None:
    """Replace a file and fix its size and CRC in the manifest, so only its content is hostile."""
    with open(os.path.join(path, name), "wb") as f:
        f.write(data)
    body = read_manifest_json(path)
    body["files"][name] = {"size": len(data), "crc32c": format_crc(crc32c(data))}
    write_legacy_manifest(path, body)


@pytest.fixture
def saved(checkpointer):
    state = {"model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, "data": {"pos": 7}}
    result = checkpointer.save(1, state)
    return checkpointer, result.path, state


# ---- item 6: one bad manifest under the root ---------------------------------------------------


@pytest.mark.timeout(60)
def test_bad_sibling_manifests_are_skipped_and_named(checkpointer, caplog, capsys):
    for step in (1, 2):
        checkpointer.save(step, {"model": {"w": torch.full((2,), float(step))}})
    good = read_manifest_json(checkpointer.path_for(2))
    bad = {}
    for step in (3, 4, 5, 6):
        bad[step] = checkpointer.path_for(step)
        os.makedirs(bad[step])
    infinite = dict(good, world_size=float("inf"), step=3)  # json writes Infinity
    write_legacy_manifest(bad[3], infinite)
    os.mkfifo(os.path.join(bad[4], MANIFEST))  # opening it for reading would block
    os.symlink("/dev/zero", os.path.join(bad[5], MANIFEST))  # reading it would never end
    with open(os.path.join(bad[6], MANIFEST), "w") as f:
        f.write("[" * 200_000 + "]" * 200_000)

    with caplog.at_level(logging.WARNING, logger="ckptd.catalog"):
        assert checkpointer.steps() == [1, 2]
        assert checkpointer.latest_step() == 2
        storage = LocalStorage()
        assert [info.step for info in list_checkpoints(storage, checkpointer.root)] == [1, 2]
        assert latest_checkpoint(storage, checkpointer.root).step == 2
        assert cli.main(["ls", checkpointer.root]) == 0
        removed = apply_retention(storage, checkpointer.root, keep_last=1)
    assert removed == [checkpointer.path_for(1)]
    listed = capsys.readouterr().out
    committed = [line for line in listed.splitlines() if " committed " in line]
    assert any(line.endswith("checkpoint-2") for line in committed), listed
    bad_names = tuple(f"checkpoint-{step}" for step in (3, 4, 5, 6))
    assert not any(line.endswith(bad_names) for line in committed), listed
    for step in (3, 4, 5, 6):
        assert os.path.basename(bad[step]) in caplog.text, step
        with pytest.raises(CkptdError):
            checkpointer.load(step)


@pytest.mark.timeout(60)
def test_index_symlinked_to_dev_zero_or_fifo_is_refused(tmp_path):
    zero = tmp_path / "zero"
    zero.mkdir()
    os.symlink("/dev/zero", zero / "model.safetensors.index.json")
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        ckptd.load_checkpoint(str(zero))
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "model.safetensors.index.json")
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        CheckpointReader.open(str(fifo))


def test_manifest_symlink_is_refused(saved, tmp_path):
    checkpointer, path, _ = saved
    elsewhere = tmp_path / "elsewhere.json"
    os.rename(os.path.join(path, MANIFEST), elsewhere)
    os.symlink(elsewhere, os.path.join(path, MANIFEST))
    with pytest.raises(UnsafeCheckpointError, match="symlink"):
        CheckpointReader.open(path)
    assert checkpointer.steps() == []


def test_a_checkpoint_directory_linked_from_outside_the_root_is_not_followed(checkpointer, tmp_path, caplog):
    """A ``checkpoint-N`` that is a symlink (here to a committed checkpoint outside the root) is
    not one of the root's checkpoints: not listed, not the latest, not loaded by step, never
    deleted through the link by retention; loading the link by its own path still follows it."""
    state = {"model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}}
    checkpointer.save(1, state)
    outside = ckptd.Checkpointer(str(tmp_path / "outside"))
    try:
        outside.save(9, {"model": {"w": torch.ones(2, 3)}})
    finally:
        outside.close()
    link = checkpointer.path_for(9)
    os.symlink(str(tmp_path / "outside" / "checkpoint-9"), link)

    with caplog.at_level(logging.WARNING, logger="ckptd.catalog"):
        assert checkpointer.steps() == [1]
        assert checkpointer.latest_step() == 1
        assert latest_checkpoint(LocalStorage(), checkpointer.root).step == 1
        loaded = checkpointer.load("latest")
        assert_same(loaded["model"]["w"], state["model"]["w"])
        with pytest.raises(UnsafeCheckpointError, match="symlink"):
            checkpointer.load(9)
        assert apply_retention(LocalStorage(), checkpointer.root, keep_last=1) == []
    assert "a symlink" in caplog.text and link in caplog.text
    assert os.path.islink(link)
    assert os.path.isfile(tmp_path / "outside" / "checkpoint-9" / MANIFEST)
    followed = checkpointer.load(link)
    assert_same(followed["model"]["w"], torch.ones(2, 3))


def test_small_file_size_cap(tmp_path):
    path = tmp_path / "big.json"
    path.write_bytes(b"[" + b" " * 4096 + b"]")
    with pytest.raises(CorruptCheckpointError, match="limit"):
        read_small_file(LocalStorage(), str(path), limit=1024)
    assert read_small_file(LocalStorage(), str(path), limit=8192).startswith(b"[")


def test_parse_json_depth_and_constants():
    assert parse_json(b'{"a": ["[[[[", {"b": "\\\\\\"]]"}]}', "x") == {"a": ["[[[[", {"b": '\\"]]'}]}
    with pytest.raises(CorruptCheckpointError, match="nested"):
        parse_json(b"[" * 600 + b"]" * 600, "x")
    with pytest.raises(CorruptCheckpointError, match="NaN"):
        parse_json(b"[NaN]", "x")
    assert parse_json(b"[Infinity]", "x", allow_constants=True) == [float("inf")]


# ---- item 7: the manifest checks itself ---------------------------------------------------------


def test_editing_the_manifest_dtype_is_caught_on_load_and_verify(saved):
    checkpointer, path, _ = saved
    with open(os.path.join(path, MANIFEST)) as f:
        text = f.read()
    assert '"F32"' in text and '"checksum"' in text
    with open(os.path.join(path, MANIFEST), "w") as f:
        f.write(text.replace('"F32"', '"I32"'))
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        checkpointer.load(1)
    assert cli.main(["verify", path]) != 0
    assert checkpointer.steps() == []


def test_manifest_without_checksum_still_loads(saved):
    checkpointer, path, state = saved
    write_legacy_manifest(path, read_manifest_json(path))
    assert "checksum" not in read_manifest_json(path)
    loaded = checkpointer.load(1)
    assert_same(state["model"], loaded["model"])
    assert loaded["data"] == {"pos": 7}
    assert cli.main(["verify", path]) == 0


def test_reindented_manifest_keeps_its_checksum_valid(saved):
    checkpointer, path, state = saved
    body = read_manifest_json(path)
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump(body, f, indent=4, sort_keys=True)
    assert_same(state["model"], checkpointer.load(1)["model"])


# ---- item 8: every malformed input raises a ckptd error -----------------------------------------


def test_component_index_that_is_not_a_string(saved):
    checkpointer, path, _ = saved
    body = read_manifest_json(path)
    body["components"]["model"]["kind"] = "torch_bin"
    body["components"]["model"]["index"] = 5
    write_legacy_manifest(path, body)
    with pytest.raises(CorruptCheckpointError, match="index"):
        checkpointer.load(1)


def test_shape_beyond_any_tensor(saved):
    checkpointer, path, _ = saved
    body = read_manifest_json(path)
    tensor = body["components"]["model"]["tensors"]["w"]
    tensor["shape"] = [2**70, 0]
    tensor["offsets"] = [tensor["offsets"][0], tensor["offsets"][0]]
    write_legacy_manifest(path, body)
    with pytest.raises(CorruptCheckpointError, match="out of range"):
        checkpointer.load(1)


@pytest.mark.parametrize(
    "tree",
    [
        {"__ckptd__": "tuple", "items": 5},
        {"__ckptd__": "dict", "items": [[{"a": 1}, 2]]},
        {"__ckptd__": "device", "value": "no-such-device"},
        {"__ckptd__": "dtype", "value": "load"},
        {"__ckptd__": "size", "items": [[1]]},
        {"__ckptd__": "bytes", "b64": "!!!"},
        {"__ckptd__": "tensor", "key": ["w"]},
        {"__ckptd__": "from-the-future"},
    ],
    ids=["items-5", "unhashable-key", "device", "dtype-not-dtype", "size-of-lists", "b64", "key-list", "tag"],
)
def test_malformed_state_tree(saved, tree):
    checkpointer, path, _ = saved
    data = json.dumps({"format": "ckptd-state", "version": 1, "components": {"data": {"pos": tree}}}).encode()
    replace_listed_file(path, "state.json", data)
    with pytest.raises(CorruptCheckpointError):
        checkpointer.load(1)


def test_deep_state_file(saved):
    checkpointer, path, _ = saved
    deep = b"[" * 200_000 + b"]" * 200_000
    data = b'{"format": "ckptd-state", "version": 1, "components": {"data": ' + deep + b"}}"
    replace_listed_file(path, "state.json", data)
    with pytest.raises(CorruptCheckpointError, match="nested"):
        checkpointer.load(1)


def test_state_tree_too_deep_for_python_is_corrupt_not_recursion(saved):
    checkpointer, path, _ = saved
    deep: object = 1
    for _ in range(150):
        deep = {"__ckptd__": "tuple", "items": [deep]}  # 300 JSON levels, within the parser's limit
    data = json.dumps({"format": "ckptd-state", "version": 1, "components": {"data": {"pos": deep}}}).encode()
    replace_listed_file(path, "state.json", data)
    try:
        loaded = checkpointer.load(1)
    except CorruptCheckpointError:
        return
    value = loaded["data"]["pos"]
    for _ in range(150):
        assert isinstance(value, tuple)
        value = value[0]
    assert value == 1


def test_deep_dict_on_save_is_unsupported(checkpointer):
    deep: dict = {}
    node = deep
    for _ in range(5000):
        node["x"] = {}
        node = node["x"]
    with pytest.raises(UnsupportedValueError, match="nested"):
        checkpointer.save(1, {"data": deep})
    assert checkpointer.steps() == []
    shallow: dict = {}
    node = shallow
    for _ in range(50):
        node["x"] = {}
        node = node["x"]
    checkpointer.save(2, {"data": shallow})
    assert checkpointer.load(2)["data"] == shallow


def test_param_sharing_that_is_not_a_list(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    safetensors_torch.save_file({"w": torch.ones(2)}, str(tmp_path / "model-00001-of-00001.safetensors"))
    index = {"metadata": {"total_size": 8, "param_sharing": 5}, "weight_map": {"w": "model-00001-of-00001.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpointError, match="param_sharing"):
        ckptd.load_checkpoint(str(tmp_path))


def test_param_sharing_metadata_that_is_not_json(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file({"w": torch.ones(2)}, str(path), metadata={"param_sharing": "[[oops"})
    with pytest.raises(CorruptCheckpointError, match="param_sharing"):
        CheckpointReader.open(str(path))


def test_index_that_is_not_json(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(CorruptCheckpointError, match="index"):
        ckptd.load_checkpoint(str(tmp_path))


@pytest.mark.timeout(60)
def test_shard_that_is_a_fifo_is_refused(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"w": "model-00001-of-00001.safetensors"}})
    )
    os.mkfifo(tmp_path / "model-00001-of-00001.safetensors")  # opening it would block forever
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        ckptd.load_checkpoint(str(tmp_path))


def test_metadata_that_json_cannot_hold_is_unsupported_on_save(checkpointer):
    with pytest.raises(UnsupportedValueError, match="metadata"):
        checkpointer.save(1, {"model": {"w": torch.ones(1)}}, metadata={"x": object()})
    deep: object = 1
    for _ in range(600):
        deep = [deep]
    with pytest.raises(UnsupportedValueError, match="metrics"):
        checkpointer.save(2, {"model": {"w": torch.ones(1)}}, metrics={"x": deep})
    assert checkpointer.steps() == []
    checkpointer.save(3, {"model": {"w": torch.ones(1)}}, metrics={"loss": float("nan")})
    assert checkpointer.manifest(3).metrics["loss"] != checkpointer.manifest(3).metrics["loss"]  # NaN kept


def test_size_limit_comes_from_the_environment(saved, monkeypatch):
    checkpointer, path, state = saved
    monkeypatch.setenv("CKPTD_MAX_JSON_BYTES", "100")
    with pytest.raises(CorruptCheckpointError, match="CKPTD_MAX_JSON_BYTES"):
        checkpointer.load(1)
    assert checkpointer.steps() == []
    monkeypatch.setenv("CKPTD_MAX_JSON_BYTES", "lots")
    with pytest.raises(ckptd.errors.ConfigError, match="CKPTD_MAX_JSON_BYTES"):
        read_small_file(LocalStorage(), os.path.join(path, MANIFEST))
    monkeypatch.delenv("CKPTD_MAX_JSON_BYTES")
    assert_same(state["model"], checkpointer.load(1)["model"])


# ---- adversarial pass, items 11-12: crafted manifests that pass their checksum -------------------
#
# Each manifest below is re-signed (its checksum recomputed as ckptd computes it), so only the
# checks behind the checksum stand between it and a load.  Before they existed these loads
# returned uninitialised memory or another key's tensor without an error.


def write_signed_manifest(path: str, body: dict) -> None:
    """Write ``body`` with a valid self-checksum: the CRC32C of its canonical JSON (docs/design.md)."""
    body = {k: v for k, v in body.items() if k != "checksum"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    body["checksum"] = format_crc(crc32c(canonical))
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump(body, f, indent=1)


class Pair(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4, 6))
        self.b = torch.nn.Parameter(torch.zeros(3))


@pytest.fixture
def two(checkpointer):
    """Step 1 (to be crafted) and step 2 (its valid neighbour, which must keep loading)."""
    states = {}
    for step in (1, 2):
        w = torch.arange(24, dtype=torch.float32).reshape(4, 6) + step
        states[step] = {"model": {"w": w, "b": torch.full((3,), float(step))}, "data": {"pos": step}}
        checkpointer.save(step, states[step])
    return checkpointer, checkpointer.path_for(1), states


def assert_neighbour_loads(checkpointer, states) -> None:
    assert checkpointer.steps() == [2]  # the crafted checkpoint-1 is "not a checkpoint" for listing
    assert_same(states[2]["model"], checkpointer.load(2)["model"])


def chunked(entry: dict, boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> dict:
    """A whole F32 tensor entry rewritten as chunks with ``boxes``, their bytes taken in order
    from the tensor's own range (so the rows of a row-slab split keep their true bytes)."""
    start = entry["offsets"][0]
    chunks = []
    for offset, shape in boxes:
        nbytes = 4 * math.prod(shape)
        chunks.append(
            {
                "file": entry["file"],
                "offsets": [start, start + nbytes],
                "global_offset": list(offset),
                "shape": list(shape),
            }
        )
        start += nbytes
    return {"dtype": entry["dtype"], "shape": entry["shape"], "chunks": chunks}


def test_a_valid_chunk_split_loads_bit_exact(two):
    checkpointer, path, states = two
    body = read_manifest_json(path)
    tensors = body["components"]["model"]["tensors"]
    tensors["w"] = chunked(tensors["w"], [((0, 0), (1, 6)), ((1, 0), (2, 6)), ((3, 0), (1, 6))])
    write_signed_manifest(path, body)
    assert_same(states[1]["model"], checkpointer.load(1)["model"])


@pytest.mark.parametrize(
    "boxes",
    [
        [((0, 0), (2, 6)), ((0, 0), (2, 6))],  # the same rows twice, rows 2-3 in no chunk
        [((0, 0), (2, 6)), ((1, 0), (2, 6))],  # row 1 twice, row 3 in none
        [((0, 0), (4, 3)), ((0, 2), (3, 4))],  # a column slab crossed by a block, the counts compensated
        [*[((r, c), (2, 2)) for r in (0, 2) for c in (0, 2, 4)][:-1], ((2, 2), (2, 2))],  # a grid cell doubled
    ],
    ids=["same-box", "shifted-rows", "crossing", "grid-cell-doubled"],
)
def test_overlapping_chunks_are_corrupt(two, boxes):
    checkpointer, path, states = two
    body = read_manifest_json(path)
    tensors = body["components"]["model"]["tensors"]
    tensors["w"] = chunked(tensors["w"], boxes)
    assert sum(math.prod(shape) for _, shape in boxes) == 24  # the element count alone cannot tell
    write_signed_manifest(path, body)
    with pytest.raises(CorruptCheckpointError, match=r"tensor model\.w: chunks overlap"):
        checkpointer.load(1)
    with pytest.raises(CorruptCheckpointError, match=r"model\.w"):
        checkpointer.load(1, keys=["model.b"])  # refused at parse: even keys that are fine do not load
    assert_neighbour_loads(checkpointer, states)


@pytest.mark.parametrize("force_sweep", [False, True], ids=["faces", "sweep"])
def test_one_overlap_among_thousands_of_chunks(checkpointer, monkeypatch, force_sweep):
    """4,096 chunks (one per rank of a 64 x 64 grid), one of them a copy of its neighbour: found
    by the face cancellation and, past its budget, by the sort-and-sweep."""
    if force_sweep:
        monkeypatch.setattr(manifest_module, "_TILING_STEPS", 0)
    w = torch.randn(64, 64)
    for step in (1, 2):
        checkpointer.save(step, {"model": {"w": w + step}})
    path = checkpointer.path_for(1)
    body = read_manifest_json(path)
    tensors = body["components"]["model"]["tensors"]
    grid = [((r, c), (1, 1)) for r in range(64) for c in range(64)]
    tensors["w"] = chunked(tensors["w"], grid)  # 1 x 1 chunks in row-major order: valid
    write_signed_manifest(path, body)
    assert_same({"w": w + 1}, checkpointer.load(1)["model"])
    tensors["w"]["chunks"][2080]["global_offset"] = [32, 33]  # the chunk at [32, 32] now doubles [32, 33]
    write_signed_manifest(path, body)
    with pytest.raises(CorruptCheckpointError, match=r"tensor model\.w: chunks overlap"):
        checkpointer.load(1)
    assert_same({"w": w + 2}, checkpointer.load(2)["model"])


def test_tiling_check_agrees_with_counting_every_element():
    """_tiles against a brute-force count, on random guillotine tilings of up to 4-D tensors,
    some moved, doubled or replaced by random boxes; the sort-and-sweep fallback too."""
    rng = random.Random(14)

    def split(offset, shape, depth):
        axis = rng.randrange(len(shape))
        if depth == 0 or shape[axis] < 2 or rng.random() < 0.3:
            return [(offset, shape)]
        cut = rng.randrange(1, shape[axis])
        low = (*shape[:axis], cut, *shape[axis + 1 :])
        high_offset = (*offset[:axis], offset[axis] + cut, *offset[axis + 1 :])
        high = (*shape[:axis], shape[axis] - cut, *shape[axis + 1 :])
        return split(offset, low, depth - 1) + split(high_offset, high, depth - 1)

    outcomes = set()
    for case in range(600):
        rank = rng.randint(1, 4)
        shape = tuple(rng.randint(1, 5) for _ in range(rank))
        boxes = split((0,) * rank, shape, 6)
        if case % 3 == 1:
            boxes[rng.randrange(len(boxes))] = boxes[rng.randrange(len(boxes))]
        elif case % 3 == 2:
            offset = tuple(rng.randrange(d) for d in shape)
            boxes[rng.randrange(len(boxes))] = (
                offset,
                tuple(rng.randint(1, d - o) for o, d in zip(offset, shape, strict=True)),
            )
        count = torch.zeros(shape, dtype=torch.int64)
        for offset, size in boxes:
            count[tuple(slice(o, o + s) for o, s in zip(offset, size, strict=True))] += 1
        exact = bool((count == 1).all())
        chunks = [ChunkRecord("f", 0, 0, offset, size) for offset, size in boxes]
        assert manifest_module._tiles(shape, chunks) is exact, (shape, boxes)
        if int(count.sum()) == math.prod(shape):  # the fallback relies on the element count
            ends = [(offset, tuple(o + s for o, s in zip(offset, size, strict=True))) for offset, size in boxes]
            assert manifest_module._disjoint(ends) is exact, (shape, boxes)
        outcomes.add(exact)
    assert outcomes == {True, False}


def test_chunks_sharing_bytes_are_corrupt(two):
    checkpointer, path, states = two
    body = read_manifest_json(path)
    tensors = body["components"]["model"]["tensors"]
    tensors["w"] = chunked(tensors["w"], [((0, 0), (2, 6)), ((2, 0), (2, 6))])
    tensors["w"]["chunks"][1]["offsets"] = tensors["w"]["chunks"][0]["offsets"]  # rows 2-3 read rows 0-1's bytes
    write_signed_manifest(path, body)
    with pytest.raises(CorruptCheckpointError, match=r"claimed twice \(by model\.w\)"):
        checkpointer.load(1)
    assert_neighbour_loads(checkpointer, states)


def test_tensors_sharing_bytes_are_corrupt(two):
    checkpointer, path, states = two
    body = read_manifest_json(path)
    tensors = body["components"]["model"]["tensors"]
    start = tensors["w"]["offsets"][0]
    tensors["b"]["offsets"] = [start + 4, start + 16]  # b claims three floats of w
    write_signed_manifest(path, body)
    with pytest.raises(CorruptCheckpointError, match=r"of 'model-00001-of-00001\.safetensors' are claimed twice") as e:
        checkpointer.load(1)
    assert "model.w" in str(e.value) and "model.b" in str(e.value)
    assert_neighbour_loads(checkpointer, states)


@pytest.mark.parametrize(
    ("tied", "message"),
    [
        ([["b", "w"]], r"component 'model': tied key 'w' is stored as well as 'b'"),
        ([["pos", "w2"]], r"component 'model': tied group \['pos', 'w2'\] does not store its first key 'pos'"),
        ([["w", "x"], ["b", "x"]], r"component 'model': key 'x' is in more than one tied group"),
        ([["w", "x", "x"]], r"component 'model': key 'x' is in more than one tied group"),
    ],
    ids=["both-stored", "key-of-another-component", "in-two-groups", "twice-in-one"],
)
def test_tied_groups_a_load_would_resolve_wrongly(two, tied, message):
    checkpointer, path, states = two
    body = read_manifest_json(path)
    body["components"]["model"]["tied"] = tied
    write_signed_manifest(path, body)
    with pytest.raises(CorruptCheckpointError, match=message):
        checkpointer.load(1)
    assert_neighbour_loads(checkpointer, states)


def test_a_valid_tied_group_still_resolves(two):
    checkpointer, path, states = two
    body = read_manifest_json(path)
    body["components"]["model"]["tied"] = [["w", "head"]]
    write_signed_manifest(path, body)
    loaded = checkpointer.load(1, keys=["model.head", "model.b"])["model"]
    assert_same({"head": states[1]["model"]["w"], "b": states[1]["model"]["b"]}, loaded)


def test_tied_bin_component_storing_both_keys(tmp_path):
    state = {"w": torch.arange(6, dtype=torch.float32), "b": torch.ones(2)}
    for name in ("crafted", "neighbour"):
        ckptd.save_checkpoint(str(tmp_path / name), state, safetensors=False)
    crafted = str(tmp_path / "crafted")
    body = read_manifest_json(crafted)
    assert body["components"]["model"]["kind"] == "torch_bin"
    body["components"]["model"]["tied"] = [["b", "w"]]
    write_signed_manifest(crafted, body)
    with pytest.raises(
        CorruptCheckpointError, match=r"component 'model' \(index pytorch_model\.bin\.index\.json\): tied key 'w'"
    ):
        ckptd.load_checkpoint(crafted)
    assert_same(state, ckptd.load_checkpoint(str(tmp_path / "neighbour")))


@pytest.mark.parametrize("stored", ["whole", "chunks"])
def test_empty_tensor_whose_strides_overflow(two, stored):
    """[0, 2**62, 2**62] holds nothing, but torch cannot compute its strides ("Stride calculation
    overflowed"): refused at parse for every way of loading."""
    checkpointer, path, states = two
    body = read_manifest_json(path)
    tensors = body["components"]["model"]["tensors"]
    w = tensors["w"]
    w["shape"] = [0, 2**62, 2**62]
    w["offsets"] = [w["offsets"][0], w["offsets"][0]]
    if stored == "chunks":
        tensors["w"] = chunked(w, [((0, 0, 0), (0, 2**62, 2**62)), ((0, 0, 0), (0, 1, 1))])
    write_signed_manifest(path, body)
    loads = {
        "fresh": lambda: checkpointer.load(1),
        "keys": lambda: checkpointer.load(1, keys=["model.w"]),
        "into": lambda: checkpointer.load(1, into={"model": Pair()}),
        "assign": lambda: checkpointer.load(1, into={"model": Pair()}, assign=True),
        "load_checkpoint": lambda: ckptd.load_checkpoint(path),
    }
    for name, load in loads.items():
        with pytest.raises(CorruptCheckpointError, match=r"tensor model\.w: shape \[0, 4611686018427387904, "):
            load()
            pytest.fail(f"{name} loaded")
    assert_neighbour_loads(checkpointer, states)


def test_reshaped_tensor_assigned_into_a_module(two):
    """w stored as [6, 4] (same bytes): assign=True used to reach torch's load_state_dict and its
    RuntimeError; now it is the size mismatch the in-place path reports."""
    checkpointer, path, states = two
    body = read_manifest_json(path)
    body["components"]["model"]["tensors"]["w"]["shape"] = [6, 4]
    write_signed_manifest(path, body)
    for assign in (False, True):
        with pytest.raises(KeyMismatchError, match=r"size mismatch for 'w'.* \(6, 4\)"):
            checkpointer.load(1, into={"model": Pair()}, assign=assign)
    module = Pair()
    checkpointer.load(2, into={"model": module}, assign=True)
    assert_same(states[2]["model"], {k: v.detach() for k, v in module.state_dict().items()})


def test_param_sharing_that_ties_a_key_to_two_tensors(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    state = {"a": torch.ones(2), "b": torch.zeros(2)}
    safetensors_torch.save_file(state, str(tmp_path / "model-00001-of-00001.safetensors"))
    weight_map = {"a": "model-00001-of-00001.safetensors", "b": "model-00001-of-00001.safetensors"}

    def index(sharing):
        index = {"metadata": {"param_sharing": sharing}, "weight_map": weight_map}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))

    index([["a", "x"], ["b", "x"]])
    with pytest.raises(CorruptCheckpointError, match=r"param_sharing ties 'x' to both 'a' and 'b'"):
        ckptd.load_checkpoint(str(tmp_path))
    index([["a", "b", "x"]])  # explicit metadata naming two stored tensors: each keeps its own bytes
    assert_same({**state, "x": state["a"]}, ckptd.load_checkpoint(str(tmp_path)))
    single = tmp_path / "single" / "model.safetensors"
    single.parent.mkdir()
    safetensors_torch.save_file(state, str(single), metadata={"param_sharing": json.dumps([["a", "x"], ["b", "x"]])})
    with pytest.raises(CorruptCheckpointError, match=r"model\.safetensors: param_sharing ties 'x' to both"):
        ckptd.load_checkpoint(str(single.parent))


def test_a_100000_tensor_manifest_still_parses():
    """The common case (one whole chunk per tensor) beside a few many-chunk tensors; the parse
    time is measured by hand (median of 5), never asserted here."""
    files = {f"model-{i:05d}-of-00004.safetensors": FileRecord(2**40, "00000000") for i in range(1, 5)}
    names = sorted(files)
    ends = dict.fromkeys(names, 0)
    tensors = {}
    for i in range(100_000):
        name = names[i % 4]
        tensors[f"layers.{i}.weight"] = TensorRecord.whole("BF16", (16, 8), name, ends[name], ends[name] + 256)
        ends[name] += 256
    for j in range(4):
        chunks = []
        for rank in range(1024):  # a 32 x 32 grid, one chunk per rank
            name = names[rank % 4]
            chunks.append(ChunkRecord(name, ends[name], ends[name] + 32, (rank // 32 * 4, rank % 32 * 4), (4, 4)))
            ends[name] += 32
        tensors[f"sharded.{j}"] = TensorRecord("BF16", (128, 128), tuple(chunks))
    component = ComponentRecord("safetensors", tensors, None, [["layers.0.weight", "lm_head.weight"]])
    manifest = Manifest(1, "2024-01-01T00:00:00Z", 1, "test", {"model": component}, files)
    parsed = Manifest.from_json(manifest.to_json(), "big")
    assert len(parsed.components["model"].tensors) == 100_004
    assert parsed.components["model"].tensors["sharded.3"] == tensors["sharded.3"]
