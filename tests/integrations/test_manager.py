"""CheckpointManager: save policies, composable retention, best/latest, preemption; and
``Checkpointer.async_save(path=...)`` (a caller-chosen location)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import assert_same, paused, pid_alive, wait_for

import ckptd
from ckptd.errors import CheckpointNotFoundError, ConfigError
from ckptd.manager import CheckpointManager, CheckpointPolicy


def small_state(value: float) -> dict[str, object]:
    return {"model": {"w": torch.full((4, 3), float(value)), "b": torch.arange(3)}, "meta": {"v": float(value)}}


def test_every_steps_saves_only_those_steps(root):
    with CheckpointManager(root, CheckpointPolicy(every_steps=3)) as manager:
        saved = [s for s in range(1, 11) if manager.maybe_save(s, small_state(s)) is not None]
        manager.wait()
        assert saved == [3, 6, 9]
        assert manager.steps() == [3, 6, 9]
        assert manager.latest() == 9
        assert manager.best() is None  # no metric configured


def test_every_seconds_and_request_save(root):
    with CheckpointManager(root, CheckpointPolicy(every_seconds=0.3)) as manager:
        assert manager.maybe_save(1, small_state(1)) is None
        time.sleep(0.35)
        assert manager.maybe_save(2, small_state(2)) is not None
        assert manager.maybe_save(3, small_state(3)) is None  # the clock restarted at the save
        manager.request_save()
        assert manager.maybe_save(4, small_state(4)) is not None
        assert manager.maybe_save(5, small_state(5)) is None  # the request is consumed
        manager.wait()
        assert manager.steps() == [2, 4]


def test_retention_rules_compose_and_keep_latest_and_best(root, caplog):
    policy = CheckpointPolicy(every_steps=1, keep_last=2, keep_every=5, keep_best=1, metric="loss", mode="min")
    losses = {s: 10.0 - s * 0.1 for s in range(1, 13)}
    losses[3] = 0.5  # the best
    caplog.set_level(logging.INFO, logger="ckptd.manager")
    with CheckpointManager(root, policy) as manager:
        for step in range(1, 13):
            manager.maybe_save(step, small_state(step), metrics={"loss": losses[step]})
            if step == 2:
                manager.wait()
                manager.preserve(2)
        manager.wait()
        assert manager.steps() == [2, 3, 5, 10, 11, 12]
        assert manager.best() == 3
        assert manager.latest() == 12
        assert manager.metrics(3) == {"loss": 0.5}
        into = small_state(0.0)
        manager.load("best", into=into)
        assert_same(into["model"], small_state(3)["model"])
        assert into["meta"] == {"v": 3.0}
    removals = [r for r in caplog.records if "retention removed" in r.getMessage()]
    assert removals and all(r.threadName == "ckptd-retention" for r in removals), "deletes off the training thread"
    # preserved steps survive a restart of the manager
    with CheckpointManager(root, CheckpointPolicy(keep_last=1)) as manager:
        assert manager.preserved() == [2]
        manager.apply_retention()
        assert manager.steps() == [2, 12]


def test_max_mode_best_and_latest_never_deleted(root):
    policy = CheckpointPolicy(every_steps=1, keep_best=2, metric="acc", mode="max")
    with CheckpointManager(root, policy) as manager:
        for step, acc in [(1, 0.1), (2, 0.9), (3, 0.5), (4, 0.7), (5, 0.2)]:
            manager.maybe_save(step, small_state(step), metrics={"acc": acc})
        manager.wait()
        assert manager.steps() == [2, 4, 5]  # best two by max, and the latest
        assert manager.best() == 2


def test_deletion_waits_for_the_newer_commit(root):
    with CheckpointManager(root, CheckpointPolicy(every_steps=1, keep_last=1)) as manager:
        manager.maybe_save(1, small_state(1))
        manager.wait()
        manager.checkpointer.health_check()
        with paused(manager.checkpointer.writer_pid):
            request = manager.maybe_save(2, small_state(2))
            time.sleep(0.3)
            assert not request.done()
            assert manager.steps() == [1], "the committed checkpoint stays while the newer one is written"
        manager.wait()
        assert manager.steps() == [2]


def test_load_latest_without_checkpoints_and_bad_policies(root):
    with CheckpointManager(root) as manager:
        with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
            manager.load("latest", into=small_state(0))
        with pytest.raises(CheckpointNotFoundError, match="metric"):
            manager.load("best", into=small_state(0))
        assert manager.maybe_save(1, small_state(1)) is None  # default policy: only when asked
        manager.save(1, small_state(1)).result()
        assert manager.steps() == [1]
    with pytest.raises(ConfigError, match="keep_best needs metric"):
        CheckpointPolicy(keep_best=2)
    with pytest.raises(ConfigError, match="mode"):
        CheckpointPolicy(metric="loss", mode="lowest")
    with pytest.raises(ConfigError, match="every_steps"):
        CheckpointPolicy(every_steps=0)
    with pytest.raises(ConfigError, match="keep_last in CheckpointPolicy"):
        CheckpointManager(root, keep_last=2)


def test_manager_on_memory_url():
    root = "memory://ckptd-manager-test/run"
    with CheckpointManager(root, CheckpointPolicy(every_steps=2, keep_last=1)) as manager:
        for step in range(1, 7):
            manager.maybe_save(step, small_state(step))
        manager.wait()
        assert manager.steps() == [6]
        loaded = manager.load()
        assert_same(loaded["model"], small_state(6)["model"])


_SIGNAL_SCRIPT = textwrap.dedent(
    """
    import sys, time, torch
    from ckptd.manager import CheckpointManager, CheckpointPolicy
    manager = CheckpointManager(sys.argv[1], CheckpointPolicy(every_steps=1000))
    manager.install_signal_handlers()
    w = torch.zeros(8)
    try:
        for step in range(1, 100000):
            w += 1
            manager.maybe_save(step, {"model": {"w": w}})
            print(step, flush=True)
            time.sleep(0.02)
    finally:
        print("finally", flush=True)
    """
)


@pytest.mark.multiprocess
def test_sigterm_makes_a_final_save_then_exits(root, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_SIGNAL_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH")] if p))
    process = subprocess.Popen([sys.executable, str(script), root], stdout=subprocess.PIPE, text=True, env=env)
    lines = []
    assert process.stdout is not None
    while len(lines) < 5:
        lines.append(process.stdout.readline().strip())
    process.send_signal(signal.SIGTERM)
    rest, _ = process.communicate(timeout=120)
    lines += rest.split()
    assert process.returncode == 128 + signal.SIGTERM
    assert lines[-1] == "finally", "the process ends through its finally blocks"
    last_step = int(lines[-2])
    with ckptd.Checkpointer(root) as ckpt:
        assert ckpt.steps() == [last_step + 1], "one final save, of the step after the signal"
        loaded = ckpt.load()
        assert torch.equal(loaded["model"]["w"], torch.full((8,), float(last_step + 1)))


def test_a_dropped_manager_is_collected_and_its_checkpointer_stops_its_writer(root):
    import gc
    import weakref

    manager = CheckpointManager(root, CheckpointPolicy(every_steps=1, keep_last=1))
    for step in (1, 2):
        manager.maybe_save(step, small_state(float(step)))
    manager.wait()
    pid = manager.checkpointer.writer_pid
    dropped = weakref.ref(manager)
    with pytest.warns(ResourceWarning, match="was not closed"):
        del manager
        gc.collect()
    assert dropped() is None  # its retention thread does not keep it alive
    wait_for(lambda: not pid_alive(pid), timeout=10)
    with ckptd.Checkpointer(root) as again:
        assert again.steps() == [2]  # retention ran before it was dropped


def test_async_save_to_a_chosen_path(root, tmp_path):
    target = tmp_path / "lightning" / "epoch=0-step=7.ckpt"
    with ckptd.Checkpointer(root) as ckpt:
        result = ckpt.save(7, small_state(7.0), path=target)
        assert result.path == str(target)
        assert os.path.isfile(target / "checkpoint_manifest.json")
        assert ckpt.steps() == [], "a chosen path is not a checkpoint-<step> under the root"
        assert not [n for n in os.listdir(root) if n.startswith(".checkpoint-")], "no staging left under the root"
        loaded = ckpt.load(str(target))
        assert_same(loaded["model"], small_state(7.0)["model"])
        with pytest.raises(ckptd.errors.CheckpointExistsError):
            ckpt.save(7, small_state(8.0), path=target)
        ckpt.save(8, small_state(8.0), path=target, overwrite=True)
        assert_same(ckpt.load(str(target))["model"], small_state(8.0)["model"])
        with pytest.raises(ConfigError, match="not on the storage"):
            ckpt.async_save(9, small_state(9.0), path="memory://elsewhere/x")
        with pytest.raises(ConfigError, match="root itself"):
            ckpt.async_save(9, small_state(9.0), path=root)


def test_same_sizes_but_renamed_keys_are_staged_under_their_new_names(root):
    """Regression: the staging arena was reused when only tensor names changed (same sizes), and
    staged the old names (Lightning's ModelCheckpoint keys its best_k_models tensors by path)."""
    with ckptd.Checkpointer(root) as ckpt:
        ckpt.save(1, {"cb": {"best": {"epoch=0-step=5.ckpt": torch.tensor(1.0)}}})
        ckpt.save(2, {"cb": {"best": {"epoch=2-step=9.ckpt": torch.tensor(2.0)}}})
        loaded = ckpt.load(2)
        assert_same(loaded["cb"], {"best": {"epoch=2-step=9.ckpt": torch.tensor(2.0)}})


def manager_on_ranks(rank: int, world: int, root: str) -> dict[str, object]:
    decisions = []
    with CheckpointManager(root, CheckpointPolicy(every_steps=4, keep_last=1), dist_timeout=60) as manager:
        for step in range(1, 7):
            if rank == 1 and step == 2:
                manager.request_save()  # one rank only: every rank must still save together
            request = manager.maybe_save(step, {"model": {"w": torch.full((4,), float(step))}})
            decisions.append(step if request is not None else None)
        manager.wait()
        return {"decisions": decisions, "steps": manager.steps()}


@pytest.mark.multiprocess
@pytest.mark.distributed
def test_ranks_agree_on_save_decisions(root):
    from distributed import run_ranks

    results = run_ranks(2, manager_on_ranks, root)
    assert results[0]["decisions"] == results[1]["decisions"] == [None, 2, None, 4, None, None]
    assert results[0]["steps"] == [4], "the coordinator applied keep_last=1 after step 4 committed"


def test_async_save_to_a_chosen_path_on_an_object_store_url():
    with ckptd.Checkpointer("memory://ckptd-chosen/run") as ckpt:
        ckpt.save(3, small_state(3.0), path="memory://ckptd-chosen/elsewhere/epoch=0-step=3.ckpt")
        assert ckpt.steps() == []
        loaded = ckpt.load("memory://ckptd-chosen/elsewhere/epoch=0-step=3.ckpt")
        assert_same(loaded["model"], small_state(3.0)["model"])
        with pytest.raises(ConfigError, match="not on the storage"):
            ckpt.async_save(4, small_state(4.0), path="/tmp/local-path")
