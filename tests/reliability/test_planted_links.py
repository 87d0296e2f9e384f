"""Links planted inside a checkpoint root never make ckptd read, write, delete or take over what
lies outside it (found by an adversarial pass at stop 44, each test failing without its fix).

Each case plants a symlink where ckptd keeps its own files (the held root's staging directory
and spare, a ``checkpoint-N`` beside a Forgather or Hugging Face run's checkpoints, a side file's
temporary name, a replica's shard) and checks that the files it leads to are left as they were.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import uuid

import pytest
import torch
from conftest import assert_same

import ckptd
from ckptd.compat import forgather
from ckptd.errors import ConfigError, StorageError
from ckptd.formats.names import ARENAS_NAME, SPARE_NAME, match_leftover_name
from ckptd.replicas.transfer import _open_checkpoint
from ckptd.storage import LocalStorage
from ckptd.storage.held import held_path

SHARD = "model-00001-of-00001.safetensors"


def precious_directory(parent: str) -> tuple[str, dict[str, bytes]]:
    """A directory of files nobody may touch, and their contents."""
    directory = os.path.join(parent, f"precious-{uuid.uuid4().hex[:8]}")
    os.makedirs(directory)
    contents = {"notes.txt": b"PRECIOUS " * 10, SHARD: b"USER DATA " * 10}
    for name, data in contents.items():
        with open(os.path.join(directory, name), "wb") as f:
            f.write(data)
    return directory, contents


def unchanged(directory: str, contents: dict[str, bytes]) -> bool:
    found = {}
    for name in os.listdir(directory):
        with open(os.path.join(directory, name), "rb") as f:
            found[name] = f.read()
    return found == contents


def test_garbage_collection_does_not_list_through_a_linked_staging_directory(tmp_path, caplog):
    """Every Checkpointer collects the staging files a dead trainer left in ``.ckptd-arenas``:
    through a link it unlinked every unlocked file of the target."""
    outside, contents = precious_directory(str(tmp_path))
    root = tmp_path / "ckpts"
    root.mkdir()
    os.symlink(outside, root / ARENAS_NAME)
    with caplog.at_level(logging.WARNING), ckptd.Checkpointer(str(root)) as ckpt:
        ckpt.save(1, {"model": {"w": torch.arange(8.0)}})
    assert ckpt.steps() == [1]
    assert unchanged(outside, contents)
    assert "is a symlink" in caplog.text
    assert os.path.islink(root / ARENAS_NAME)


@pytest.fixture
def held_outside():
    """A directory beside the suite's held roots (same filesystem, so a rename could reach it),
    removed afterwards: the suite fails on anything left in its held base."""
    base = os.environ["CKPTD_HELD_DIR"]
    directory, contents = precious_directory(base)
    yield directory, contents
    shutil.rmtree(directory)


def test_a_held_save_refuses_a_linked_staging_directory(held_outside):
    outside, contents = held_outside
    name = f"links{uuid.uuid4().hex[:8]}"
    root = held_path(f"shm://{name}")
    os.makedirs(root)
    os.symlink(outside, os.path.join(root, ARENAS_NAME))
    with ckptd.Checkpointer(f"shm://{name}", hold_after_exit=0) as ckpt:
        with pytest.raises(ConfigError, match="is a symlink"):
            ckpt.save(1, {"model": {"w": torch.arange(4096.0)}})
    assert unchanged(outside, contents)


def test_a_held_save_never_takes_over_the_files_of_a_linked_spare(held_outside):
    """A save that does not adopt its staging files (here through a staging budget) reuses the
    spare's files by renaming them in: through a link it renamed the outside shard into the new
    checkpoint and wrote over it."""
    outside, contents = held_outside
    name = f"links{uuid.uuid4().hex[:8]}"
    state = {"model": {"w": torch.arange(1024.0)}}
    with ckptd.Checkpointer(f"shm://{name}", hold_after_exit=0, staging_memory="1GB") as ckpt:
        ckpt.save(1, state)
        assert SHARD in os.listdir(ckpt.path_for(1))
        os.symlink(outside, os.path.join(ckpt.root, SPARE_NAME))
        ckpt.save(2, state)
        assert unchanged(outside, contents)
        assert_same(ckpt.load(2)["model"]["w"], state["model"]["w"])
        assert os.stat(os.path.join(ckpt.path_for(2), SHARD)).st_ino != os.stat(os.path.join(outside, SHARD)).st_ino


@pytest.mark.parametrize("target", ["outside", "sibling"])
def test_forgather_rotation_neither_counts_nor_follows_a_linked_checkpoint(tmp_path, target):
    """A ``checkpoint-99`` link (to a newer checkpoint outside, or to the run's own last one) was
    the latest and counted by rotation, which then deleted the only real checkpoint."""
    model_dir = tmp_path / "model"
    with ckptd.Checkpointer(str(model_dir / "checkpoints")) as ckpt:
        ckpt.save(10, {"model": {"w": torch.ones(4)}})
    real = str(model_dir / "checkpoints" / "checkpoint-10")
    if target == "outside":
        with ckptd.Checkpointer(str(tmp_path / "elsewhere")) as other:
            other.save(99, {"model": {"w": torch.zeros(4)}})
        os.symlink(str(tmp_path / "elsewhere" / "checkpoint-99"), model_dir / "checkpoints" / "checkpoint-99")
    else:
        os.symlink(real, model_dir / "checkpoints" / "checkpoint-99")
    assert forgather.find_latest_checkpoint(str(model_dir)) == real
    forgather.maybe_delete_oldest_checkpoint(str(model_dir), max_checkpoints=1)
    assert os.path.isdir(real) and not os.path.islink(real)
    assert forgather.validate_checkpoint(real)
    if target == "outside":
        assert os.path.isdir(tmp_path / "elsewhere" / "checkpoint-99")


@pytest.fixture
def hf_worker():
    pytest.importorskip("transformers")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "integrations"))
    try:
        import hf_worker

        yield hf_worker
    finally:
        sys.path.pop(0)


def test_hf_trainer_rotation_ignores_a_linked_checkpoint(tmp_path, hf_worker):
    """With ``save_total_limit=1`` a planted ``checkpoint-99`` link was the protected latest and
    every checkpoint the run committed was deleted, the one just committed included."""
    with ckptd.Checkpointer(str(tmp_path / "elsewhere")) as other:
        other.save(99, {"model": {"w": torch.zeros(4)}})
    out = tmp_path / "run"
    out.mkdir()
    os.symlink(str(tmp_path / "elsewhere" / "checkpoint-99"), out / "checkpoint-99")
    trainer = hf_worker.make_trainer(str(out), max_steps=10, save_steps=5, save_total_limit=1)
    try:
        trainer.train()
    finally:
        trainer.close_checkpointers()
    real = sorted(n for n in os.listdir(out) if n.startswith("checkpoint-") and not os.path.islink(out / n))
    assert real == ["checkpoint-10"]
    assert os.path.isfile(tmp_path / "elsewhere" / "checkpoint-99" / "checkpoint_manifest.json")


def test_hf_trainer_side_files_are_never_written_through_a_planted_name(tmp_path, hf_worker):
    """Resuming rebuilds a missing ``trainer_state.json`` through a temporary file: its name was
    ``<file>.tmp-<pid>``, opened following links, so a link planted under it was written through."""
    out = tmp_path / "run"
    trainer = hf_worker.make_trainer(str(out), max_steps=5, save_steps=5)
    try:
        trainer.train()
    finally:
        trainer.close_checkpointers()
    checkpoint = out / "checkpoint-5"
    os.unlink(checkpoint / "trainer_state.json")  # a crash between the commit and the side files
    victim = tmp_path / "precious.txt"
    victim.write_text("PRECIOUS USER DATA\n")
    os.symlink(victim, checkpoint / f"trainer_state.json.tmp-{os.getpid()}")
    trainer = hf_worker.make_trainer(str(out), max_steps=6, save_steps=100)
    try:
        trainer.train(resume_from_checkpoint=str(checkpoint))
    finally:
        trainer.close_checkpointers()
    assert victim.read_text() == "PRECIOUS USER DATA\n"
    assert not os.path.islink(checkpoint / "trainer_state.json")
    assert '"global_step": 5' in (checkpoint / "trainer_state.json").read_text()


def test_a_replica_is_not_sent_from_a_checkpoint_whose_shard_is_a_link(tmp_path, caplog):
    """The sender of a peer replica opened the files by path: a shard linked to an outside file
    sent that file's bytes, restored on the peer as the checkpoint."""
    with ckptd.Checkpointer(str(tmp_path / "ckpts")) as ckpt:
        ckpt.save(3, {"model": {"w": torch.arange(16.0)}})
        path = ckpt.path_for(3)
    opened = _open_checkpoint(path)
    assert opened is not None  # the checkpoint as saved is sent
    for _, _, fd in opened[1]:
        os.close(fd)
    outside = tmp_path / "outside.safetensors"
    os.rename(os.path.join(path, SHARD), outside)
    os.symlink(outside, os.path.join(path, SHARD))
    with caplog.at_level(logging.WARNING):
        assert _open_checkpoint(path) is None
    assert "not sending" in caplog.text


@pytest.mark.parametrize("name", ["....replaced-0a1b", "...deleting-0a1b", ".a/b.tmp-0a1b"])
def test_a_leftover_name_whose_base_is_no_entry_of_the_root_is_not_a_leftover(name):
    """``....replaced-<hex>`` has base ``..``: collecting it renamed the root's parent (refused by
    the kernel, but every collection then failed)."""
    assert match_leftover_name(name) is None
    assert match_leftover_name(".checkpoint-3.replaced-0a1b")["base"] == "checkpoint-3"


@pytest.mark.parametrize("existing", [False, True], ids=["new", "overwrite"])
def test_a_staging_directory_swapped_for_a_link_is_not_published(tmp_path, existing):
    """A save's staging directory replaced by a link while the writer wrote (a race an adversarial
    pass won): publishing renamed the link into place, a checkpoint that was what it led to."""
    outside, contents = precious_directory(str(tmp_path))
    staging, final = str(tmp_path / ".checkpoint-1.tmp-0a1b"), str(tmp_path / "checkpoint-1")
    os.symlink(outside, staging)
    storage = LocalStorage()
    with pytest.raises(StorageError, match="replaced by a symlink"):
        if existing:
            os.mkdir(final)
            storage.exchange_directories(staging, final)
        else:
            storage.publish_directory(staging, final)
    assert os.path.islink(staging) and (os.path.isdir(final) and not os.path.islink(final)) == existing
    assert unchanged(outside, contents)
