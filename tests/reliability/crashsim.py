"""Run a ckptd operation in a subprocess that records, or dies at, chosen OS calls; then check
what a crash left behind (shared by the durability and kill-point tests)."""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Call", "HERE", "check_root", "read_calls", "run", "stop_zygote"]

HERE = os.path.dirname(os.path.abspath(__file__))
_HOOK = os.path.join(HERE, "oshook")
_REPO = os.path.dirname(os.path.dirname(HERE))


@dataclass(frozen=True)
class Call:
    """One recorded OS call: process, thread name, operation (rename/unlink/rmdir/mkdir/fsync/write,
    create: ``os.open`` with ``O_CREAT``), paths."""

    pid: int
    thread: str
    op: str
    paths: tuple[str, ...]


class _Zygote:
    """The forking server of ``zygote.py``, started on first use and stopped at exit."""

    def __init__(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([_HOOK, HERE, _REPO, env.get("PYTHONPATH", "")])
        env.pop("CKPTD_TEST_KILL", None)
        env.pop("CKPTD_TEST_RECORD", None)
        env.pop("CKPTD_TEST_FAIL", None)
        self.process = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "zygote.py")],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def ask(self, request: dict[str, Any], timeout: float) -> dict[str, int]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not ready:
            self.stop()
            raise AssertionError(f"{request['action']} did not finish within {timeout}s")
        line = self.process.stdout.readline()
        assert line, "the zygote process died"
        return json.loads(line)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


_zygote: list[_Zygote] = []


def stop_zygote() -> None:
    """Stop the forking server (a fixture's teardown; also at exit)."""
    while _zygote:
        _zygote.pop().stop()


atexit.register(stop_zygote)


def run(
    action: str,
    args: Mapping[str, Any],
    *,
    kill: str | None = None,
    record: str | None = None,
    fail: str | None = None,
    timeout: float = 90,
) -> None:
    """Run ``scenario.main(action, args)`` in a fresh process under the OS-call hook; with
    ``kill`` the run must die there (SIGKILL), without it the run must succeed.  ``fail``
    (``op|regex|errno``) makes those calls fail instead (``CKPTD_TEST_FAIL``)."""
    if not _zygote:
        _zygote.append(_Zygote())
    with tempfile.NamedTemporaryFile(prefix="ckptd-scenario-", suffix=".err", delete=False) as f:
        errors = f.name
    try:
        reply = _zygote[0].ask(
            {
                "action": action,
                "args": dict(args),
                "CKPTD_TEST_KILL": kill,
                "CKPTD_TEST_RECORD": record,
                "CKPTD_TEST_FAIL": fail,
                "stderr": errors,
            },
            timeout,
        )
        with open(errors, errors="replace") as f:
            output = f.read()[-3000:]
    finally:
        os.unlink(errors)
    if kill:
        assert reply.get("signal") == signal.SIGKILL, f"kill point {kill!r} was never reached ({reply}):\n{output}"
    else:
        assert reply.get("exit") == 0, f"{action} failed ({reply}):\n{output}"


def read_calls(log: str) -> list[Call]:
    """The calls a recorded run made, in order."""
    calls = []
    with open(log) as f:
        for line in f:
            pid, thread, op, *paths = line.split()
            calls.append(Call(int(pid), thread, op, tuple(paths)))
    return calls


def check_root(
    root: str,
    *,
    required: Mapping[int, set[int]],
    allowed: Mapping[int, set[int]] | None = None,
    resave: tuple[int, ...] = (),
) -> dict[int, int]:
    """What every test checks after a crash; returns the step -> variant found.

    A new Checkpointer (whose start-up collects garbage) must find every ``required`` step, each
    holding one of the variants listed, and nothing but ``required`` and ``allowed`` steps; every
    visible step must verify and load bit for bit; nothing hidden may be left under the root, and
    no ``checkpoint-*`` directory without a manifest.  Then each step of ``resave`` (and a fresh
    one) is saved again and checked the same way.
    """
    from scenario import state_for

    import ckptd
    from ckptd.catalog import read_manifest
    from ckptd.storage.local import LocalStorage

    allowed_all = {**(allowed or {}), **required}
    with ckptd.Checkpointer(root, max_shard_size="4KB") as ckpt:
        found = _check_visible(root, ckpt, allowed_all)
        missing = set(required) - set(found)
        assert not missing, f"steps {sorted(missing)} were lost (found {found})"
        for step in (*resave, 999):
            ckpt.save(step, state_for(step, 7), overwrite=step in ckpt.steps())
            allowed_all = {**allowed_all, step: {7}}
        after = _check_visible(root, ckpt, allowed_all)
        for step in (*resave, 999):
            assert after.get(step) == 7, f"the new save of step {step} did not take ({after})"
    names = os.listdir(root)
    assert not [n for n in names if n.startswith(".")], f"left behind under {root}: {names}"
    storage = LocalStorage()
    bare = [n for n in names if read_manifest(storage, os.path.join(root, n)) is None]
    assert not bare, f"directories without a manifest under {root}: {bare}"
    return found


def _check_visible(root: str, ckpt: Any, allowed: Mapping[int, set[int]]) -> dict[int, int]:
    from scenario import state_for

    from ckptd.load.reader import CheckpointReader

    names = os.listdir(root)
    assert not [n for n in names if n.startswith(".")], f"garbage collection left {sorted(names)}"
    found: dict[int, int] = {}
    for step in ckpt.steps():
        assert step in allowed, f"step {step} should not exist (allowed {sorted(allowed)})"
        reader = CheckpointReader.open(ckpt.path_for(step))
        reader.verify()
        model = reader.read("model")
        variant = int(model["w"][0, 0].item()) - step * 10
        assert variant in allowed[step], f"step {step} holds variant {variant}, expected {allowed[step]}"
        expected = state_for(step, variant)["model"]
        for key, tensor in expected.items():
            got = model[key]
            assert got.dtype == tensor.dtype and got.shape == tensor.shape, f"step {step} {key}"
            assert torch.equal(got, tensor), f"step {step}: {key} differs"
        found[step] = variant
    return found
