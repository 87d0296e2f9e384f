"""A save that fails in one rank's own state raises the same ckptd error on every rank."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import assert_same
from distributed import run_ranks

import ckptd
from ckptd.errors import CkptdError, DistributedSaveError, UnsupportedValueError

pytestmark = [pytest.mark.multiprocess, pytest.mark.distributed]


class BrokenState:
    """A component whose ``state_dict()`` raises (a bug in the caller's code on one rank)."""

    def state_dict(self) -> dict[str, object]:
        raise RuntimeError("optimizer state is inconsistent (test)")


def fail_state_dict_on_rank_one(rank: int, world: int, root: str) -> dict[str, object]:
    model = {"w": torch.arange(6.0) + rank}
    with ckptd.Checkpointer(root, dist_timeout=30) as ckpt:
        extra = BrokenState() if rank == 1 else {"lr": 0.1}
        try:
            ckpt.async_save(1, {"model": model, "extra": extra}, sharing={"model": "per_rank"})
        except CkptdError as e:  # one handler on every rank
            error = e
        else:
            raise AssertionError(f"rank {rank}: the save did not fail")
        cause = error.__cause__
        outcome = {
            "type": type(error).__name__,
            "ranks": getattr(error, "ranks", None),
            "message": str(error),
            "cause": f"{type(cause).__name__}: {cause}" if cause is not None else None,
        }
        # Nothing is left half-done: the next save of the same step commits on every rank.
        ckpt.save(1, {"model": model, "extra": {"lr": 0.1}}, sharing={"model": "per_rank"})
        outcome["loaded"] = ckpt.load(1)["model"]["w"]
        # Every rank failing alike with a ckptd error raises that error on every rank.
        with pytest.raises(UnsupportedValueError, match="sparse tensor"):
            ckpt.async_save(2, {"model": {"s": torch.eye(2).to_sparse()}})
        assert ckpt.steps() == [1]
    return outcome


def test_state_dict_raising_on_one_rank_raises_distributed_save_error_on_every_rank(tmp_path):
    root = str(tmp_path / "ckpts")
    results = run_ranks(3, fail_state_dict_on_rank_one, root)
    for rank, outcome in results.items():
        assert outcome["type"] == DistributedSaveError.__name__, (rank, outcome)
        assert outcome["ranks"] == [1], (rank, outcome)
        assert "planning the save failed on rank(s) [1]" in outcome["message"], outcome
        assert "rank 1: RuntimeError: optimizer state is inconsistent (test)" in outcome["message"], outcome
        assert_same(torch.arange(6.0) + rank, outcome["loaded"], f"rank {rank}")
    # the failed rank chains its own exception; the others have nothing to chain
    assert results[1]["cause"] == "RuntimeError: optimizer state is inconsistent (test)"
    assert results[0]["cause"] is None and results[2]["cause"] is None
    names = os.listdir(root)  # the committed step only: no staging directory left behind
    assert len(names) == 1 and names[0].startswith("checkpoint-"), names
