"""Exact resume, proved: 2N steps straight == N steps + async_save + a fresh process + load + N steps.

The run has dropout (global torch RNG), Python randomness, AdamW, a cosine LR schedule, a CPU
GradScaler under bfloat16 autocast and a shuffled loader whose position is saved (torchdata's
``StatefulDataLoader`` when installed, else a stateful sampler).  Final parameters, optimizer,
scheduler, scaler, loader state, RNG draws and the loss curve must be bit-identical.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import assert_same
from distributed import run_ranks
from resume_worker import first_half, second_half, straight

import ckptd

N = 10
WORKER = os.path.join(os.path.dirname(__file__), "resume_worker.py")


def run_phase(*args: str) -> None:
    package_root = os.path.dirname(os.path.dirname(ckptd.__file__))
    path = os.pathsep.join(p for p in [package_root, os.environ.get("PYTHONPATH")] if p)
    subprocess.run([sys.executable, WORKER, *args], check=True, env=dict(os.environ, PYTHONPATH=path), timeout=240)


def check_identical(expected: dict, resumed: dict, where: str) -> None:
    assert expected["step"] == resumed["step"] == 2 * N
    assert expected["losses"].shape == (2 * N,)
    for key in ("losses", "model", "optimizer", "scheduler", "scaler", "data", "torch_rng", "python_rng", "next_draw"):
        assert_same(expected[key], resumed[key], f"{where}.{key}")
    assert expected["optimizer"]["state"], "the optimizer has state to compare"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_exact_resume_in_a_fresh_process(tmp_path):
    root = str(tmp_path / "ckpts")
    run_phase("straight", str(2 * N), str(tmp_path / "straight.pt"))
    run_phase("first", str(N), root, str(tmp_path / "first.pt"))
    run_phase("second", str(N), str(2 * N), root, str(tmp_path / "second.pt"))
    expected = torch.load(tmp_path / "straight.pt", weights_only=False)
    resumed = torch.load(tmp_path / "second.pt", weights_only=False)
    check_identical(expected, resumed, "resumed")
    # the run is not trivially deterministic: a resume from the wrong state would differ
    with ckptd.Checkpointer(root) as ckpt:
        saved = ckpt.load(N, components=["progress", "model"])
    assert saved["progress"]["step"] == N
    assert_same(saved["progress"]["losses"], expected["losses"][:N])
    assert not torch.equal(saved["model"]["0.weight"], expected["model"]["0.weight"])


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.distributed
def test_exact_resume_under_two_gloo_ranks(tmp_path):
    root = str(tmp_path / "ckpts")
    expected = run_ranks(2, straight, 2 * N)
    run_ranks(2, first_half, N, root)
    resumed = run_ranks(2, second_half, N, 2 * N, root)
    for rank in (0, 1):
        check_identical(expected[rank], resumed[rank], f"rank{rank}")
    assert not torch.equal(expected[0]["losses"], expected[1]["losses"]), "ranks see different data"
    assert_same(expected[0]["model"], expected[1]["model"], "DDP keeps replicas equal")
