"""Checkpointer: async save → commit → load, snapshot semantics, arena reuse, back-pressure."""

from __future__ import annotations

import asyncio
import json
import os
import threading

import pytest
import torch
from conftest import TinyLM, assert_same, clone_state, paused, pid_alive, wait_for

import ckptd
from ckptd.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
    KeyMismatchError,
    UnsafeCheckpointError,
    UnsupportedValueError,
)


def full_state(model, optimizer, scheduler):
    return {
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "rng": ckptd.RNGState(),
        "data": {"epoch": 3, "position": 1234, "shuffle": (7, 11), "history": [0.5, float("inf")]},
    }


def test_async_save_then_load_dict_is_bit_exact(checkpointer, trained):
    model, optimizer, scheduler = trained
    expected = {
        "model": clone_state(model.state_dict()),
        "optimizer": clone_state(optimizer.state_dict()),
        "scheduler": scheduler.state_dict(),
    }
    request = checkpointer.async_save(5, full_state(model, optimizer, scheduler))
    result = request.wait(60)
    assert request.done() and request.exception() is None
    assert result.step == 5 and result.path.endswith("checkpoint-5")
    loaded = checkpointer.load(5)
    assert_same(expected["model"], loaded["model"], "model")
    assert_same(expected["optimizer"], loaded["optimizer"], "optimizer")
    assert_same(expected["scheduler"], loaded["scheduler"], "scheduler")
    assert loaded["data"] == {"epoch": 3, "position": 1234, "shuffle": (7, 11), "history": [0.5, float("inf")]}
    # tied parameters come back as one tensor under both names
    assert loaded["model"]["head.weight"] is loaded["model"]["embed.weight"]


def test_load_into_objects_in_place_and_retie(checkpointer, trained):
    model, optimizer, scheduler = trained
    torch.manual_seed(1)
    checkpointer.save(1, full_state(model, optimizer, scheduler))
    rng_expected = torch.rand(4)

    fresh = TinyLM()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=3, gamma=0.5)
    data: dict = {}
    embed_storage = fresh.embed.weight.data_ptr()
    torch.manual_seed(99)
    checkpointer.load(
        "latest",
        into={"model": fresh, "optimizer": fresh_opt, "scheduler": fresh_sched, "rng": ckptd.RNGState(), "data": data},
    )
    assert_same(model.state_dict(), fresh.state_dict(), "model")
    assert fresh.embed.weight.data_ptr() == embed_storage, "in-place load must not reallocate parameters"
    assert fresh.head.weight is fresh.embed.weight
    assert_same(optimizer.state_dict(), fresh_opt.state_dict(), "optimizer")
    assert fresh_sched.state_dict() == scheduler.state_dict()
    assert_same(rng_expected, torch.rand(4), "rng")
    assert data["position"] == 1234


def test_mutating_or_freeing_tensors_after_return_does_not_change_the_save(checkpointer):
    weights = {"a": torch.randn(256, 64), "b": torch.arange(1000, dtype=torch.int64), "c": torch.randn(3, 5).t()}
    expected = clone_state(weights)
    checkpointer.health_check()
    with paused(checkpointer.writer_pid):
        request = checkpointer.async_save(1, {"model": weights})
        assert request.staged.is_set()
        for tensor in weights.values():
            tensor.fill_(0) if tensor.is_contiguous() else tensor.mul_(0)
        weights.clear()
        del tensor
    request.wait(60)
    assert_same(expected, checkpointer.load(1)["model"])


def test_arena_is_reused_for_the_same_layout_and_replanned_when_shapes_change(checkpointer):
    state = {"w": torch.randn(128, 128), "b": torch.randn(128)}
    checkpointer.save(1, {"model": state})
    arenas = list(checkpointer._pool._arenas)
    assert len(arenas) == 1
    first_plan = arenas[0].plan
    state["w"].add_(1)
    checkpointer.save(2, {"model": state})
    assert checkpointer._pool._arenas == arenas and arenas[0].plan is first_plan
    assert_same(state, checkpointer.load(2)["model"])

    bigger = {"w": torch.randn(1024, 1024), "b": torch.randn(1024), "extra": torch.ones(3, dtype=torch.bool)}
    checkpointer.save(3, {"model": bigger})
    assert arenas[0].plan is not first_plan or checkpointer._pool._arenas != arenas
    assert_same(bigger, checkpointer.load(3)["model"])
    smaller = {"w": torch.randn(16, 16)}
    checkpointer.save(4, {"model": smaller})
    assert_same(smaller, checkpointer.load(4)["model"])
    assert_same(state, checkpointer.load(2)["model"])


def test_second_save_in_flight_waits_for_the_arena_and_both_commit(checkpointer):
    state = {"w": torch.randn(64, 64)}
    first = clone_state(state)
    checkpointer.health_check()
    pid = checkpointer.writer_pid
    outcome: dict = {}
    with paused(pid):
        req1 = checkpointer.async_save(1, {"model": state})
        state["w"].add_(1.0)
        second = clone_state(state)

        def save_second() -> None:
            outcome["request"] = checkpointer.async_save(2, {"model": state})

        thread = threading.Thread(target=save_second)
        thread.start()
        thread.join(0.5)
        assert thread.is_alive(), "a second save must wait while the only arena is being written"
    thread.join(30)
    req2 = outcome["request"]
    req1.wait(60)
    req2.wait(60)
    assert req2.timings["wait"] > 0
    assert_same(first, checkpointer.load(1)["model"])
    assert_same(second, checkpointer.load(2)["model"])


def test_two_arenas_let_a_second_save_stage_while_the_first_is_written(root):
    with ckptd.Checkpointer(root, max_in_flight=2) as ckpt:
        ckpt.health_check()
        state = {"w": torch.randn(32, 32)}
        with paused(ckpt.writer_pid):
            req1 = ckpt.async_save(1, {"model": state})
            req2 = ckpt.async_save(2, {"model": {"w": state["w"] + 1}})
            assert not req1.done() and not req2.done()
        assert req1.wait(60).step == 1 and req2.wait(60).step == 2
        assert_same(state["w"] + 1, ckpt.load(2)["model"]["w"])


def test_unsupported_object_fails_before_anything_is_written(checkpointer, root):
    class Opaque:
        pass

    with pytest.raises(UnsupportedValueError, match=r"data\.thing"):
        checkpointer.async_save(1, {"model": {"w": torch.ones(2)}, "data": {"thing": Opaque()}})
    assert os.listdir(root) == []
    assert checkpointer.pending() == []


def test_pickle_needs_opt_in_on_save_and_on_load(checkpointer):
    from fractions import Fraction

    checkpointer.save(1, {"data": {"ratio": Fraction(1, 3)}}, allow_pickle=True)
    with pytest.raises(UnsafeCheckpointError, match="allow_pickle"):
        checkpointer.load(1)
    assert checkpointer.load(1, allow_pickle=True)["data"]["ratio"] == Fraction(1, 3)


def test_existing_step_is_refused_unless_overwrite(checkpointer):
    checkpointer.save(1, {"model": {"w": torch.zeros(3)}})
    with pytest.raises(CheckpointExistsError):
        checkpointer.async_save(1, {"model": {"w": torch.ones(3)}})
    checkpointer.save(1, {"model": {"w": torch.ones(3)}}, overwrite=True)
    assert_same(torch.ones(3), checkpointer.load(1)["model"]["w"])
    assert checkpointer.steps() == [1]


def test_directories_without_manifest_are_never_listed_or_loaded(checkpointer, root):
    checkpointer.save(1, {"model": {"w": torch.zeros(3)}})
    checkpointer.save(2, {"model": {"w": torch.ones(3)}})
    os.remove(os.path.join(checkpointer.path_for(2), "checkpoint_manifest.json"))
    os.makedirs(os.path.join(root, "checkpoint-000009"))
    with open(os.path.join(root, "checkpoint-000009", "model.safetensors"), "wb") as f:
        f.write(b"junk")
    assert checkpointer.steps() == [1]
    assert checkpointer.latest_step() == 1
    assert_same(torch.zeros(3), checkpointer.load("latest")["model"]["w"])
    with pytest.raises(CheckpointNotFoundError, match=r"checkpoint_manifest\.json"):
        checkpointer.load(2)
    with pytest.raises(CheckpointNotFoundError):
        checkpointer.load(9)


def test_latest_on_empty_root_is_a_clear_error(checkpointer):
    assert checkpointer.latest_step() is None
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        checkpointer.load()


def test_keep_last_rotates_old_checkpoints(root):
    with ckptd.Checkpointer(root, keep_last=2) as ckpt:
        for step in range(1, 6):
            ckpt.async_save(step, {"model": {"w": torch.full((4,), float(step))}})
        ckpt.wait()
        assert ckpt.steps() == [4, 5]
        assert_same(torch.full((4,), 5.0), ckpt.load()["model"]["w"])


def test_keys_returns_only_requested_tensors_and_reads_only_their_shards(root):
    tensors = {f"layer{i}.weight": torch.full((256,), float(i)) for i in range(6)}
    with ckptd.Checkpointer(root, max_shard_size=1024) as ckpt:
        ckpt.save(1, {"model": tensors, "optimizer": {"lr": 0.1}})
        manifest = ckpt.manifest(1)
        files = {t.file for t in manifest.components["model"].tensors.values()}
        assert len(files) == 6
        target_file = manifest.components["model"].tensors["layer2.weight"].file
        # Scramble every other shard with bytes of the same size: they must not be read.
        for name in files - {target_file}:
            path = os.path.join(ckpt.path_for(1), name)
            with open(path, "r+b") as f:
                f.write(b"\xff" * os.path.getsize(path))
        out = ckpt.load(1, keys=["model.layer2.weight"])
        assert list(out) == ["model"] and list(out["model"]) == ["layer2.weight"]
        assert_same(tensors["layer2.weight"], out["model"]["layer2.weight"])
        with pytest.raises(KeyMismatchError, match="nope"):
            ckpt.load(1, keys=["model.nope"])
        with pytest.raises(ConfigError, match="component"):
            ckpt.load(1, keys=["weights.layer2.weight"])


def test_components_selects_and_metadata_is_recorded(checkpointer):
    checkpointer.save(
        7, {"model": {"w": torch.ones(2)}, "extra": {"note": "hi"}}, metadata={"run": "exp1"}, metrics={"loss": 0.25}
    )
    assert checkpointer.load(7, components=["extra"]) == {"extra": {"note": "hi"}}
    manifest = checkpointer.manifest(7)
    assert manifest.metadata == {"run": "exp1"} and manifest.metrics == {"loss": 0.25}
    assert manifest.step == 7 and manifest.world_size == 1
    assert set(manifest.timings) >= {"plan", "stage", "write", "commit"}


def test_request_is_a_future_and_awaitable(checkpointer):
    request = checkpointer.async_save(1, {"model": {"w": torch.ones(2)}})
    seen = []
    request.add_done_callback(seen.append)
    result = asyncio.run(_await(request))
    assert result.step == 1 and request.done()
    wait_for(lambda: seen == [request])
    assert "committed" in repr(request)


async def _await(request):
    return await request


def test_bad_arguments_are_clear_errors(checkpointer):
    with pytest.raises(ConfigError, match="step"):
        checkpointer.async_save(-1, {"model": {}})
    with pytest.raises(ConfigError, match="mapping"):
        checkpointer.async_save(1, {})
    with pytest.raises(ConfigError, match="component name"):
        checkpointer.async_save(1, {"../evil": {"w": torch.ones(1)}})
    with pytest.raises(ConfigError, match="max_shard_size"):
        ckptd.Checkpointer(checkpointer.root, max_shard_size="lots")


def test_manifest_is_written_last_and_lists_every_file(checkpointer, trained):
    model, optimizer, scheduler = trained
    result = checkpointer.save(3, full_state(model, optimizer, scheduler))
    names = set(os.listdir(result.path))
    with open(os.path.join(result.path, "checkpoint_manifest.json")) as f:
        body = json.load(f)
    assert set(body["files"]) == names - {"checkpoint_manifest.json"}
    assert body["format"] == "ckptd" and body["format_version"] == 1
    assert body["components"]["model"]["tied"] == [["embed.weight", "head.weight"]]
    assert "head.weight" not in body["components"]["model"]["tensors"]
    mtimes = {n: os.stat(os.path.join(result.path, n)).st_mtime_ns for n in names}
    assert mtimes["checkpoint_manifest.json"] == max(mtimes.values())
    for name, info in body["files"].items():
        assert os.path.getsize(os.path.join(result.path, name)) == info["size"]
    index = json.load(open(os.path.join(result.path, "model.safetensors.index.json")))
    assert set(index) == {"metadata", "weight_map"} and set(index["metadata"]) == {"total_size"}
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for k, t in model.state_dict().items() if k != "head.weight"
    )


def test_close_frees_the_arena_mapping_and_stops_the_writer(root):
    ckpt = ckptd.Checkpointer(root)
    ckpt.save(1, {"model": {"w": torch.randn(1000)}})
    pid = ckpt.writer_pid
    with open("/proc/self/maps") as f:
        assert "ckptd-arena" in f.read()
    ckpt.close()
    with open("/proc/self/maps") as f:
        assert "ckptd-arena" not in f.read()
    wait_for(lambda: not os.path.exists(f"/proc/{pid}"), timeout=10)
    with pytest.raises(ConfigError, match="closed"):
        ckpt.async_save(2, {"model": {"w": torch.ones(1)}})


def test_close_finishes_pending_saves(root):
    ckpt = ckptd.Checkpointer(root)
    requests = [ckpt.async_save(step, {"model": {"w": torch.full((10,), float(step))}}) for step in range(3)]
    ckpt.close()
    assert all(r.done() and r.exception() is None for r in requests)
    with ckptd.Checkpointer(root) as again:
        assert again.steps() == [0, 1, 2]


def test_a_dropped_checkpointer_is_collected_and_stops_its_writer(root):
    import gc
    import weakref

    ckpt = ckptd.Checkpointer(root)
    ckpt.save(1, {"model": {"w": torch.randn(1000)}})
    pid = ckpt.writer_pid
    collected = weakref.ref(ckpt)
    with pytest.warns(ResourceWarning, match="was not closed"):
        del ckpt
        gc.collect()
    assert collected() is None  # no thread of its own keeps it alive
    wait_for(lambda: not pid_alive(pid), timeout=10)
    wait_for(lambda: "ckptd-arena" not in open("/proc/self/maps").read(), timeout=10)
    with ckptd.Checkpointer(root) as again:
        assert again.steps() == [1]


@pytest.mark.filterwarnings("ignore::ResourceWarning")  # raised on the completion thread
def test_a_dropped_checkpointer_still_commits_its_queued_saves(root):
    import gc
    import weakref

    ckpt = ckptd.Checkpointer(root, max_in_flight=2)  # two saves staged while the writer is stopped
    ckpt.save(0, {"model": {"w": torch.zeros(10)}})
    pid = ckpt.writer_pid
    with paused(pid):
        requests = [ckpt.async_save(step, {"model": {"w": torch.full((10,), float(step))}}) for step in (1, 2)]
        collected = weakref.ref(ckpt)
        del ckpt
        gc.collect()
        assert collected() is not None  # its queued saves keep it alive
    results = [r.result(timeout=30) for r in requests]
    wait_for(lambda: gc.collect() >= 0 and collected() is None, timeout=10)
    wait_for(lambda: not pid_alive(pid), timeout=10)
    assert [os.path.basename(r.path) for r in results] == ["checkpoint-1", "checkpoint-2"]
    with ckptd.Checkpointer(root) as again:
        assert again.steps() == [0, 1, 2]
        loaded = again.load(2)["model"]["w"]
        assert loaded.dtype == torch.float32 and torch.equal(loaded, torch.full((10,), 2.0))


def test_planning_pauses_the_garbage_collector_and_restores_it(tmp_path):
    import gc

    seen: list[bool] = []

    class Probe:
        def __init__(self, fail: bool = False) -> None:
            self.fail = fail

        def state_dict(self):
            seen.append(gc.isenabled())
            if self.fail:
                raise RuntimeError("probe failed")
            return {"x": torch.arange(4.0)}

    assert gc.isenabled()
    with ckptd.Checkpointer(str(tmp_path / "root")) as ckpt:
        ckpt.async_save(1, {"probe": Probe()}).result()
        assert seen == [False] and gc.isenabled()
        with pytest.raises(Exception, match="probe failed"):
            ckpt.async_save(2, {"probe": Probe(fail=True)})
        assert seen == [False, False] and gc.isenabled()
        gc.disable()  # the caller's choice is kept
        try:
            ckpt.async_save(3, {"probe": Probe()}).result()
            assert not gc.isenabled()
        finally:
            gc.enable()
        loaded = ckpt.load(1)
    assert torch.equal(loaded["probe"]["x"], torch.arange(4.0))
