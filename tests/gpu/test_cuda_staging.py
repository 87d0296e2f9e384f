"""The device-to-host path of ``async_save`` on a real CUDA device.

The staging arena is shared memory registered with CUDA (``cudaHostRegister``), so device-to-host
copies run as DMA at full speed; the copies are queued on a side stream after the caller's work,
and the next optimizer step's kernels are ordered after them.  Every test here needs a CUDA
device (marker ``cuda``) and is skipped without one; ``benchmarks/bench_gpu.py`` measures the
same path against a raw pinned-copy floor.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import assert_same

import ckptd
import ckptd.save.arena as arena_module

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BIG = 8192  # one 8192 x 8192 float32 tensor is 256 MiB: its copy takes milliseconds, a race is visible


def _host(value: Any) -> Any:
    """``value`` with every tensor moved to the CPU (cloned), for comparisons after the GPU moved on."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _host(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_host(v) for v in value]
    return value


def _big_model() -> torch.nn.Module:
    """Two square layers, 512 MiB of float32 parameters on the GPU, with gradients."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(BIG, BIG), torch.nn.Linear(BIG, BIG)).cuda()
    model(torch.randn(4, BIG, device="cuda")).pow(2).mean().backward()
    return model


def test_the_arena_is_shared_memory_that_cuda_sees_as_page_locked(checkpointer):
    state = {"w": torch.randn(1024, 1024, device="cuda")}
    checkpointer.save(1, {"model": state})
    (arena,) = checkpointer._pool._arenas
    assert arena.pinned
    # CUDA reports the registered shared-memory mapping as page-locked host memory: copies into
    # it are DMA, not a bounce through a pageable buffer.
    assert arena._base.is_pinned()
    assert arena.segment.size >= state["w"].nbytes
    assert_same(_host(state), checkpointer.load(1, verify=True)["model"])


@pytest.mark.parametrize("staging", ["blocking", "pipelined"])
def test_a_save_that_returned_holds_the_values_from_before_in_place_kernels(checkpointer, staging):
    model = _big_model()
    expected = _host(model.state_dict())
    request = checkpointer.async_save(1, {"model": model}, staging=staging)
    with torch.no_grad():  # queued on the current stream the moment async_save returns
        for parameter in model.parameters():
            parameter.mul_(-3.0).add_(1.0)
    request.wait(120)
    assert_same(expected, checkpointer.load(1, verify=True)["model"])
    assert not torch.equal(expected["0.weight"], model[0].weight.cpu())  # the kernels did change them


def test_background_staging_racing_the_optimizer_step_saves_the_values_before_it(checkpointer):
    """``staging="background"`` returns with the copies still queued on the side stream; the
    step that follows at once must not overwrite a parameter before its copy has read it."""
    model = _big_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=10.0)  # every element moves by a lot
    expected = _host(model.state_dict())
    request = checkpointer.async_save(1, {"model": model}, staging="background")
    optimizer.step()  # queued while the copies are in flight; the step guard orders it after them
    after_step = _host(model.state_dict())
    request.wait(120)
    assert not torch.equal(expected["0.weight"], after_step["0.weight"])
    assert_same(expected, checkpointer.load(1, verify=True)["model"])


def test_without_the_step_guard_the_same_race_saves_values_the_step_wrote(checkpointer, monkeypatch):
    """The protection removed: with the optimizer step no longer waiting for the copies, the race
    above is real on the GPU (the step's kernels run beside the copies), so the test above
    checks something."""
    monkeypatch.setattr(arena_module.StepGuard, "_before_step", lambda self, optimizer, args, kwargs: None)
    model = _big_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=10.0)
    expected = _host(model.state_dict())
    request = checkpointer.async_save(1, {"model": model}, staging="background")
    optimizer.step()
    request.wait(120)
    loaded = checkpointer.load(1)["model"]
    assert not all(torch.equal(expected[k], loaded[k]) for k in expected), "the copies all ran before the step"


def test_the_copies_start_after_the_work_already_queued_on_the_callers_stream(checkpointer):
    """A kernel still queued when ``async_save`` is called (here: a fill after a long run of
    products) is part of the snapshot: the side stream waits for the caller's stream first."""
    weights = torch.zeros(BIG, BIG, device="cuda")
    busy = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    for _ in range(200):  # tens of milliseconds of queued work before the fill
        torch.mm(busy, busy)
    weights.fill_(7.0)
    request = checkpointer.async_save(1, {"model": {"w": weights}}, staging="background")
    request.wait(120)
    loaded = checkpointer.load(1)["model"]["w"]
    assert torch.equal(loaded, torch.full((BIG, BIG), 7.0))


def test_background_saves_in_a_training_loop_each_hold_their_own_step(checkpointer):
    """Saves of a GPU model and its Adam state every step, each raced by the next step: every
    checkpoint is the state of the step it names, optimizer moments and CPU step counters included."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randn(64, 2048, device="cuda")
    expected: dict[int, Any] = {}
    requests = []
    for step in range(1, 6):
        model(data).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        expected[step] = _host({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
        requests.append(checkpointer.async_save(step, {"model": model, "optimizer": optimizer}, staging="background"))
    for request in requests:
        request.wait(120)
    for step, state in expected.items():
        loaded = checkpointer.load(step, verify=True)
        assert_same(state["model"], loaded["model"], where=f"step {step} model")
        assert_same(state["optimizer"]["state"], _optimizer_state(loaded["optimizer"]), where=f"step {step} optim")


def _optimizer_state(saved: Any) -> Any:
    """The per-parameter state of a saved optimizer state dict, keyed by integer as PyTorch has it."""
    return {int(k): v for k, v in saved["state"].items()}


@pytest.mark.parametrize("staging", ["blocking", "background"])
def test_a_state_larger_than_the_budget_streams_from_the_device_through_the_pinned_ring(root, staging):
    """512 MiB of parameters through a 64 MiB page-locked ring, chunk by chunk on the side stream;
    with background staging the optimizer step that follows waits for the last chunk."""
    model = _big_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=10.0)
    expected = _host(model.state_dict())
    with ckptd.Checkpointer(root, staging_memory="64MiB", chunk_size="8MiB") as ckpt:
        request = ckpt.async_save(1, {"model": model}, staging=staging)
        optimizer.step()
        request.wait(300)
        (arena,) = ckpt._pool._arenas
        assert arena.streamed and arena.pinned and arena.size == 64 * 1024 * 1024
        assert_same(expected, ckpt.load(1, verify=True)["model"])
    assert not torch.equal(expected["0.weight"], model[0].weight.cpu())  # the step did run


def test_loads_land_on_the_device_bit_for_bit(checkpointer):
    torch.manual_seed(2)
    state = {
        "w": torch.randn(300, 700, device="cuda"),
        "h": torch.randn(64, 64, device="cuda").to(torch.bfloat16),
        "i": torch.randint(-(2**40), 2**40, (1000,), device="cuda"),
    }
    checkpointer.save(1, {"model": state})
    loaded = checkpointer.load(1, device="cuda", verify=True)["model"]
    for key, tensor in state.items():
        assert loaded[key].is_cuda, key
        assert loaded[key].dtype == tensor.dtype and loaded[key].shape == tensor.shape, key
        assert torch.equal(loaded[key], tensor), key
    module = torch.nn.Linear(700, 300, bias=False).cuda()
    checkpointer.save(2, {"model": {"weight": state["w"]}})
    with torch.no_grad():
        module.weight.zero_()
    checkpointer.load(2, into={"model": module})
    assert module.weight.is_cuda and torch.equal(module.weight, state["w"])


def test_cuda_generator_state_round_trips(checkpointer):
    torch.cuda.manual_seed_all(11)
    torch.randn(10, device="cuda")  # the generator has moved on from its seed
    checkpointer.save(1, {"rng": ckptd.RNGState()})
    drawn = torch.randn(1000, device="cuda")
    torch.cuda.manual_seed_all(99)
    checkpointer.load(1, into={"rng": ckptd.RNGState()})
    assert torch.equal(torch.randn(1000, device="cuda"), drawn)


@pytest.fixture
def nccl_world_of_one() -> Iterator[None]:
    """A real NCCL process group of one rank on this GPU (FSDP2's DTensors need one)."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store = dist.HashStore()
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _fsdp_model(seed: int) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(3))).cuda()
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def _full(value: Any) -> Any:
    """Whole tensors (DTensors gathered) on the CPU."""
    if hasattr(value, "full_tensor"):  # a copy: with one rank the gathered tensor may be the shard itself
        return value.full_tensor().detach().to("cpu", copy=True)
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _full(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_full(v) for v in value]
    return value


def test_fsdp2_on_nccl_saves_dtensors_and_loads_them_back_and_as_plain_tensors(checkpointer, nccl_world_of_one):
    model = _fsdp_model(seed=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randn(8, 256, device="cuda")
    model(data).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    assert type(model[0].weight).__name__ == "DTensor"
    expected_model = _full(model.state_dict())
    expected_optimizer = _full(optimizer.state_dict()["state"])
    request = checkpointer.async_save(4, {"model": model, "optimizer": optimizer}, staging="background")
    model(data).pow(2).mean().backward()
    optimizer.step()  # races the staging copies of DTensor local shards
    request.wait(120)

    fresh = _fsdp_model(seed=4)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh(data).pow(2).mean().backward()
    fresh_optimizer.step()  # optimizer state exists, with other values
    checkpointer.load(4, into={"model": fresh, "optimizer": fresh_optimizer})
    assert_same(expected_model, _full(fresh.state_dict()), where="model into FSDP2")
    assert_same(expected_optimizer, _full(fresh_optimizer.state_dict()["state"]), where="optimizer into FSDP2")

    plain = checkpointer.load(4, components=["model"])["model"]  # resharded to whole tensors, no mesh needed
    assert_same(expected_model, plain, where="model as plain tensors")
