"""What every command promises: ``diff --exact`` compares bytes, a closed pipe ends a command
quietly, errors name the command, arguments are checked before anything happens, and
``export-hf`` writes models only unless told otherwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from cli_helpers import EXIT, REPO, assert_error, run, run_json

import ckptd
from ckptd.cli.output import EXIT_BROKEN_PIPE, EXIT_DIFFERS, EXIT_USAGE


def _save(root: str, state: dict) -> str:
    with ckptd.Checkpointer(root) as ckpt:
        ckpt.save(1, state)
    return os.path.join(root, "checkpoint-1")


# ---- diff --exact ------------------------------------------------------------------------------


def test_diff_exact_reads_the_bytes_the_manifests_vouch_for(tmp_path):
    """Two copies of one state: the manifests record the same CRC32C for every file.  A byte
    flipped inside one tensor of B (nothing else touched) is invisible to the CRC comparison and
    found by --exact."""
    torch.manual_seed(0)
    state = {"model": {"a": torch.randn(64), "b": torch.randn(8, 8)}, "optimizer": {"m": torch.randn(16)}}
    a, b = _save(str(tmp_path / "a"), state), _save(str(tmp_path / "b"), state)
    record = ckptd.CheckpointReader.open(b).locate("model", ["b"])["b"]
    with open(os.path.join(b, record.file), "r+b") as f:
        f.seek(record.start + 37)
        byte = f.read(1)
        f.seek(record.start + 37)
        f.write(bytes([byte[0] ^ 0x01]))

    quick = run_json("diff", a, b)
    assert quick["_exit"] == 0 and quick["changed"] == [] and quick["unchanged"] == 3
    assert "compared by the CRC32C the manifests record" in run("diff", a, b).stdout

    exact = run_json("diff", a, b, "--exact")
    assert exact["_exit"] == EXIT_DIFFERS == 7
    assert exact["exact"] is True
    assert [(c["component"], c["key"], c["reason"]) for c in exact["changed"]] == [("model", "b", "data")]
    assert exact["unchanged"] == 2
    text = run("diff", a, b, "--exact")
    assert text.returncode == EXIT_DIFFERS and "~ model/b  data differs" in text.stdout
    assert "compared byte by byte" in text.stdout
    assert_error(run("verify", b), "corrupt", "CRC32C mismatch")  # (what verify is for)


def test_diff_of_identical_checkpoints_exits_0_and_of_different_ones_7(tmp_path):
    state = {"model": {"w": torch.arange(10.0)}}
    a, b = _save(str(tmp_path / "a"), state), _save(str(tmp_path / "b"), state)
    assert run("diff", a, b, "--exact").returncode == 0
    c = _save(str(tmp_path / "c"), {"model": {"w": torch.arange(10.0), "extra": torch.zeros(2)}})
    out = run_json("diff", a, c)
    assert out["_exit"] == EXIT_DIFFERS and [t["key"] for t in out["added"]] == ["extra"]


# ---- broken pipes ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def large_output(tmp_path_factory):
    """A checkpoint whose ``info --top 5000`` is far more than a pipe holds (64 KiB)."""
    root = str(tmp_path_factory.mktemp("pipe") / "runs")
    return _save(root, {"model": {f"layers.{i}.weight": torch.zeros(2) for i in range(3000)}})


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_a_reader_that_stops_early_ends_the_command_quietly(large_output, as_json):
    environment = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    args = [sys.executable, "-m", "ckptd", "info", large_output, "--top", "5000", *(["--json"] if as_json else [])]
    for _ in range(5):
        process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environment)
        assert process.stdout is not None and process.stderr is not None
        first = process.stdout.read(100 if as_json else 1)  # `head -c 100`, `head -1`
        if not as_json:
            first += process.stdout.readline()
        process.stdout.close()
        stderr = process.stderr.read()
        code = process.wait(timeout=60)
        assert first
        assert code in (0, EXIT_BROKEN_PIPE), (code, stderr)
        assert stderr == b"", stderr.decode()


# ---- errors name the command -------------------------------------------------------------------


def test_a_bad_option_value_never_poses_as_the_program_name(tmp_path):
    out = run("--storage-options", "{bad json", "ls", "s3://bucket/runs")
    line = assert_error(out, "usage", "--storage-options", "not valid JSON")
    assert out.returncode == EXIT_USAGE
    assert line.startswith("ckptd ls: error: ") and not line.startswith("ckptd {bad json")
    out = run("--storage-options", "{bad json", "--json", "info", str(tmp_path))
    line = assert_error(out, "usage", "not valid JSON")
    assert line.startswith("ckptd info: error: ")
    assert json.loads(out.stdout)["command"] == "info"
    line = assert_error(run("--storage-options", "{bad json"), "usage")
    assert line.startswith("ckptd: error: ")
    line = assert_error(run("--storage-options", "{}", "nonsense", "x"), "usage", "invalid choice")
    assert line.startswith("ckptd: error: ")


# ---- arguments before side effects -------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["--keep-last", "0"],
        ["--steps", "0"],
        ["--every", "-1"],
        ["--width", "30"],  # not a multiple of the 4 attention heads
        ["--staging", "sometimes"],
        ["--layers", "two"],
    ],
    ids=lambda a: " ".join(a),
)
def test_demo_checks_its_arguments_before_printing_or_creating_anything(tmp_path, args):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    before = sorted(os.listdir(scratch))
    out = run("demo", *args, env={**os.environ, "TMPDIR": str(scratch)})
    assert_error(out, "usage", args[0])
    assert out.stdout == ""
    assert sorted(os.listdir(scratch)) == before == []


def test_other_commands_check_numbers_before_acting(tmp_path):
    root = str(tmp_path / "runs")
    path = _save(root, {"model": {"w": torch.ones(2)}})
    stale = os.path.join(root, ".checkpoint-000002.tmp-otherhost-1-abcd")
    os.makedirs(stale)
    os.utime(stale, (0, 0))
    assert_error(run("gc", root, "--older-than", "-5"), "usage", "--older-than")
    assert_error(run("gc", root, "--older-than", "nan"), "usage", "--older-than")
    assert os.path.exists(stale)
    assert_error(run("rm", root, "-1"), "usage")
    assert_error(run("info", path, "--top", "-1"), "usage", "--top")
    out = run("consolidate", path, str(tmp_path / "flat"), "--max-shard-size", "lots")
    assert_error(out, "usage", "--max-shard-size")
    assert not os.path.exists(tmp_path / "flat")
    assert ckptd.Checkpointer(root).steps() == [1]


# ---- export-hf ---------------------------------------------------------------------------------


@pytest.fixture
def trained_checkpoint(tmp_path):
    """A checkpoint of a model and its Adam state, with the model's config.json beside."""
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 8)).sum().backward()
    optimizer.step()
    path = _save(str(tmp_path / "runs"), {"model": model, "optimizer": optimizer})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "linear"}, f)
    return path


def test_export_hf_refuses_a_component_that_is_not_the_model(trained_checkpoint, tmp_path):
    out_dir = str(tmp_path / "hf")
    out = run("export-hf", trained_checkpoint, out_dir, "--component", "optimizer")
    assert_error(out, "usage", "'optimizer' is not the model", "--allow-non-model")
    assert not os.path.exists(out_dir) and [n for n in os.listdir(tmp_path) if n.startswith(".")] == []
    assert_error(run("convert", trained_checkpoint, out_dir, "--component", "optimizer"), "usage", "--allow-non-model")

    document = run_json("export-hf", trained_checkpoint, out_dir, "--component", "optimizer", "--allow-non-model")
    assert document["_exit"] == 0 and document["tensors"] == 6
    assert document["config"] is False and "config.json" not in os.listdir(out_dir)  # the model's: not copied
    (warning,) = document["warnings"]
    assert "not a model" in warning and "from_pretrained" in warning

    text = run("export-hf", trained_checkpoint, str(tmp_path / "hf2"), "--component", "optimizer", "--allow-non-model")
    assert text.returncode == 0 and "wrote HF model" not in text.stdout
    assert "not a model" in text.stdout and "warning: " in text.stderr


def test_export_hf_copies_the_config_of_the_model_or_says_from_pretrained_needs_one(trained_checkpoint, tmp_path):
    document = run_json("export-hf", trained_checkpoint, str(tmp_path / "hf"), "--component", "model")
    assert document["config"] is True and document["warnings"] == []
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == {"model_type": "linear"}

    os.remove(os.path.join(trained_checkpoint, "config.json"))
    document = run_json("export-hf", trained_checkpoint, str(tmp_path / "bare"))
    assert document["_exit"] == EXIT["ok"] and document["config"] is False
    (warning,) = document["warnings"]
    assert "from_pretrained will need one" in warning and "--config" in warning
    assert document["_stderr"] == ""  # with --json the hint is in the document
    text = run("export-hf", trained_checkpoint, str(tmp_path / "bare2"))
    assert text.returncode == 0 and "wrote HF model" in text.stdout
    assert "warning: " in text.stderr and "--config" in text.stderr
