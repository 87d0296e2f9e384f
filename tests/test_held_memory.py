"""Held-memory roots (``shm://NAME``): checkpoints in this user's shared memory that outlive the
trainer for ``hold_after_exit``, restored by a new process, released by the keeper (or ``drop``).

Real processes throughout: the trainer is a child process in a process group of its own, killed
with ``killpg(SIGKILL)`` as torchrun kills its workers (the writer dies with it); the keeper is
the real daemon; another user is a real uid (``setpriv``).  The session's held roots live under a
base of their own (``CKPTD_HELD_DIR``, set by the ``leftover_processes`` plugin, which also fails
the suite if a keeper or held memory is left)."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import pytest
import torch
from conftest import assert_same, process_state, wait_for, writers_fail, writers_strike

import ckptd
from ckptd.errors import ConfigError, HeldRootInUseError, UnsafeCheckpointError
from ckptd.storage.held import control_path, held_path, private_directory
from ckptd.writer import keeper as keeper_module
from ckptd.writer.keeper import POLL_SECONDS, HoldLease

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TRAINER = r"""
import json, os, signal, sys
import torch, ckptd

root, local, last, hold, mode = sys.argv[1:6]

def state(step):
    generator = torch.Generator().manual_seed(step)
    size = 4 * 1024 * 1024 if mode == "big" else 2048
    return {"model": {"w": torch.randn(size, generator=generator), "b": torch.full((16,), float(step))},
            "progress": {"step": step}}

ckpt = ckptd.Checkpointer(root, hold_after_exit=float(hold), max_shard_size="4MiB",
                          tiers=[ckptd.Tier(local, every=2, keep_last=2)])
for step in range(1, int(last) + 1):
    ckpt.save(step, state(step))
ckpt.wait_promotions(60)
if mode == "big":  # one more save, left writing: the test freezes and kills it mid-way
    ckpt.async_save(int(last) + 1, state(int(last) + 1))
print(json.dumps({"writer": ckpt.writer_pid, "keeper": ckptd.held_roots()[0].keeper_pid}), flush=True)
signal.pause()
"""


def _state(step: int, mode: str = "small") -> dict[str, Any]:
    generator = torch.Generator().manual_seed(step)
    size = 4 * 1024 * 1024 if mode == "big" else 2048
    return {
        "model": {"w": torch.randn(size, generator=generator), "b": torch.full((16,), float(step))},
        "progress": {"step": step},
    }


def _name() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Trainer:
    """A training process in a process group of its own, saving steps 1..last to ``root`` (with a
    local tier every 2 steps), then waiting to be killed."""

    def __init__(self, root: str, local: str, last: int, hold: float, mode: str = "small") -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", TRAINER, root, local, str(last), str(hold), mode],
            stdout=subprocess.PIPE,
            start_new_session=True,
            cwd=REPO,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line, f"the trainer exited with {self.process.wait()} before it was ready"
        self.pids = json.loads(line)

    def kill_group(self) -> None:
        """torchrun's way: SIGKILL to the trainer's whole process group (its writer included)."""
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)
        wait_for(lambda: not _alive(self.pids["writer"]), timeout=30)


def _committed(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("checkpoint-"))


def _controls(name: str) -> list[str]:
    """The control files of ``name`` in the private ``.hold`` directory."""
    directory = os.path.dirname(control_path(name, "inuse"))
    return sorted(f for f in os.listdir(directory) if f.rpartition(".")[0] == name)


def _held_bytes(name: str) -> int:
    return next((root.nbytes for root in ckptd.held_roots() if root.url == f"shm://{name}"), 0)


def test_a_restarted_trainer_restores_from_memory_after_a_killpg_and_the_memory_is_released_after_the_hold(tmp_path):
    name, local = _name(), str(tmp_path / "local")
    trainer = Trainer(f"shm://{name}", local, last=3, hold=60.0)  # the restart below sets 0.5 s
    keeper = trainer.pids["keeper"]
    trainer.kill_group()
    assert _alive(keeper), "the keeper runs in a session of its own: killpg must not reach it"
    assert _committed(held_path(name)) == ["checkpoint-2", "checkpoint-3"]  # keep_last=2 by default
    with ckptd.Checkpointer(f"shm://{name}", hold_after_exit=0.5, tiers=[ckptd.Tier(local, every=2)]) as restarted:
        assert restarted.latest_step() == 3
        assert_same(_state(3), restarted.load())
        assert restarted.last_load is not None and restarted.last_load.tier == 0  # from memory, not from disk
        assert restarted.last_load.path == os.path.join(held_path(name), "checkpoint-3")
    wait_for(lambda: not os.path.exists(held_path(name)), timeout=30)
    wait_for(lambda: not _alive(keeper), timeout=30)
    assert _held_bytes(name) == 0 and all(r.url != f"shm://{name}" for r in ckptd.held_roots())
    assert _controls(name) == [], "the lease and keeper lock files go with the root"
    with ckptd.Checkpointer(local) as disk:  # the local tier kept what was promoted to it
        assert disk.steps() == [2]


@pytest.mark.parametrize("made_by", ["link", "write"])
def test_a_trainer_killed_mid_save_leaves_its_previous_snapshot_and_never_serves_the_half_written_one(
    tmp_path, monkeypatch, made_by
):
    name, local = _name(), str(tmp_path / "local")
    if made_by == "write":  # a staging budget: the writer copies the arena into the files
        monkeypatch.setenv("CKPTD_STAGING_MEMORY", "256MiB")
    # the trainer's writer stops itself right after it made its first file of step 2's staging
    # (linked its staging file there, or wrote into it)
    with writers_strike(made_by, r"/\.checkpoint-2\.tmp-[^/]+/model-[^/]*\.safetensors$", whom="stop"):
        trainer = Trainer(f"shm://{name}", local, last=1, hold=60.0, mode="big")
    root = held_path(name)
    arenas = os.path.join(root, ".ckptd-arenas")

    def staged_bytes() -> int:
        total = 0
        for entry in os.listdir(root):
            if entry.startswith(".checkpoint-2.tmp-"):
                for directory, _, files in os.walk(os.path.join(root, entry)):
                    total += sum(os.path.getsize(os.path.join(directory, f)) for f in files)
        return total

    wait_for(lambda: process_state(trainer.pids["writer"]) == "T", timeout=60)
    assert not os.path.exists(os.path.join(root, "checkpoint-2"))
    trainer.kill_group()
    assert staged_bytes() > 0  # a half-written snapshot of step 2 is in memory...
    with ckptd.Checkpointer(f"shm://{name}", hold_after_exit=0, tiers=[ckptd.Tier(local, every=2)]) as restarted:
        assert restarted.steps() == [1]  # ...and is no checkpoint: never listed, never loaded
        assert_same(_state(1, "big"), restarted.load())
        assert restarted.last_load is not None and restarted.last_load.tier == 0
        assert not [e for e in os.listdir(root) if e.startswith(".checkpoint-2.tmp-")]  # collected at open
        # the dead trainer's staging files are gone too; step 1's shard files keep their bytes
        assert not os.path.exists(arenas) or os.listdir(arenas) == []
        assert_same(_state(1, "big"), restarted.load(1, verify=True))
    wait_for(lambda: not os.path.exists(root), timeout=30)


def test_a_new_trainer_takes_the_held_root_over_and_stops_the_clock(tmp_path):
    name = _name()
    trainer = Trainer(f"shm://{name}", str(tmp_path / "local"), last=2, hold=60.0)
    keeper = trainer.pids["keeper"]
    trainer.kill_group()
    successor = ckptd.Checkpointer(f"shm://{name}", hold_after_exit=1.0)  # the hold is 1 s from now on
    try:
        time.sleep(3.0)  # three times the hold: only the successor's lease keeps the root
        assert successor.steps() == [1, 2]
        assert next(r for r in ckptd.held_roots() if r.url == f"shm://{name}").in_use
        successor.save(3, _state(3))
    finally:
        successor.close()
    wait_for(lambda: not os.path.exists(held_path(name)), timeout=30)
    wait_for(lambda: not _alive(keeper), timeout=30)


def test_memory_that_lost_the_newest_step_gives_way_to_the_local_tier(tmp_path):
    name, local = _name(), str(tmp_path / "local")
    with ckptd.Checkpointer(f"shm://{name}", hold_after_exit=0, tiers=[ckptd.Tier(local, every=2)]) as ckpt:
        for step in (1, 2):
            ckpt.save(step, _state(step))
        assert ckpt.wait_promotions(60)
    wait_for(lambda: not os.path.exists(held_path(name)), timeout=30)  # released at once: the host "rebooted"
    with ckptd.Checkpointer(f"shm://{name}", hold_after_exit=0, tiers=[ckptd.Tier(local, every=2)]) as restarted:
        assert_same(_state(2), restarted.load())
        assert restarted.last_load is not None and restarted.last_load.tier == 1
    wait_for(lambda: not os.path.exists(held_path(name)), timeout=30)


def test_a_damaged_held_snapshot_is_refused_and_the_local_copy_loads(tmp_path):
    name, local = _name(), str(tmp_path / "local")
    with ckptd.Checkpointer(f"shm://{name}", hold_after_exit=0, tiers=[ckptd.Tier(local, every=2)]) as ckpt:
        ckpt.save(2, _state(2))
        assert ckpt.wait_promotions(60)
        shard = next(
            os.path.join(directory, f)
            for directory, _, files in os.walk(held_path(name))
            for f in files
            if f.endswith(".safetensors")
        )
        with open(shard, "r+b") as f:
            f.seek(-3, os.SEEK_END)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x01]))
        assert_same(_state(2), ckpt.load())
        assert ckpt.last_load is not None and ckpt.last_load.tier == 1
    wait_for(lambda: not os.path.exists(held_path(name)), timeout=30)


def test_drop_is_refused_while_a_trainer_uses_the_root_and_frees_it_otherwise(tmp_path):
    name = _name()
    ckpt = ckptd.Checkpointer(f"shm://{name}", hold_after_exit=300)
    try:
        ckpt.save(1, _state(1))
        (described,) = [r for r in ckptd.held_roots() if r.url == f"shm://{name}"]
        assert described.in_use and described.nbytes >= 2048 * 4 and described.hold_after_exit == 300
        assert described.keeper_pid is not None and _alive(described.keeper_pid)
        with pytest.raises(HeldRootInUseError, match=name):
            ckptd.drop_held(f"shm://{name}")
        assert os.path.isdir(held_path(name))
    finally:
        ckpt.close()
    assert os.path.isdir(held_path(name))  # held for 300 s...
    dropped = ckptd.drop_held(name)  # ...unless dropped
    assert dropped.url == f"shm://{name}" and not dropped.in_use
    assert not os.path.exists(held_path(name))
    wait_for(lambda: not _alive(described.keeper_pid), timeout=30)  # the keeper saw it go
    assert _controls(name) == []
    with pytest.raises(ckptd.errors.CheckpointNotFoundError):
        ckptd.drop_held(name)


def test_a_lease_that_waited_on_a_removed_lock_file_holds_the_file_that_replaced_it():
    # A keeper removes a root holding the ``inuse`` lock and then unlinks the file.  A trainer that
    # was waiting on that file must end up holding the file now at the path, or the next keeper
    # (which locks the path) would find the root unused and remove it under the live trainer.
    name = _name()
    removing = os.open(control_path(name, "inuse"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(removing, fcntl.LOCK_EX)  # a keeper in the middle of a removal
    leases: list[Any] = []
    taking = threading.Thread(target=lambda: leases.append(HoldLease(name, 0.0)))
    taking.start()
    try:
        time.sleep(0.5)
        assert not leases, "the lease waits while the removal holds the lock"
        os.unlink(control_path(name, "inuse"))
        os.close(removing)  # the removal ends
        taking.join(30)
        (lease,) = leases
        time.sleep(3 * POLL_SECONDS)  # the keeper the lease started has looked at least twice
        described = [r for r in ckptd.held_roots() if r.url == f"shm://{name}"]
        assert described and described[0].in_use, "the lease holds the lock file at the path, not the removed one"
        fresh = os.open(control_path(name, "inuse"), os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fresh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fresh)
    finally:
        taking.join(30)
        for lease in leases:
            lease.close()
    wait_for(lambda: _controls(name) == [], timeout=30)  # nothing saved: the keeper forgets it all


def test_what_cut_short_removals_left_is_removed_and_a_live_names_files_are_kept(tmp_path):
    # Versions before this one left NAME.inuse and NAME.keeper behind for every root released; a
    # keeper or drop killed in the middle of deleting a root leaves it renamed out of sight, its
    # memory held by nothing; a lease killed while writing its settings leaves their staging file.
    # A keeper that ends (here: through a drop) removes all of it, never what a live process uses.
    orphan, live, dropped = _name(), _name(), _name()
    for kind in ("inuse", "keeper"):
        with open(control_path(orphan, kind), "w") as f:
            f.write("12345\n" if kind == "keeper" else "")
    doomed = os.path.join(private_directory(), f".dropping-{orphan}-123-1")  # renamed, its deletion killed
    os.makedirs(os.path.join(doomed, "checkpoint-1"))
    with open(os.path.join(doomed, "checkpoint-1", "model.safetensors"), "wb") as f:
        f.write(b"\0" * 4096)
    stale, fresh = (
        control_path(orphan, "settings") + ".staging-123-1",
        control_path(live, "settings") + ".staging-456-1",
    )
    for staged in (stale, fresh):
        with open(staged, "w") as f:
            f.write("{")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))  # a lease died writing it an hour ago
    with ckptd.Checkpointer(f"shm://{live}", hold_after_exit=300) as using:
        using.save(1, _state(1))
        with ckptd.Checkpointer(f"shm://{dropped}", hold_after_exit=300) as other:
            other.save(1, _state(1))
        ckptd.drop_held(dropped)
        wait_for(lambda: _controls(dropped) == [], timeout=30)
        assert _controls(orphan) == [] and not os.path.exists(stale)
        assert os.path.exists(fresh), "settings being written now are a live lease's"
        os.unlink(fresh)
        assert not os.path.exists(doomed), "a root whose deletion was cut short is deleted"
        assert _controls(live) == [f"{live}.inuse", f"{live}.keeper", f"{live}.settings"]
        (described,) = [r for r in ckptd.held_roots() if r.url == f"shm://{live}"]
        assert described.in_use and described.keeper_pid is not None
    ckptd.drop_held(live)
    wait_for(lambda: _controls(live) == [], timeout=30)


def _shard_inodes(root: str, step: int) -> set[int]:
    directory = os.path.join(root, f"checkpoint-{step}")
    return {os.stat(os.path.join(directory, n)).st_ino for n in os.listdir(directory) if n.endswith(".safetensors")}


@pytest.mark.parametrize("staging_memory", [None, "256MiB"], ids=["staged-files", "budget-spare"])
def test_a_save_reuses_the_pages_of_the_checkpoint_retention_dropped(tmp_path, staging_memory):
    # Staged files: step 4 stages into step 1's files once retention dropped it.  With a budget
    # the writer copies the arena into files, taking the spare's (the dropped checkpoint's).
    name = _name()
    try:
        with ckptd.Checkpointer(
            f"shm://{name}", hold_after_exit=300, keep_last=2, staging_memory=staging_memory
        ) as ckpt:
            inodes = {}
            for step in (1, 2, 3, 4, 5):
                ckpt.save(step, _state(step, "big"))
                inodes[step] = _shard_inodes(ckpt.root, step)
            assert ckpt.steps() == [4, 5]
            spare = os.path.join(ckpt.root, ".ckptd-spare")
            assert "checkpoint_manifest.json" not in os.listdir(spare), "a spare is never a checkpoint"
            assert inodes[4] == inodes[1] and inodes[5] == inodes[2], "step 4 took step 1's files, step 5 step 2's"
            assert not inodes[3] & inodes[1], "step 3 was written before any checkpoint was dropped"
            for step in (4, 5):
                assert_same(_state(step, "big"), ckpt.load(step, verify=True))
    finally:
        ckptd.drop_held(name, force=True)


def _arena_inodes(root: str) -> set[int]:
    directory = os.path.join(root, ".ckptd-arenas")
    return {os.stat(os.path.join(directory, n)).st_ino for n in os.listdir(directory)}


def _bytes_written_by(pid: int) -> int:
    with open(f"/proc/{pid}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


@pytest.mark.parametrize("keep_last", [1, 3])
def test_a_held_save_links_the_files_it_staged_into_and_holds_one_state_beyond_its_checkpoints(keep_last):
    name = _name()
    try:
        with ckptd.Checkpointer(f"shm://{name}", hold_after_exit=300, keep_last=keep_last) as ckpt:
            files_per_save = 0
            for step in range(1, 7):
                before = _bytes_written_by(ckpt.writer_pid) if step > 1 else 0
                ckpt.save(step, _state(step, "big"))
                shards = _shard_inodes(ckpt.root, step)
                files_per_save = len(shards)
                assert shards <= _arena_inodes(ckpt.root), "every shard file is a file the trainer staged into"
                if step > 1:  # the writer checksummed and linked: it wrote no shard's bytes
                    assert _bytes_written_by(ckpt.writer_pid) - before < 1024 * 1024
            assert ckpt.steps() == list(range(7 - keep_last, 7))
            # the kept checkpoints and the next save's arena: nothing more is held
            assert len(_arena_inodes(ckpt.root)) == (keep_last + 1) * files_per_save
            for step in ckpt.steps():  # no save copied into the files of a kept checkpoint
                assert_same(_state(step, "big"), ckpt.load(step, verify=True))
        assert os.listdir(os.path.join(held_path(name), ".ckptd-arenas")) == []  # close() drops its names
        with ckptd.Checkpointer(f"shm://{name}", hold_after_exit=300) as reopened:  # the files stay whole
            assert_same(_state(6, "big"), reopened.load(6, verify=True))
    finally:
        ckptd.drop_held(name, force=True)


def test_prepare_on_a_held_root_makes_the_whole_ring_and_saves_back_to_back_make_no_arena():
    name = _name()
    try:
        with ckptd.Checkpointer(f"shm://{name}", hold_after_exit=300, keep_last=2) as ckpt:
            ckpt.prepare(_state(0, "big"))
            ring = _arena_inodes(ckpt.root)
            for step in range(1, 6):  # no pause between saves: nothing is made in the background
                ckpt.save(step, _state(step, "big"))
                assert _shard_inodes(ckpt.root, step) <= ring
            assert _arena_inodes(ckpt.root) == ring and len(ring) == 3 * len(_shard_inodes(ckpt.root, 5))
            for step in (4, 5):
                assert_same(_state(step, "big"), ckpt.load(step, verify=True))
    finally:
        ckptd.drop_held(name, force=True)


def test_a_staged_file_that_cannot_be_linked_is_written(tmp_path):
    name = _name()
    try:
        with writers_fail("link", r"/\.checkpoint-\d+\.tmp-[^/]+/[^/]+\.safetensors$", 18):  # EXDEV
            with ckptd.Checkpointer(f"shm://{name}", hold_after_exit=300, keep_last=2) as ckpt:
                for step in (1, 2, 3):
                    ckpt.save(step, _state(step, "big"))
                    assert not _shard_inodes(ckpt.root, step) & _arena_inodes(ckpt.root)
                for step in (2, 3):
                    assert_same(_state(step, "big"), ckpt.load(step, verify=True))
    finally:
        ckptd.drop_held(name, force=True)


def test_files_an_incremental_save_linked_into_a_kept_checkpoint_are_never_reused(tmp_path):
    name = _name()
    table = torch.randn(512, 1024, generator=torch.Generator().manual_seed(7))
    try:
        with ckptd.Checkpointer(f"shm://{name}", hold_after_exit=300, keep_last=2, incremental=True) as ckpt:
            for step in (1, 2, 3):  # declared frozen: saves 2 and 3 link save 1's file of the table
                ckpt.save(step, {**_state(step, "big"), "table": {"embed": table}}, frozen={"table": ["embed"]})
            # retention made step 1 the spare, without the table's file that steps 2 and 3 share
            assert "table-00001-of-00001.safetensors" not in os.listdir(os.path.join(ckpt.root, ".ckptd-spare"))
            assert os.stat(os.path.join(ckpt.path_for(3), "table-00001-of-00001.safetensors")).st_nlink >= 2
            before = table.clone()
            table.add_(1.0)  # the table changes: save 4 writes the file a spare of that name holds
            ckpt.save(4, {**_state(4, "big"), "table": {"embed": table}})
            assert ckpt.steps() == [3, 4]
            assert_same(before, ckpt.load(3, verify=True)["table"]["embed"])  # step 3 kept its bytes
            assert_same(table, ckpt.load(4, verify=True)["table"]["embed"])
    finally:
        ckptd.drop_held(name, force=True)


def test_reads_of_a_checkpoint_whose_pages_are_being_reused_return_it_whole_or_say_it_was_replaced(tmp_path):
    name = _name()
    seen: dict[str, int] = {"whole": 0, "replaced": 0}
    wrong: list[str] = []
    try:
        with ckptd.Checkpointer(f"shm://{name}", hold_after_exit=300, keep_last=2) as ckpt:
            ckpt.save(1, _state(1, "big"))
            ckpt.save(2, _state(2, "big"))
            reader = ckptd.CheckpointReader.open(ckpt.path_for(1))
            want = _state(1, "big")["model"]

            def read_step_1() -> None:  # until it is told step 1 is gone: after save 4, at the latest
                for _ in range(100_000):
                    try:
                        got = reader.read("model")
                    except ckptd.errors.CheckpointReplacedError:
                        seen["replaced"] += 1
                        return
                    if all(torch.equal(got[k], v) for k, v in want.items()):
                        seen["whole"] += 1
                    else:
                        wrong.append("a read returned bytes that are not step 1's")

            thread = threading.Thread(target=read_step_1)
            thread.start()
            for step in (3, 4):  # 3 makes step 1 the spare, 4 overwrites its files
                ckpt.save(step, _state(step, "big"))
            thread.join(60)
            reader.close()
            assert _shard_inodes(ckpt.root, 4) and ckpt.steps() == [3, 4]
    finally:
        ckptd.drop_held(name, force=True)
    assert not wrong, wrong
    assert seen["replaced"] == 1, seen  # the reader learned step 1 is gone, and never read step 4 as step 1


def test_a_held_base_that_does_not_exist_is_named_in_the_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTD_HELD_DIR", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match=r"CKPTD_HELD_DIR=.*missing names a directory that does not exist"):
        ckptd.Checkpointer("shm://x")
    assert not (tmp_path / "missing").exists()  # never created: a typo must not hold memory on disk


def test_a_private_directory_that_is_not_private_is_refused(tmp_path, monkeypatch):
    base = tmp_path / "base"
    base.mkdir()
    monkeypatch.setenv("CKPTD_HELD_DIR", str(base))
    mine = base / f"ckptd-{os.getuid()}"
    mine.mkdir(mode=0o700)
    os.chmod(mine, 0o755)  # readable by everyone: another user could read the snapshots
    with pytest.raises(UnsafeCheckpointError, match="not a private directory"):
        ckptd.Checkpointer("shm://x")
    os.rmdir(mine)
    (base / "elsewhere").mkdir(mode=0o700)
    os.symlink(base / "elsewhere", mine)  # a link planted by someone else
    with pytest.raises(UnsafeCheckpointError, match="not a private directory"):
        ckptd.Checkpointer("shm://x")
    os.unlink(mine)
    if os.getuid() == 0:
        mine.mkdir(mode=0o700)
        os.chown(mine, 65534, 65534)  # another user's
        with pytest.raises(UnsafeCheckpointError, match="owner uid 65534"):
            ckptd.Checkpointer("shm://x")
    for bad in ("shm://", "shm://a/b", "shm://..", "shm://.hidden"):
        with pytest.raises(ConfigError):
            ckptd.Checkpointer(bad)
    with pytest.raises(ConfigError, match="fastest tier"):
        ckptd.Tier("shm://x")


@pytest.mark.skipif(os.getuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_another_user_cannot_read_or_take_a_held_snapshot(tmp_path):
    name = _name()
    with ckptd.Checkpointer(f"shm://{name}", hold_after_exit=0) as ckpt:
        ckpt.save(1, _state(1))
        shard = next(
            os.path.join(directory, f)
            for directory, _, files in os.walk(held_path(name))
            for f in files
            if f.endswith(".safetensors")
        )
        probe = f"""
import os, sys
sys.path.insert(0, {REPO!r})
from ckptd.writer.keeper import held_roots
for what in (lambda: os.listdir({private_directory()!r}), lambda: open({shard!r}, "rb").read(1)):
    try:
        what()
        print("READ")
    except PermissionError:
        print("denied")
print([root.url for root in held_roots()])  # its own namespace: none of ours
"""
        system_python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
        result = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", system_python, "-c", probe],
            capture_output=True,
            text=True,
            timeout=60,
            cwd="/",
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.split("\n")[:3] == ["denied", "denied", "[]"], result.stdout + result.stderr
    wait_for(lambda: not os.path.exists(held_path(name)), timeout=30)


def test_hold_after_exit_reads_durations_and_the_environment(monkeypatch):
    assert ckptd.CheckpointerOptions(hold_after_exit="5min").hold_after_exit == 300.0
    assert ckptd.CheckpointerOptions(hold_after_exit="90s").hold_after_exit == 90.0
    assert ckptd.CheckpointerOptions(hold_after_exit=0).hold_after_exit == 0.0
    monkeypatch.setenv("CKPTD_HOLD_AFTER_EXIT", "1h")
    assert ckptd.CheckpointerOptions.from_env().hold_after_exit == 3600.0
    for bad in (-1, "soon", "5 days", True, float("nan")):
        with pytest.raises(ConfigError, match="hold_after_exit"):
            ckptd.CheckpointerOptions(hold_after_exit=bad)


def _save_two_ranks_to_memory(rank: int, world: int, held: str, local: str) -> None:
    with ckptd.Checkpointer(held, dist_timeout=60, hold_after_exit=60, tiers=[ckptd.Tier(local, every=2)]) as ckpt:
        for step in (1, 2, 3):
            mine = {"v": torch.full((5,), float(100 * rank + step))}
            ckpt.save(step, {"model": _state(step)["model"], "mine": mine}, sharing={"mine": "per_rank"})
        ckpt.wait_promotions(120)


def _restore_two_ranks(rank: int, world: int, held: str, local: str) -> dict[str, Any]:
    with ckptd.Checkpointer(held, dist_timeout=60, hold_after_exit=0, tiers=[ckptd.Tier(local, every=2)]) as ckpt:
        loaded = ckpt.load()
        assert ckpt.last_load is not None
        return {"step": ckpt.last_load.step, "tier": ckpt.last_load.tier, "mine": loaded["mine"]["v"]}


@pytest.mark.distributed
@pytest.mark.multiprocess
def test_two_ranks_save_to_one_held_root_and_a_restarted_job_restores_from_it(tmp_path):
    from distributed import run_ranks

    name, local = _name(), str(tmp_path / "local")
    run_ranks(2, _save_two_ranks_to_memory, f"shm://{name}", local)
    assert _committed(held_path(name)) == ["checkpoint-2", "checkpoint-3"]  # one root, both ranks' files
    outcomes = run_ranks(2, _restore_two_ranks, f"shm://{name}", local)
    for rank in (0, 1):
        assert (outcomes[rank]["step"], outcomes[rank]["tier"]) == (3, 0)
        assert_same(torch.full((5,), float(100 * rank + 3)), outcomes[rank]["mine"])
    wait_for(lambda: not os.path.exists(held_path(name)), timeout=30)  # hold_after_exit=0 once both are gone


def test_a_held_checkpoint_is_checked_as_it_is_read_into_new_and_live_tensors(tmp_path):
    """From held memory, ``verify=True`` into new tensors and ``verify="inline"`` into live ones
    check each file as it lands (one pass over the memory): bit-exact, and a flipped byte in
    the held file raises."""
    from ckptd.errors import CorruptCheckpointError

    name = _name()
    try:
        with ckptd.Checkpointer(f"shm://{name}", hold_after_exit=300) as ckpt:
            path = ckpt.save(1, _state(1, "big")).path
            assert_same(_state(1, "big"), ckpt.load(1, verify=True))
            live = {"w": torch.zeros(4 * 1024 * 1024), "b": torch.zeros(16)}
            ckpt.load(1, into={"model": live}, verify="inline")
            assert_same(_state(1, "big")["model"], live)
            shard = next(os.path.join(path, n) for n in sorted(os.listdir(path)) if n.endswith(".safetensors"))
            with open(shard, "r+b") as f:
                f.seek(os.path.getsize(shard) // 2)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0xFF]))
            with pytest.raises(CorruptCheckpointError, match="CRC32C"):
                ckpt.load(1, verify=True)
            with pytest.raises(CorruptCheckpointError, match="CRC32C"):
                ckpt.load(1, into={"model": live}, verify="inline")
    finally:
        ckptd.drop_held(name, force=True)


def test_a_root_named_like_a_settings_file_keeps_its_lock_files_through_a_sweep():
    # "run.settings" is a legal name: its lock files (run.settings.inuse, ...) must never be taken
    # for settings being written, even once they are old, or its live trainer loses its lease.
    name, other = f"{_name()}.settings", _name()
    with ckptd.Checkpointer(f"shm://{name}", hold_after_exit=300) as using:
        using.save(1, _state(1))
        hour_ago = time.time() - 3600
        for kind in ("inuse", "keeper", "settings"):
            os.utime(control_path(name, kind), (hour_ago, hour_ago))
        with ckptd.Checkpointer(f"shm://{other}", hold_after_exit=300) as passing:
            passing.save(1, _state(1))
        ckptd.drop_held(other)  # sweeps what removals left
        assert _controls(name) == [f"{name}.inuse", f"{name}.keeper", f"{name}.settings"]
        with pytest.raises(HeldRootInUseError):
            ckptd.drop_held(name)
        assert using.steps() == [1]
    ckptd.drop_held(name)
    wait_for(lambda: _controls(name) == [] and _controls(other) == [], timeout=30)


def test_threads_writing_one_names_hold_settings_at_once_never_fail():
    name, failures = _name(), []

    def write(hold: float) -> None:
        for _ in range(200):
            try:
                keeper_module._write_settings(name, hold)
            except OSError as e:
                failures.append(e)

    threads = [threading.Thread(target=write, args=(float(i),)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert failures == []
    with open(control_path(name, "settings")) as f:
        assert json.load(f)["hold_after_exit"] in {0.0, 1.0, 2.0, 3.0}
    assert _controls(name) == [f"{name}.settings"], "no settings being written are left"
    os.unlink(control_path(name, "settings"))


def test_ls_and_drop_wait_for_a_removal_and_do_not_take_it_for_a_trainer():
    # A keeper (or a drop) removing a root holds its inuse file exclusively for as long as the
    # deletion takes; leases hold it shared.  Meanwhile ls must not say "in use", nor drop refuse.
    name = _name()
    os.makedirs(os.path.join(held_path(name), "checkpoint-1"))
    removing = os.open(control_path(name, "inuse"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(removing, fcntl.LOCK_EX)
    answers: dict[str, Any] = {}

    def ask(what: str, call: Any) -> None:
        try:
            answers[what] = call()
        except Exception as e:  # noqa: BLE001 - the assertion below shows it
            answers[what] = e

    asking = [
        threading.Thread(target=ask, args=("ls", ckptd.held_roots)),
        threading.Thread(target=ask, args=("drop", lambda: ckptd.drop_held(name))),
    ]
    for thread in asking:
        thread.start()
    time.sleep(0.5)
    assert answers == {}, "ls and drop wait for the removal instead of reporting a trainer"
    shutil.rmtree(held_path(name))  # the removal ends: root, then the lock file, then the lock
    os.unlink(control_path(name, "inuse"))
    os.close(removing)
    for thread in asking:
        thread.join(30)
    assert all(not r.in_use for r in answers["ls"] if r.url == f"shm://{name}")
    assert isinstance(answers["drop"], ckptd.HeldRoot) and not answers["drop"].in_use
    assert _controls(name) == [] and not os.path.exists(held_path(name))


def test_held_roots_reads_a_keeper_that_has_not_written_its_pid_yet_as_none():
    name = _name()
    os.makedirs(os.path.join(held_path(name), "checkpoint-1"))
    starting = os.open(control_path(name, "keeper"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(starting, fcntl.LOCK_EX)  # a keeper between its lock and its pid
    try:
        (described,) = [r for r in ckptd.held_roots() if r.url == f"shm://{name}"]
        assert described.keeper_pid is None and not described.in_use
    finally:
        os.close(starting)
    ckptd.drop_held(name)
    assert _controls(name) == [] and not os.path.exists(held_path(name))


def test_dropping_a_name_with_only_lock_files_left_removes_them():
    name = _name()  # a removal killed after it removed the root and the settings
    for kind in ("inuse", "keeper"):
        open(control_path(name, kind), "w").close()
    with pytest.raises(ckptd.errors.CheckpointNotFoundError):
        ckptd.drop_held(name)
    assert _controls(name) == []
