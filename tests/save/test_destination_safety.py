"""Where a save (``path=``) or ``ckptd.consolidate`` may commit: a new path, an empty directory, or
(with ``overwrite=True``) an existing checkpoint, swapped in whole; never a directory of someone
else's files, whatever ``overwrite`` says (the commit replaces a manifest-less directory, so such
a destination is refused before anything is written), and for ``consolidate`` never its source."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import assert_same

import ckptd
from ckptd.errors import CheckpointExistsError, ConfigError, ForeignFilesError


def _saved(root: str, value: float = 1.0) -> tuple[str, dict[str, torch.Tensor]]:
    state = {"w": torch.full((4, 3), value), "b": torch.arange(5, dtype=torch.int64)}
    with ckptd.Checkpointer(root) as ckpt:
        path = ckpt.save(1, {"model": state}).path
    return path, {k: v.clone() for k, v in state.items()}


def _created(path: str) -> str:
    manifest = ckptd.CheckpointReader.open(path).manifest
    assert manifest is not None
    return manifest.created_utc


def _hidden(directory: str) -> list[str]:
    return [name for name in os.listdir(directory) if name.startswith(".")]


def test_an_existing_checkpoint_is_replaced_only_with_overwrite(root, tmp_path):
    source, _ = _saved(root)
    out = str(tmp_path / "out")
    ckptd.consolidate(source, out)
    first = _created(out)
    with pytest.raises(CheckpointExistsError, match="overwrite=True"):
        ckptd.consolidate(source, out)
    assert _created(out) == first, "the refused call left the checkpoint as it was"

    other, other_expected = _saved(str(tmp_path / "other"), value=7.0)
    ckptd.consolidate(other, out, overwrite=True)
    assert _created(out) != first
    assert_same(other_expected, ckptd.load_checkpoint(out))
    assert _hidden(str(tmp_path)) == [], "no staging or replaced directory left behind"


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_directory_that_is_not_a_checkpoint_is_never_replaced(root, tmp_path, overwrite):
    source, _ = _saved(root)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(ForeignFilesError, match="not a ckptd checkpoint"):
        ckptd.consolidate(source, str(precious), overwrite=overwrite)
    assert os.listdir(precious) == ["notes.txt"]
    assert (precious / "notes.txt").read_text() == "not a checkpoint"
    assert _hidden(str(tmp_path)) == [], "refused before anything was staged"


def test_a_file_at_the_destination_is_never_replaced(root, tmp_path):
    source, _ = _saved(root)
    target = tmp_path / "model.bin"
    target.write_bytes(b"someone else's file")
    with pytest.raises(ForeignFilesError, match="not a ckptd checkpoint"):
        ckptd.consolidate(source, str(target), overwrite=True)
    assert target.read_bytes() == b"someone else's file"


def test_an_empty_directory_takes_the_checkpoint(root, tmp_path):
    source, expected = _saved(root)
    empty = tmp_path / "empty"
    empty.mkdir()
    ckptd.consolidate(source, str(empty))
    assert_same(expected, ckptd.load_checkpoint(str(empty)))
    ckptd.CheckpointReader.open(str(empty)).verify()


def test_the_source_is_not_a_destination(root):
    source, expected = _saved(root)
    with pytest.raises(ConfigError, match="other than its source"):
        ckptd.consolidate(source, source, overwrite=True)
    assert_same(expected, ckptd.load_checkpoint(source))
    ckptd.CheckpointReader.open(source).verify()


# ---- Checkpointer saves to a chosen path ------------------------------------------------------


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_save_to_a_chosen_directory_of_someone_elses_files_is_refused_before_staging(root, tmp_path, overwrite):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("not a checkpoint")
    with ckptd.Checkpointer(root) as ckpt:
        with pytest.raises(ForeignFilesError, match="not a ckptd checkpoint"):
            ckpt.save(1, {"model": {"w": torch.ones(3)}}, path=str(precious), overwrite=overwrite)
        assert not [n for n in os.listdir(root) if n.startswith(".")], "refused before a staging directory"
        ckpt.save(2, {"model": {"w": torch.ones(3)}})  # the Checkpointer goes on
    assert os.listdir(precious) == ["notes.txt"]
    assert (precious / "notes.txt").read_text() == "not a checkpoint"


def test_a_save_to_an_empty_chosen_directory_commits_there(root, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with ckptd.Checkpointer(root) as ckpt:
        result = ckpt.save(1, {"model": {"w": torch.arange(3.0)}}, path=str(empty))
    assert result.path == str(empty)
    assert_same({"w": torch.arange(3.0)}, ckptd.load_checkpoint(str(empty)))


def test_a_checkpoint_with_a_broken_manifest_is_replaced_only_with_overwrite(root):
    with ckptd.Checkpointer(root) as ckpt:
        path = ckpt.save(1, {"model": {"w": torch.zeros(3)}}).path
        with open(os.path.join(path, "checkpoint_manifest.json"), "w") as f:
            f.write("{ not json")
        with pytest.raises(CheckpointExistsError, match="overwrite=True"):
            ckpt.save(1, {"model": {"w": torch.ones(3)}})
        assert os.path.exists(os.path.join(path, "model-00001-of-00001.safetensors")), "left for a person to look at"
        ckpt.save(1, {"model": {"w": torch.ones(3)}}, overwrite=True)
        assert_same({"w": torch.ones(3)}, ckpt.load(1)["model"])


def test_a_step_directory_written_by_another_tool_is_never_replaced(root):
    """An HF Trainer output dir has ``checkpoint-500/`` of its own: saving step 500 there fails."""
    theirs = os.path.join(root, "checkpoint-500")
    os.makedirs(theirs)
    with open(os.path.join(theirs, "trainer_state.json"), "w") as f:
        f.write('{"global_step": 500}')
    with ckptd.Checkpointer(root) as ckpt:
        for overwrite in (False, True):
            with pytest.raises(ForeignFilesError, match="not a ckptd checkpoint"):
                ckpt.save(500, {"model": {"w": torch.ones(2)}}, overwrite=overwrite)
        assert ckpt.checkpoints() == []
    assert os.listdir(theirs) == ["trainer_state.json"]


def _export_of_safetensors_only(directory: str) -> list[str]:
    """Someone's weights export: shards and an HF index, no ckptd state file, no manifest."""
    from safetensors.torch import save_file

    os.makedirs(directory)
    save_file({"w": torch.ones(2)}, os.path.join(directory, "model-00001-of-00001.safetensors"))
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        f.write('{"metadata": {}, "weight_map": {"w": "model-00001-of-00001.safetensors"}}')
    return sorted(os.listdir(directory))


def test_a_step_directory_of_safetensors_files_alone_is_never_replaced(root):
    """Shards and indexes do not say whose they are: without a ckptd state file they are kept."""
    theirs = os.path.join(root, "checkpoint-7")
    names = _export_of_safetensors_only(theirs)
    with ckptd.Checkpointer(root) as ckpt:
        for overwrite in (False, True):
            with pytest.raises(ForeignFilesError, match="not a ckptd checkpoint"):
                ckpt.save(7, {"model": {"w": torch.zeros(2)}}, overwrite=overwrite)
    assert sorted(os.listdir(theirs)) == names
    from safetensors.torch import load_file

    assert_same({"w": torch.ones(2)}, load_file(os.path.join(theirs, "model-00001-of-00001.safetensors")))


@pytest.mark.parametrize(
    "state_text",
    ['{"format": "something-else", "components": {}}', "{ not json", '["ckptd-state"]'],
)
def test_a_state_json_that_is_not_ckptds_does_not_make_a_directory_ours(root, state_text):
    theirs = os.path.join(root, "checkpoint-8")
    _export_of_safetensors_only(theirs)
    with open(os.path.join(theirs, "state.json"), "w") as f:
        f.write(state_text)
    with ckptd.Checkpointer(root) as ckpt:
        with pytest.raises(ForeignFilesError):
            ckpt.save(8, {"model": {"w": torch.zeros(2)}})
    with open(os.path.join(theirs, "state.json")) as f:
        assert f.read() == state_text


def test_a_same_step_save_committed_during_the_checks_is_never_replaced_without_overwrite(root, monkeypatch):
    """Defect 10: save A passed its destination check, was descheduled, and save B of the same
    step committed meanwhile; A then swapped its directory in and B's checkpoint was gone, both
    saves reporting success.  Here B commits inside A's last check, exactly in that window."""
    from ckptd.save import commit

    first = {"w": torch.full((4,), 1.0)}
    second = {"w": torch.full((4,), 2.0)}
    real_check = commit.check_destination
    with ckptd.Checkpointer(root) as a, ckptd.Checkpointer(root) as b:
        interleaved: list[str] = []

        def check_then_let_b_commit(final_dir: str, **kwargs: object) -> None:
            real_check(final_dir, **kwargs)  # type: ignore[arg-type]
            if not interleaved:
                interleaved.append("B")  # B's own checks (B's commit) pass straight through
                b.save(5, {"model": second})  # B commits in A's window

        monkeypatch.setattr(commit, "check_destination", check_then_let_b_commit)
        with pytest.raises(CheckpointExistsError, match="checkpoint-5"):
            a.save(5, {"model": first})
        assert interleaved, "B committed between A's checks"
        monkeypatch.setattr(commit, "check_destination", real_check)
        assert_same(second, b.load(5, verify=True)["model"])
        assert _hidden(root) == [], "A's staging directory is removed"
