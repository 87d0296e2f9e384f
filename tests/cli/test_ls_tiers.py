"""``ckptd ls ROOT`` lists the slower tiers recorded under the root (``Checkpointer(tiers=...)``)
with their checkpoints; a tier out of reach is a warning, not a failure; ``memory ls --json``
follows its schema."""

from __future__ import annotations

import json
import os
import uuid

import torch
from cli_helpers import run, run_json
from test_json import LS, MEMORY_LS, check

import ckptd
from ckptd.formats.names import TIERS_RECORD_NAME


def _state(step: int) -> dict[str, dict[str, torch.Tensor]]:
    return {"model": {"w": torch.full((256,), float(step))}}


def test_ls_lists_every_recorded_tier_with_its_checkpoints(tmp_path):
    fast, slow, slower = (str(tmp_path / name) for name in ("fast", "slow", "slower"))
    tiers = [ckptd.Tier(slow, every=2, keep_last=2), ckptd.Tier(slower, every=3)]
    with ckptd.Checkpointer(fast, keep_last=1, tiers=tiers) as ckpt:
        for step in range(1, 7):
            ckpt.save(step, _state(step))
        assert ckpt.wait_promotions(60)
    with open(os.path.join(fast, TIERS_RECORD_NAME)) as f:
        record = json.load(f)
    assert "storage_options" not in json.dumps(record)  # credentials never land in the record
    document = run_json("ls", fast)
    check(document, LS)
    assert [c["step"] for c in document["checkpoints"]] == [6]
    listed = {t["tier"]: (t["root"], t["every"], t["keep_last"], [c["step"] for c in t["checkpoints"]], t["error"])
              for t in document["tiers"]}  # fmt: skip
    assert listed == {1: (slow, 2, 2, [4, 6], None), 2: (slower, 3, None, [3, 6], None)}
    text = run("ls", fast)
    assert text.returncode == 0
    assert f"tier 1: {slow} (every 2 steps, keeps 2)" in text.stdout and "checkpoint-4" in text.stdout


def test_a_tier_out_of_reach_is_a_warning_and_the_root_still_lists(tmp_path):
    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    with ckptd.Checkpointer(fast, tiers=[ckptd.Tier(slow)]) as ckpt:
        ckpt.save(1, _state(1))
        assert ckpt.wait_promotions(60)
    record_path = os.path.join(fast, TIERS_RECORD_NAME)
    with open(record_path) as f:
        record = json.load(f)
    record["tiers"][0]["root"] = "nosuch://bucket/run"  # a store this machine has no client for
    with open(record_path, "w") as f:
        json.dump(record, f)
    document = run_json("ls", fast)
    check(document, LS)
    assert [c["step"] for c in document["checkpoints"]] == [1]
    (tier,) = document["tiers"]
    assert tier["checkpoints"] == [] and tier["error"]
    text = run("ls", fast)
    assert text.returncode == 0 and "tier 1" in text.stdout and "could not be listed" in text.stderr


def test_memory_ls_json_schema():
    name = f"t{uuid.uuid4().hex[:10]}"
    with ckptd.Checkpointer(f"shm://{name}", hold_after_exit=0) as ckpt:
        ckpt.save(1, _state(1))
        document = run_json("memory", "ls")
        check(document, MEMORY_LS)
        assert any(r["url"] == f"shm://{name}" and r["in_use"] for r in document["roots"])
    ckptd.drop_held(name)
