"""Accelerate with ckptd's state hooks: save_state() writes the models through ckptd (no model
files of Accelerate's own), load_state() restores them, and a SIGKILLed run resumes to the same
weights as an uninterrupted run."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("accelerate")

from accelerate import Accelerator
from conftest import assert_same
from killed_runs import run_script

import ckptd
from ckptd.integrations.accelerate import MODELS_DIR, register_ckptd_hooks

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

WORKER = os.path.join(os.path.dirname(__file__), "accelerate_worker.py")


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def test_save_state_and_load_state_go_through_ckptd(tmp_path):
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    first, second = torch.nn.Linear(4, 3), Tied()
    optimizer = torch.optim.AdamW([*first.parameters(), *second.parameters()], lr=0.1)
    first, second, optimizer = accelerator.prepare(first, second, optimizer)
    hooks = register_ckptd_hooks(accelerator)
    try:
        out = str(tmp_path / "state")
        expected = {
            "first": {k: v.clone() for k, v in first.state_dict().items()},
            "second": second.embed.weight.clone(),
        }
        accelerator.save_state(out)
        with torch.no_grad():  # training goes on while the writer writes
            first.weight.zero_()
            second.embed.weight.fill_(3.0)
        hooks.wait()
        names = set(os.listdir(out))
        assert MODELS_DIR in names and not [n for n in names if n.startswith(("model", "pytorch_model"))]
        assert "optimizer.bin" in names, "optimizer state is still Accelerate's"
        with ckptd.Checkpointer(str(tmp_path)) as ckpt:
            saved = ckpt.load(os.path.join(out, MODELS_DIR))
        assert_same(saved["model"], expected["first"])
        assert set(saved["model_1"]) == {"embed.weight", "head.weight"}
        accelerator.load_state(out)
        assert_same(dict(first.state_dict()), expected["first"])
        assert torch.equal(second.embed.weight, expected["second"])
        assert second.head.weight is second.embed.weight, "tie kept"
    finally:
        hooks.remove()
    # without the hooks, a directory without Accelerate's model files is refused by Accelerate
    with pytest.raises((FileNotFoundError, OSError, ValueError, RuntimeError)):
        accelerator.load_state(out)


def run_worker(root: str, result: str, *extra: str, kill_after: int | None = None) -> list[int]:
    return run_script(WORKER, root, result, *extra, kill_after=kill_after)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigkilled_accelerate_run_resumes_to_the_same_weights(tmp_path):
    run_worker(str(tmp_path / "straight"), str(tmp_path / "straight.pt"))
    killed = str(tmp_path / "killed")
    steps = run_worker(killed, str(tmp_path / "never.pt"), kill_after=17)
    assert steps[-1] < 30
    complete = [
        os.path.join(killed, n)
        for n in os.listdir(killed)
        if os.path.isfile(os.path.join(killed, n, MODELS_DIR, "checkpoint_manifest.json"))
        and os.path.isfile(os.path.join(killed, n, "random_states_0.pkl"))
    ]
    latest = max(complete, key=lambda p: int(p.rsplit("_", 1)[1]))
    assert int(latest.rsplit("_", 1)[1]) >= 15
    run_worker(killed, str(tmp_path / "resumed.pt"), "--resume", latest)
    expected = torch.load(tmp_path / "straight.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert_same(expected, resumed, "final weights")
