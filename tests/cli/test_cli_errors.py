"""Every error of the command line is one line on stderr with a documented exit code."""

from __future__ import annotations

import json
import os

import pytest
import torch
from cli_helpers import EXIT, assert_error, run
from conftest import assert_same

import ckptd


@pytest.fixture
def committed(tmp_path):
    """A root holding checkpoint 12, written by the library."""
    root = str(tmp_path / "runs")
    with ckptd.Checkpointer(root) as ckpt:
        ckpt.save(12, {"model": {"w": torch.arange(6, dtype=torch.float32)}, "progress": {"step": 12}})
    return root, os.path.join(root, "checkpoint-12")


def test_ls_and_gc_of_a_missing_root_fail_with_not_found(tmp_path):
    missing = str(tmp_path / "nonexistent" / "runs")
    assert_error(run("ls", missing), "not_found", missing, "no such directory")
    assert_error(run("gc", missing), "not_found", missing)
    assert not os.path.exists(missing)


def test_ls_of_a_checkpoint_instead_of_a_root_is_a_usage_error(committed):
    root, path = committed
    line = assert_error(run("ls", path), "usage", "is a checkpoint, not a root")
    assert f"ckptd ls {root}" in line  # the hint names the root to list instead


def test_info_of_a_root_names_the_checkpoints_in_it(committed):
    root, path = committed
    assert_error(run("info", root), "usage", "root of 1 checkpoint", path)


def test_info_and_consolidate_of_missing_paths_fail_with_not_found(tmp_path):
    missing = str(tmp_path / "nope")
    assert_error(run("info", missing), "not_found", missing)
    assert_error(run("verify", missing), "not_found", missing)
    assert_error(run("consolidate", missing, str(tmp_path / "out")), "not_found", missing)
    assert not os.path.exists(tmp_path / "out")


def test_consolidate_onto_an_existing_destination_needs_overwrite(committed, tmp_path):
    _root, path = committed
    destination = str(tmp_path / "flat")
    assert run("consolidate", path, destination).returncode == 0
    first = ckptd.CheckpointReader.open(destination).manifest.created_utc
    assert_error(run("consolidate", path, destination), "conflict", destination, "--overwrite")
    assert ckptd.CheckpointReader.open(destination).manifest.created_utc == first  # untouched
    out = run("consolidate", path, destination, "--overwrite")
    assert out.returncode == 0, out.stderr
    reader = ckptd.CheckpointReader.open(destination)
    assert reader.manifest.created_utc != first
    assert torch.equal(reader.read("model")["w"], torch.arange(6, dtype=torch.float32))
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []  # no staging left behind


def test_consolidate_never_replaces_a_directory_of_other_files_even_with_overwrite(committed, tmp_path):
    _root, path = committed
    destination = tmp_path / "notes"
    destination.mkdir()
    (destination / "todo.txt").write_text("mine")
    line = assert_error(run("consolidate", path, str(destination), "--overwrite"), "conflict", "not a ckptd checkpoint")
    assert "pass --overwrite" not in line, "the hint must not suggest what was just refused"
    assert os.listdir(destination) == ["todo.txt"]
    assert (destination / "todo.txt").read_text() == "mine"
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []  # no staging left behind


def test_a_corrupt_checkpoint_fails_verify_with_the_corrupt_code(committed):
    _root, path = committed
    shard = os.path.join(path, "model-00001-of-00001.safetensors")
    with open(shard, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    assert_error(run("verify", path), "corrupt", "CRC32C mismatch", "model-00001-of-00001.safetensors")


def test_a_truncated_file_fails_info_with_the_corrupt_code(committed):
    _root, path = committed
    shard = os.path.join(path, "model-00001-of-00001.safetensors")
    os.truncate(shard, os.path.getsize(shard) - 4)
    assert_error(run("info", path), "corrupt", "truncated")


def test_rm_of_a_checkpoint_an_older_versions_checkpoint_references_is_refused(legacy_root):
    assert_error(run("rm", legacy_root, "1"), "conflict", "checkpoint-2", "checkpoint-3")
    assert_error(run("rm", legacy_root, "7"), "not_found", "step 7", "[1, 2, 3]")
    assert run("rm", legacy_root, "3").returncode == 0
    assert run("rm", legacy_root, "2").returncode == 0
    assert run("rm", legacy_root, "1").returncode == 0
    assert ckptd.Checkpointer(legacy_root).steps() == []


def test_rm_of_a_checkpoint_a_newer_incremental_one_linked_from_leaves_the_newer_whole(tmp_path):
    root = str(tmp_path / "runs")
    frozen = torch.nn.Linear(4, 4)
    frozen.weight.requires_grad_(False)
    with ckptd.Checkpointer(root, incremental=True) as ckpt:
        ckpt.save(1, {"model": frozen})
        assert ckpt.save(2, {"model": frozen}).bytes_linked > 0
    assert run("rm", root, "1").returncode == 0
    with ckptd.Checkpointer(root) as ckpt:
        assert ckpt.steps() == [2]
        assert_same(frozen.state_dict(), ckpt.load(2, verify=True)["model"])


def test_usage_errors_are_one_line_with_code_2(tmp_path):
    assert_error(run("bogus"), "usage", "invalid choice")
    assert_error(run("ls"), "usage", "root")
    assert_error(run("ls", str(tmp_path), "--storage-options", "{not json"), "usage", "not valid JSON")
    assert_error(run("--storage-options", "[1]", "ls", str(tmp_path)), "usage", "JSON object")
    assert_error(run("convert", str(tmp_path), str(tmp_path / "x"), "--to", "onnx"), "usage", "invalid choice")


def test_debug_shows_the_traceback(tmp_path):
    out = run("info", str(tmp_path / "nope"), "--debug")
    assert out.returncode == EXIT["not_found"]
    assert "Traceback" in out.stderr
    assert "CheckpointNotFoundError" in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("ckptd info: error: ")


def test_json_errors_are_a_document_on_stdout_too(tmp_path):
    out = run("ls", str(tmp_path / "nope"), "--json")
    assert out.returncode == EXIT["not_found"]
    document = json.loads(out.stdout)
    assert document["ok"] is False and document["command"] == "ls"
    assert document["error"]["code"] == "not_found" and document["error"]["exit_code"] == 3
    assert str(tmp_path / "nope") in document["error"]["message"]
    assert len(out.stderr.strip().splitlines()) == 1


def test_demo_twice_in_the_same_directory_resumes(tmp_path):
    directory = str(tmp_path / "demo")
    args = ("demo", "--dir", directory, "--size", "tiny", "--steps", "4", "--every", "2")
    first = run(*args)
    assert first.returncode == 0, first.stderr
    second = run(*args)
    assert second.returncode == 0, second.stderr
    assert "Traceback" not in second.stderr
    assert "resuming from step 4" in second.stdout
    assert "reloaded model identical: True" in second.stdout
    assert ckptd.Checkpointer(directory).steps() == [4, 6, 8]


@pytest.mark.objectstore
def test_ls_of_a_missing_bucket_fails_with_not_found(s3):
    options = json.dumps(s3.options())
    out = run("ls", "s3://no-such-bucket-ckptd/x", "--storage-options", options)
    assert_error(out, "not_found", "s3://no-such-bucket-ckptd", "bucket does not exist")


@pytest.mark.objectstore
def test_ls_of_s3_without_credentials_is_a_storage_error(s3):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
        AWS_CONFIG_FILE=os.devnull,
        AWS_EC2_METADATA_DISABLED="true",
        AWS_DEFAULT_REGION="us-east-1",
    )
    options = json.dumps({"endpoint_url": s3.endpoint})
    out = run("ls", s3.url(), "--storage-options", options, env=env)
    line = assert_error(out, "storage", "credentials")
    assert "AWS_ACCESS_KEY_ID" in line  # the hint says how to provide them


@pytest.mark.objectstore
def test_consolidate_to_s3_replaces_a_checkpoint_but_never_someone_elses_objects(committed, s3):
    _root, path = committed
    options = json.dumps(s3.options())
    target = s3.url("flat")
    assert run("consolidate", path, target, "--storage-options", options).returncode == 0
    out = run("consolidate", path, target, "--overwrite", "--storage-options", options)
    assert out.returncode == 0, out.stderr
    reader = ckptd.CheckpointReader.open(target, s3.options())
    reader.verify()
    assert torch.equal(reader.read("model")["w"], torch.arange(6, dtype=torch.float32))
    s3.client.put_object(Bucket=s3.bucket, Key="data/notes.txt", Body=b"mine")
    out = run("consolidate", path, s3.url("data"), "--overwrite", "--storage-options", options)
    assert_error(out, "conflict", s3.url("data"))
    assert s3.keys("data/") == ["data/notes.txt"]  # --overwrite replaces checkpoints only
