"""A warm save reuses the previous save's tensor descriptions only while they still hold.

The reuse spares a new object per tensor and save; every change that alters a description (a
dtype, a shape, a frozen flag, a key, the order, the count) must produce new descriptions equal
to what a fresh describer builds.
"""

from __future__ import annotations

import pytest
import torch

from ckptd.save.describe import Describer
from ckptd.storage import storage_for


def _describe(describer: Describer, state: dict) -> tuple:
    return describer.payload(describer.flatten(state, {}, False), 1, None).locals


def _state() -> dict:
    weight = torch.nn.Parameter(torch.ones(4, 3))
    return {"model": {"w": weight, "b": torch.zeros(3), "step": torch.tensor(7)}, "extra": {"m": torch.ones(2)}}


def test_an_unchanged_state_reuses_its_descriptions(tmp_path):
    describer = Describer(storage_for(str(tmp_path)), str(tmp_path), None)
    state = _state()
    first = _describe(describer, state)
    second = _describe(describer, state)
    assert second == first
    assert all(a is b for a, b in zip(first, second, strict=True))
    # New tensor objects with the same keys, dtypes and shapes describe the same layout.
    third = _describe(describer, {c: {k: v.clone() for k, v in t.items()} for c, t in state.items()})
    assert all(a is b for a, b in zip(first, third, strict=True))


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s["model"].update(b=torch.zeros(3, dtype=torch.float64)),  # dtype
        lambda s: s["model"].update(b=torch.zeros(4)),  # shape
        lambda s: s["model"].update(b=torch.zeros(1, 3)),  # rank, same numel
        lambda s: s["model"]["w"].requires_grad_(False),  # frozen
        lambda s: s.update(model={"b": s["model"]["b"], "w": s["model"]["w"], "step": s["model"]["step"]}),  # order
        lambda s: s["model"].update(c=torch.zeros(1)),  # count
        lambda s: s.update(model={("v" if k == "w" else k): v for k, v in s["model"].items()}),  # key
        lambda s: s.update(model={}),  # no tensors left
    ],
    ids=["dtype", "shape", "rank", "frozen", "order", "count", "key", "empty"],
)
def test_a_changed_state_is_described_afresh(tmp_path, change):
    describer = Describer(storage_for(str(tmp_path)), str(tmp_path), None)
    state = _state()
    first = _describe(describer, state)
    change(state)
    again = _describe(describer, state)
    fresh = _describe(Describer(storage_for(str(tmp_path)), str(tmp_path), None), state)
    assert again == fresh
    assert again != first
