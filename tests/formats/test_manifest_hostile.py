"""Regression tests for issue 13, items 6-8: hostile manifests, state files and indexes.

One bad manifest must not break listing the root; an edited manifest must not load; every
malformed input raises a ckptd error (CorruptCheckpointError on load, UnsupportedValueError on save).
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from conftest import assert_same

import ckptd
from ckptd import cli
from ckptd.catalog import apply_retention, latest_checkpoint, list_checkpoints
from ckptd.errors import CkptdError, CorruptCheckpointError, UnsafeCheckpointError, UnsupportedValueError
from ckptd.formats.checksum import crc32c, format_crc
from ckptd.formats.json_files import parse_json, read_small_file
from ckptd.load.reader import CheckpointReader
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
