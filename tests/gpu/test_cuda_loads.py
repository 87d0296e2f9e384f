"""Loads onto a CUDA device: bytes read into page-locked memory and copied to the targets
(``ckptd.load.to_device``), bit for bit, in order with the caller's queued work.  Needs a CUDA
device (marker ``cuda``); skipped without one."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import ckptd
import ckptd.load.to_device as to_device

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _mixed_state() -> dict[str, torch.Tensor]:
    """Dtypes, a 0-d and an empty tensor, and one tensor larger than a staging wave."""
    generator = torch.Generator(device="cuda").manual_seed(5)
    return {
        "big": torch.randn(to_device.WAVE_BYTES // 4 * 2 + 12345, device="cuda", generator=generator),  # 2+ waves
        "f32": torch.randn(333, 77, device="cuda", generator=generator),
        "bf16": torch.randn(64, 1000, device="cuda", generator=generator).to(torch.bfloat16),
        "i64": torch.randint(-(2**60), 2**60, (4099,), device="cuda", generator=generator),
        "bool": torch.rand(1001, device="cuda", generator=generator) > 0.5,
        "scalar": torch.tensor(3.25, device="cuda"),
        "empty": torch.empty(0, 5, device="cuda"),
        **{f"small.{i}": torch.full((17, i + 1), float(i), device="cuda") for i in range(40)},
    }


def _assert_on_device_and_equal(expected: dict[str, torch.Tensor], loaded: dict[str, Any]) -> None:
    assert set(loaded) == set(expected)
    for key, tensor in expected.items():
        value = loaded[key]
        assert value.is_cuda, key
        assert value.dtype == tensor.dtype and value.shape == tensor.shape, key
        assert torch.equal(value, tensor), key


def test_fresh_tensors_load_onto_the_device_through_the_staging_waves(checkpointer, monkeypatch):
    state = _mixed_state()
    checkpointer.save(1, {"model": state})
    waves: list[Any] = []
    real = to_device._waves

    def recorded(pieces: Any) -> Any:
        waves.append(real(pieces))
        return waves[-1]

    monkeypatch.setattr(to_device, "_waves", recorded)
    _assert_on_device_and_equal(state, checkpointer.load(1, device="cuda", verify=True)["model"])
    assert waves and len(waves[0]) >= 3, "the device path was not taken, or in fewer waves than the bytes need"
    assert all(sum(p[2].numel() for p in wave) <= to_device.WAVE_BYTES for wave in waves[0])


def test_loads_into_live_cuda_tensors_fill_them_in_place(checkpointer):
    state = _mixed_state()
    checkpointer.save(1, {"model": state})
    targets = {k: torch.zeros_like(v) for k, v in state.items()}
    pointers = {k: v.data_ptr() for k, v in targets.items()}
    checkpointer.load(1, into={"model": targets})
    _assert_on_device_and_equal(state, targets)
    assert {k: v.data_ptr() for k, v in targets.items()} == pointers


def test_a_module_on_the_device_restores_bit_for_bit(checkpointer):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.LayerNorm(512), torch.nn.Linear(512, 10)).cuda()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    checkpointer.save(1, {"model": model})
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
    checkpointer.load(1, into={"model": model})
    _assert_on_device_and_equal(expected, dict(model.state_dict()))


def test_targets_of_another_dtype_or_layout_take_the_host_path_and_still_match(checkpointer):
    weight = torch.randn(300, 200, device="cuda")
    checkpointer.save(1, {"model": {"w": weight, "t": weight.clone()}})
    half = torch.zeros(300, 200, device="cuda", dtype=torch.bfloat16)  # converted from float32
    transposed = torch.zeros(200, 300, device="cuda").t()  # not contiguous
    checkpointer.load(1, into={"model": {"w": half, "t": transposed}})
    assert torch.equal(half, weight.to(torch.bfloat16))
    assert torch.equal(transposed, weight)


def test_work_queued_on_a_target_finishes_before_the_load_replaces_its_bytes(checkpointer):
    stored = torch.full((4096, 4096), 7.0, device="cuda")
    checkpointer.save(1, {"model": {"w": stored}})
    target = torch.zeros(4096, 4096, device="cuda")
    busy = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    for _ in range(200):  # tens of milliseconds queued before the fill
        torch.mm(busy, busy)
    target.fill_(1.0)  # still queued when the load starts: the load's bytes must land after it
    checkpointer.load(1, into={"model": {"w": target}})
    assert torch.equal(target, stored)


def test_a_keys_load_onto_the_device_reads_only_those_keys(checkpointer):
    state = _mixed_state()
    checkpointer.save(1, {"model": state})
    loaded = checkpointer.load(1, keys=["model.f32", "model.small.3"], device="cuda")
    assert torch.equal(loaded["model"]["f32"], state["f32"]) and loaded["model"]["f32"].is_cuda
    assert torch.equal(loaded["model"]["small.3"], state["small.3"])


def test_a_truncated_shard_fails_the_device_load_with_our_error_and_a_good_load_follows(checkpointer):
    state = {"w": torch.randn(1024, 1024, device="cuda")}
    path = checkpointer.save(1, {"model": state}).path
    checkpointer.save(2, {"model": state})
    shard = next(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 4096)
    with pytest.raises(ckptd.errors.CorruptCheckpointError, match="safetensors"):
        checkpointer.load(1, device="cuda")
    again = checkpointer.load(2, device="cuda")["model"]["w"]  # the staging buffer is free again
    assert torch.equal(again, state["w"])
