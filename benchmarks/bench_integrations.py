#!/usr/bin/env python
"""Benchmark training step time with each framework's default checkpointing against ckptd.

For each integration (Lightning ``CkptdCheckpointIO``, HF ``CkptdTrainer``, Accelerate
``register_ckptd_hooks``) and for a plain loop (``ckptd.CheckpointManager`` against
``torch.save``), a small CPU model (``--mb`` MB of fp32 parameters, AdamW) is trained ``--steps``
steps three ways:

* ``none``: no checkpointing at all (the floor);
* ``default``: the framework's own checkpointing (``ModelCheckpoint`` with the stock
  ``TorchCheckpointIO``; the stock ``Trainer``; ``accelerator.save_state`` without hooks;
  ``torch.save``), a save every ``--every`` steps, all checkpoints kept;
* ``ckptd``: the same saves at the same steps, through the ckptd integration.

The three runs are interleaved ``--repeats`` times per framework, their order rotated by one
each repeat (none, default, ckptd; then default, ckptd, none; ...), with garbage collected and
dirty pages written back (``os.sync``) before each run; each triple gives two ratios of step
time, ckptd / none and default / none; the table reports their medians and passes when
ckptd's overhead is <= 5%.

What is timed: from the end of the first training step to the moment every save of the run has
been committed (the framework's call returned and, for ckptd, its pending saves were waited for).
The frameworks' default saves are synchronous, so both are measured the same way: the final wait
is *included*.  Step time = that window / (steps - 1).  One thing is kept out of the window, for
ckptd only: starting its writer process, a once-per-run cost (reported separately as
``writer_start_s``); the ckptd Checkpointer is created and its writer pinged before training.

Fairness: the same state is saved at the same steps (model, optimizer, scheduler, and what the
framework adds); the bytes each run left on disk are reported per save.  ckptd runs with
``fsync`` on by default (``--fsync off`` to turn it off); the framework defaults and
``torch.save`` do not fsync, so by default ckptd gives the stronger durability (fsynced files and
an atomic commit).  Torch runs with ``--threads`` intra-op threads (default 1).

``--design paired`` measures the same cost another way, to get below this VM's run-to-run noise
(whole runs of the same arm differ by up to 30% here): one run per arm and repeat with a save
every ``2 x --every`` steps, every step timed; each window of ``--every`` steps that starts at
a save (the save call and its asynchronous write) is paired with the ``--every`` steps after it,
before the next save, in the same run.  Their time ratio is the step time with a save every
``--every`` steps over the step time without saves, so slow drifts of the machine cancel out;
the table reports the median over every pair of every run.

Example::

    python benchmarks/bench_integrations.py --quick --json integrations.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_save import markdown_table  # the sibling script (its heavy imports are torch's only)

__all__ = ["FRAMEWORKS", "VARIANTS", "main"]

VARIANTS = ("none", "default", "ckptd")
TARGET = 0.05
BATCH = 32


# ---- models and data ------------------------------------------------------------------------


def mlp_width(mb: float, depth: int = 4) -> int:
    """Width of a ``depth``-layer square MLP holding about ``mb`` MB of fp32 weights."""
    return max(8, int(math.sqrt(mb * 2**20 / 4 / depth)))


def make_mlp(mb: float) -> torch.nn.Module:
    """An MLP of about ``mb`` MB of parameters ending in one output."""
    torch.manual_seed(0)
    width = mlp_width(mb)
    layers: list[torch.nn.Module] = []
    for _ in range(3):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, width))
    return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), *layers, torch.nn.Linear(width, 1))


def regression_data(count: int) -> torch.utils.data.TensorDataset:
    """``count`` random (x, y) pairs with 16 features."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(count, 16, generator=generator)
    return torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True) * 0.3)


def loader(steps: int) -> torch.utils.data.DataLoader:
    """A loader giving exactly ``steps`` batches per epoch."""
    return torch.utils.data.DataLoader(regression_data(steps * BATCH), batch_size=BATCH, shuffle=False)


@dataclass
class Run:
    """One timed training run."""

    framework: str
    variant: str
    repeat: int
    seconds: float = 0.0
    step_s: float = 0.0
    saves: int = 0
    bytes_per_save: float = 0.0
    writer_start_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    step_times: list[float] = field(default_factory=list)  # seconds of steps 2..N (the paired design)


class Clock:
    """The timed window: ``start()`` after the first step, ``stop()`` once all saves committed."""

    def __init__(self) -> None:
        self.started: float | None = None
        self.stopped: float | None = None
        self.ticks: list[float] = []  # the end of every training step, in order (step 1 first)

    def tick(self) -> None:
        """A training step ended (the paired design times each step)."""
        self.ticks.append(time.perf_counter())

    def start(self) -> None:
        if self.started is None:
            self.started = time.perf_counter()

    def stop(self) -> None:
        self.stopped = time.perf_counter()

    @property
    def seconds(self) -> float:
        if self.started is None or self.stopped is None:
            raise RuntimeError("the timed window was not opened and closed")
        return self.stopped - self.started


def _warm(checkpointer: Any) -> float:
    """Start ckptd's writer process before the timed window; returns how long it took."""
    started = time.perf_counter()
    checkpointer.health_check()
    return time.perf_counter() - started


# ---- the frameworks --------------------------------------------------------------------------


def run_plain(variant: str, root: str, args: argparse.Namespace, clock: Clock) -> dict[str, Any]:
    """A hand-written loop: ``torch.save`` of model + optimizer, or ``CheckpointManager``."""
    from ckptd import CheckpointManager, CheckpointPolicy

    model = make_mlp(args.mb)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    manager = None
    info: dict[str, Any] = {}
    if variant == "ckptd":
        manager = CheckpointManager(root, CheckpointPolicy(every_steps=args.interval), fsync=args.fsync == "on")
        info["writer_start_s"] = _warm(manager.checkpointer)
    try:
        step = 0
        for x, y in loader(args.steps):
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if variant == "default" and step % args.interval == 0:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, f"{root}/step-{step}.pt")
            elif manager is not None:
                manager.maybe_save(step, {"model": model, "optimizer": optimizer})
            clock.tick()
            if step == 1:
                clock.start()
        if manager is not None:
            manager.wait()
        clock.stop()
    finally:
        if manager is not None:
            manager.close()
    return info


def run_lightning(variant: str, root: str, args: argparse.Namespace, clock: Clock) -> dict[str, Any]:
    """Lightning ``Trainer.fit``: ``ModelCheckpoint`` with the stock IO, or ``CkptdCheckpointIO``."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from ckptd.integrations.lightning import CkptdCheckpointIO

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_mlp(args.mb)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=50, gamma=0.9)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    class Timer(Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *rest: Any) -> None:
            clock.tick()  # before ModelCheckpoint's save (callbacks run in order): it lands in the next step
            if trainer.global_step == 1:
                clock.start()

    callbacks: list[Any] = [Timer()]
    plugins: list[Any] = []
    io = None
    info: dict[str, Any] = {}
    if variant != "none":
        callbacks.append(ModelCheckpoint(dirpath=root, every_n_train_steps=args.interval, save_top_k=-1))
    if variant == "ckptd":
        io = CkptdCheckpointIO(fsync=args.fsync == "on")
        plugins.append(io)
        info["writer_start_s"] = _warm(io._checkpointer(root))  # the Checkpointer its saves will use
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=variant != "none",
        plugins=plugins,
        callbacks=callbacks,
    )
    try:
        trainer.fit(Module(), loader(args.steps))
        if io is not None:
            io.wait()  # teardown() already waited; a no-op kept for clarity
        clock.stop()
    finally:
        if io is not None:
            io.teardown()
    return info


def run_transformers(variant: str, root: str, args: argparse.Namespace, clock: Clock) -> dict[str, Any]:
    """HF ``Trainer.train`` (a small GPT-2): the stock ``Trainer`` or ``CkptdTrainer``."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from ckptd.integrations.transformers import CkptdTrainer

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, count: int) -> None:
            generator = torch.Generator().manual_seed(5)
            self.tokens = torch.randint(0, 256, (count, 16), generator=generator)

        def __len__(self) -> int:
            return len(self.tokens)

        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.tokens[index], "labels": self.tokens[index]}

    class Timer(TrainerCallback):
        def on_step_end(self, targs: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.tick()  # before the Trainer saves: the save lands in the next step
            if state.global_step == 1:
                clock.start()

    # about --mb MB: 2 blocks of ~12 * n_embd^2 weights (+ embeddings)
    n_embd = max(32, int(math.sqrt(args.mb * 2**20 / 4 / 24)) // 32 * 32)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=16, n_embd=n_embd, n_layer=2, n_head=4)
    targs = TrainingArguments(
        output_dir=root,
        max_steps=args.steps,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        save_strategy="no" if variant == "none" else "steps",
        save_steps=args.interval,
        logging_strategy="no",
        log_level="error",
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    common = {"model": GPT2LMHeadModel(config), "args": targs, "train_dataset": Tokens(args.steps * 8)}
    info: dict[str, Any] = {}
    if variant == "ckptd":
        trainer: Any = CkptdTrainer(**common, callbacks=[Timer()], ckptd_options={"fsync": args.fsync == "on"})
        info["writer_start_s"] = _warm(trainer._ckptd(root))  # the Checkpointer _save_checkpoint will use
    else:
        trainer = Trainer(**common, callbacks=[Timer()])
    try:
        trainer.train()  # CkptdTrainer.train waits for its pending saves before returning
        clock.stop()
    finally:
        if variant == "ckptd":
            trainer.close_checkpointers()
    return info


def run_accelerate(variant: str, root: str, args: argparse.Namespace, clock: Clock) -> dict[str, Any]:
    """An Accelerate loop: ``accelerator.save_state`` alone, or with ``register_ckptd_hooks``."""
    from accelerate import Accelerator

    from ckptd.integrations.accelerate import register_ckptd_hooks

    accelerator = Accelerator(cpu=True)
    model = make_mlp(args.mb)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=50, gamma=0.9)
    model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, loader(args.steps), scheduler)
    hooks = None
    info: dict[str, Any] = {}
    if variant == "ckptd":
        hooks = register_ckptd_hooks(accelerator, fsync=args.fsync == "on")
        info["writer_start_s"] = _warm(hooks._checkpointer(os.path.abspath(root)))  # the one its saves use
    try:
        step = 0
        for x, y in data:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            step += 1
            if variant != "none" and step % args.interval == 0:
                accelerator.save_state(os.path.join(root, f"step_{step}"))
            clock.tick()
            if step == 1:
                clock.start()
        if hooks is not None:
            hooks.wait()
        clock.stop()
    finally:
        if hooks is not None:
            hooks.remove()
    return info


FRAMEWORKS: dict[str, Callable[[str, str, argparse.Namespace, Clock], dict[str, Any]]] = {
    "plain": run_plain,
    "lightning": run_lightning,
    "transformers": run_transformers,
    "accelerate": run_accelerate,
}


# ---- measuring -------------------------------------------------------------------------------


def tree_bytes(root: str) -> int:
    """Bytes of the regular files under ``root``."""
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(folder, name))
    return total


def rotated(variants: tuple[str, ...], repeat: int) -> tuple[str, ...]:
    """The arms in the order of ``repeat``: rotated by one each repeat, so that no arm always
    runs first or right after another one (the order effects of one process average out)."""
    shift = repeat % len(variants)
    return variants[shift:] + variants[:shift]


def settle() -> None:
    """Before each run: collect the previous run's garbage and write back its dirty pages, so
    neither lands inside the next run's timed window."""
    gc.collect()
    os.sync()
    time.sleep(0.2)


def measure(framework: str, variant: str, repeat: int, args: argparse.Namespace, parent: str) -> Run:
    """One run in a fresh directory (removed afterwards)."""
    root = tempfile.mkdtemp(prefix=f"{framework}-{variant}-", dir=parent)
    clock = Clock()
    try:
        info = FRAMEWORKS[framework](variant, root, args, clock)
        saves = 0 if variant == "none" else args.steps // args.interval
        size = tree_bytes(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return Run(
        framework=framework,
        variant=variant,
        repeat=repeat,
        seconds=clock.seconds,
        step_s=clock.seconds / (args.steps - 1),
        saves=saves,
        bytes_per_save=size / saves if saves else 0.0,
        writer_start_s=info.get("writer_start_s"),
        step_times=[b - a for a, b in zip(clock.ticks, clock.ticks[1:], strict=False)],
    )


def paired_ratios(step_times: list[float], every: int) -> list[float]:
    """The paired design's ratios for one run with a save every ``2 * every`` steps.

    ``step_times[i]`` is step ``i + 2`` (the interval between the ends of steps ``i + 1`` and
    ``i + 2``).  For each save at step ``s`` (``s`` = 2·every, 4·every, ...), the *save window*
    is steps ``s .. s + every - 1`` (the save call is in step ``s`` or, when the framework saves
    after the step's callbacks, in ``s + 1``; the async write runs in the steps after it) and the
    *clean window* is the next ``every`` steps, before the next save.  Their time ratio is the
    step time with a save every ``every`` steps over the step time without saves, measured
    side by side in the same run, so slow drifts of the machine cancel out.
    """
    ratios = []
    interval = 2 * every
    for save in range(interval, len(step_times) + 2, interval):
        first = save - 2  # index of step `save` in step_times
        window = step_times[first : first + every]
        clean = step_times[first + every : first + interval]
        if len(window) == every and len(clean) == every:
            ratios.append(sum(window) / sum(clean))
    return ratios


@dataclass(frozen=True)
class PairedSummary:
    """The paired design's verdict for one framework."""

    framework: str
    ckptd_overhead: float  # median ratio - 1 over every pair of every ckptd run
    default_overhead: float
    ckptd_ratios: list[float]
    default_ratios: list[float]
    step_ms: dict[str, float]  # median clean-window step per variant
    mb_per_save: dict[str, float]
    passed: bool


def summarize_paired(framework: str, runs: list[Run], every: int) -> PairedSummary:
    """Pool the pairs of every run of each variant; medians."""
    ratios: dict[str, list[float]] = {"default": [], "ckptd": []}
    clean_steps: dict[str, list[float]] = {"default": [], "ckptd": []}
    sizes: dict[str, list[float]] = {"default": [], "ckptd": []}
    for run in runs:
        if run.framework != framework or run.variant not in ratios:
            continue
        ratios[run.variant] += paired_ratios(run.step_times, every)
        clean_steps[run.variant].append(statistics.median(run.step_times))
        sizes[run.variant].append(run.bytes_per_save)
    overhead = {v: statistics.median(r) - 1.0 for v, r in ratios.items()}
    return PairedSummary(
        framework=framework,
        ckptd_overhead=overhead["ckptd"],
        default_overhead=overhead["default"],
        ckptd_ratios=ratios["ckptd"],
        default_ratios=ratios["default"],
        step_ms={v: statistics.median(t) * 1e3 for v, t in clean_steps.items()},
        mb_per_save={v: statistics.median(b) / 1e6 for v, b in sizes.items()},
        passed=overhead["ckptd"] <= TARGET,
    )


def paired_table(summaries: list[PairedSummary]) -> str:
    """The Markdown table of the paired design."""
    header = [
        "framework", "median step ms default", "median step ms ckptd", "pairs", "default overhead",
        "ckptd overhead", "MB/save default", "MB/save ckptd", "ckptd overhead <= 5%",
    ]  # fmt: skip
    rows = [
        [
            s.framework,
            f"{s.step_ms['default']:.2f}",
            f"{s.step_ms['ckptd']:.2f}",
            str(len(s.ckptd_ratios)),
            f"{s.default_overhead:+.1%}",
            f"{s.ckptd_overhead:+.1%}",
            f"{s.mb_per_save['default']:.1f}",
            f"{s.mb_per_save['ckptd']:.1f}",
            "pass" if s.passed else "FAIL",
        ]
        for s in summaries
    ]
    return markdown_table(header, rows, left_aligned={0, 8})


@dataclass(frozen=True)
class Summary:
    """Medians of one framework's runs and of its per-triple ratios."""

    framework: str
    step_ms: dict[str, float]
    ckptd_ratio: float
    default_ratio: float
    ckptd_ratios: list[float]
    default_ratios: list[float]
    mb_per_save: dict[str, float]
    passed: bool


def summarize(framework: str, runs: list[Run]) -> Summary:
    """Ratios per repeat (each triple ran back to back), then medians."""
    by = {(r.variant, r.repeat): r for r in runs if r.framework == framework}
    repeats = sorted({r.repeat for r in runs if r.framework == framework})
    ckptd = [by["ckptd", i].step_s / by["none", i].step_s for i in repeats]
    default = [by["default", i].step_s / by["none", i].step_s for i in repeats]
    ratio = statistics.median(ckptd)
    return Summary(
        framework=framework,
        step_ms={v: statistics.median(by[v, i].step_s for i in repeats) * 1e3 for v in VARIANTS},
        ckptd_ratio=ratio,
        default_ratio=statistics.median(default),
        ckptd_ratios=ckptd,
        default_ratios=default,
        mb_per_save={v: statistics.median(by[v, i].bytes_per_save for i in repeats) / 1e6 for v in VARIANTS[1:]},
        passed=ratio - 1.0 <= TARGET,
    )


def table(summaries: list[Summary]) -> str:
    """The Markdown table printed at the end."""
    header = [
        "framework", "none ms/step", "default ms/step", "ckptd ms/step", "default / none", "ckptd / none",
        "MB/save default", "MB/save ckptd", "ckptd overhead <= 5%",
    ]  # fmt: skip
    rows = [
        [
            s.framework,
            f"{s.step_ms['none']:.2f}",
            f"{s.step_ms['default']:.2f}",
            f"{s.step_ms['ckptd']:.2f}",
            f"{s.default_ratio:.3f}",
            f"{s.ckptd_ratio:.3f}",
            f"{s.mb_per_save['default']:.1f}",
            f"{s.mb_per_save['ckptd']:.1f}",
            "pass" if s.passed else "FAIL",
        ]
        for s in summaries
    ]
    return markdown_table(header, rows, left_aligned={0, 8})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=8.0, help="model parameters in MB of fp32 (default 8)")
    parser.add_argument("--steps", type=int, default=200, help="training steps per run (default 200)")
    parser.add_argument("--every", type=int, default=20, help="save every N steps (default 20)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved (none, default, ckptd) triples (default 3)")
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS), help="comma-separated subset of %(default)s")
    parser.add_argument("--fsync", choices=("on", "off"), default="on", help="ckptd's fsync (default on)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--dir", default="/work", help="parent of the benchmark directory (default /work)")
    parser.add_argument(
        "--design",
        choices=("runs", "paired"),
        default="runs",
        help="runs: whole runs with a save every --every steps against runs without (default); paired: "
        "one run per arm with a save every 2 x --every steps, each save window paired with the clean "
        "window after it in the same run",
    )
    parser.add_argument("--quick", action="store_true", help="short run: 60 steps, 2 repeats")
    parser.add_argument("--json", help="write the runs and summaries to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 60, 2
    args.interval = args.every * (2 if args.design == "paired" else 1)  # steps between two saves
    if args.steps < 2 * args.interval:
        parser.error(f"--steps must cover at least two saves (--steps >= {2 * args.interval})")
    unknown = set(args.frameworks.split(",")) - set(FRAMEWORKS)
    if unknown:
        parser.error(f"unknown frameworks {sorted(unknown)}; choose from {list(FRAMEWORKS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run every framework's interleaved triples and print the table; returns 0 if all pass."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "transformers", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    with contextlib.suppress(ImportError):
        import transformers

        transformers.utils.logging.disable_progress_bar()
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    parent = tempfile.mkdtemp(prefix="ckptd-bench-integrations-", dir=args.dir)
    frameworks = args.frameworks.split(",")
    runs: list[Run] = []
    started = time.monotonic()
    try:
        for framework in frameworks:
            variants = VARIANTS if args.design == "runs" else ("default", "ckptd")
            for repeat in range(args.repeats):
                for variant in rotated(variants, repeat):
                    settle()
                    run = measure(framework, variant, repeat, args, parent)
                    runs.append(run)
                    print(
                        f"{framework:12s} {variant:8s} #{repeat}: {run.step_s * 1e3:7.2f} ms/step, "
                        f"{run.bytes_per_save / 1e6:6.1f} MB/save"
                        + (f", writer start {run.writer_start_s:.2f} s (untimed)" if run.writer_start_s else ""),
                        flush=True,
                    )
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    with open("/proc/loadavg") as f:
        load_after = f.read().split()[:3]
    summaries: list[Any]
    print()
    if args.design == "paired":
        summaries = [summarize_paired(framework, runs, args.every) for framework in frameworks]
        print(
            f"paired design: {args.steps} steps per run, a save every {args.interval} steps; each window of "
            f"{args.every} steps starting at a save against the {args.every} steps after it (same run); model "
            f"{args.mb} MB fp32 + AdamW, {args.repeats} runs per arm, torch threads {args.threads}, ckptd fsync "
            f"{args.fsync} (framework defaults do not fsync); load average {' '.join(load_before)} before, "
            f"{' '.join(load_after)} after; {time.monotonic() - started:.0f} s"
        )
        print(paired_table(summaries))
    else:
        summaries = [summarize(framework, runs) for framework in frameworks]
        print(
            f"{args.steps} steps, a save every {args.every}, model {args.mb} MB fp32 + AdamW, {args.repeats} repeats, "
            f"torch threads {args.threads}, ckptd fsync {args.fsync} (framework defaults do not fsync); "
            "step time includes the final wait for pending saves (defaults are synchronous); "
            f"load average {' '.join(load_before)} before, {' '.join(load_after)} after; "
            f"{time.monotonic() - started:.0f} s"
        )
        print(table(summaries))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "loadavg_before": load_before,
                    "loadavg_after": load_after,
                    "nproc": os.cpu_count(),
                    "torch": torch.__version__,
                    "timed_window": "end of step 1 to all saves committed (final wait included)",
                    "runs": [asdict(r) for r in runs],
                    "summaries": [asdict(s) for s in summaries],
                },
                f,
                indent=2,
            )
            f.write("\n")
    return 0 if all(s.passed for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
