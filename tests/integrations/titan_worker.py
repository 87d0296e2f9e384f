"""A small loop driving CkptdCheckpointManager the way torchtitan's Trainer does (used by
test_torchtitan.py): ``python titan_worker.py ROOT RESULT ASYNC_MODE [--slow]``."""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

import ckptd
from ckptd.integrations.torchtitan import CkptdCheckpointManager

__all__ = ["MAX_STEPS", "build", "main"]

MAX_STEPS = 30


class Batches:
    """A deterministic data source whose position is checkpointed."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(4)
        self.x = torch.randn(64, 6, generator=generator)
        self.index = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [(self.index * 4 + i) % 64 for i in range(4)]
        self.index += 1
        x = self.x[rows]
        return x, x.sum(1, keepdim=True)

    def state_dict(self) -> dict[str, int]:
        return {"index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.index = int(state["index"])


class TrainState:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def build(root: str, async_mode: str, **config: Any) -> tuple[Any, ...]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.1), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})],
        implementation="for-loop",
    ).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=3).build(optimizers=optimizers, training_steps=MAX_STEPS)
    data, train_state = Batches(), TrainState()
    settings = {"enable": True, "folder": "checkpoint", "interval": 5, "keep_latest_k": 3, "async_mode": async_mode}
    manager = CkptdCheckpointManager(
        CkptdCheckpointManager.Config(**(settings | config)),
        dataloader=data,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": train_state, "rng": ckptd.RNGState()},  # dropout: the RNG is state too
        base_folder=root,
    )
    return model, optimizers, schedulers, data, train_state, manager


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    root, result, async_mode = argv[0], argv[1], argv[2]
    model, optimizers, schedulers, data, train_state, manager = build(root, async_mode, last_save_model_only=False)
    manager.load(step=-1)
    while train_state.step < MAX_STEPS:
        train_state.step += 1
        x, y = data.next()
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizers.zero_grad()
        loss.backward()
        optimizers.step()
        schedulers.step()
        manager.save(train_state.step, last_step=train_state.step == MAX_STEPS)
        manager.maybe_wait_for_staging()
        print(train_state.step, flush=True)
        if "--slow" in argv:
            time.sleep(0.15)
    manager.maybe_wait_for_saving()
    manager.close()
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, result)


if __name__ == "__main__":
    main(sys.argv[1:])
