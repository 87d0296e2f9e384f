"""Random-number-generator state as a checkpoint component."""

from __future__ import annotations

import random
import sys
from typing import Any

import torch

__all__ = ["RNGState"]


class RNGState:
    """Captures and restores Python, NumPy (if imported), torch CPU and CUDA generator states.

    Pass an instance as a component: ``ckpt.async_save(step, {"rng": ckptd.RNGState(), ...})`` and
    ``ckpt.load(into={"rng": ckptd.RNGState()})``.  Each rank keeps its own RNG state.
    """

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            state["numpy"] = numpy.random.get_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(_as_tuple(state["python"]))
        torch.set_rng_state(state["torch"].cpu())
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([t.cpu() for t in state["cuda"]])
        if "numpy" in state:
            import numpy

            numpy.random.set_state(state["numpy"])


def _as_tuple(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuple(v) for v in value)
    return value
