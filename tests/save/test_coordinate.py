"""The commit protocol (solo, and over a c10d store) and the incremental-save policy."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed as torch_dist
from conftest import assert_same

import ckptd
from ckptd.catalog import read_manifest
from ckptd.dist.group import DistContext
from ckptd.errors import CheckpointExistsError, DistributedSaveError
from ckptd.retention import RunRecord
from ckptd.save.coordinate import Outcome, Report, Round, SoloCoordinator, StoreCoordinator
from ckptd.save.incremental import IncrementalPolicy, plan_file_frozen
from ckptd.storage import LocalStorage
from ckptd.writer.protocol import FileResult


class Frozen(torch.nn.Module):
    """A frozen embedding (files an incremental save reuses) and a trainable head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, 32)
        self.head = torch.nn.Linear(32, 8)
        self.embed.weight.requires_grad_(False)


def result(name: str, offset: int = 0, size: int = 4) -> FileResult:
    return FileResult(name=name, size=size, crc32c=7, seconds=0.0, file_offset=offset)


# ---- SoloCoordinator -----------------------------------------------------------------------


def test_solo_commits_the_reported_results_and_never_aborts():
    coordinator = SoloCoordinator()
    round_ = Round("k", 3, time.monotonic())
    calls: list[str] = []
    coordinator.prepare(round_, lambda: calls.append("prepare"))
    report = Report((result("a"), result("b")))
    coordinator.report(round_, report)
    committed: list[list[FileResult]] = []

    def commit(results):
        committed.append(list(results))
        return "manifest"

    outcome = coordinator.outcome(round_, report, commit, lambda: calls.append("abort"))
    assert outcome == Outcome("manifest")
    assert committed == [[result("a"), result("b")]]
    assert calls == ["prepare"]


def test_solo_aborts_and_raises_the_rank_s_own_error_without_committing():
    coordinator = SoloCoordinator()
    round_ = Round("k", 3, time.monotonic())
    error = OSError("disk full writing model-00001-of-00001.safetensors")
    aborted: list[bool] = []
    with pytest.raises(OSError) as caught:
        coordinator.outcome(
            round_, Report(error=error), lambda results: pytest.fail("committed"), lambda: aborted.append(True)
        )
    assert caught.value is error
    assert aborted == [True]


def test_solo_aborts_when_the_commit_fails():
    coordinator = SoloCoordinator()
    aborted: list[bool] = []

    def commit(results):
        raise CheckpointExistsError("checkpoint-3 already exists")

    with pytest.raises(CheckpointExistsError, match="checkpoint-3 already exists"):
        coordinator.outcome(Round("k", 3, time.monotonic()), Report(), commit, lambda: aborted.append(True))
    assert aborted == [True]


def test_solo_prepare_failure_is_raised_from_wait_and_leaves_the_old_checkpoint():
    """Object stores learn that a step exists from the claim, in the coordinator's prepare."""
    state = {"model": {"w": torch.arange(10, dtype=torch.float32)}}
    with ckptd.Checkpointer("memory://ckptd-coordinate/run") as ckpt:
        ckpt.save(1, state)
        with pytest.raises(CheckpointExistsError, match="overwrite=True"):
            ckpt.save(1, {"model": {"w": torch.zeros(10)}})
        assert_same(state["model"], ckpt.load(1)["model"])


def test_solo_overwrites_a_checkpoint_a_later_one_linked_from_and_both_stay_whole(root):
    model = Frozen()
    with ckptd.Checkpointer(root, incremental=True) as ckpt:
        ckpt.save(1, {"model": model})
        assert ckpt.save(2, {"model": model}).bytes_linked > 0
        replacement = {"w": torch.arange(6, dtype=torch.float32)}
        ckpt.save(1, {"model": replacement}, overwrite=True)
        assert not [n for n in os.listdir(root) if n.startswith(".")], "no staging directory left behind"
        assert_same(replacement, ckpt.load(1, verify=True)["model"])
        assert_same(model.state_dict(), ckpt.load(2, verify=True)["model"])


# ---- StoreCoordinator over a real c10d store (two ranks as threads) --------------------------


def contexts(timeout: float = 5.0) -> tuple[DistContext, DistContext]:
    store = torch_dist.HashStore()
    return (
        DistContext(rank=0, world_size=2, coordinator=0, group=None, store=store, timeout=timeout),
        DistContext(rank=1, world_size=2, coordinator=0, group=None, store=store, timeout=timeout),
    )


def committed_manifest(root: str):
    """The manifest of a real save (what ``commit`` returns)."""
    with ckptd.Checkpointer(root) as ckpt:
        path = ckpt.save(1, {"model": {"w": torch.arange(12, dtype=torch.float32)}}).path
    manifest = read_manifest(LocalStorage(), path)
    assert manifest is not None
    return manifest


def run_other_rank(dist: DistContext, round_: Round, report: Report) -> dict[str, object]:
    out: dict[str, object] = {}

    def other() -> None:  # the order Saver.complete calls the steps in
        coordinator = StoreCoordinator(dist)
        own = report
        try:
            coordinator.prepare(round_, lambda: pytest.fail("only the coordinator prepares"))
        except DistributedSaveError as e:
            own = Report(error=e)
        coordinator.report(round_, own)
        try:
            out["outcome"] = coordinator.outcome(round_, own, lambda r: pytest.fail("committed"), lambda: None)
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            out["error"] = e

    thread = threading.Thread(target=other)
    thread.start()
    out["thread"] = thread
    return out


def test_store_coordinator_commits_every_rank_s_results_and_tells_the_others(root):
    manifest = committed_manifest(root)
    zero, one = contexts()
    round_ = Round("save1", 5, time.monotonic())
    other = run_other_rank(one, round_, Report((result("b", size=6),)))
    coordinator = StoreCoordinator(zero)
    coordinator.prepare(round_, lambda: None)
    report = Report((result("a", size=4),))
    coordinator.report(round_, report)
    seen: list[list[FileResult]] = []

    def commit(results):
        seen.append(sorted(results, key=lambda r: r.name))
        return manifest

    outcome = coordinator.outcome(round_, report, commit, lambda: pytest.fail("aborted"))
    other["thread"].join(10)
    assert seen == [[result("a", size=4), result("b", size=6)]]
    assert outcome == Outcome(manifest)
    total = sum(f.size for f in manifest.files.values())
    assert other.get("error") is None and other["outcome"] == Outcome(None, bytes_written=total)
    assert not zero.store.check(["ckptd/save1/commit"]), "the save's keys are removed after the acks"


def test_store_coordinator_names_the_failed_rank_and_aborts():
    zero, one = contexts()
    round_ = Round("save2", 6, time.monotonic())
    own = OSError("no space left writing model-00002-of-00002.safetensors")
    other = run_other_rank(one, round_, Report(error=own))
    coordinator = StoreCoordinator(zero)
    coordinator.prepare(round_, lambda: None)
    report = Report((result("a"),))
    coordinator.report(round_, report)
    aborted: list[bool] = []
    with pytest.raises(DistributedSaveError, match=r"rank\(s\) \[1\].*no space left") as caught:
        coordinator.outcome(round_, report, lambda r: pytest.fail("committed"), lambda: aborted.append(True))
    other["thread"].join(10)
    assert caught.value.ranks == [1] and aborted == [True]
    error = other["error"]
    assert isinstance(error, DistributedSaveError) and error.__cause__ is own, "the rank's own error is the cause"


def test_store_coordinator_prepare_failure_reaches_the_other_rank_and_keeps_its_type():
    zero, one = contexts()
    round_ = Round("save3", 7, time.monotonic())
    other = run_other_rank(one, round_, Report())
    coordinator = StoreCoordinator(zero)
    exists = CheckpointExistsError("checkpoint-7 already exists; pass overwrite=True")
    report = Report()

    def make_destination() -> None:
        raise exists

    try:
        coordinator.prepare(round_, make_destination)
    except CheckpointExistsError as e:
        report = Report(error=e)
    coordinator.report(round_, report)
    with pytest.raises(CheckpointExistsError, match="overwrite=True"):
        coordinator.outcome(round_, report, lambda r: pytest.fail("committed"), lambda: None)
    other["thread"].join(10)
    error = other["error"]
    assert isinstance(error, DistributedSaveError) and error.ranks == [0, 1]
    assert "could not prepare the save: CheckpointExistsError" in str(error.__cause__)


def test_store_coordinator_names_a_rank_that_never_reports():
    zero, _ = contexts(timeout=0.3)
    round_ = Round("save4", 8, time.monotonic())
    coordinator = StoreCoordinator(zero)
    coordinator.prepare(round_, lambda: None)
    coordinator.report(round_, Report())
    with pytest.raises(DistributedSaveError, match="did not report") as caught:
        coordinator.outcome(round_, Report(), lambda r: pytest.fail("committed"), lambda: None)
    assert caught.value.ranks == [1]


# ---- IncrementalPolicy, on real saves ------------------------------------------------------


def saved_twice(root: str, mode: bool | str) -> tuple[IncrementalPolicy, object, str, str]:
    """Two real incremental saves; returns a fresh policy that knows the first, and the plan."""
    torch.manual_seed(0)
    model = Frozen()
    with ckptd.Checkpointer(root, incremental=mode) as ckpt:
        ckpt.save(1, {"model": model})
        with torch.no_grad():
            model.head.bias.add_(1.0)
        ckpt.save(2, {"model": model})
        plan = ckpt._saver._plan
        first, second = ckpt.path_for(1), ckpt.path_for(2)
    policy = IncrementalPolicy(LocalStorage(), root, mode, RunRecord())
    policy.committed(first, None)
    return policy, plan, first, second


def test_policy_reuses_frozen_files_of_the_agreed_last_save(root):
    policy, plan, first, second = saved_twice(root, True)
    frozen = {f.file_name for f in plan.files if f.frozen}
    assert frozen and all(plan_file_frozen(plan, name) for name in frozen)
    reuse = policy.select(plan, os.path.join(root, "checkpoint-3"), [first, first])
    assert set(reuse.reused) == frozen
    assert {r.holder for r in reuse.reused.values()} == {first}
    assert {n: r.source for n, r in reuse.reused.items()} == {n: os.path.join(first, n) for n in frozen}
    records = read_manifest(LocalStorage(), second).files
    assert {n for n, f in records.items() if f.reused == "link"} == frozen
    assert all((r.size, r.crc32c) == (records[n].size, records[n].crc32c) for n, r in reuse.reused.items())
    assert reuse.hashed == {}, "only hash mode rewrites-unless-unchanged"
    assert reuse.holders == {first}


def test_policy_reuses_nothing_without_agreement_or_over_its_own_holder(root):
    policy, plan, first, _ = saved_twice(root, True)
    elsewhere = os.path.join(root, "checkpoint-3")
    assert policy.select(plan, elsewhere, [first, None]).reused == {}, "a rank has not seen the commit"
    assert policy.select(plan, elsewhere, [first, os.path.join(root, "checkpoint-0")]).reused == {}
    assert policy.select(plan, first, [first]).reused == {}, "overwriting the checkpoint that holds the files"


def test_policy_hash_mode_offers_the_unchanged_layout_of_trainable_files_with_their_digest(root):
    policy, plan, first, _ = saved_twice(root, "hash")
    reuse = policy.select(plan, os.path.join(root, "checkpoint-3"), [first])
    trainable = {f.file_name for f in plan.files if not f.frozen}
    assert set(reuse.hashed) == trainable and not set(reuse.hashed) & set(reuse.reused)
    assert all(r.digest and r.digest.startswith("sha256:") for r in reuse.hashed.values())
    assert reuse.reused, "frozen files are still taken without a digest comparison"


def test_policy_off_reuses_nothing(root):
    _, plan, first, _ = saved_twice(root, True)
    off = IncrementalPolicy(LocalStorage(), root, False, RunRecord())
    off.committed(first, None)
    assert off.reusable(plan) == {} and off.select(plan, os.path.join(root, "x"), [first]).holders == frozenset()


def test_policy_keeps_its_source_in_use_until_every_queued_save_releases_it(root):
    policy, plan, first, _ = saved_twice(root, True)
    target = os.path.join(root, "checkpoint-3")
    one = policy.select(plan, target, [first])
    two = policy.select(plan, target, [first])
    assert policy.run.in_use() == {first}
    policy.release(one)
    assert policy.run.in_use() == {first}, "the second queued save still links from it"
    policy.release(two)
    assert policy.run.in_use() == set()


def test_policy_overwrites_a_checkpoint_others_linked_from(root):
    policy, _, first, second = saved_twice(root, True)
    policy.refuse_overwriting_referenced(first)  # 2 holds its own (linked) files: nothing refers to 1
    policy.refuse_overwriting_referenced(second)


def test_policy_remembers_the_last_commit_and_reads_its_manifest_when_not_given(root):
    policy, plan, first, second = saved_twice(root, True)
    assert policy.last_path == first
    policy.committed(second, None)
    assert policy.last_path == second
    reuse = policy.select(plan, os.path.join(root, "checkpoint-3"), [second])
    assert {r.holder for r in reuse.reused.values()} == {second}, "the last checkpoint holds its files itself"
