"""A short multi-rank CPU training job (gloo) that async-saves with ckptd and resumes from it.

Run under ``torchrun``; every rank runs the same code.  Settings come from the environment (the
deploy recipes set them) or the command line:

* ``CKPTD_CHECKPOINT_URL``: where checkpoints go (``s3://bucket/runs/x``, ``/shared/runs/x``).
* ``CKPTD_STORAGE_OPTIONS``: JSON fsspec options (``{"endpoint_url": "http://minio:9000"}``);
  credentials come from ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` (or a profile).
* other ``CKPTD_*`` variables tune the Checkpointer (``CKPTD_PART_SIZE``, ``CKPTD_MAX_IN_FLIGHT``...).

On start it resumes from the latest committed checkpoint.  On SIGTERM (preemption, a pod being
deleted, Slurm's ``--signal``) it finishes the current step, saves synchronously and exits 0, so
the job can be requeued and resume from that save.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist

import ckptd

stop_requested = False


def _on_term(signum: int, frame: object) -> None:
    global stop_requested
    stop_requested = True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("CKPTD_CHECKPOINT_URL"), help="checkpoint root")
    parser.add_argument("--storage-options", default=os.environ.get("CKPTD_STORAGE_OPTIONS", "{}"))
    parser.add_argument("--steps", type=int, default=int(os.environ.get("TRAIN_STEPS", "20")))
    parser.add_argument("--save-every", type=int, default=int(os.environ.get("SAVE_EVERY", "5")))
    parser.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step (to simulate work)")
    parser.add_argument(
        "--heartbeat", default=os.environ.get("TRAIN_HEARTBEAT"), help="file rank 0 touches every step (health checks)"
    )
    args = parser.parse_args()
    if not args.url:
        parser.error("set CKPTD_CHECKPOINT_URL or pass --url")
    signal.signal(signal.SIGTERM, _on_term)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    model = torch.nn.parallel.DistributedDataParallel(net)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    ckpt = ckptd.Checkpointer(args.url, storage_options=json.loads(args.storage_options), keep_last=2)
    start = 0
    latest = ckpt.latest_step()
    if latest is not None:
        ckpt.load(latest, into={"model": net, "optimizer": optimizer})
        start = latest
    if rank == 0:
        where = f"resuming from step {start}" if latest is not None else "starting from scratch"
        print(f"[rank 0/{world}] {where}; checkpoints in {args.url}", flush=True)

    step = start
    loss = torch.zeros(())
    for step in range(start + 1, args.steps + 1):
        generator = torch.Generator().manual_seed(step * 1000 + rank)  # deterministic data per step and rank
        inputs = torch.randn(16, 32, generator=generator)
        loss = (model(inputs) - inputs[:, :8]).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        time.sleep(args.step_seconds)
        if args.heartbeat and rank == 0:
            with open(args.heartbeat, "a"):
                os.utime(args.heartbeat)
        stop = torch.tensor([1 if stop_requested else 0])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # every rank stops at the same step
        if stop.item():
            result = ckpt.save(step, {"model": net, "optimizer": optimizer, "progress": {"step": step}})
            if rank == 0:
                print(f"[rank 0] SIGTERM: saved step {step} to {result.path}; exiting for requeue", flush=True)
            break
        if step % args.save_every == 0 or step == args.steps:
            ckpt.async_save(step, {"model": net, "optimizer": optimizer, "progress": {"step": step}})
            if rank == 0:
                print(f"[rank 0] step {step} loss {loss.item():.4f}: save started", flush=True)
    ckpt.close()  # waits for the last save to commit
    if rank == 0:
        print(f"[rank 0] done at step {step}; committed steps {ckpt.steps()}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
