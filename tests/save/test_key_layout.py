"""The ``spread`` key layout: shard files under hash-named subdirectories, read by every loader.

``key_layout="spread"`` puts ``model-00001-of-00002.safetensors`` at ``<2 hex digits>/model-...``
inside the checkpoint directory, so object keys differ right after the checkpoint's prefix.  The
manifest and the HF index record the relative paths; these tests load, select keys, verify,
consolidate, list, rotate and save incrementally over such checkpoints on local disk, and check
that a manifest naming a path that leaves the directory is still refused.
(S3: ``tests/storage/test_spread_keys.py``.)
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from conftest import assert_same, clone_state
from safetensors.torch import load_file

import ckptd
from ckptd import cli
from ckptd.errors import ConfigError, UnsafeCheckpointError
from ckptd.formats.checksum import crc32c, format_crc
from ckptd.formats.names import shard_file_name, spread_file_name
from ckptd.storage import check_file_name

_SPREAD = re.compile(r"^[0-9a-f]{2}/[a-z]+-\d{5}-of-\d{5}\.safetensors$")


def _manifest(path: str) -> dict:
    with open(os.path.join(path, "checkpoint_manifest.json")) as f:
        return json.load(f)


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(16, 16, generator=generator) for i in range(6)}


def test_spread_file_name_is_a_stable_two_hex_digit_subdirectory():
    name = shard_file_name("model", 1, 8)
    assert spread_file_name(name) == spread_file_name(name)
    assert re.fullmatch(r"[0-9a-f]{2}/model-00001-of-00008\.safetensors", spread_file_name(name))
    prefixes = {spread_file_name(shard_file_name("model", i, 64)).split("/")[0] for i in range(1, 65)}
    assert len(prefixes) > 30, "64 shards land in many prefixes, not a handful"


def test_key_layout_is_validated(root):
    with pytest.raises(ConfigError, match="key_layout must be one of 'flat', 'spread'"):
        ckptd.CheckpointerOptions(key_layout="sharded")
    assert ckptd.CheckpointerOptions().key_layout == "flat"


@pytest.mark.parametrize("name", ["3f/model-00001-of-00002.safetensors", "model.safetensors", "a/b"])
def test_check_file_name_accepts_one_subdirectory(name):
    assert check_file_name(name, "test") == name


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "3f/../x", "3f/../../x", "a//b", "a/b/c", "./x", "x/", "a\\b"])
def test_check_file_name_refuses_paths_that_leave_or_nest(name):
    with pytest.raises(UnsafeCheckpointError, match="is not a plain name inside the checkpoint"):
        check_file_name(name, "test")


def test_spread_round_trip_keys_verify_index_consolidate_and_cli(root, tmp_path, capsys):
    state = _state()
    expected = clone_state(state)
    with ckptd.Checkpointer(root, key_layout="spread", max_shard_size="2KB") as ckpt:
        result = ckpt.save(1, {"model": state, "extra": {"a": 1}})
        files = _manifest(result.path)["files"]
        shards = [name for name in files if name.endswith(".safetensors")]
        assert len(shards) == 6 and all(_SPREAD.match(name) for name in shards)
        assert all(os.path.isfile(os.path.join(result.path, *name.split("/"))) for name in shards)
        assert not [n for n in os.listdir(result.path) if n.endswith(".safetensors")], "no shard at the top"

        loaded = ckpt.load(1, verify=True)
        assert_same(expected, loaded["model"])
        assert loaded["extra"] == {"a": 1}
        some = ckpt.load(1, keys=["model.layers.4.weight"])
        assert list(some["model"]) == ["layers.4.weight"]
        assert torch.equal(some["model"]["layers.4.weight"], expected["layers.4.weight"])

    with open(os.path.join(result.path, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    assert set(weight_map.values()) == set(shards)
    merged: dict[str, torch.Tensor] = {}
    for name in set(weight_map.values()):  # HF tooling: index value joined to the directory
        merged.update(load_file(os.path.join(result.path, name)))
    assert_same(expected, merged)
    assert_same(expected, ckptd.load_checkpoint(result.path))

    out = str(tmp_path / "consolidated")
    ckptd.consolidate(result.path, out, verify=True)
    assert_same(expected, ckptd.load_checkpoint(out))

    assert cli.main(["verify", result.path]) == 0
    assert "sizes and CRC32C match" in capsys.readouterr().out
    assert cli.main(["ls", root]) == 0
    assert "checkpoint-1" in capsys.readouterr().out
    hf = str(tmp_path / "hf")
    assert cli.main(["convert", result.path, hf, "-q"]) == 0
    assert_same(expected, ckptd.load_checkpoint(hf))
    back = str(tmp_path / "back")
    assert cli.main(["convert", hf, back, "--to", "ckptd", "-q"]) == 0
    assert_same(expected, ckptd.load_checkpoint(back))


def test_corrupt_spread_shard_is_found_by_verify(root):
    with ckptd.Checkpointer(root, key_layout="spread", max_shard_size="2KB") as ckpt:
        result = ckpt.save(1, {"model": _state()})
    name = next(n for n in _manifest(result.path)["files"] if n.endswith(".safetensors"))
    path = os.path.join(result.path, *name.split("/"))
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    with ckptd.Checkpointer(root) as ckpt, pytest.raises(ckptd.errors.CorruptCheckpointError, match=re.escape(name)):
        ckpt.load(1, verify=True)


def test_incremental_save_over_a_spread_base_links_its_files_into_their_subdirectories(root):
    frozen = {"model": ["layers.[0-3].*"]}
    state = _state()
    with ckptd.Checkpointer(root, key_layout="spread", incremental=True, max_shard_size="2KB", keep_last=1) as ckpt:
        first = ckpt.save(1, {"model": state}, frozen=frozen)
        inodes = {
            name: os.stat(os.path.join(first.path, *name.split("/"))).st_ino for name in _manifest(first.path)["files"]
        }
        state["layers.5.weight"].add_(1)
        result = ckpt.save(2, {"model": state}, frozen=frozen)
        files = _manifest(result.path)["files"]
        linked = [name for name, f in files.items() if f.get("reused") == "link"]
        assert linked and all(_SPREAD.match(name) for name in linked)
        assert all(os.stat(os.path.join(result.path, *name.split("/"))).st_ino == inodes[name] for name in linked)
        assert ckpt.steps() == [2], "step 2 holds its own files: step 1 goes"
        assert_same(state, ckpt.load(2, verify=True)["model"])
        state["layers.0.weight"].add_(1)
        ckpt.save(3, {"model": state})  # nothing frozen: every file written again
        assert ckpt.steps() == [3]
    assert sorted(os.listdir(root)) == ["checkpoint-3"]


def test_manifest_naming_a_path_outside_the_checkpoint_is_refused(root):
    with ckptd.Checkpointer(root, key_layout="spread", max_shard_size="2KB") as ckpt:
        result = ckpt.save(1, {"model": _state()})
    body = _manifest(result.path)
    name = next(n for n in body["files"] if n.endswith(".safetensors"))
    hostile = name.split("/")[0] + "/../../outside.safetensors"
    body["files"][hostile] = body["files"].pop(name)
    for record in body["components"]["model"]["tensors"].values():
        if record.get("file") == name:
            record["file"] = hostile
    body.pop("checksum")
    body["checksum"] = format_crc(
        crc32c(json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode())
    )
    with open(os.path.join(result.path, "checkpoint_manifest.json"), "w") as f:
        json.dump(body, f, indent=1)
    with ckptd.Checkpointer(root) as ckpt, pytest.raises(UnsafeCheckpointError, match=re.escape(hostile)):
        ckpt.load(1)
    with pytest.raises(UnsafeCheckpointError, match=re.escape(hostile)):
        ckptd.load_checkpoint(result.path)


def test_transformers_from_pretrained_reads_a_spread_checkpoint(root):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    with ckptd.Checkpointer(root, key_layout="spread", max_shard_size="4KB") as ckpt:
        result = ckpt.save(1, {"model": model})
    shards = [n for n in _manifest(result.path)["files"] if n.endswith(".safetensors")]
    assert len(shards) > 2 and all(_SPREAD.match(n) for n in shards)
    config.save_pretrained(result.path)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(result.path)
    assert_same(model.state_dict(), loaded.state_dict())


def test_a_spread_checkpoint_left_aside_by_a_crash_is_recovered_only_when_complete(root):
    from ckptd.garbage import collect_garbage
    from ckptd.storage import LocalStorage

    state = _state()
    with ckptd.Checkpointer(root, key_layout="spread", max_shard_size="2KB") as ckpt:
        complete = ckpt.save(1, {"model": state}).path
        broken = ckpt.save(2, {"model": state}).path
    shard = next(n for n in _manifest(broken)["files"] if n.endswith(".safetensors"))
    os.remove(os.path.join(broken, *shard.split("/")))
    for path in (complete, broken):  # as an overwrite interrupted before the new copy was in place
        os.rename(path, os.path.join(root, f".{os.path.basename(path)}.replaced-0123abcd"))
    collect_garbage(LocalStorage(), root, older_than=0)
    assert os.path.isdir(complete), "complete: every file in its subdirectory, so it is restored"
    assert not os.path.exists(broken), "a shard is missing from its subdirectory: not restored"
    assert_same(state, ckptd.load_checkpoint(complete))
