"""A small Accelerate training loop whose save_state()/load_state() go through ckptd's hooks
(used by test_accelerate.py).

``python accelerate_worker.py ROOT RESULT [--resume DIR] [--slow]``: trains to ``MAX_STEPS``,
``save_state(ROOT/step_<n>)`` every 5 steps, prints each finished step (after its save), writes
the final weights to RESULT.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

from ckptd.integrations.accelerate import register_ckptd_hooks

__all__ = ["MAX_STEPS", "main"]

MAX_STEPS = 30
EVERY = 5  # = batches per epoch: saves fall on epoch boundaries


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    root, result = argv[0], argv[1]
    resume = argv[argv.index("--resume") + 1] if "--resume" in argv else None
    slow = "--slow" in argv
    set_seed(0)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.2), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.8)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(40, 8, generator=generator)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8, shuffle=False)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    hooks = register_ckptd_hooks(accelerator)
    step = 0
    if resume is not None:
        accelerator.load_state(resume)
        step = int(os.path.basename(resume).split("_")[1])
    while step < MAX_STEPS:
        for inputs, targets in loader:
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            step += 1
            if step % EVERY == 0:
                accelerator.save_state(os.path.join(root, f"step_{step}"))
            print(step, flush=True)
            if slow:
                time.sleep(0.15)
            if step >= MAX_STEPS:
                break
    hooks.remove()
    torch.save({k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}, result)


if __name__ == "__main__":
    main(sys.argv[1:])
