#!/usr/bin/env python
"""Recovery with tiers: what a save costs training with slower tiers behind it, and how long a new
process takes to get its state back from each tier.

Two parts, on one state of ``--size-mib`` MiB (float32 tensors of a transformer-like mix):

1. **Save cost** (interleaved rounds: one tier, then with tiers, ...): a CPU training step (a
   matrix product of the size of a small model's step) runs in a loop; a save is started with
   ``async_save`` and the loop goes on until the save is committed and (with tiers) copied to
   every tier.  Per configuration: how long ``async_save`` blocked, when the save committed, when
   the last copy was done, and the loop's steps while all that ran against its steps with no save
   (median step time ratio).  Configurations: one tier (local disk); + a local tier (another
   directory, ``every=1``); + an S3 tier (moto on loopback, ``every=1``); memory (``shm://``) as
   the only tier; memory + a local tier (``every=1``).
2. **Restore** (each a fresh process, after the trainer process ended): from process start to the
   state loaded into live tensors, and the load alone, from: the memory tier, after the trainer
   saved to ``shm://`` with a local tier behind it and was SIGKILLed with its process group (as
   torchrun does), against the floor measured in the same process (a ``copy_`` of the same bytes
   into fresh tensors); the local tier with the files in the page cache; the same after
   ``posix_fadvise(DONTNEED)`` (cold); the slower local tier (the fast tier's copy removed); the
   S3 tier; and a peer replica (``peer_recovery.py``: two gloo ranks on simulated hosts, both
   SIGKILLed after saving with ``PeerSnapshots(replicas=1)``, host 1's memory removed, a new job
   restoring rank 1 from rank 0's replica).
3. **A tier copy alone** (no training loop; interleaved): ``promote_checkpoint`` of a committed
   checkpoint from local disk (its files dropped from the page cache first, as a save leaves
   them), then from held memory, to a local tier directory.
4. **Memory into live tensors** (in this process, interleaved): a load from a held-memory root into
   tensors already in use (a restart that rebuilt the model first, or a rollback), with and without
   ``verify``, against ``copy_`` of the same bytes from tensors in memory into those targets (the
   floor of any restore from memory).

Then a goodput table from the measured figures (``goodput``, formula in its docstring).

Example::

    python benchmarks/bench_recovery.py --quick          # 128 MiB, 2 rounds: a few minutes
    python benchmarks/bench_recovery.py --size-mib 1024 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
from floors import drop_from_page_cache
from peer_recovery import peer_replica_rounds, print_peer_rows

import ckptd

CREDENTIALS = {"key": "testing", "secret": "testing"}


def make_state(size_mib: int) -> dict[str, torch.Tensor]:
    """Square-ish float32 tensors adding up to ``size_mib`` MiB (32 of them)."""
    generator = torch.Generator().manual_seed(0)
    per = size_mib * 1024 * 1024 // 4 // 32
    return {f"layers.{i}.weight": torch.randn(per, generator=generator) for i in range(32)}


@contextlib.contextmanager
def moto_endpoint() -> Iterator[str]:
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    import boto3

    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket="tiers")  # fmt: skip
    try:
        yield endpoint
    finally:
        server.stop()


class Steps:
    """A training-step loop on a thread: ``window()`` times the steps between two moments."""

    def __init__(self) -> None:
        torch.manual_seed(1)
        self.a = torch.randn(384, 384)
        self.b = torch.randn(384, 384)
        self.times: list[tuple[float, float]] = []  # (start, seconds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            for _ in range(8):
                torch.mm(self.a, self.b)
            self.times.append((started, time.perf_counter() - started))

    def between(self, start: float, end: float) -> list[float]:
        return [s for t, s in list(self.times) if start <= t and t + s <= end]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def save_round(state: dict[str, torch.Tensor], root: str, tiers: list[ckptd.Tier], steps: Steps) -> dict[str, float]:
    """One save with ``tiers``: blocking, committed, copied (seconds from the call) and the step
    time ratio during that window against the same length of quiet steps just before.  The save
    measured is a run's steady state: the fourth, after three that created the arena, started the
    writer and filled ``keep_last=2`` (so it drops one, and on a held root reuses the pages of the
    one dropped before)."""
    with ckptd.Checkpointer(root, tiers=tiers, keep_last=2, hold_after_exit=600) as ckpt:
        for warm in (0, 1, 2):
            ckpt.save(warm, {"model": state})
        ckpt.wait_promotions()
        time.sleep(1.0)
        quiet_start = time.perf_counter()
        time.sleep(1.0)
        started = time.perf_counter()
        request = ckpt.async_save(3, {"model": state})
        blocking = time.perf_counter() - started
        request.wait()
        committed = time.perf_counter() - started
        ckpt.wait_promotions()
        copied = time.perf_counter() - started
        ended = time.perf_counter()
        errors = [p.error for p in ckpt.promotions() if p.error is not None]
        if errors:
            raise SystemExit(f"a promotion failed: {errors[0]}")
    quiet = steps.between(quiet_start, started)
    during = steps.between(started + blocking, max(ended, started + blocking + 0.05))
    return {
        "blocking": blocking,
        "committed": committed,
        "copied": copied,
        "step_quiet": statistics.median(quiet) if quiet else float("nan"),
        "step_during": statistics.median(during) if during else float("nan"),
    }


def training_lost(outcome: dict[str, float]) -> float:
    """Seconds of training one save cost: the call's blocking, plus the steps' slowdown while
    the save committed and copied (``(ratio - 1) x`` that window)."""
    window = outcome["copied"] - outcome["blocking"]
    return outcome["blocking"] + max(0.0, outcome["step_during"] / outcome["step_quiet"] - 1) * window


RESTORE = r"""
import sys, time, json
began = float(sys.argv[1])
import torch, ckptd
tiers = [ckptd.Tier(**t) for t in json.loads(sys.argv[3])]
shapes = json.loads(sys.argv[4])
verify = json.loads(sys.argv[5])  # true (a checksum pass first) or "inline" (checked as the bytes land)
targets = {k: torch.empty(tuple(s)) for k, s in shapes.items()}
with ckptd.Checkpointer(sys.argv[2], tiers=tiers, hold_after_exit=600) as ckpt:
    started = time.time()
    ckpt.load("latest", into={"model": targets}, verify=verify)
    done = time.time()
fresh = {k: torch.empty(tuple(s)) for k, s in shapes.items()}  # the floor: the same bytes copy_'d into fresh tensors
floor_started = time.perf_counter()
for key, tensor in fresh.items():
    tensor.copy_(targets[key])
floor = time.perf_counter() - floor_started
print(json.dumps({"total": done - began, "load": done - started, "tier": ckpt.last_load.tier, "copy_floor": floor}))
"""

TRAINER = r"""
import os, signal, sys, json
sys.path.insert(0, sys.argv[1])
import ckptd
from bench_recovery import make_state
ckpt = ckptd.Checkpointer(sys.argv[2], hold_after_exit=600, tiers=[ckptd.Tier(sys.argv[3])])
ckpt.save(7, {"model": make_state(int(sys.argv[4]))})
ckpt.wait_promotions()
print("saved", flush=True)
signal.pause()
"""


def trainer_killed_after_a_save(root: str, local: str, size_mib: int) -> None:
    """A training process saves step 7 to ``root`` (with a local tier) and is SIGKILLed with its
    process group, writer included, as torchrun kills a failed worker."""
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, os.path.dirname(os.path.abspath(__file__)), root, local, str(size_mib)],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert trainer.stdout is not None
    if trainer.stdout.readline().strip() != b"saved":
        raise SystemExit(f"the trainer failed (exit {trainer.wait()})")
    os.killpg(trainer.pid, signal.SIGKILL)
    trainer.wait()


def restore(
    root: str, tiers: list[dict[str, Any]], shapes: dict[str, list[int]], verify: bool | str = True
) -> dict[str, float]:
    """A fresh process restoring the newest step into live tensors (a load across tiers checks
    CRC32C: ``verify=True`` in a pass first, ``"inline"`` as the bytes land)."""
    arguments = [root, json.dumps(tiers), json.dumps(shapes), json.dumps(verify)]
    done = subprocess.run(
        [sys.executable, "-c", RESTORE, str(time.time()), *arguments], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"restore failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def copy_alone(state: dict[str, torch.Tensor], work: str, rounds: int) -> dict[str, list[float]]:
    """Seconds of one tier copy (``promote_checkpoint``) from a local root and from a held root
    to a local directory, interleaved per round, with nothing else running."""
    from ckptd.storage import storage_for
    from ckptd.tiers import promote_checkpoint

    sources = {"local disk -> local tier": os.path.join(work, "copy-source"),
               "memory -> local tier": f"shm://bench-recovery-{os.getpid()}-copy"}  # fmt: skip
    paths = {}
    for name, root in sources.items():
        with ckptd.Checkpointer(root, hold_after_exit=600) as ckpt:
            ckpt.save(1, {"model": state})
            paths[name] = ckpt.path_for(1)
    times: dict[str, list[float]] = {name: [] for name in sources}
    try:
        for index in range(rounds):
            for name, path in paths.items():
                if not name.startswith("memory"):  # as a save leaves them: written with O_DIRECT, not cached
                    drop_from_page_cache([os.path.join(d, f) for d, _, files in os.walk(path) for f in files])
                storage = storage_for(path)
                target = os.path.join(work, f"copy-{index}-{len(times[name])}-{name[:5]}", "checkpoint-1")
                os.makedirs(os.path.dirname(target))
                started = time.perf_counter()
                promote_checkpoint(storage, path, storage, target)
                times[name].append(time.perf_counter() - started)
                shutil.rmtree(os.path.dirname(target))
    finally:
        ckptd.drop_held(sources["memory -> local tier"], force=True)
    return times


def memory_into_live(state: dict[str, torch.Tensor], rounds: int) -> dict[str, list[float]]:
    """Seconds to load a held-memory checkpoint into live tensors, with ``verify`` (a checksum
    pass first), with ``verify="inline"`` (checked as the bytes land) and without, and the
    ``copy_`` floor, interleaved per round."""
    held = f"shm://bench-recovery-{os.getpid()}-live"
    targets = {k: torch.zeros_like(v) for k, v in state.items()}  # live: their pages exist already
    times: dict[str, list[float]] = {"verify": [], "verify inline": [], "no verify": [], "copy_ floor": []}
    modes: dict[str, Any] = {"verify": True, "verify inline": "inline", "no verify": False}
    try:
        with ckptd.Checkpointer(held, hold_after_exit=0) as ckpt:
            ckpt.save(1, {"model": state})
            ckpt.load(1, into={"model": targets}, verify=True)  # the first pass faults nothing in later
            for _ in range(rounds):
                for kind in times:
                    started = time.perf_counter()
                    if kind == "copy_ floor":
                        for key, target in targets.items():
                            target.copy_(state[key])
                    else:
                        ckpt.load(1, into={"model": targets}, verify=modes[kind])
                    times[kind].append(time.perf_counter() - started)
    finally:
        with contextlib.suppress(ckptd.errors.CkptdError):
            ckptd.drop_held(held, force=True)
    return times


def goodput(interval_s: float, save_cost_s: float, restore_s: float, failures_per_hour: float) -> float:
    """Fraction of time spent on useful training, for saves every ``interval_s`` seconds that
    cost training ``save_cost_s`` each (blocking plus slowdown), with ``failures_per_hour``
    failures, each losing half an interval of work on average plus ``restore_s`` to get back:

        goodput = (1 - save_cost_s / interval_s) * (1 - failures_per_second * (interval_s / 2 + restore_s))
    """
    rate = failures_per_hour / 3600
    return max(0.0, (1 - save_cost_s / interval_s) * (1 - rate * (interval_s / 2 + restore_s)))


def measure_restores(
    args: argparse.Namespace,
    state: dict[str, torch.Tensor],
    work: str,
    s3: dict[str, Any] | None,
    figures: dict[str, Any],
) -> None:
    """Parts 2-4: restores (memory after a SIGKILL, peer replicas, local tiers warm and cold, S3),
    a tier copy alone, and memory into live tensors; into ``figures``."""
    shapes = {k: list(v.shape) for k, v in state.items()}
    # ---- restore from memory, after the trainer was killed -------------------------------
    held, behind = f"shm://bench-recovery-{os.getpid()}-restore", os.path.join(work, "restore-behind")
    trainer_killed_after_a_save(held, behind, args.size_mib)
    try:
        held_now = next(r.nbytes for r in ckptd.held_roots() if r.url == held)
        figures.setdefault("held_bytes", {})["restore"] = held_now
        for _ in range(args.rounds):
            row = restore(held, [{"root": behind}], shapes)
            if row["tier"] != 0:
                raise SystemExit(f"the memory tier did not serve the restore: tier {row['tier']}")
            figures["restore"].setdefault("memory tier 0 (trainer SIGKILLed)", []).append(row)
            row = restore(held, [{"root": behind}], shapes, verify="inline")
            figures["restore"].setdefault("memory tier 0, verify inline", []).append(row)
    finally:
        ckptd.drop_held(held, force=True)

    figures["peers"] = peer_replica_rounds(args.size_mib, args.rounds)

    # ---- restore -------------------------------------------------------------------------
    fast, slow = os.path.join(work, "restore-fast"), os.path.join(work, "restore-slow")
    tiers: list[ckptd.Tier] = [ckptd.Tier(slow)]
    tier_args: list[dict[str, Any]] = [{"root": slow}]
    if s3 is not None:
        tiers.append(ckptd.Tier("s3://tiers/restore", storage_options=s3))
        tier_args.append({"root": "s3://tiers/restore", "storage_options": s3})
    with ckptd.Checkpointer(fast, tiers=tiers) as ckpt:
        ckpt.save(7, {"model": state})
    rows = figures["restore"]
    files = [os.path.join(dirpath, n) for dirpath, _, names in os.walk(fast) for n in names]
    for _ in range(args.rounds):
        for path in files:  # warm: read once through the page cache
            with open(path, "rb") as f:
                while f.read(16 << 20):
                    pass
        rows.setdefault("local tier 0, page cache warm", []).append(restore(fast, tier_args, shapes))
        drop_from_page_cache(files)
        rows.setdefault("local tier 0, cold", []).append(restore(fast, tier_args, shapes))
    os.rename(os.path.join(fast, "checkpoint-7"), os.path.join(work, "moved-away"))
    for _ in range(args.rounds):
        rows.setdefault("local tier 1 (tier 0 lost)", []).append(restore(fast, tier_args, shapes))
    if s3 is not None:
        shutil.rmtree(os.path.join(slow, "checkpoint-7"))
        for _ in range(args.rounds):
            rows.setdefault("S3 tier 2 (tiers 0 and 1 lost)", []).append(restore(fast, tier_args, shapes))
    figures["copy"] = copy_alone(state, work, args.rounds)
    figures["live"] = memory_into_live(state, max(args.rounds, 5))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="128 MiB, 2 rounds")
    parser.add_argument("--no-s3", action="store_true", help="skip the S3 tier (moto)")
    parser.add_argument("--save-only", action="store_true", help="part 1 only: the save cost of each configuration")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.quick:
        args.size_mib, args.rounds = 128, 2
    state = make_state(args.size_mib)
    work = tempfile.mkdtemp(prefix="bench-recovery-")
    figures: dict[str, Any] = {"size_mib": args.size_mib, "rounds": args.rounds, "save": {}, "restore": {}}
    stack = contextlib.ExitStack()
    try:
        endpoint = None if args.no_s3 else stack.enter_context(moto_endpoint())
        s3 = {"endpoint_url": endpoint, **CREDENTIALS} if endpoint else None
        configurations: dict[str, Any] = {
            "one tier (local)": lambda r: [],
            "+ local tier": lambda r: [ckptd.Tier(os.path.join(work, f"slow-{r}"), keep_last=2)],
        }
        if s3 is not None:
            configurations["+ S3 tier"] = lambda r: [ckptd.Tier(f"s3://tiers/{r}", keep_last=2, storage_options=s3)]
        configurations["memory (shm://)"] = lambda r: []
        configurations["memory + local tier"] = lambda r: [ckptd.Tier(os.path.join(work, f"slow-{r}"), keep_last=2)]
        steps = Steps()
        try:
            for index in range(args.rounds):  # interleaved: every configuration once per round
                for number, (name, tiers) in enumerate(configurations.items()):
                    label = f"{index}-{number}"
                    memory = name.startswith("memory")
                    held = f"shm://bench-recovery-{os.getpid()}-{label}"
                    root = held if memory else os.path.join(work, f"fast-{label}")
                    figures["save"].setdefault(name, []).append(save_round(state, root, tiers(label), steps))
                    if memory:
                        figures.setdefault("held_bytes", {})[name] = ckptd.drop_held(root).nbytes
                    shutil.rmtree(root, ignore_errors=True)
                    shutil.rmtree(os.path.join(work, f"slow-{label}"), ignore_errors=True)
        finally:
            steps.stop()

        if not args.save_only:
            measure_restores(args, state, work, s3, figures)
    finally:
        stack.close()
        shutil.rmtree(work, ignore_errors=True)

    print(f"{args.size_mib} MiB, {args.rounds} rounds")
    print("save cost                blocking  committed  copied   step during / quiet   training lost")
    summary: dict[str, dict[str, float]] = {}
    for name, outcomes in figures["save"].items():
        med = {k: statistics.median(o[k] for o in outcomes) for k in outcomes[0]}
        ratio = statistics.median(o["step_during"] / o["step_quiet"] for o in outcomes)
        lost = statistics.median(training_lost(o) for o in outcomes)
        summary[name] = {**med, "step_ratio": ratio, "training_lost": lost}
        print(
            f"  {name:<22} {med['blocking']:7.3f}s {med['committed']:8.3f}s {med['copied']:7.3f}s"
            f"   {ratio:.2f}x{'':14}{lost:.3f}s"
        )
    one = summary.get("one tier (local)")
    # the target: the memory tier costs training <= 2% more than a one-tier save at the
    # same interval; at a save every 10 s that is 0.2 s per save.  Read two ways: the memory
    # tier alone, and a memory tier added in front of the local one.
    for name, what in (("memory (shm://)", "memory tier"), ("memory + local tier", "memory + local tier")):
        if one is not None and name in summary:
            extra = summary[name]["training_lost"] - one["training_lost"]
            verdict = "pass" if extra <= 0.02 * 10 else "FAIL"
            share = f"{extra / 10:+.1%} of a 10 s interval"
            print(f"  {what} against one tier: {extra:+.3f}s of training per save ({share}) {verdict}")
    held_bytes = figures.get("held_bytes", {})
    for name, nbytes in held_bytes.items():
        print(f"  memory held by {name}: {nbytes / 2**20:.0f} MiB (the root after close; a trainer adds an arena)")
    if args.save_only:
        figures["summary"] = summary
        if args.json:
            with open(args.json, "w") as f:
                json.dump(figures, f, indent=1)
        return
    print("restore (fresh process)  start->restored   load alone   tier read   load / copy_ floor (median of pairs)")
    restored: dict[str, float] = {}
    for name, outcomes in figures["restore"].items():
        total = statistics.median(o["total"] for o in outcomes)
        load = statistics.median(o["load"] for o in outcomes)
        ratio = statistics.median(o["load"] / o["copy_floor"] for o in outcomes)
        restored[name] = total
        print(f"  {name:<32} {total:6.2f}s {load:10.2f}s   {outcomes[0]['tier']}   {ratio:.2f}x")
    print_peer_rows(figures["peers"])
    print("a tier copy alone (no training)        median   per round")
    for name, seconds in figures["copy"].items():
        print(f"  {name:<36} {statistics.median(seconds):6.3f}s   {', '.join(f'{x:.2f}' for x in seconds)}")
    live = figures["live"]
    floor = live["copy_ floor"]
    print("memory into live tensors (in-process)  median   / copy_ floor (median of per-round ratios)")
    for kind, seconds in live.items():
        ratio = statistics.median(s / f for s, f in zip(seconds, floor, strict=True))
        print(f"  {kind:<36} {statistics.median(seconds):6.3f}s   {ratio:.2f}x")
    figures["summary"] = summary
    one = summary["one tier (local)"]
    cost = one["blocking"]  # what training waits for; the slowdown while writing is reported above
    sources = {
        "memory": restored.get("memory tier 0 (trainer SIGKILLed)", float("nan")),
        "local (warm)": restored.get("local tier 0, page cache warm", float("nan")),
    }
    print("goodput (save every N s, 1 failure per H hours, restored from memory | from the warm local tier)")
    for interval in (60.0, 600.0, 1800.0):
        for hours in (1.0, 24.0):
            values = "  ".join(f"{goodput(interval, cost, seconds, 1 / hours):.4f}" for seconds in sources.values())
            print(f"  every {interval:6.0f}s  failure every {hours:4.0f}h  goodput {values}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
