"""Kill points of incremental saves and of retention, generated: every rename, link, unlink,
rmdir and fsync under the root, one SIGKILL each.

A scenario first runs once under the OS-call recorder; each recorded call (its path made
independent of host, pid and random names) becomes a kill point, before the call and, for the
calls that publish or unpublish a checkpoint, after it too.  After each crash a new Checkpointer
(whose start-up collects garbage) must show only whole checkpoints: every visible one verifies
and loads bit for bit, nothing hidden is left, the newest checkpoint committed before the kill is
still there (retention never deletes the newest), and new saves work.

Scenarios: an incremental run with ``keep_last=1`` (step 2 links step 1's frozen file, then
retention deletes step 1 while step 2 shares that file's inode), and retention over a root an
older version wrote, whose checkpoints reference their predecessor's files (defect 4: a holder
deleted before the checkpoint referencing it left a checkpoint that no longer loads).
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from conftest import LEGACY_INCREMENTAL
from crashsim import Call, check_root, read_calls, run, stop_zygote

import ckptd
from ckptd.load.reader import CheckpointReader

pytestmark = pytest.mark.slow

_OPS = ("rename", "link", "unlink", "rmdir", "fsync")
_RANDOM = [
    (re.compile(r"\\\.tmp\\-[^/]*"), r"\.tmp-[^/]*"),
    (re.compile(r"\\\.deleting\\-[^/]*"), r"\.deleting-[^/]*"),
    (re.compile(r"\\\.replaced\\-[^/]*"), r"\.replaced-[^/]*"),
]


@pytest.fixture(scope="module", autouse=True)
def _forking_server() -> Any:
    yield
    stop_zygote()


@dataclass(frozen=True)
class KillPoint:
    kill: str  # CKPTD_TEST_KILL
    index: int  # position of the call in the recording
    call: Call


def pattern_of(path: str, root: str) -> str | None:
    """A regex for ``path`` under ``root`` that matches the same call in another run."""
    if path != root and not path.startswith(root + os.sep):
        return None
    relative = re.escape(os.path.relpath(path, os.path.dirname(root)))  # "ckpts/..."
    for random, replacement in _RANDOM:
        relative = random.sub(lambda _, r=replacement: r, relative)
    return "/" + relative + "$"


def kill_points(calls: list[Call], root: str) -> list[KillPoint]:
    """One kill point per recorded call of ``_OPS`` under ``root`` (before it), plus after each
    rename and link (a publish, an exchange, a rename aside for deletion, a linked file)."""
    points = []
    for index, call in enumerate(calls):
        if call.op not in _OPS:
            continue
        pattern = pattern_of(call.paths[0], root)
        if pattern is None:
            continue
        regex = re.compile(pattern)
        # the hook counts every call of that operation with any path matching the pattern
        count = sum(1 for c in calls[: index + 1] if c.op == call.op and any(regex.search(p) for p in c.paths))
        points.append(KillPoint(f"{call.op}|{pattern}|{count}|before", index, call))
        if call.op in ("rename", "link"):
            points.append(KillPoint(f"{call.op}|{pattern}|{count}|after", index + 1, call))
    return points


def committed_before(calls: list[Call], index: int, root: str) -> list[int]:
    """Steps published (a staging directory renamed to ``checkpoint-N``) by the calls before ``index``."""
    steps = []
    for call in calls[:index]:
        if call.op == "rename" and ".tmp-" in call.paths[0] and os.path.dirname(call.paths[1]) == root:
            steps.append(int(os.path.basename(call.paths[1]).split("-")[1]))
    return steps


def recorded(action: str, args: dict[str, Any], root: str, tmp_path: Any) -> list[Call]:
    log = str(tmp_path / "calls.log")
    run(action, {**args, "root": root}, record=log)
    return read_calls(log)


def fresh_root(tmp_path: Any, name: str, legacy: bool) -> str:
    parent = tmp_path / name
    parent.mkdir()
    root = str(parent / "ckpts")
    if legacy:
        shutil.copytree(LEGACY_INCREMENTAL, root)
    return root


def test_every_kill_point_of_an_incremental_run_with_keep_last_one(tmp_path):
    args = {"steps": [1, 2], "incremental": True, "keep_last": 1}
    probe = fresh_root(tmp_path, "probe", legacy=False)
    calls = recorded("save", args, probe, tmp_path)
    assert any(c.op == "link" for c in calls), "step 2 links step 1's frozen file"
    points = kill_points(calls, probe)
    assert len(points) >= 20, [p.kill for p in points]
    failures = []
    for number, point in enumerate(points):
        root = fresh_root(tmp_path, f"point-{number}", legacy=False)
        try:
            run("save", {**args, "root": root}, kill=point.kill)
            newest = committed_before(calls, point.index, probe)
            required = {max(newest): {0}} if newest else {}
            found = check_root(root, required=required, allowed={1: {0}, 2: {0}}, resave=(2,))
            if newest and max(newest) == 1:
                assert set(found) <= {1, 2}
        except (AssertionError, ckptd.errors.CkptdError) as e:
            failures.append(f"{point.kill} ({point.call.op} {' '.join(point.call.paths)}): {e}")
    assert not failures, "\n".join(failures)


def check_legacy_root(root: str, newest: int | None) -> set[int]:
    """Every visible checkpoint of the older version's root (steps 1-3) and of the new save (4)
    verifies and loads bit for bit; ``newest`` must be among them; nothing hidden is left."""
    from scenario import state_for

    with ckptd.Checkpointer(root) as ckpt:
        steps = set(ckpt.steps())
        for step in steps:
            reader = CheckpointReader.open(ckpt.path_for(step))
            reader.verify()
            model = reader.read("model")
            if step == 4:
                expected = state_for(4)["model"]
                assert all(torch.equal(model[k], v) for k, v in expected.items()), "step 4"
            else:
                assert torch.equal(model["adapter.bias"], torch.full((4,), float(step))), f"step {step}"
                assert model["base.weight"].shape == (8, 8)
        if newest is not None:
            assert newest in steps, f"the newest committed step {newest} was lost (found {sorted(steps)})"
        ckpt.save(5, state_for(5))
    hidden = [n for n in os.listdir(root) if n.startswith(".")]
    assert not hidden, f"left behind: {hidden}"
    return steps


def test_every_kill_point_of_retention_over_an_older_versions_referencing_checkpoints(tmp_path):
    """Defect 4: with the holder (checkpoint-1) deleted first, a kill before its referrers went
    left checkpoints 2 and 3 that no longer loaded, and gc could not repair them."""
    args = {"steps": [4], "keep_last": 1}
    probe = fresh_root(tmp_path, "probe", legacy=True)
    calls = recorded("save", args, probe, tmp_path)
    renamed_aside = [os.path.basename(c.paths[0]) for c in calls if c.op == "rename" and ".deleting-" in c.paths[1]]
    assert renamed_aside == ["checkpoint-3", "checkpoint-2", "checkpoint-1"], "referrers before their holder"
    points = kill_points(calls, probe)
    failures = []
    for number, point in enumerate(points):
        root = fresh_root(tmp_path, f"point-{number}", legacy=True)
        try:
            run("save", {**args, "root": root}, kill=point.kill)
            committed = committed_before(calls, point.index, probe)
            check_legacy_root(root, 4 if committed else 3)
        except (AssertionError, ckptd.errors.CkptdError) as e:
            failures.append(f"{point.kill} ({point.call.op} {' '.join(point.call.paths)}): {e}")
    assert not failures, "\n".join(failures)


def test_a_filesystem_that_refuses_hard_links_gets_copies(tmp_path):
    """EXDEV, EPERM (protected_hardlinks, FUSE), EMLINK: the incremental save copies the file in
    the kernel instead, and the checkpoint is as whole (here every link() fails with EXDEV)."""
    root = fresh_root(tmp_path, "nolinks", legacy=False)
    run("save", {"steps": [1, 2], "incremental": True, "root": root}, fail="link|.|18")
    found = check_root(root, required={1: {0}, 2: {0}})
    assert found == {1: 0, 2: 0}
    body = ckptd.CheckpointReader.open(os.path.join(root, "checkpoint-2")).manifest
    assert body is not None and {f.reused for f in body.files.values()} >= {"copy"}
    copied = [n for n, f in body.files.items() if f.reused == "copy"]
    for name in copied:
        assert os.stat(os.path.join(root, "checkpoint-2", name)).st_nlink == 1, "a copy, not a link"
