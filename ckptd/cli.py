"""The ``ckptd`` command line: ``demo``, ``ls``, ``info``, ``verify``, ``gc``."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence

__all__ = ["main"]


def _cmd_demo(args: argparse.Namespace) -> int:
    import torch

    from .checkpointer import Checkpointer
    from .rng import RNGState

    torch.manual_seed(0)
    model = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(args.width, nhead=4, dim_feedforward=4 * args.width, batch_first=True),
        num_layers=args.layers,
    )
    head = torch.nn.Linear(args.width, args.width)
    params = [*model.parameters(), *head.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    nbytes = sum(p.numel() * p.element_size() for p in params)
    root = args.dir or tempfile.mkdtemp(prefix="ckptd-demo-")
    print(
        f"ckptd demo: {nbytes / 2**20:.1f} MiB of parameters (+2x Adam state), {args.staging} staging, saving to {root}"
    )
    step_times: list[float] = []
    requests = []
    with Checkpointer(root, keep_last=args.keep, staging=args.staging) as ckpt:
        for step in range(1, args.steps + 1):
            started = time.perf_counter()
            batch = torch.randn(8, 32, args.width)
            loss = (head(model(batch)) - batch).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step_times.append(time.perf_counter() - started)
            if step % args.every == 0:
                state = {
                    "model": model,
                    "head": head,
                    "optimizer": optimizer,
                    "scheduler": scheduler,
                    "rng": RNGState(),
                    "progress": {"step": step, "loss": loss.item()},
                }
                request = ckpt.async_save(step, state)
                requests.append(request)
                median_step = statistics.median(step_times)
                stall = request.timings["blocking"]
                print(
                    f"step {step:4d}  loss {loss.item():.4f}  save stalled training {stall * 1e3:7.1f} ms "
                    f"({stall / median_step:5.2f} steps of {median_step * 1e3:.1f} ms)"
                )
        ckpt.wait()
        for request in requests:
            result = request.result()
            print(
                f"checkpoint {result.step:4d}: {result.bytes_written / 2**20:7.1f} MiB committed in "
                f"{result.timings['total']:.2f} s (write {result.timings['write']:.2f} s)"
            )
        latest = ckpt.latest_step()
        if latest is None:
            print("no checkpoint was committed")
            return 1
        restored = torch.nn.TransformerEncoder(
            torch.nn.TransformerEncoderLayer(args.width, nhead=4, dim_feedforward=4 * args.width, batch_first=True),
            num_layers=args.layers,
        )
        ckpt.load(latest, into={"model": restored}, verify=True)
        same = all(
            torch.equal(a, b) for a, b in zip(model.state_dict().values(), restored.state_dict().values(), strict=True)
        )
        print(f"latest checkpoint: step {latest}; reloaded model identical: {same}; checkpoints kept: {ckpt.steps()}")
    return 0 if same else 1


def _location(url: str, args: argparse.Namespace) -> tuple[object, str]:
    from .storage import normalize_location, storage_for

    root = normalize_location(url)
    return storage_for(root, args.storage_options), root


def _cmd_ls(args: argparse.Namespace) -> int:
    from .catalog import list_checkpoints

    storage, root = _location(args.root, args)
    for info in list_checkpoints(storage, root):  # type: ignore[arg-type]
        size = sum(f.size for f in info.manifest.files.values())
        print(f"{info.step:>10}  {info.created_utc}  {size / 2**20:10.1f} MiB  {info.path}")
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    from .load.reader import CheckpointReader

    reader = CheckpointReader.open(args.path, args.storage_options)
    print(f"format: {reader.kind}")
    if reader.manifest is not None:
        m = reader.manifest
        print(f"step: {m.step}  created: {m.created_utc}  world size: {m.world_size}  ckptd {m.library_version}")
        print("timings: " + json.dumps({k: round(v, 4) for k, v in m.timings.items()}))
        if m.metadata:
            print("metadata: " + json.dumps(m.metadata))
    for component in reader.components():
        keys = reader.keys(component)
        print(f"component {component}: {len(keys)} tensors")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from .errors import CkptdError
    from .load.reader import CheckpointReader

    try:
        reader = CheckpointReader.open(args.path, args.storage_options, require_manifest=True)
        reader.verify()
    except (CkptdError, OSError) as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    files = reader.manifest.files if reader.manifest else {}
    print(f"OK: {len(files)} files, {sum(f.size for f in files.values())} bytes, sizes and CRC32C match")
    return 0


def _cmd_consolidate(args: argparse.Namespace) -> int:
    from .tools.consolidate import consolidate

    manifest = consolidate(
        args.source,
        args.destination,
        max_shard_size=args.max_shard_size,
        storage_options=args.storage_options,
        destination_storage_options=args.storage_options,
        verify=args.verify,
    )
    total = sum(f.size for f in manifest.files.values())
    print(f"consolidated {args.source} into {args.destination}: {len(manifest.files)} files, {total} bytes")
    return 0


def _cmd_gc(args: argparse.Namespace) -> int:
    from .catalog import collect_garbage

    storage, root = _location(args.root, args)
    removed = collect_garbage(storage, root, older_than=args.older_than)  # type: ignore[arg-type]
    for path in removed:
        print(f"removed {path}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckptd", description="Asynchronous, crash-safe PyTorch checkpoints")
    parser.add_argument(
        "--storage-options",
        type=_json_object,
        default={},
        metavar="JSON",
        help='fsspec options for URLs, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\'',
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small model on CPU, async-saving every few steps")
    demo.add_argument("--dir", help="checkpoint root (default: a new temporary directory)")
    demo.add_argument("--steps", type=int, default=40)
    demo.add_argument("--every", type=int, default=10, help="save every N steps")
    demo.add_argument("--width", type=int, default=256, help="model width")
    demo.add_argument("--layers", type=int, default=4)
    demo.add_argument("--keep", type=int, default=3, help="checkpoints to keep")
    demo.add_argument(
        "--staging",
        choices=("blocking", "background"),
        default="blocking",
        help="background: return before the copy; the next optimizer step waits for it",
    )
    demo.set_defaults(func=_cmd_demo)
    ls = sub.add_parser("ls", help="list committed checkpoints under a root")
    ls.add_argument("root")
    ls.set_defaults(func=_cmd_ls)
    info = sub.add_parser("info", help="describe a checkpoint")
    info.add_argument("path")
    info.set_defaults(func=_cmd_info)
    verify = sub.add_parser("verify", help="check sizes and CRC32C of every file of a checkpoint")
    verify.add_argument("path")
    verify.set_defaults(func=_cmd_verify)
    consolidate = sub.add_parser(
        "consolidate", help="rewrite a checkpoint with whole tensors in HF-style shards (bounded memory)"
    )
    consolidate.add_argument("source")
    consolidate.add_argument("destination")
    consolidate.add_argument("--max-shard-size", default="2GB")
    consolidate.add_argument("--verify", action="store_true", help="check the source's CRC32C first")
    consolidate.set_defaults(func=_cmd_consolidate)
    gc = sub.add_parser("gc", help="remove what crashed saves left (staging directories, unfinished prefixes)")
    gc.add_argument("root")
    gc.add_argument("--older-than", type=float, default=24 * 3600, help="seconds, for other hosts' leftovers")
    gc.set_defaults(func=_cmd_gc)
    return parser


def _json_object(text: str) -> dict[str, object]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ckptd`` console script."""
    args = _parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
