"""``--json`` output of every command matches the schema documented in docs/cli.md.

The schema is written here as dicts (key -> type, nested dicts for objects, one-element lists
for arrays of that shape); ``check`` demands exactly those keys with those types.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from cli_helpers import run, run_json

import ckptd

STR_OR_NONE = (str, type(None))
INT_OR_NONE = (int, type(None))

ENVELOPE = {"schema": int, "command": str, "ok": bool}
ERROR = {**ENVELOPE, "error": {"code": str, "exit_code": int, "message": str, "hint": str}}
LISTED_CHECKPOINT = {
    "step": int,
    "path": str,
    "created_utc": str,
    "bytes_written": int,
    "bytes_linked": int,
    "bytes_copied": int,
    "bytes_referenced": int,
    "files": int,
    "references": [str],
}
LS = {
    **ENVELOPE,
    "root": str,
    "checkpoints": [{**LISTED_CHECKPOINT, "state": str}],
    "leftovers": [
        {"name": str, "path": str, "kind": str, "bytes": int, "files": int, "active": bool, "collectable": bool}
    ],
    "tiers": [
        {
            "tier": int,
            "root": str,
            "every": int,
            "keep_last": INT_OR_NONE,
            "error": STR_OR_NONE,
            "checkpoints": [LISTED_CHECKPOINT],
        }
    ],
}
MEMORY_LS = {
    **ENVELOPE,
    "roots": [
        {
            "url": str,
            "path": str,
            "nbytes": int,
            "in_use": bool,
            "keeper_pid": INT_OR_NONE,
            "hold_after_exit": (float, type(None)),
        }
    ],
}
TENSOR = {"component": str, "key": str, "dtype": str, "shape": [int], "bytes": int, "chunks": int}
INFO = {
    **ENVELOPE,
    "path": str,
    "format": str,
    "step": INT_OR_NONE,
    "created_utc": STR_OR_NONE,
    "world_size": INT_OR_NONE,
    "library_version": STR_OR_NONE,
    "components": [
        {"name": str, "kind": str, "sharing": str, "tensors": int, "bytes": int, "dtypes": dict, "tied_groups": int}
    ],
    "tensor_count": int,
    "tensor_bytes": int,
    "dtypes": dict,
    "largest_tensors": [TENSOR],
    "files": [{"name": str, "size": int, "crc32c": STR_OR_NONE, "reused": STR_OR_NONE, "checkpoint": STR_OR_NONE}],
    "bytes_written": int,
    "bytes_linked": int,
    "bytes_copied": int,
    "bytes_referenced": int,
    "references": [{"checkpoint": str, "path": str, "files": int, "bytes": int, "committed": bool}],
    "non_tensor_components": [str],
    "metadata": dict,
    "metrics": dict,
    "timings": dict,
}
VERIFY = {**ENVELOPE, "path": str, "files": int, "bytes": int, "verified": bool}
SIDE = {"dtype": str, "shape": [int]}
DIFF = {
    **ENVELOPE,
    "a": str,
    "b": str,
    "exact": bool,
    "added": [{"component": str, "key": str, **SIDE}],
    "removed": [{"component": str, "key": str, **SIDE}],
    "changed": [{"component": str, "key": str, "reason": str, "a": SIDE, "b": SIDE}],
    "unchanged": int,
}
GC = {
    **ENVELOPE,
    "root": str,
    "removed": [str],
    "bytes_freed": int,
    "kept": [{"path": str, "kind": str, "reason": str}],
}
RM = {**ENVELOPE, "root": str, "removed": str, "step": int}
CONSOLIDATE = {
    **ENVELOPE,
    "source": str,
    "destination": str,
    "files": int,
    "bytes": int,
    "seconds": (int, float),
    "overwritten": bool,
}
CONVERT = {
    **ENVELOPE,
    "source": str,
    "destination": str,
    "format": str,
    "files": int,
    "tensors": int,
    "bytes": int,
    "config": bool,
    "seconds": (int, float),
    "warnings": [str],
}
DEMO = {
    **ENVELOPE,
    "root": str,
    "saves": [{"step": int, "bytes": int, "stall_seconds": float, "total_seconds": float}],
    "latest_step": INT_OR_NONE,
    "reloaded_identical": bool,
    "steps_kept": [int],
    "kept_directory": bool,
}


def check(value: Any, schema: Any, where: str = "$") -> None:
    """``value`` has exactly the keys of ``schema``, each of the given type (recursively)."""
    if isinstance(schema, dict):
        assert isinstance(value, dict), f"{where}: expected an object, got {value!r}"
        value = {k: v for k, v in value.items() if not k.startswith("_")}
        assert set(value) == set(schema), f"{where}: keys {sorted(value)} != {sorted(schema)}"
        for key, sub in schema.items():
            check(value[key], sub, f"{where}.{key}")
    elif isinstance(schema, list):
        assert isinstance(value, list), f"{where}: expected an array, got {value!r}"
        for i, item in enumerate(value):
            check(item, schema[0], f"{where}[{i}]")
    else:
        assert isinstance(value, schema) and not (isinstance(value, bool) and schema is int), (
            f"{where}: {value!r} is not {schema}"
        )


def test_check_rejects_missing_extra_and_mistyped_keys():
    check({"schema": 1, "command": "x", "ok": True}, ENVELOPE)
    for bad in ({"schema": 1, "command": "x"}, {"schema": 1, "command": "x", "ok": True, "more": 1}):
        with pytest.raises(AssertionError):
            check(bad, ENVELOPE)
    with pytest.raises(AssertionError):
        check({"schema": "1", "command": "x", "ok": True}, ENVELOPE)
    with pytest.raises(AssertionError):
        check({"a": [1, "x"]}, {"a": [int]})


@pytest.fixture(scope="module")
def incremental_root(tmp_path_factory):
    """Steps 1 and 2 (step 2 links step 1's frozen embedding file) and one stale staging dir."""
    root = str(tmp_path_factory.mktemp("json") / "runs")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 8))
    model[0].weight.requires_grad_(False)
    with ckptd.Checkpointer(root, incremental=True) as ckpt:
        ckpt.save(1, {"model": model, "progress": {"epoch": 0}}, metrics={"loss": 2.0})
        with torch.no_grad():
            model[1].weight.add_(1.0)
        ckpt.save(2, {"model": model, "progress": {"epoch": 1}}, metrics={"loss": 1.5}, metadata={"run": "a"})
    stale = os.path.join(root, ".checkpoint-000003.tmp-otherhost-1-abcd")
    os.makedirs(stale)
    with open(os.path.join(stale, "model-00001-of-00001.safetensors"), "wb") as f:
        f.write(b"\0" * 3000)
    os.utime(stale, (0, 0))
    return root, model


def test_ls_json(incremental_root):
    root, _ = incremental_root
    document = run_json("ls", root)
    check(document, LS)
    assert document["_exit"] == 0 and document["_stderr"] == ""  # the leftover warning is in the document
    first, second = document["checkpoints"]
    assert (first["step"], second["step"]) == (1, 2)
    assert second["references"] == [] and second["bytes_referenced"] == 0
    manifest = ckptd.CheckpointReader.open(second["path"]).manifest
    assert second["bytes_linked"] == sum(f.size for f in manifest.files.values() if f.reused == "link") > 0
    assert second["bytes_written"] == sum(f.size for f in manifest.files.values() if not f.reused)
    assert second["bytes_copied"] == 0
    assert 0 < second["bytes_written"] < first["bytes_written"]
    (leftover,) = document["leftovers"]
    assert leftover["kind"] == "staging" and leftover["bytes"] == 3000
    assert leftover["collectable"] and not leftover["active"]


def test_info_json(incremental_root):
    root, _model = incremental_root
    document = run_json("info", os.path.join(root, "checkpoint-2"))
    check(document, INFO)
    assert document["step"] == 2 and document["format"] == "ckptd"
    assert document["metrics"] == {"loss": 1.5} and document["metadata"] == {"run": "a"}
    assert document["tensor_count"] == 3 and document["dtypes"] == {"F32": 3}
    assert document["non_tensor_components"] == ["progress"]
    largest = document["largest_tensors"][0]
    assert (largest["key"], largest["shape"], largest["bytes"]) == ("0.weight", [64, 16], 64 * 16 * 4)
    assert document["references"] == [] and document["bytes_linked"] > 0
    linked = [f for f in document["files"] if f["reused"] == "link"]
    assert linked and all(f["checkpoint"] is None for f in document["files"])
    assert all(len(f["crc32c"]) == 8 for f in document["files"])


def test_ls_and_info_json_of_an_older_versions_referencing_checkpoints(legacy_root):
    document = run_json("ls", legacy_root)
    check(document, LS)
    third = document["checkpoints"][2]
    assert third["references"] == ["checkpoint-1"] and third["bytes_referenced"] > 0 and third["bytes_linked"] == 0
    info = run_json("info", os.path.join(legacy_root, "checkpoint-3"))
    check(info, INFO)
    (reference,) = info["references"]
    assert reference["checkpoint"] == "checkpoint-1" and reference["committed"]
    assert [f["name"] for f in info["files"] if f["checkpoint"]] == ["model-00002-of-00002.safetensors"]


def test_verify_diff_json(incremental_root):
    root, _ = incremental_root
    a, b = (os.path.join(root, f"checkpoint-{i}") for i in (1, 2))
    document = run_json("verify", b)
    check(document, VERIFY)
    assert document["verified"] and document["files"] == 4
    diff = run_json("diff", a, b, "--exact")
    check(diff, DIFF)
    assert diff["_exit"] == 7  # differs
    assert diff["added"] == [] and diff["removed"] == []
    assert [(c["key"], c["reason"]) for c in diff["changed"]] == [("1.weight", "data")]
    assert diff["unchanged"] == 2
    quick = run_json("diff", a, b)
    check(quick, DIFF)
    assert "0.weight" not in {c["key"] for c in quick["changed"]}  # the same (linked) file: unchanged


def test_gc_rm_consolidate_convert_json(incremental_root, tmp_path):
    root, _model = incremental_root
    flat = str(tmp_path / "flat")
    document = run_json("consolidate", os.path.join(root, "checkpoint-2"), flat)
    check(document, CONSOLIDATE)
    assert document["overwritten"] is False
    hf = str(tmp_path / "hf")
    converted = run_json("convert", flat, hf)
    check(converted, CONVERT)
    assert converted["format"] == "hf" and converted["tensors"] == 3
    assert "--config" in converted["warnings"][0]  # no config.json: from_pretrained will need one
    exported = run_json("export-hf", flat, str(tmp_path / "hf2"))
    check(exported, CONVERT)
    removed = run_json("gc", root)
    check(removed, GC)
    assert removed["removed"] == [os.path.join(root, ".checkpoint-000003.tmp-otherhost-1-abcd")]
    assert removed["bytes_freed"] == 3000
    again = run_json("gc", root)
    assert again["removed"] == [] and again["bytes_freed"] == 0
    deleted = run_json("rm", root, "2")
    check(deleted, RM)
    assert deleted["step"] == 2 and not os.path.exists(deleted["removed"])
    failed = run_json("rm", root, "2")
    check(failed, ERROR)
    assert failed["_exit"] == 3 and failed["error"]["code"] == "not_found"


def test_demo_json_and_temporary_directory_removed(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    document = run_json("demo", "--size", "tiny", "--steps", "2", "--every", "1", env=env)
    check(document, DEMO)
    assert document["reloaded_identical"] and document["latest_step"] == 2
    assert not document["kept_directory"] and not os.path.exists(document["root"])
    assert [n for n in os.listdir(tmp_path) if n.startswith("ckptd-demo-")] == []  # (torch may add its own caches)


def test_global_options_anywhere_and_version(incremental_root):
    root, _ = incremental_root
    options = '{"anon": false}'  # ignored for local paths, but parsed
    before = run("--json", "--storage-options", options, "ls", root)
    after = run("ls", root, "--storage-options", options, "--json")
    assert before.returncode == after.returncode == 0
    assert before.stdout == after.stdout and before.stdout.startswith("{")
    version = run("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"ckptd {ckptd.__version__}"
    assert run("ls", root, "--version").stdout.strip() == f"ckptd {ckptd.__version__}"
