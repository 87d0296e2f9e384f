#!/usr/bin/env python
"""Benchmark incremental saves, which make every checkpoint self-contained by hard-linking (or
copying) unchanged files instead of referencing them: what the links and the SHA-256 digests of
``incremental="hash"`` cost, against floors of the same work measured in the same run.

The state: ``--frozen-gib`` GiB of frozen bf16 weights (``requires_grad=False``, in files of their
own) and ``--trainable-mib`` MiB of trainable fp32 weights.  Rounds are interleaved (floor, ours,
floor, ours), each timed write after ``floors.settle_machine``; reported are medians of per-pair
ratios.

* **incremental=True** (warm saves after the first): time from ``async_save`` to committed,
  against the **write floor of the trainable bytes alone** (``floors.WriteFloor``: O_DIRECT or
  buffered 16 MiB pwrites + fsync, the faster).  The frozen files are hard-linked: their bytes
  are neither read nor written, so the floor of the same work is writing the rest; the links,
  the indexes, the manifest and the directory fsyncs are ckptd's overhead above it.
* **incremental=False**: the same state written whole, for the saving (full / incremental).
* **incremental="hash"**, nothing changed since the last save: the frozen files are linked as
  above; the trainable file is staged, its SHA-256 computed, and linked instead of written.
  Floor: the copy floor of the trainable bytes (``floors.CopyFloor``) plus one-thread
  ``hashlib.sha256`` of them (what the decision "unchanged" needs at least: the bytes in memory,
  and a digest of every byte).

Example::

    python benchmarks/bench_incremental.py --frozen-gib 1 --trainable-mib 64 --rounds 3
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_save import GIB, MIB, machine_info  # the sibling script, importable once its directory is on the path
from floors import CopyFloor, WriteFloor, settle_machine

import ckptd


class Model(torch.nn.Module):
    """Frozen bf16 blocks (a base model) and a trainable fp32 adapter."""

    def __init__(self, frozen_bytes: int, trainable_bytes: int) -> None:
        super().__init__()
        rows = 4096
        blocks = max(1, frozen_bytes // (256 * MIB))
        columns = max(1, frozen_bytes // blocks // (rows * 2))
        self.base = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(rows, columns).to(torch.bfloat16), requires_grad=False)
            for _ in range(blocks)
        )
        self.adapter = torch.nn.Parameter(torch.randn(max(1, trainable_bytes // 4 // 1024), 1024))

    def trainable_bytes(self) -> int:
        return self.adapter.numel() * 4

    def all_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())


def _committed(ckpt: ckptd.Checkpointer, step: int, model: Model) -> tuple[float, ckptd.SaveResult]:
    settle_machine(0.5)
    started = time.perf_counter()
    result = ckpt.async_save(step, {"model": model}).result()
    return time.perf_counter() - started, result


def _sha256_floor(tensor: torch.Tensor) -> float:
    view = tensor.detach().contiguous().view(torch.uint8).numpy()
    started = time.perf_counter()
    hashlib.sha256(memoryview(view)).digest()
    return time.perf_counter() - started


def _median_ratio(pairs: list[tuple[float, float]]) -> float:
    return statistics.median(ours / floor for floor, ours in pairs)


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Model(int(args.frozen_gib * GIB), int(args.trainable_mib * MIB))
    trainable, total = model.trainable_bytes(), model.all_bytes()
    work = tempfile.mkdtemp(prefix="ckptd-bench-incremental-", dir=args.dir)
    try:
        trainable_copy = CopyFloor([model.adapter.detach()])
        trainable_copy.measure()  # fills its page-aligned buffer with the trainable bytes
        write_floor = WriteFloor(trainable_copy.anonymous, trainable_copy.nbytes, work)
        out: dict[str, Any] = {"machine": machine_info(work), "frozen_bytes": total - trainable}
        out["trainable_bytes"] = trainable
        linked, full, hashed = [], [], []
        with (
            ckptd.Checkpointer(os.path.join(work, "inc"), incremental=True, keep_last=2) as inc,
            ckptd.Checkpointer(os.path.join(work, "full"), keep_last=2) as whole,
            ckptd.Checkpointer(os.path.join(work, "hash"), incremental="hash", keep_last=2) as by_hash,
        ):
            for ckpt in (inc, whole, by_hash):
                ckpt.prepare({"model": model})
                ckpt.save(0, {"model": model})  # the first save writes everything
            for step in range(1, args.rounds + 1):
                with torch.no_grad():
                    model.adapter.add_(1.0)
                floor = write_floor.measure()["floor"]
                seconds, result = _committed(inc, step, model)
                assert result.bytes_linked >= total - trainable, result
                linked.append((floor, seconds))
                seconds_full, _ = _committed(whole, step, model)
                full.append((seconds, seconds_full))
                by_hash.save(1000 + step, {"model": model})  # the trainable file changed: written
                hash_floor = trainable_copy.measure()["floor"] + _sha256_floor(model.adapter)
                seconds_hash, result = _committed(by_hash, 2000 + step, model)  # unchanged: all linked
                assert result.bytes_written < total // 100, result
                hashed.append((hash_floor, seconds_hash))
                print(
                    f"round {step}: incremental {seconds:.3f} s (write floor of the trainable bytes {floor:.3f} s), "
                    f"full {seconds_full:.3f} s; hash unchanged {seconds_hash:.3f} s (copy + sha256 floor "
                    f"{hash_floor:.3f} s)",
                    flush=True,
                )
        out["incremental_vs_trainable_write_floor"] = _median_ratio(linked)
        out["full_vs_incremental"] = _median_ratio(full)
        out["hash_unchanged_vs_copy_plus_sha256_floor"] = _median_ratio(hashed)
        out["pairs"] = {"incremental": linked, "full": full, "hash": hashed}
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frozen-gib", type=float, default=1.0)
    parser.add_argument("--trainable-mib", type=float, default=64.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: the temporary directory)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    out = run(args)
    print(
        f"\nincremental / write floor of the trainable bytes: {out['incremental_vs_trainable_write_floor']:.2f}x\n"
        f"full save / incremental save:                     {out['full_vs_incremental']:.2f}x\n"
        f"hash mode, unchanged / (copy floor + sha256):     {out['hash_unchanged_vs_copy_plus_sha256_floor']:.2f}x"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
