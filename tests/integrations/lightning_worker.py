"""A small Lightning training run saving through CkptdCheckpointIO (used by test_lightning.py).

``python lightning_worker.py DIRPATH OUT [CKPT_PATH] [--slow]``: trains to ``MAX_STEPS`` with a
checkpoint every 5 steps (all kept), resuming from CKPT_PATH if given, prints each finished step
and writes the final weights to OUT.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from ckptd.integrations.lightning import CkptdCheckpointIO

__all__ = ["MAX_STEPS", "Regressor", "make_trainer", "train_loader"]

MAX_STEPS = 30


class Regressor(pl.LightningModule):
    """A two-layer regressor with AdamW and a step LR schedule."""

    def __init__(self, lr: float = 0.05, dims: tuple[int, int] = (8, 16), name: str = "tiny") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(dims[0], dims[1]), torch.nn.ReLU(), torch.nn.Linear(dims[1], 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=True, prog_bar=False)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def train_loader() -> DataLoader:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(40, 8, generator=generator)
    y = x.sum(dim=1, keepdim=True) * 0.3
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)


class _Report(Callback):
    def __init__(self, slow: bool) -> None:
        self.slow = slow

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        print(trainer.global_step, flush=True)
        if self.slow:
            time.sleep(0.15)


def make_trainer(dirpath: str, max_steps: int = MAX_STEPS, slow: bool = False, **checkpoint: Any) -> pl.Trainer:
    callback = ModelCheckpoint(dirpath=dirpath, **({"every_n_train_steps": 5, "save_top_k": -1} | checkpoint))
    return pl.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[CkptdCheckpointIO()],
        callbacks=[callback, _Report(slow)],
    )


def main(argv: list[str]) -> None:
    slow = "--slow" in argv
    args = [a for a in argv if a != "--slow"]
    dirpath, out = args[0], args[1]
    ckpt_path = args[2] if len(args) > 2 else None
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    model = Regressor()
    trainer = make_trainer(dirpath, slow=slow)
    trainer.fit(model, train_loader(), ckpt_path=ckpt_path)
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, out)


if __name__ == "__main__":
    main(sys.argv[1:])
