"""Staging: background copies guarded by the optimizer step, prepare(), failures, I/O options."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import TinyLM, assert_same, clone_state, train_steps

import ckptd


class GatedTensor(torch.Tensor):
    """A tensor whose copy waits for ``gate``: it holds a background staging open on demand."""

    gate = threading.Event()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_ and any(isinstance(a, GatedTensor) for a in args[1:2]):
            if not cls.gate.wait(30):
                raise RuntimeError("gate never opened")
        return super().__torch_function__(func, types, args, kwargs or {})


class ExplodingTensor(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_ and any(isinstance(a, ExplodingTensor) for a in args[1:2]):
            raise RuntimeError("cannot copy this tensor (test)")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_background_staging_returns_at_once_and_the_next_step_waits(checkpointer):
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    train_steps(model, optimizer, 1)
    model(torch.randint(0, 64, (2, 8))).float().pow(2).mean().backward()  # gradients for the next step
    expected = clone_state(model.state_dict())
    GatedTensor.gate.clear()
    gated = torch.ones(1000).as_subclass(GatedTensor)
    request = checkpointer.async_save(1, {"model": model, "gated": {"x": gated}}, staging="background")
    assert not request.staged.is_set(), "background staging returns before the copy"
    stepper = threading.Thread(target=optimizer.step)
    stepper.start()
    stepper.join(0.5)
    assert stepper.is_alive(), "the optimizer step must wait for the snapshot"
    GatedTensor.gate.set()
    stepper.join(30)
    assert not stepper.is_alive()
    request.wait(60)
    assert request.staged.is_set()
    assert_same(expected, checkpointer.load(1)["model"])
    assert not torch.equal(model.layers[0].weight, expected["layers.0.weight"]), "the step did run"


def test_background_staging_with_a_plain_state_and_explicit_wait(checkpointer):
    state = {"w": torch.randn(256, 256)}
    expected = clone_state(state)
    request = checkpointer.async_save(1, {"model": state}, staging="background")
    request.staged.wait(30)
    state["w"].add_(1)
    request.wait(60)
    assert_same(expected, checkpointer.load(1)["model"])


def test_background_staging_failure_fails_the_request_and_frees_the_step(checkpointer):
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    bad = torch.ones(3).as_subclass(ExplodingTensor)
    request = checkpointer.async_save(1, {"model": model, "bad": {"x": bad}}, staging="background")
    optimizer.step()  # must not hang on the failed snapshot
    with pytest.raises(RuntimeError, match="cannot copy"):
        request.wait(30)
    assert checkpointer.steps() == []
    checkpointer.save(2, {"model": model})  # the arena was released
    assert checkpointer.steps() == [2]


def test_prepare_allocates_the_arena_before_the_first_save(checkpointer):
    state = {"model": {"w": torch.randn(512, 512), "b": torch.randn(512)}}
    size = checkpointer.prepare(state)
    assert size >= 512 * 513 * 4
    arenas = list(checkpointer._pool._arenas)
    assert len(arenas) == 1 and arenas[0].size == size
    request = checkpointer.async_save(1, state)
    assert checkpointer._pool._arenas == arenas, "the prepared arena is reused"
    request.wait(60)
    assert_same(state["model"], checkpointer.load(1)["model"])


def _resident_shared_bytes() -> int:
    """RssShmem of this process: shared-memory pages mapped and present."""
    for line in open("/proc/self/status"):
        if line.startswith("RssShmem:"):
            return int(line.split()[1]) * 1024
    pytest.skip("no RssShmem in /proc/self/status")


def test_prepare_faults_the_arena_in_and_a_save_created_arena_is_not(tmp_path):
    state = {"model": {"w": torch.randn(4096, 4096)}}  # 64 MiB
    with ckptd.Checkpointer(str(tmp_path / "prepared")) as ckpt:
        before = _resident_shared_bytes()
        size = ckpt.prepare(state)
        assert _resident_shared_bytes() - before >= size * 0.95, "prepare() left pages to fault at the first copy"
    from ckptd.save.arena import StagingArena

    before = _resident_shared_bytes()
    arena = StagingArena(1, 64 << 20, populate=False)
    try:
        resident = _resident_shared_bytes() - before
        if arena.pinned:  # cudaHostRegister locks every page of the mapping in memory: all resident
            assert resident >= (64 << 20) * 0.95, "a registered arena is page-locked, hence resident"
        else:
            assert resident < (8 << 20), "a save's new arena should fault in at its copy"
    finally:
        arena.close()


@pytest.mark.parametrize(
    "options",
    [{"direct_io": False}, {"direct_io": False, "drop_cache": False}, {"writer_ionice": None, "writer_nice": 0}],
)
def test_io_options_keep_the_data_intact(root, options):
    state = {"w": torch.randn(3 * 1024 * 1024 + 7), "b": torch.arange(10)}
    with ckptd.Checkpointer(root, chunk_size="1MiB", **options) as ckpt:
        ckpt.save(1, {"model": state})
        assert_same(state, ckpt.load(1, verify=True)["model"])


def test_staging_mode_is_validated(checkpointer):
    with pytest.raises(ckptd.errors.ConfigError, match="staging"):
        checkpointer.async_save(1, {"model": {"w": torch.ones(1)}}, staging="eventually")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_stage_on_a_side_stream_and_the_step_waits_on_the_gpu(checkpointer):
    model = torch.nn.Linear(1024, 1024).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.randn(8, 1024, device="cuda")).sum().backward()
    expected = clone_state(model.state_dict())
    request = checkpointer.async_save(1, {"model": model}, staging="background")
    optimizer.step()  # its kernels are ordered after the staging copies by the step guard
    request.wait(60)
    assert checkpointer._pool._arenas[0].pinned
    assert_same({k: v.cpu() for k, v in expected.items()}, checkpointer.load(1)["model"])
