"""What the commands print and write: ls/gc text, HF and DCP conversions, progress, no library prints."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest
import torch
from cli_helpers import REPO, run

import ckptd
from ckptd.cli.output import Progress


def test_ls_has_a_header_sizes_and_a_leftover_warning(tmp_path):
    root = str(tmp_path / "runs")
    with ckptd.Checkpointer(root) as ckpt:
        ckpt.save(3, {"model": {"w": torch.zeros(256)}})
    stale = os.path.join(root, ".checkpoint-000004.tmp-otherhost-1-abcd")  # a crashed save's staging dir
    os.makedirs(stale)
    with open(os.path.join(stale, "model-00001-of-00001.safetensors"), "wb") as f:
        f.write(b"\0" * 2048)
    os.utime(stale, (0, 0))
    stray = os.path.join(root, "checkpoint-5")  # no manifest, and not ckptd's staging: gc leaves it
    os.makedirs(stray)
    out = run("ls", root)
    assert out.returncode == 0, out.stderr
    header, committed, *leftovers = out.stdout.strip().splitlines()
    assert header.split() == ["STEP", "CREATED", "(UTC)", "WRITTEN", "LINKED", "COPIED", "FILES", "STATE", "NAME"]
    assert committed.split()[0] == "3" and "committed" in committed and committed.endswith("checkpoint-3")
    assert len(leftovers) == 2 and all("incomplete" in line for line in leftovers)
    assert "2.0 KiB" in leftovers[0] and leftovers[0].endswith(os.path.basename(stale))
    gc_hint, by_hand = out.stderr.strip().splitlines()
    assert gc_hint.startswith("warning: 1 leftover") and "(2.0 KiB)" in gc_hint and f"ckptd gc {root}" in gc_hint
    assert by_hand.startswith(f"warning: {stray} ") and "by hand" in by_hand
    cleaned = run("gc", root)
    assert cleaned.returncode == 0 and cleaned.stdout.splitlines()[0] == f"removed {stale}"
    assert not os.path.exists(stale) and os.path.isdir(stray)
    assert f"kept {stray}: not removed by gc" in cleaned.stderr
    quiet_empty = run("ls", str(tmp_path))
    assert quiet_empty.returncode == 0 and "no committed checkpoints" in quiet_empty.stdout


def test_gc_says_nothing_to_remove(tmp_path):
    out = run("gc", str(tmp_path))
    assert out.returncode == 0 and out.stdout.strip() == f"nothing to remove under {tmp_path}"
    kept = tmp_path / "checkpoint-2"  # gc leaves it and says so on stderr, unless --quiet
    kept.mkdir()
    noted = run("gc", str(tmp_path))
    assert noted.stdout == out.stdout and f"kept {kept}" in noted.stderr
    quiet = run("--quiet", "gc", str(tmp_path))
    assert quiet.returncode == 0 and quiet.stdout == out.stdout and quiet.stderr == ""


@pytest.mark.hf
def test_export_hf_with_config_loads_in_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    root = str(tmp_path / "runs")
    with ckptd.Checkpointer(root) as ckpt:
        path = ckpt.save(5, {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}).path
    config.save_pretrained(str(tmp_path / "cfg"))
    hf = str(tmp_path / "hf")
    out = run("export-hf", path, hf, "--config", str(tmp_path / "cfg" / "config.json"), "--max-shard-size", "40KB")
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""  # no progress when stderr is not a terminal
    names = sorted(os.listdir(hf))
    assert "config.json" in names and "model.safetensors.index.json" in names
    assert len([n for n in names if n.startswith("model-")]) > 1
    loaded = transformers.AutoModelForCausalLM.from_pretrained(hf)
    for key, value in model.state_dict().items():
        got = loaded.state_dict()[key]
        assert got.dtype == value.dtype and got.shape == value.shape and torch.equal(got, value), key
    back = str(tmp_path / "back")
    out = run("convert", hf, back)  # HF directory -> ckptd checkpoint
    assert out.returncode == 0, out.stderr
    reader = ckptd.CheckpointReader.open(back)
    assert reader.kind == "ckptd"
    assert run("verify", back).returncode == 0
    tensors = reader.read("model")
    assert torch.equal(tensors["transformer.wte.weight"], model.transformer.wte.weight)


def test_convert_from_a_real_dcp_checkpoint(tmp_path, dcp_checkpoint):
    model, optimizer, source = dcp_checkpoint
    target = str(tmp_path / "ckptd")
    out = run("convert", source, target)
    assert out.returncode == 0, out.stderr
    loaded = ckptd.Checkpointer(str(tmp_path / "unused")).load(target)
    assert loaded["step"] == 7
    for key, value in model.state_dict().items():
        got = loaded["model"][key]
        assert got.dtype == value.dtype and got.shape == value.shape and torch.equal(got, value), key
    momentum = loaded["optim"]["state"]["0"]["momentum_buffer"]  # DCP's own loader keys state by "0"
    assert torch.equal(momentum, optimizer.state_dict()["state"][0]["momentum_buffer"])
    hf = str(tmp_path / "hf")
    out = run("convert", source, hf, "--to", "hf")
    assert out.returncode == 0, out.stderr
    from safetensors.torch import load_file

    (shard,) = [n for n in os.listdir(hf) if n.endswith(".safetensors")]
    tensors = load_file(os.path.join(hf, shard))
    assert set(tensors) == set(model.state_dict())
    assert torch.equal(tensors["0.weight"], model[0].weight.detach())
    index = json.loads(Path(hf, "model.safetensors.index.json").read_text())
    assert index["weight_map"] == dict.fromkeys(model.state_dict(), shard)


def test_progress_draws_only_when_enabled(capsys):
    quiet = Progress("verify x", 100, enabled=False)
    quiet.update(50)
    quiet.close()
    assert capsys.readouterr().err == ""
    shown = Progress("verify x", 100, enabled=True)
    for _ in range(4):
        shown.update(25)
    shown.close()
    err = capsys.readouterr().err
    assert "verify x" in err and "100" in err


def test_library_code_never_prints():
    """Only the command line prints; the library logs under the ``ckptd`` logger."""
    offenders = []
    for path in Path(REPO, "ckptd").rglob("*.py"):
        if "cli" in path.relative_to(REPO).parts[1:2]:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                offenders.append(f"{path}:{node.lineno}")
    assert offenders == []


def test_demo_prints_its_first_line_before_importing_torch(tmp_path):
    import subprocess
    import sys
    import time

    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    started = time.monotonic()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ckptd",
            "demo",
            "--size",
            "tiny",
            "--steps",
            "2",
            "--every",
            "1",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    first = process.stdout.readline()
    waited = time.monotonic() - started
    rest, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    assert first.startswith("ckptd demo (tiny)") and str(tmp_path) in first
    assert waited < 5, f"first line after {waited:.1f} s"  # torch alone takes seconds to import
    assert "reloaded model identical: True" in rest


@pytest.mark.objectstore
def test_s3_ls_verify_consolidate_overwrite(s3):
    options = json.dumps(s3.options())
    with ckptd.Checkpointer(s3.url("runs"), storage_options=s3.options()) as ckpt:
        ckpt.save(4, {"model": {"w": torch.arange(8, dtype=torch.float32)}})
    out = run("ls", s3.url("runs"), "--storage-options", options)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[1].split()[0] == "4" and out.stderr == ""
    path = s3.url("runs/checkpoint-4")
    assert run("--storage-options", options, "verify", path).returncode == 0
    target = s3.url("flat")
    assert run("consolidate", path, target, "--storage-options", options).returncode == 0
    again = run("consolidate", path, target, "--storage-options", options)
    assert again.returncode == 6 and "--overwrite" in again.stderr
    replaced = run("consolidate", path, target, "--overwrite", "--storage-options", options)
    assert replaced.returncode == 0, replaced.stderr
    reader = ckptd.CheckpointReader.open(target, s3.options())
    assert torch.equal(reader.read("model")["w"], torch.arange(8, dtype=torch.float32))
    assert run("gc", s3.url("runs"), "--storage-options", options).stdout.startswith("nothing to remove")


def test_main_in_process_leaves_the_ckptd_logger_as_it_was(tmp_path, capsys):
    import logging

    from ckptd.cli import main

    logger = logging.getLogger("ckptd")
    before = (list(logger.handlers), logger.level, logger.propagate)
    assert main(["gc", str(tmp_path / "missing"), "--debug"]) == 3
    assert (list(logger.handlers), logger.level, logger.propagate) == before
    assert "Traceback" in capsys.readouterr().err
