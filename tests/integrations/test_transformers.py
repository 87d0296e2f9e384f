"""Hugging Face Trainer with CkptdTrainer: async checkpoints loadable by from_pretrained,
save_total_limit and load_best_model_at_end honoured, and a SIGKILLed run resumed
(resume_from_checkpoint=True) to the same weights as an uninterrupted run."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from conftest import assert_same
from hf_worker import MAX_STEPS, make_trainer
from killed_runs import run_script
from transformers import GPT2LMHeadModel

import ckptd
from ckptd.integrations.transformers import is_ckptd_checkpoint

pytestmark = [pytest.mark.hf, pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")]

WORKER = os.path.join(os.path.dirname(__file__), "hf_worker.py")


def checkpoints(output_dir: str) -> list[str]:
    paths = [os.path.join(output_dir, n) for n in os.listdir(output_dir)]
    return sorted((p for p in paths if is_ckptd_checkpoint(p)), key=lambda p: int(p.rsplit("-", 1)[1]))


@pytest.mark.slow
def test_total_limit_best_model_and_from_pretrained(tmp_path):
    output_dir = str(tmp_path / "out")
    trainer = make_trainer(
        output_dir,
        max_steps=20,
        save_total_limit=2,
        eval_strategy="steps",
        eval_steps=5,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
    )
    trainer.train()
    trainer.close_checkpointers()
    kept = checkpoints(output_dir)
    best = trainer.state.best_model_checkpoint
    assert best is not None and best in kept
    assert kept[-1].endswith("checkpoint-20"), "the latest is kept"
    assert len(kept) == 2 or (len(kept) == 3 and best not in kept[-2:]), kept
    for path in kept:
        names = set(os.listdir(path))
        assert {"config.json", "trainer_state.json", "checkpoint_manifest.json"} <= names
        assert json.load(open(os.path.join(path, "trainer_state.json")))["global_step"] == int(path.rsplit("-", 1)[1])
    with ckptd.Checkpointer(output_dir) as ckpt:
        saved_best = ckpt.load(best, components=["model"])["model"]
        saved_last = ckpt.load(kept[-1], components=["model", "optimizer", "scheduler", "rng"])
    assert saved_last["optimizer"]["state"], "optimizer state saved"
    assert saved_last["scheduler"]["last_epoch"] == 20
    # load_best_model_at_end: the trainer's model holds the best checkpoint's weights
    for key, value in saved_best.items():
        assert torch.equal(trainer.model.state_dict()[key], value), key
    # from_pretrained reads the checkpoint directory (config.json + HF-style safetensors)
    reloaded = GPT2LMHeadModel.from_pretrained(kept[-1])
    reloaded_state = reloaded.state_dict()
    for key, value in saved_last["model"].items():
        assert torch.equal(reloaded_state[key], value), key
    assert reloaded.lm_head.weight.data_ptr() == reloaded.transformer.wte.weight.data_ptr(), "ties kept"


def run_worker(output_dir: str, result: str, *extra: str, kill_after: int | None = None) -> list[int]:
    return run_script(WORKER, output_dir, result, *extra, kill_after=kill_after)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigkilled_trainer_resumes_to_the_same_weights(tmp_path):
    run_worker(str(tmp_path / "straight"), str(tmp_path / "straight.pt"))
    killed = str(tmp_path / "killed")
    steps = run_worker(killed, str(tmp_path / "never.pt"), kill_after=17)
    assert steps[-1] < MAX_STEPS
    survivors = checkpoints(killed)
    assert survivors and int(survivors[-1].rsplit("-", 1)[1]) >= 15
    run_worker(killed, str(tmp_path / "resumed.pt"), "--resume")
    expected = torch.load(tmp_path / "straight.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert_same(expected, resumed, "final weights")
