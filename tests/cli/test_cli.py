"""The ckptd command line."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

import ckptd
from ckptd.cli import main


def test_demo_trains_saves_and_reloads(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ckptd",
            "demo",
            "--dir",
            str(tmp_path),
            "--steps",
            "6",
            "--every",
            "3",
            "--width",
            "32",
            "--layers",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("save stalled training") == 2
    assert "reloaded model identical: True" in out.stdout
    with ckptd.Checkpointer(str(tmp_path)) as ckpt:
        assert ckpt.steps() == [3, 6]
        assert ckpt.load(6)["progress"]["step"] == 6


def test_ls_info_verify_gc(tmp_path, capsys):
    root = str(tmp_path)
    with ckptd.Checkpointer(root) as ckpt:
        ckpt.save(12, {"model": {"w": torch.ones(3)}})
    stale = os.path.join(root, ".checkpoint-000013.tmp-otherhost-1-abcd")
    os.makedirs(stale)
    os.utime(stale, (0, 0))
    assert main(["ls", root]) == 0
    assert "checkpoint-12" in capsys.readouterr().out
    assert main(["info", os.path.join(root, "checkpoint-12")]) == 0
    assert "step: 12" in capsys.readouterr().out
    assert main(["verify", os.path.join(root, "checkpoint-12")]) == 0
    assert "CRC32C match" in capsys.readouterr().out
    assert main(["gc", root]) == 0
    assert not os.path.exists(stale)
