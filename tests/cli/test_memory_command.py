"""``ckptd memory ls|drop``: this user's held-memory roots (``shm://NAME``), listed and dropped by
the command line, against a real Checkpointer holding a lease on one."""

from __future__ import annotations

import os
import uuid

import torch
from cli_helpers import assert_error, run, run_json

import ckptd
from ckptd.storage.held import held_path


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"model": {"w": torch.full((2048,), float(step))}}


def _name() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


def test_the_cli_lists_and_drops_held_roots(tmp_path):
    name = _name()
    ckpt = ckptd.Checkpointer(f"shm://{name}", hold_after_exit=300)
    try:
        ckpt.save(1, _state(1))
        listed = run_json("memory", "ls")
        (entry,) = [r for r in listed["roots"] if r["url"] == f"shm://{name}"]
        assert entry["in_use"] is True and entry["nbytes"] > 0 and entry["path"] == held_path(name)
        assert_error(run("memory", "drop", name), "conflict", "in use", name)
        assert run("ls", f"shm://{name}").returncode == 0  # every command reads shm:// roots
        assert run("verify", f"shm://{name}/checkpoint-1").returncode == 0
    finally:
        ckpt.close()
    text = run("memory", "ls")
    assert f"shm://{name}" in text.stdout and "held" in text.stdout
    dropped = run_json("memory", "drop", f"shm://{name}")
    assert dropped["dropped"]["url"] == f"shm://{name}"
    assert not os.path.exists(held_path(name))
    assert_error(run("memory", "drop", name), "not_found", name)
    assert_error(run("memory", "drop"), "usage", "NAME")
    assert_error(run("memory", "ls", "extra"), "usage")
