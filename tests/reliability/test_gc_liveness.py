"""Garbage collection leaves alone what a live process owns, in whatever PID namespace it runs,
and collects what a dead owner left.

A sidecar container shares the host name and the filesystem with the trainer but numbers its
processes differently: its ``ckptd gc`` found the pid in a live save's staging directory name
dead (no such process in its namespace) and deleted the directory under the save (defect 9).
Owners now hold an ``flock`` on each hidden leftover (``ckptd.storage.liveness``): a save's
staging directory, an overwrite's ``.replaced-`` directory, ``write_stream``'s temporary file, a
consolidation's or conversion's staging directory.  The kernel sees every lock of the host
whatever the namespace, and drops it when the owner dies.

The namespace case runs the collection under ``unshare --user --pid --fork --map-root-user``
(same host name, same filesystem, its own pid numbering) while a real save is frozen at an exact
OS call (the ``oshook`` of ``crashsim``); where unshare is not allowed those tests are skipped and
:func:`test_a_held_lock_outweighs_a_dead_pid_in_the_name` still shows the same situation.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import assert_same, process_stopped, wait_for
from crashsim import HERE
from scenario import state_for

import ckptd
from ckptd.formats.names import host_label, match_leftover_name
from ckptd.garbage import collect_garbage, find_leftovers
from ckptd.load.reader import CheckpointReader
from ckptd.storage.liveness import hold_new_directory, is_held
from ckptd.storage.local import LocalStorage

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

REPO = os.path.dirname(os.path.dirname(HERE))
OSHOOK = os.path.join(HERE, "oshook")
CHILD = os.path.join(HERE, "liveness_child.py")
STAGING_2 = r"/\.checkpoint-2\.tmp-[^/]*"
PID_NAMESPACE = ("unshare", "--user", "--pid", "--fork", "--map-root-user")


def _works(command: tuple[str, ...]) -> bool:
    try:
        return subprocess.run([*command, "true"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


needs_pid_namespace = pytest.mark.skipif(
    not _works(PID_NAMESPACE), reason="unshare --user --pid --fork --map-root-user is not allowed here"
)


def _env(stop_at: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    paths = [HERE, REPO, env.get("PYTHONPATH", "")]
    env.pop("CKPTD_TEST_KILL", None)
    env.pop("CKPTD_TEST_RECORD", None)
    if stop_at is not None:  # the process freezes itself (SIGSTOP) at that OS call
        paths.insert(0, OSHOOK)
        env["CKPTD_TEST_KILL"] = f"{stop_at}|1|after|stop"
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


@contextlib.contextmanager
def _frozen(action: str, args: dict[str, Any], stop_at: str) -> Iterator[subprocess.Popen[str]]:
    """A real process (and its writer process) running ``scenario.main(action, args)`` (or
    ``convert``), frozen right after the OS call ``stop_at`` (``op|path regex``) when the block
    starts; whatever is left of them is killed at the end."""
    command = [CHILD, "frozen", json.dumps({"action": action, "args": args})]
    process = subprocess.Popen(
        [sys.executable, *command],
        env=_env(stop_at),
        start_new_session=True,  # its own process group: killpg takes the writer too
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: process_stopped(process.pid) or process.poll() is not None, timeout=120)
        assert process.poll() is None, f"{command} ended before {stop_at}: {process.stderr.read()}"  # type: ignore[union-attr]
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        process.stderr.close()  # type: ignore[union-attr]


def _carry_on(process: subprocess.Popen[str]) -> None:
    """Continue a frozen process and check it finished its work."""
    os.kill(process.pid, signal.SIGCONT)
    _, errors = process.communicate(timeout=120)
    assert process.returncode == 0, errors


def _gc_in_another_pid_namespace(root: str, owner: int, older_than: float | None = None) -> dict[str, Any]:
    """``ckptd gc ROOT --json`` from a new PID namespace on this host (a sidecar container's
    view); checks that the owner's pid means nothing there, as in the defect."""
    args: dict[str, Any] = {"root": root, "watch": owner}
    if older_than is not None:
        args["older_than"] = older_than
    out = subprocess.run(
        [*PID_NAMESPACE, sys.executable, CHILD, "gc", json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    seen, document = out.stdout.splitlines()
    assert json.loads(seen) == {"pid_alive": False}, "the owner's pid must look dead from the other namespace"
    assert out.returncode == 0, out.stderr
    return json.loads(document)


def _gc_here(root: str, *extra: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "ckptd", "gc", root, "--json", *extra],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _hidden(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith("."))


def _prepare(root: str, steps: tuple[int, ...]) -> None:
    with ckptd.Checkpointer(root, max_shard_size="4KB") as ckpt:
        for step in steps:
            ckpt.save(step, state_for(step))


def _assert_step(root: str, step: int, variant: int = 0) -> None:
    reader = CheckpointReader.open(os.path.join(root, f"checkpoint-{step}"))
    reader.verify()
    assert_same(reader.read("model"), state_for(step, variant)["model"])


@needs_pid_namespace
def test_gc_in_another_pid_namespace_leaves_a_live_save_alone(tmp_path: Any) -> None:
    root = str(tmp_path / "ckpts")
    _prepare(root, (1,))
    # Frozen with every shard, index and the state file written, the manifest just created (empty).
    with _frozen("save", {"root": root, "steps": [2]}, f"create|{STAGING_2}/checkpoint_manifest") as trainer:
        (staging,) = _hidden(root)
        assert f"-{trainer.pid}-" in staging
        document = _gc_in_another_pid_namespace(root, trainer.pid)
        assert document["removed"] == []
        assert {"path": os.path.join(root, staging), "kind": "staging", "reason": "save in progress"} in document[
            "kept"
        ]
        assert _hidden(root) == [staging]
        _carry_on(trainer)  # the save commits: its directory was never touched
    assert _hidden(root) == []
    _assert_step(root, 1)
    _assert_step(root, 2)


@needs_pid_namespace
def test_gc_in_another_pid_namespace_leaves_an_overwrite_between_its_renames_alone(tmp_path: Any) -> None:
    """An overwrite where the filesystem cannot exchange two directories: the old checkpoint is
    renamed aside to ``.checkpoint-2.replaced-*``, then the staging directory is renamed into
    place.  Between the two, a collection that took the old copy for a crash's leftover would
    restore it as ``checkpoint-2`` (and the save would fail)."""
    root = str(tmp_path / "ckpts")
    _prepare(root, (1, 2))
    overwrite = {"root": root, "steps": [2], "overwrite": True, "variant": 1, "no_exchange": True}
    with _frozen("save", overwrite, "rename|/checkpoint-2$") as trainer:  # renamed aside
        hidden = _hidden(root)
        assert [match_leftover_name(n).group("kind") for n in hidden] == ["replaced", "tmp"], hidden  # type: ignore[union-attr]
        assert "checkpoint-2" not in os.listdir(root)
        document = _gc_in_another_pid_namespace(root, trainer.pid)
        assert document["removed"] == []
        assert _hidden(root) == hidden and "checkpoint-2" not in os.listdir(root)
        _carry_on(trainer)
    assert _hidden(root) == []
    _assert_step(root, 1)
    _assert_step(root, 2, variant=1)


@needs_pid_namespace
def test_gc_in_another_pid_namespace_leaves_a_consolidation_alone(tmp_path: Any) -> None:
    root = str(tmp_path / "ckpts")
    _prepare(root, (1,))
    destination = os.path.join(root, "consolidated")
    args = {"source": os.path.join(root, "checkpoint-1"), "destination": destination}
    with _frozen("consolidate", args, r"create|/\.consolidated\.tmp-[^/]*/") as job:
        (staging,) = _hidden(root)
        document = _gc_in_another_pid_namespace(root, job.pid)
        assert document["removed"] == [] and _hidden(root) == [staging]
        _carry_on(job)
    assert _hidden(root) == []
    reader = CheckpointReader.open(destination)
    reader.verify()
    assert_same(reader.read("model"), state_for(1)["model"])


def test_a_conversion_in_progress_is_never_too_old_to_keep(tmp_path: Any) -> None:
    """A conversion's staging directory names no owner, so it goes by age; while the conversion
    holds it, not even ``--older-than 0`` removes it."""
    root = str(tmp_path / "ckpts")
    _prepare(root, (1,))
    destination = os.path.join(root, "hf")
    args = {"source": os.path.join(root, "checkpoint-1"), "destination": destination}
    with _frozen("convert", args, r"create|/\.hf\.tmp-[^/]*/") as job:
        (staging,) = _hidden(root)
        document = _gc_here(root, "--older-than", "0")
        assert document["removed"] == [] and _hidden(root) == [staging]
        _carry_on(job)
    assert _hidden(root) == []
    assert "model.safetensors.index.json" in os.listdir(destination)


def test_a_held_lock_outweighs_a_dead_pid_in_the_name(tmp_path: Any) -> None:
    """The defect without a second PID namespace: the staging directory's name records a pid
    that does not exist here, which is exactly what a collection in another PID namespace sees
    of a live trainer (its pid is a number of another numbering); meanwhile a live process holds
    the directory's lock, as that trainer does.  The lock decides: the directory stays until the
    owner lets go, then goes."""
    root = tmp_path / "ckpts"
    root.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # exited: no such process (unless reused meanwhile: see below)
    staging = root / f".checkpoint-5.tmp-{host_label()}-{pid}-0a1b2c3d"
    held = hold_new_directory(str(staging), lambda p: os.makedirs(p, exist_ok=True))
    try:
        (staging / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 64)
        (leftover,) = find_leftovers(LocalStorage(), str(root))
        assert leftover.active
        document = _gc_here(str(root), "--older-than", "0")
        assert document["removed"] == [] and staging.is_dir()
        assert document["kept"] == [{"path": str(staging), "kind": "staging", "reason": "save in progress"}]
    finally:
        held.release()
    assert _gc_here(str(root))["removed"] == [str(staging)]
    assert not staging.exists()


def test_a_staging_directory_whose_locker_was_killed_is_collected(tmp_path: Any) -> None:
    """A real save killed with SIGKILL (trainer and writer) mid-save: its staging directory's
    lock is free at once.  The name is then made to record a pid that is alive here (as after
    pid reuse, or when that number belongs to another process in the collecting namespace): the
    free lock still says the owner is gone, and the collection removes it."""
    root = str(tmp_path / "ckpts")
    _prepare(root, (1,))
    with _frozen("save", {"root": root, "steps": [2]}, f"create|{STAGING_2}/checkpoint_manifest") as trainer:
        (staging,) = _hidden(root)
        path = os.path.join(root, staging)
        assert is_held(path) is True
        os.killpg(trainer.pid, signal.SIGKILL)
        trainer.wait()
    assert is_held(path) is False  # the kernel dropped the lock with the process
    alive = staging.replace(f"-{trainer.pid}-", f"-{os.getpid()}-")
    os.rename(path, os.path.join(root, alive))
    document = _gc_here(root)
    assert document["removed"] == [os.path.join(root, alive)]
    assert _hidden(root) == []
    _assert_step(root, 1)
    assert os.listdir(root) == ["checkpoint-1"]


def test_a_forked_child_does_not_keep_its_parents_staging_directory_alive(tmp_path: Any) -> None:
    """A process holding a staging directory forks (a DataLoader worker), then dies with SIGKILL
    while the child lives on: the child closed its copy of the lock at the fork, so the
    directory is collected."""
    root = tmp_path / "ckpts"
    root.mkdir()
    staging = root / f".checkpoint-3.tmp-{host_label()}-1-0a1b2c3d"
    owner = subprocess.Popen(
        [sys.executable, CHILD, "hold", json.dumps({"path": str(staging), "fork": True})],
        env=_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    worker = 0
    try:
        assert owner.stdout is not None
        worker = int(owner.stdout.readline().split()[1])
        assert worker > 0 and is_held(str(staging)) is True
        owner.kill()
        owner.wait()
        assert os.path.exists(f"/proc/{worker}")  # the worker lives on
        assert is_held(str(staging)) is False
        assert collect_garbage(LocalStorage(), str(root)) == [str(staging)]
    finally:
        owner.kill()
        owner.communicate()  # closes stdin: the worker's read returns
        if worker:
            wait_for(lambda: not os.path.exists(f"/proc/{worker}") or _zombie(worker))


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_write_stream_holds_its_temporary_file(tmp_path: Any) -> None:
    """``write_stream``'s temporary file names no owner, so it goes by age; while its writer
    holds it, not even ``older_than=0`` removes it, and the file lands whole."""
    root = tmp_path / "ckpts"
    root.mkdir()
    target = root / "notes.bin"
    writer = subprocess.Popen(
        [sys.executable, CHILD, "write_stream", json.dumps({"path": str(target)})],
        env=_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None and writer.stdin is not None
        assert writer.stdout.readline().strip() == "writing"
        (temporary,) = _hidden(str(root))
        assert temporary.startswith(".notes.bin.tmp-")
        assert collect_garbage(LocalStorage(), str(root), older_than=0) == []
        assert _hidden(str(root)) == [temporary]
        writer.stdin.write("go\n")
        writer.stdin.flush()
        _, errors = writer.communicate(timeout=60)
        assert writer.returncode == 0, errors
    finally:
        writer.kill()
        writer.communicate()
    assert target.read_bytes() == b"a" * 1000 + b"b" * 1000
    assert _hidden(str(root)) == []
