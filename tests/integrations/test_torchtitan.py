"""torchtitan's checkpoint manager contract backed by ckptd (runs where torchtitan is installed:
it pins packages the main test environment does not want, so it lives in a separate venv)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("torchtitan")

from conftest import assert_same
from killed_runs import run_script
from titan_worker import MAX_STEPS, build

import ckptd
from ckptd.integrations.torchtitan import CkptdCheckpointManager

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

WORKER = os.path.join(os.path.dirname(__file__), "titan_worker.py")


def test_interval_retention_last_step_export_and_load(tmp_path):
    root = str(tmp_path)
    model, optimizers, schedulers, data, train_state, manager = build(
        root, "async_with_pinned_mem", export_dtype="bfloat16"
    )
    for step in range(1, 13):
        train_state.step = step
        loss = model(data.next()[0]).sum()
        optimizers.zero_grad()
        loss.backward()
        optimizers.step()
        schedulers.step()
        manager.maybe_wait_for_staging()
        assert manager.save(step, last_step=step == 12) == (step % 5 == 0 or step == 12)
    manager.maybe_wait_for_saving()
    manager.close()
    with ckptd.Checkpointer(os.path.join(root, "checkpoint")) as ckpt:
        assert ckpt.steps() == [5, 10, 12]
        last = ckpt.load(12)
        full = ckpt.load(10)
    assert set(last) == {"model"}, "last_save_model_only"
    assert all(v.dtype == torch.bfloat16 for v in last["model"].values()), "export_dtype"
    assert {"model", "optimizer", "lr_scheduler", "dataloader", "train_state"} <= set(full)
    assert full["train_state"] == {"step": 10} and full["dataloader"] == {"index": 10}
    # a fresh manager loads the latest full checkpoint in place (load_step picks one)
    model2, optimizers2, _, data2, train_state2, manager2 = build(root, "disabled", load_step=10)
    assert manager2.load() is True
    assert train_state2.step == 10 and data2.index == 10
    assert_same({k: v.float() for k, v in full["model"].items()}, dict(model2.state_dict()))
    assert optimizers2.state_dict().keys() == full["optimizer"].keys()
    manager2.close()
    with pytest.raises(ckptd.errors.ConfigError, match="async_mode"):
        build(str(tmp_path / "x"), "sometimes")
    with pytest.raises(ckptd.errors.ConfigError, match="last_save_in_hf"):
        build(str(tmp_path / "y"), "disabled", last_save_in_hf=True)
    disabled = CkptdCheckpointManager(
        CkptdCheckpointManager.Config(enable=False),
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={},
    )
    assert disabled.save(5) is False and disabled.load() is False


def run_worker(root: str, result: str, mode: str, kill_after: int | None = None) -> list[int]:
    return run_script(WORKER, root, result, mode, kill_after=kill_after)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_sigkilled_titan_loop_resumes_to_the_same_weights(tmp_path, mode):
    run_worker(str(tmp_path / "straight"), str(tmp_path / "straight.pt"), mode)
    steps = run_worker(str(tmp_path / "killed"), str(tmp_path / "never.pt"), mode, kill_after=17)
    assert steps[-1] < MAX_STEPS
    run_worker(str(tmp_path / "killed"), str(tmp_path / "resumed.pt"), mode)
    expected = torch.load(tmp_path / "straight.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert_same(expected, resumed, "final weights")
