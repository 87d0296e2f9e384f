"""Lightning with CkptdCheckpointIO: ModelCheckpoint rotation, fit(ckpt_path=...), non-tensor
entries without pickle, scoped pickle opt-in, and a SIGKILLed run resumed to the same weights."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from conftest import assert_same  # noqa: E402
from killed_runs import run_script  # noqa: E402
from lightning_worker import MAX_STEPS, Regressor, make_trainer, train_loader  # noqa: E402

import ckptd  # noqa: E402
from ckptd.errors import UnsafeCheckpointError, UnsupportedValueError  # noqa: E402
from ckptd.integrations.lightning import CkptdCheckpointIO  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

WORKER = os.path.join(os.path.dirname(__file__), "lightning_worker.py")


def committed(dirpath: str) -> list[str]:
    return sorted(
        os.path.join(dirpath, n)
        for n in os.listdir(dirpath)
        if os.path.isfile(os.path.join(dirpath, n, "checkpoint_manifest.json"))
    )


@pytest.mark.slow
def test_model_checkpoint_top_k_rotation_and_round_trip(tmp_path):
    dirpath = str(tmp_path / "ckpts")
    pl.seed_everything(0, verbose=False)
    model = Regressor()
    trainer = make_trainer(dirpath, max_steps=20, save_top_k=2, monitor="train_loss", mode="min")
    trainer.fit(model, train_loader())
    callback = trainer.checkpoint_callback
    kept = committed(dirpath)
    assert len(kept) == 2, kept
    assert sorted(callback.best_k_models) == kept
    assert all(os.path.isdir(p) for p in kept), "each .ckpt path is a ckptd checkpoint directory"
    assert not [n for n in os.listdir(dirpath) if n.startswith(".checkpoint-")], "no staging left"
    io = CkptdCheckpointIO()
    loaded = io.load_checkpoint(callback.best_model_path)
    expected_keys = {"epoch", "global_step", "pytorch-lightning_version", "state_dict", "loops", "callbacks"}
    assert expected_keys | {"optimizer_states", "lr_schedulers", "hyper_parameters"} <= set(loaded)
    assert loaded["hyper_parameters"] == {"lr": 0.05, "dims": (8, 16), "name": "tiny"}, "tuples survive"
    (state,) = [v for k, v in loaded["callbacks"].items() if k.startswith("ModelCheckpoint")]
    assert state["dirpath"] == dirpath
    assert isinstance(state["best_model_score"], torch.Tensor) and state["best_model_score"].ndim == 0
    assert isinstance(loaded["optimizer_states"][0]["state"][0]["exp_avg"], torch.Tensor)
    assert loaded["lr_schedulers"][0]["step_size"] == 7
    io.teardown()
    # trainer.fit(ckpt_path=...) continues from it
    best_step = loaded["global_step"]
    resumed = make_trainer(str(tmp_path / "more"), max_steps=best_step + 5)
    again = Regressor()
    resumed.fit(again, train_loader(), ckpt_path=callback.best_model_path)
    assert resumed.global_step == best_step + 5


class Tag:
    """A hyper-parameter JSON cannot hold."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tag) and other.value == self.value

    __hash__ = None  # type: ignore[assignment]


def test_trainer_save_checkpoint_and_scoped_pickle(tmp_path):
    pl.seed_everything(0, verbose=False)
    model = Regressor()
    trainer = make_trainer(str(tmp_path / "unused"), max_steps=3)
    trainer.fit(model, train_loader())
    checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    checkpoint["hyper_parameters"] = {"tag": Tag(3)}
    path = str(tmp_path / "manual" / "x.ckpt")
    io = CkptdCheckpointIO()
    with pytest.raises(UnsupportedValueError, match="pickle_keys"):
        io.save_checkpoint(checkpoint, path)
    opted = CkptdCheckpointIO(pickle_keys=("hyper_parameters",))
    opted.save_checkpoint(checkpoint, path)
    opted.wait(path)
    loaded = opted.load_checkpoint(path)
    assert loaded["hyper_parameters"] == {"tag": Tag(3)}
    assert_same(loaded["state_dict"], checkpoint["state_dict"])
    with pytest.raises(UnsafeCheckpointError, match="pickle_keys"):
        io.load_checkpoint(path)
    # the rest is plain ckptd: no pickle anywhere else
    with ckptd.Checkpointer(str(tmp_path / "manual")) as ckpt:
        assert set(ckpt.load(path, components=["model"])["model"]) == set(checkpoint["state_dict"])
    opted.remove_checkpoint(path)
    assert not os.path.exists(path)
    opted.teardown()
    io.teardown()


def run_worker(dirpath: str, out: str, *extra: str, kill_after: int | None = None) -> list[int]:
    return run_script(WORKER, dirpath, out, *extra, kill_after=kill_after)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigkilled_run_resumes_to_the_same_weights(tmp_path):
    straight = str(tmp_path / "straight")
    run_worker(straight, str(tmp_path / "straight.pt"))
    killed = str(tmp_path / "killed")
    steps = run_worker(killed, str(tmp_path / "never.pt"), kill_after=17)
    assert steps[-1] < MAX_STEPS and not os.path.exists(tmp_path / "never.pt")
    survivors = committed(killed)
    assert survivors, "checkpoints committed before the kill survive it"
    latest = max(survivors, key=lambda p: CkptdCheckpointIO().load_checkpoint(p)["global_step"])
    assert CkptdCheckpointIO().load_checkpoint(latest)["global_step"] >= 15
    run_worker(killed, str(tmp_path / "resumed.pt"), latest)
    expected = torch.load(tmp_path / "straight.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert_same(expected, resumed, "final weights")


def test_removal_waits_for_the_newer_save(tmp_path):
    from conftest import paused

    io = CkptdCheckpointIO()
    old, new = str(tmp_path / "c" / "epoch=0-step=5.ckpt"), str(tmp_path / "c" / "epoch=1-step=10.ckpt")
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "global_step": 5}, old)
    io.wait()
    writer = io._checkpointers[str(tmp_path / "c")]
    writer.health_check()
    with paused(writer.writer_pid):
        io.save_checkpoint({"state_dict": {"w": torch.full((3,), 2.0)}, "global_step": 10}, new)
        io.remove_checkpoint(old)  # ModelCheckpoint rotates right after starting the newer save
        assert os.path.isfile(os.path.join(old, "checkpoint_manifest.json")), "kept until the newer one commits"
    io.teardown()
    assert not os.path.exists(old)
    assert torch.equal(io.load_checkpoint(new)["state_dict"]["w"], torch.full((3,), 2.0))
    io.teardown()


class _Payload:
    """Unpickling it leaves a marker file (what a hostile ``.ckpt`` would run instead)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (open, (self.marker, "w"))


def test_a_plain_ckpt_file_is_never_unpickled_unless_asked(tmp_path):
    marker = str(tmp_path / "ran")
    path = str(tmp_path / "hostile.ckpt")
    torch.save({"state_dict": {}, "payload": _Payload(marker)}, path)
    io = CkptdCheckpointIO()
    try:
        with pytest.raises(pickle.UnpicklingError):
            io.load_checkpoint(path)  # Lightning's default weights_only=None
        assert not os.path.exists(marker)
        io.load_checkpoint(path, weights_only=False)  # the caller opted in
        assert os.path.exists(marker)
    finally:
        io.teardown()
