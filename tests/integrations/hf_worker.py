"""A tiny GPT-2 (built from a config, no download) trained by CkptdTrainer (used by test_transformers.py).

``python hf_worker.py OUTPUT_DIR RESULT [--resume] [--slow]``: trains to ``MAX_STEPS`` saving
every 5 steps, printing each finished step; writes the final weights to RESULT.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from ckptd.integrations.transformers import CkptdTrainer

__all__ = ["MAX_STEPS", "TokenData", "make_trainer", "tiny_model"]

MAX_STEPS = 30


class TokenData(torch.utils.data.Dataset):
    """Random token sequences (fixed by ``seed``) with labels = inputs."""

    def __init__(self, count: int = 40, seed: int = 5) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, 64, (count, 8), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def tiny_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.0
    )
    return GPT2LMHeadModel(config)


class _Report(TrainerCallback):
    def __init__(self, slow: bool) -> None:
        self.slow = slow

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        print(state.global_step, flush=True)
        if self.slow:
            time.sleep(0.15)


def make_trainer(output_dir: str, slow: bool = False, **overrides: Any) -> CkptdTrainer:
    arguments = {
        "output_dir": output_dir,
        "max_steps": MAX_STEPS,
        "per_device_train_batch_size": 8,
        "learning_rate": 5e-3,
        "lr_scheduler_type": "linear",
        "warmup_steps": 3,
        "save_strategy": "steps",
        "save_steps": 5,
        "logging_steps": 5,
        "report_to": [],
        "use_cpu": True,
        "seed": 0,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
        **overrides,
    }
    eval_data = TokenData(16, seed=9) if overrides.get("eval_strategy") else None
    return CkptdTrainer(
        model=tiny_model(),
        args=TrainingArguments(**arguments),
        train_dataset=TokenData(),
        eval_dataset=eval_data,
        callbacks=[_Report(slow)],
    )


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    output_dir, result = argv[0], argv[1]
    trainer = make_trainer(output_dir, slow="--slow" in argv)
    trainer.train(resume_from_checkpoint=True if "--resume" in argv else None)
    trainer.close_checkpointers()
    torch.save({k: v.clone() for k, v in trainer.model.state_dict().items()}, result)


if __name__ == "__main__":
    main(sys.argv[1:])
