"""``ckptd demo``: a small CPU training loop that async-saves, reports the stall per save, reloads.

The default size finishes in well under 20 s on two cores; ``--size`` picks bigger models.  The
arguments are checked before anything is printed or created; the first line is printed before
torch is imported.  Without ``--dir`` the checkpoints go to a new temporary directory, removed at
the end unless ``--keep``; with ``--dir D`` a second run resumes from the latest checkpoint in
``D`` and keeps going.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from ..options import STAGING_MODES, CheckpointerOptions
from .app import Context, Result, positive_int
from .output import EXIT_OK, EXIT_OTHER, EXIT_USAGE, CliError, human_size

__all__ = ["SIZES", "register"]

# width, layers, steps, save every
SIZES = {
    "tiny": (64, 1, 12, 4),
    "small": (128, 2, 20, 5),
    "medium": (256, 4, 40, 10),
    "large": (512, 8, 60, 15),
}
_HEADS = 4


def register(add: Callable[[str, str], argparse.ArgumentParser]) -> None:
    """Add the ``demo`` subcommand."""
    demo = add("demo", "train a small model on CPU, async-saving every few steps, then reload it")
    demo.add_argument("--dir", help="checkpoint root (default: a temporary directory, removed at the end)")
    demo.add_argument("--size", choices=sorted(SIZES), default="small", help="model size (default: small)")
    demo.add_argument("--steps", type=positive_int, help="training steps (default: per size)")
    demo.add_argument("--every", type=positive_int, help="save every N steps (default: per size)")
    demo.add_argument("--width", type=positive_int, help="model width, a multiple of 4 (default: per size)")
    demo.add_argument("--layers", type=positive_int, help="transformer layers (default: per size)")
    demo.add_argument("--keep-last", type=positive_int, default=3, help="checkpoints to keep (default 3)")
    demo.add_argument("--keep", action="store_true", help="keep the temporary directory")
    demo.add_argument(
        "--staging",
        choices=STAGING_MODES,
        default="blocking",
        help="blocking: the writer starts after the copy; pipelined: during it; background: return "
        "before the copy (the next optimizer step waits for it)",
    )
    demo.set_defaults(func=_demo)


def _demo(args: argparse.Namespace, context: Context) -> Result:
    width, layers, steps, every = SIZES[args.size]
    width, layers = args.width or width, args.layers or layers
    steps, every = args.steps or steps, args.every or every
    if width % _HEADS:
        raise CliError(f"--width must be a multiple of {_HEADS} (the attention heads), got {width}", EXIT_USAGE)
    if args.dir is not None and os.path.exists(args.dir) and not os.path.isdir(args.dir):
        raise CliError(f"--dir {args.dir} is a file, not a directory", EXIT_USAGE)
    CheckpointerOptions(keep_last=args.keep_last, staging=args.staging)  # its errors, before any side effect
    temporary = args.dir is None
    root = args.dir or tempfile.mkdtemp(prefix="ckptd-demo-")
    context.say(f"ckptd demo ({args.size}): {layers} layer(s) of width {width}, {steps} steps, saving to {root}")
    try:
        body = _run(root, width, layers, steps, every, args, context)
    finally:
        if temporary and not args.keep:
            shutil.rmtree(root, ignore_errors=True)
            context.note(f"removed {root} (pass --keep to keep it)")
    body["kept_directory"] = not temporary or args.keep
    return body, lambda b, c: None, EXIT_OK if body["reloaded_identical"] else EXIT_OTHER


def _build(width: int, layers: int) -> Any:
    import torch

    encoder = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(width, nhead=_HEADS, dim_feedforward=2 * width, batch_first=True),
        num_layers=layers,
        enable_nested_tensor=False,
    )
    return torch.nn.Sequential(encoder, torch.nn.Linear(width, width))


def _run(
    root: str, width: int, layers: int, steps: int, every: int, args: argparse.Namespace, context: Context
) -> dict[str, Any]:
    import torch

    from ..checkpointer import Checkpointer
    from ..rng import RNGState

    torch.manual_seed(0)
    model = _build(width, layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=max(1, steps // 2))
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    saves: list[dict[str, Any]] = []
    step_times: list[float] = []
    with Checkpointer(root, keep_last=args.keep_last, staging=args.staging) as ckpt:
        start = 0
        latest = ckpt.latest_step()
        if latest is not None:
            ckpt.load(latest, into={"model": model, "optimizer": optimizer, "scheduler": scheduler, "rng": RNGState()})
            start = latest
            context.say(f"resuming from step {start} (found in {root})")
        context.say(f"{human_size(nbytes)} of parameters (+2x AdamW state), {args.staging} staging")
        requests = []
        for step in range(start + 1, start + steps + 1):
            began = time.perf_counter()
            batch = torch.randn(8, 16, width)
            loss = (model(batch) - batch).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step_times.append(time.perf_counter() - began)
            if step % every:
                continue
            state = {
                "model": model,
                "optimizer": optimizer,
                "scheduler": scheduler,
                "rng": RNGState(),
                "progress": {"step": step, "loss": loss.item()},
            }
            request = ckpt.async_save(step, state)
            requests.append(request)
            median = statistics.median(step_times)
            stall = request.timings["blocking"]
            context.say(
                f"step {step:4d}  loss {loss.item():.4f}  save stalled training {stall * 1e3:7.1f} ms "
                f"({stall / median:5.2f} steps of {median * 1e3:.1f} ms)"
            )
        ckpt.wait()
        for request in requests:
            result = request.result()
            saves.append(
                {
                    "step": result.step,
                    "bytes": result.bytes_written,
                    "stall_seconds": request.timings["blocking"],
                    "total_seconds": result.timings["total"],
                }
            )
            context.say(
                f"checkpoint {result.step:4d}: {human_size(result.bytes_written)} committed in "
                f"{result.timings['total']:.2f} s (write {result.timings['write']:.2f} s)"
            )
        latest = ckpt.latest_step()
        same = False
        if latest is not None:
            restored = _build(width, layers)
            ckpt.load(latest, into={"model": restored}, verify=True)
            same = all(
                torch.equal(a, b)
                for a, b in zip(model.state_dict().values(), restored.state_dict().values(), strict=True)
            )
        kept = ckpt.steps()
    context.say(f"latest checkpoint: step {latest}; reloaded model identical: {same}; checkpoints kept: {kept}")
    return {"root": root, "saves": saves, "latest_step": latest, "reloaded_identical": same, "steps_kept": kept}
