"""Shared fixtures and helpers: small models, bit-exact comparisons, pausing the writer."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
import torch

import ckptd


class TinyLM(torch.nn.Module):
    """A small language-model-shaped module with a tied embedding / output head."""

    def __init__(self, vocab: int = 64, width: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("position", torch.arange(8), persistent=True)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(self.norm(x))


def train_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 2) -> None:
    """Run a few optimizer steps so that optimizer state exists."""
    for _ in range(steps):
        tokens = torch.randint(0, 64, (4, 8))
        model(tokens).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def assert_same(a: Any, b: Any, where: str = "state") -> None:
    """Recursive equality; tensors must match bit for bit, with dtype and shape."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: expected a tensor, got {type(b).__name__}"
        assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{where}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert torch.equal(_bits(a), _bits(b)), f"{where}: values differ"
        return
    if isinstance(a, Mapping):
        assert isinstance(b, Mapping), f"{where}: expected a mapping, got {type(b).__name__}"
        assert set(a) == set(b), f"{where}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
        return
    if isinstance(a, (list, tuple)):
        assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
        return
    if isinstance(a, float) and a != a:
        assert isinstance(b, float) and b != b, f"{where}: {a!r} != {b!r}"
        return
    assert a == b and type(a) is type(b), f"{where}: {a!r} ({type(a).__name__}) != {b!r} ({type(b).__name__})"


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor (so NaNs and signed zeros compare exactly)."""
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def clone_state(value: Any) -> Any:
    """A deep copy of nested state with tensors cloned (the expected value of a save)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, Mapping):
        return {k: clone_state(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clone_state(v) for v in value]
    if isinstance(value, tuple):
        return tuple(clone_state(v) for v in value)
    return value


@contextlib.contextmanager
def paused(pid: int) -> Iterator[None]:
    """Freeze a process (SIGSTOP) for the duration of the block."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def wait_for(condition: Callable[[], bool], timeout: float = 30.0, interval: float = 0.01) -> None:
    """Poll until ``condition()`` is true; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def root(tmp_path: Any) -> str:
    """A fresh checkpoint root directory."""
    path = tmp_path / "ckpts"
    return str(path)


@pytest.fixture
def checkpointer(root: str) -> Iterator[ckptd.Checkpointer]:
    """A Checkpointer on a fresh root, closed after the test."""
    ckpt = ckptd.Checkpointer(root)
    try:
        yield ckpt
    finally:
        ckpt.close(wait=False)


@pytest.fixture
def trained() -> tuple[TinyLM, torch.optim.Optimizer, Any]:
    """A TinyLM with AdamW state after two steps and a scheduler."""
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    train_steps(model, optimizer)
    scheduler.step()
    return model, optimizer, scheduler
