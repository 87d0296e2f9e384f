"""Kill points: SIGKILL (trainer and writer together) at chosen OS calls of a save, an overwrite,
retention, consolidation and garbage collection, then check what is left.

Each point names the call and its path; the run must actually die there (else the point is
stale and the test fails).  After each crash a new Checkpointer (its start-up collects garbage)
must see every committed step whole and verified, the previous steps intact, nothing hidden
left under the root, and a new save of the crashed step (and a fresh one) must work.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import pytest
from crashsim import check_root, run, stop_zygote
from scenario import state_for

import ckptd
from ckptd.load.reader import CheckpointReader

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _forking_server() -> Any:
    yield
    stop_zygote()


STAGING_2 = r"/\.checkpoint-2\.tmp-[^/]*"


@dataclass(frozen=True)
class Point:
    """A crash point: the committed steps first, then ``action`` killed at ``kill``."""

    name: str
    setup: tuple[int, ...]
    action: str
    args: dict[str, Any]
    kill: str
    required: dict[int, set[int]]
    allowed: dict[int, set[int]] = field(default_factory=dict)
    resave: tuple[int, ...] = (2,)

    @property
    def needs_exchange(self) -> bool:
        return self.name.startswith("overwrite/")


SAVE2 = {"steps": [2]}
OVERWRITE2 = {"steps": [2], "overwrite": True, "variant": 1}
FALLBACK2 = {**OVERWRITE2, "no_exchange": True}
ONE = {1: {0}}
BOTH = {1: {0}, 2: {0}}

POINTS = [
    # -- a save of step 2 beside step 1 ------------------------------------------------------
    Point("save/shard-write", (1,), "save", SAVE2, f"write|{STAGING_2}/model-00001|1|before", ONE),
    Point("save/shard-fsync", (1,), "save", SAVE2, f"fsync|{STAGING_2}/model-00002|1|before", ONE),
    Point("save/index-write", (1,), "save", SAVE2, f"write|{STAGING_2}/model.safetensors.index|1|before", ONE),
    Point("save/state-fsync", (1,), "save", SAVE2, f"fsync|{STAGING_2}/state.json|1|before", ONE),
    Point("save/manifest-write", (1,), "save", SAVE2, f"write|{STAGING_2}/checkpoint_manifest|1|before", ONE),
    # The manifest is durable: recovery may publish the staging directory (never delete it).
    Point("save/manifest-fsync", (1,), "save", SAVE2, f"fsync|{STAGING_2}/checkpoint_manifest|1|after", ONE, BOTH),
    Point("save/staging-fsync", (1,), "save", SAVE2, f"fsync|{STAGING_2}$|1|after", ONE, BOTH),
    Point("save/publish-rename", (1,), "save", SAVE2, f"rename|{STAGING_2}$|1|before", ONE, BOTH),
    Point("save/after-rename", (1,), "save", SAVE2, f"rename|{STAGING_2}$|1|after", BOTH),
    Point("save/parent-fsync", (1,), "save", SAVE2, "fsync|/ckpts$|2|after", BOTH),
    # -- overwrite of step 2 (atomic exchange) ----------------------------------------------
    Point(
        "overwrite/manifest-write", (1, 2), "save", OVERWRITE2, f"write|{STAGING_2}/checkpoint_manifest|1|before", BOTH
    ),
    Point("overwrite/before-exchange", (1, 2), "save", OVERWRITE2, f"fsync|{STAGING_2}$|1|after", {1: {0}, 2: {0, 1}}),
    Point("overwrite/after-exchange", (1, 2), "save", OVERWRITE2, r"rename|\.deleting-|1|before", {1: {0}, 2: {1}}),
    Point("overwrite/old-removal", (1, 2), "save", OVERWRITE2, r"unlink|\.deleting-|2|before", {1: {0}, 2: {1}}),
    # -- overwrite of step 2 where the filesystem cannot exchange (two renames) -------------
    Point("fallback/aside", (1, 2), "save", FALLBACK2, "rename|/checkpoint-2$|1|before", BOTH),
    Point("fallback/between-renames", (1, 2), "save", FALLBACK2, f"rename|{STAGING_2}$|1|before", {1: {0}, 2: {1}}),
    Point("fallback/old-removal", (1, 2), "save", FALLBACK2, r"unlink|\.replaced-|1|before", {1: {0}, 2: {1}}),
    # -- retention -----------------------------------------------------------------------------
    Point(
        "retention/rename-aside",
        (1, 2, 3),
        "retention",
        {"keep_last": 1},
        "rename|/checkpoint-1$|1|before",
        {3: {0}},
        BOTH,
    ),
    # Retention deletes newest first (2, then 1): a kill while 2 is half-deleted leaves 1 whole.
    Point(
        "retention/mid-delete",
        (1, 2, 3),
        "retention",
        {"keep_last": 1},
        r"unlink|\.deleting-|3|before",
        {3: {0}},
        {1: {0}},
    ),
    Point(
        "retention/rmdir", (1, 2, 3), "retention", {"keep_last": 1}, r"rmdir|\.deleting-|1|before", {3: {0}}, {1: {0}}
    ),
    Point(
        "retention/in-save",
        (1, 2),
        "save",
        {"steps": [3], "keep_last": 2},
        r"unlink|\.checkpoint-1\.deleting-|2|before",
        {2: {0}, 3: {0}},
        resave=(1, 3),
    ),
]


def _can_exchange(where: Any) -> bool:
    from ckptd.storage.local import exchange_paths

    a, b = where / "exchange-a", where / "exchange-b"
    a.mkdir()
    b.mkdir()
    try:
        return exchange_paths(str(a), str(b))
    finally:
        a.rmdir()
        b.rmdir()


def _prepare(root: str, steps: tuple[int, ...]) -> None:
    with ckptd.Checkpointer(root, max_shard_size="4KB") as ckpt:
        for step in steps:
            ckpt.save(step, state_for(step))


@pytest.mark.parametrize("point", POINTS, ids=[p.name for p in POINTS])
def test_kill_point(point: Point, tmp_path: Any) -> None:
    if point.needs_exchange and not _can_exchange(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} has no renameat2(RENAME_EXCHANGE): see fallback/*")
    root = str(tmp_path / "ckpts")
    _prepare(root, point.setup)
    run(point.action, {"root": root, **point.args}, kill=point.kill)
    check_root(root, required=point.required, allowed=point.allowed, resave=point.resave)


# -- consolidation: ckptd.consolidate(root/checkpoint-1 -> root/consolidated) ------------

CONSOLIDATION = [
    ("consolidate/shard-rename", r"rename|\.consolidated\.tmp-[^/]*/model-00001|1|before", False),
    ("consolidate/manifest-write", r"write|\.consolidated\.tmp-[^/]*/checkpoint_manifest|1|before", False),
    ("consolidate/publish", r"rename|\.consolidated\.tmp-[^/]*$|1|after", True),
]


@pytest.mark.parametrize(("kill", "published"), [c[1:] for c in CONSOLIDATION], ids=[c[0] for c in CONSOLIDATION])
def test_kill_point_consolidation(kill: str, published: bool, tmp_path: Any) -> None:
    root = str(tmp_path / "ckpts")
    _prepare(root, (1,))
    destination = os.path.join(root, "consolidated")
    run("consolidate", {"source": os.path.join(root, "checkpoint-1"), "destination": destination}, kill=kill)
    check_root(root, required=ONE, resave=(1,))
    assert os.path.isdir(destination) == published
    if published:
        reader = CheckpointReader.open(destination)
        reader.verify()
        assert_model(reader.read("model"), state_for(1)["model"])
    ckptd.consolidate(os.path.join(root, "checkpoint-1"), os.path.join(root, "again"))  # works after the crash
    CheckpointReader.open(os.path.join(root, "again")).verify()


# -- garbage collection, finishing an overwrite a crash interrupted ---------------------------

GC = [
    ("gc/recover-rename", rf"rename|{STAGING_2}$|1|after"),
    ("gc/remove-replaced", r"unlink|\.replaced-|1|before"),
]


@pytest.mark.parametrize("kill", [c[1] for c in GC], ids=[c[0] for c in GC])
def test_kill_point_garbage_collection(kill: str, tmp_path: Any) -> None:
    root = str(tmp_path / "ckpts")
    _prepare(root, (1, 2))
    run("save", {"root": root, **FALLBACK2}, kill=f"rename|{STAGING_2}$|1|before")
    names = os.listdir(root)
    assert "checkpoint-2" not in names, names  # the window the overwrite crashed in
    run("gc", {"root": root}, kill=kill)
    check_root(root, required={1: {0}, 2: {1}})


def assert_model(got: dict[str, Any], expected: dict[str, Any]) -> None:
    import torch

    assert set(got) == set(expected)
    for key, tensor in expected.items():
        assert got[key].dtype == tensor.dtype and got[key].shape == tensor.shape, key
        assert torch.equal(got[key], tensor), key
