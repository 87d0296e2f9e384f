"""A small training run used by the exact-resume tests, in its own process.

``python resume_worker.py straight STEPS OUT`` trains STEPS steps; ``first N ROOT OUT`` trains N
steps, async-saves, trains on a little (the save must not see it) and exits; ``second N TOTAL ROOT
OUT`` loads the checkpoint of step N in a fresh process and trains to TOTAL.  Each writes its final
state to OUT with ``torch.save``.  Under torch.distributed (``run_ranks``) the same functions run
on every rank with DDP and a per-rank data order, RNG and loader state.
"""

from __future__ import annotations

import random
import sys
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Sampler, TensorDataset

import ckptd

__all__ = ["ResumableSampler", "first_half", "second_half", "straight"]

BATCH = 8
SAMPLES = 96
AFTER_SAVE = 3  # steps trained after the async save, which the checkpoint must not contain


class ResumableSampler(Sampler[int]):
    """A shuffled sampler (new order each epoch, this rank's slice) whose position is state."""

    def __init__(self, size: int, seed: int, rank: int = 0, world: int = 1) -> None:
        self.size, self.seed, self.rank, self.world = size, seed, rank, world
        self.epoch = 0
        self.offset = 0

    def _order(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.size, generator=generator)[self.rank :: self.world].tolist()

    def __iter__(self):  # type: ignore[no-untyped-def]
        order = self._order()
        while self.offset < len(order):
            index = order[self.offset]
            self.offset += 1
            yield index
        self.epoch += 1
        self.offset = 0

    def __len__(self) -> int:
        return len(range(self.rank, self.size, self.world))

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])


class Run:
    """Model with dropout, AdamW, a cosine schedule, a CPU GradScaler and a stateful loader."""

    def __init__(self, rank: int = 0, world: int = 1) -> None:
        torch.set_num_threads(1)
        torch.manual_seed(0)
        self.world = world
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.Dropout(0.25), torch.nn.ReLU(), torch.nn.Linear(32, 4)
        )
        if world > 1:
            model = torch.nn.parallel.DistributedDataParallel(model)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=40)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        data = torch.Generator().manual_seed(1)
        inputs = torch.randn(SAMPLES, 16, generator=data)
        dataset = TensorDataset(inputs, torch.randint(0, 4, (SAMPLES,), generator=data))
        try:
            from torchdata.stateful_dataloader import StatefulDataLoader as loader_class
        except ImportError:
            loader_class = None
        # The loader gets a generator of its own: DataLoader draws a base seed at every iter(),
        # which must not consume the global RNG that dropout uses (a resume calls iter() mid-epoch).
        self.sampler = ResumableSampler(SAMPLES, seed=2, rank=rank, world=world)
        self.loader: Any = (loader_class or DataLoader)(
            dataset, batch_size=BATCH, sampler=self.sampler, generator=torch.Generator()
        )
        # torchdata's StatefulDataLoader saves the sampler's state with its own; a plain
        # DataLoader (num_workers=0 pulls indices lazily) is resumed through the sampler.
        self.data_state: Any = self.loader if loader_class is not None else self.sampler
        torch.manual_seed(100 + rank)  # dropout differs per rank
        random.seed(7 + rank)
        self.step = 0
        self.losses: list[torch.Tensor] = []

    def state(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "scaler": self.scaler,
            "data": self.data_state,
            "rng": ckptd.RNGState(),
            "progress": {"step": self.step, "losses": torch.stack(self.losses) if self.losses else torch.zeros(0)},
        }

    # the loader position, RNG and losses differ per rank
    sharing: ClassVar[dict[str, str]] = {"data": "per_rank", "rng": "per_rank", "progress": "per_rank"}

    def train_to(self, end: int) -> None:
        while self.step < end:
            for x, y in self.loader:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = F.cross_entropy(self.model(x), y)
                self.optimizer.zero_grad(set_to_none=True)
                self.scaler.scale(loss).backward()
                self.scaler.step(self.optimizer)
                self.scaler.update()
                self.scheduler.step()
                self.losses.append(loss.detach().float().clone())
                self.step += 1
                # a little Python randomness in the loop too (augmentation-like)
                random.random()
                if self.step >= end:
                    return

    def outcome(self) -> dict[str, Any]:
        return {
            "model": {k: v.clone() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "data": self.data_state.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.random(),
            "next_draw": torch.rand(4),
            "losses": torch.stack(self.losses),
            "step": self.step,
        }


def straight(rank: int, world: int, steps: int) -> dict[str, Any]:
    run = Run(rank, world)
    run.train_to(steps)
    return run.outcome()


def first_half(rank: int, world: int, steps: int, root: str) -> dict[str, Any]:
    run = Run(rank, world)
    run.train_to(steps)
    with ckptd.Checkpointer(root) as ckpt:
        request = ckpt.async_save(steps, run.state(), sharing=run.sharing if world > 1 else None)
        run.train_to(steps + AFTER_SAVE)  # mutates everything while the save may still be written
        request.result()
    return {"path": request.path}


def second_half(rank: int, world: int, steps: int, total: int, root: str) -> dict[str, Any]:
    run = Run(rank, world)
    torch.manual_seed(12345)  # whatever the fresh process did, the checkpoint decides
    with ckptd.Checkpointer(root) as ckpt:
        progress: dict[str, Any] = {}
        into = {**run.state(), "progress": progress}
        ckpt.load(steps, into=into, sharing=run.sharing if world > 1 else None)
    run.step = int(progress["step"])
    run.losses = list(progress["losses"].unbind(0))
    run.train_to(total)
    return run.outcome()


def main(argv: list[str]) -> None:
    phase = argv[0]
    if phase == "straight":
        result = straight(0, 1, int(argv[1]))
        out = argv[2]
    elif phase == "first":
        result = first_half(0, 1, int(argv[1]), argv[2])
        out = argv[3]
    elif phase == "second":
        result = second_half(0, 1, int(argv[1]), int(argv[2]), argv[3])
        out = argv[4]
    else:
        raise SystemExit(f"unknown phase {phase!r}")
    torch.save(result, out)


if __name__ == "__main__":
    main(sys.argv[1:])
