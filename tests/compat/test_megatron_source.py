"""ckptd's Megatron bridge against Megatron-Core's source tree at a newer release than the
installable wheel: core_v0.19.0 (no strategy registry, ``strategies/base.py`` gone, the common
state inside the ``torch_dist`` files, ``integrity.json``); core_v0.17.0 and core_v0.18.0 trees
run too (what they lack is detected and left out: ``integrity.json`` before 0.18).

Runs when ``CKPTD_MEGATRON_SRC`` names a tree made by ``scripts/megatron_source.sh`` (see
docs/migration.md), skipped otherwise.  Megatron runs only in spawned processes that put that
tree first on ``sys.path`` (tests/compat/megatron_source.py); this process runs ckptd alone on
what they wrote.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_same
from distributed import run_ranks
from megatron_fixtures import (
    COMMON,
    WORLD,
    assert_whole_layout_loaded,
    expected_for_rank,
    expected_objects,
    expected_tensors,
    whole_layout,
)
from megatron_source import ENV, generate_on_rank, load_on_one_rank

import ckptd
from ckptd.compat import megatron as mcore
from ckptd.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafeCheckpointError

SRC = os.environ.get(ENV, "")

pytestmark = [
    pytest.mark.skipif(
        not SRC,
        reason=f"{ENV} is not set: run scripts/megatron_source.sh MEGATRON_LM_GIT_DIR core_v0.19.0 and set "
        f"the {ENV}=... it prints (docs/migration.md, Megatron-Core)",
    ),
    pytest.mark.interop,
    pytest.mark.multiprocess,
    pytest.mark.distributed,
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[int, dict[str, Any]]]:
    """2 gloo ranks of the source tree's Megatron save (and load back) the fixture state."""
    if not Path(SRC, "megatron", "core", "dist_checkpointing").is_dir():
        pytest.fail(f"{ENV}={SRC} has no megatron/core/dist_checkpointing: make it with scripts/megatron_source.sh")
    root = str(tmp_path_factory.mktemp("megatron_src"))
    return root, run_ranks(WORLD, generate_on_rank, root, SRC)


@pytest.fixture(scope="module")
def one_rank(generated: tuple[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """World size 1 with the source tree's Megatron and ckptd's LoadStrategy (and a corrupted copy)."""
    root = generated[0]
    corrupt = os.path.join(root, "corrupt")
    shutil.copytree(os.path.join(root, "torch_dist"), corrupt)
    flip_a_byte(corrupt)
    return run_ranks(1, load_on_one_rank, root, SRC)[0]


def flip_a_byte(directory: str) -> str:
    """Corrupt one byte in the middle of the first ``.distcp`` file; returns its name."""
    name = sorted(n for n in os.listdir(directory) if n.endswith(".distcp"))[0]
    path = os.path.join(directory, name)
    data = bytearray(Path(path).read_bytes())
    data[len(data) // 2] ^= 0xFF
    Path(path).write_bytes(bytes(data))
    return name


def needs_integrity(generated: tuple[str, dict[int, dict[str, Any]]]) -> None:
    if not generated[1][0]["integrity"]:
        pytest.skip(f"Megatron {generated[1][0]['version']} writes no integrity.json (0.18+ does)")


def test_the_source_tree_is_a_megatron_without_strategy_registry(generated):
    _, results = generated
    # detected by what is there: no registry; SaveStrategy is a torch_dist strategy (0.17+)
    assert (results[0]["registry"], results[0]["save_is_torch_dist"]) == (False, True), results[0]["version"]
    if results[0]["version"].startswith("0.19"):
        assert not results[0]["has_base"]  # strategies/base.py is gone


def test_megatron_wrote_torch_dist(generated):
    root, results = generated
    files = results[0]["files:torch_dist"]
    assert {"metadata.json", ".metadata"} <= set(files)
    if results[0]["version"].startswith("0.19"):
        assert "common.pt" not in files  # the common state is the "common_state" sharded object
    directory = os.path.join(root, "torch_dist")
    assert mcore.megatron_backend(directory) == "torch_dist"
    if results[0]["integrity"]:
        listed = json.loads(Path(directory, "integrity.json").read_text())["files"]
        assert set(listed) == set(files) - {"integrity.json"}


def test_ckptd_reads_the_torch_dist_checkpoint(generated):
    directory = os.path.join(generated[0], "torch_dist")
    assert_same(COMMON, mcore.load_common_state_dict(directory))  # args: an argparse.Namespace
    assert_same(expected_tensors(), mcore.load_plain_tensors(directory))
    assert_same(expected_tensors(), ckptd.load_checkpoint(directory))
    metadata = mcore.load_sharded_metadata(directory)
    assert {k for k in metadata if "/shard_" in k} == set(expected_objects())  # common_state is not an object
    assert metadata["layers.mlp.weight"].global_shape == (2, 3, 4)
    verify = True if generated[1][0]["integrity"] else None
    assert_whole_layout_loaded(mcore.load(whole_layout(mcore), directory, verify_integrity=verify))


def test_ckptd_save_strategy_under_the_source_tree(generated):
    root, results = generated
    integrity = results[0]["integrity"]
    for name in ("ckptd", "ckptd_async"):
        directory = os.path.join(root, name)
        expected_files = ["ckptd", "common.pt", "metadata.json"] + (
            ["integrity.json"] if name == "ckptd" and integrity else []
        )
        assert results[0][f"files:{name}"] == sorted(expected_files), name
        config = json.loads(Path(directory, "metadata.json").read_text())
        assert (config["sharded_backend"], config["sharded_backend_version"]) == ("ckptd", 1)
        assert ckptd.validate_checkpoint(os.path.join(directory, "ckptd"))
        assert_same(COMMON, mcore.load_common_state_dict(directory))
        assert_whole_layout_loaded(mcore.load(whole_layout(mcore), directory))
    # async: Megatron's AsyncCallsQueue finalizes; metadata.json only after ckptd's commit
    assert (results[0]["async:before"], results[0]["async:after"]) == (False, True)
    assert len(results[0]["async:finalized"]) == 1


def test_two_ranks_load_their_pieces_back(generated):
    _, results = generated
    for rank in range(WORLD):
        expected = expected_for_rank(rank)
        for case in ("megatron<-torch_dist", "ckptd<-torch_dist", "ckptd<-ckptd", "ckptd<-ckptd_async"):
            assert_same(expected, results[rank][case], f"rank {rank} {case}")


def test_megatron_loads_on_one_rank_with_ckptd_load_strategy(generated, one_rank):
    for name in ("ckptd", "torch_dist"):
        assert_whole_layout_loaded(one_rank[f"load:{name}"])
        assert_same(COMMON, {k: one_rank[f"common:{name}"][k] for k in COMMON}, name)
        assert one_rank[f"shapes:{name}"] == {k: tuple(v.shape) for k, v in expected_tensors().items()}
    if generated[1][0]["integrity"]:
        assert "hash mismatch" in one_rank["megatron:corrupt"]


def test_integrity_json_is_checked_when_present(generated, tmp_path):
    needs_integrity(generated)
    directory = str(tmp_path / "corrupt")
    shutil.copytree(os.path.join(generated[0], "torch_dist"), directory)
    assert mcore.verify_integrity(directory, required=True)
    name = flip_a_byte(directory)
    for read in (
        lambda: mcore.load(whole_layout(mcore), directory),
        lambda: mcore.load_common_state_dict(directory),
        lambda: mcore.load_plain_tensors(directory),
    ):
        with pytest.raises(CorruptCheckpointError, match=name):
            read()
    assert mcore.load_common_state_dict(directory, verify_integrity=False) is not None  # opted out

    # a name outside the directory is refused before anything is opened
    manifest = json.loads(Path(directory, "integrity.json").read_text())
    manifest["files"]["../outside"] = "0" * 64
    Path(directory, "integrity.json").write_text(json.dumps(manifest))
    with pytest.raises(UnsafeCheckpointError, match="outside"):
        mcore.load_common_state_dict(directory)
    # a checkpoint file the manifest does not list
    del manifest["files"]["../outside"], manifest["files"][".metadata"]
    Path(directory, "integrity.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptCheckpointError, match=r"\.metadata: not listed"):
        mcore.verify_integrity(directory)
    os.remove(os.path.join(directory, "integrity.json"))
    with pytest.raises(CheckpointNotFoundError, match="verify_integrity"):
        mcore.load(whole_layout(mcore), directory, verify_integrity=True)


def test_a_symlink_in_integrity_json_is_not_followed(generated, tmp_path):
    needs_integrity(generated)
    directory = str(tmp_path / "linked")
    shutil.copytree(os.path.join(generated[0], "torch_dist"), directory)
    outside = tmp_path / "elsewhere.distcp"
    name = sorted(n for n in os.listdir(directory) if n.endswith(".distcp"))[0]
    shutil.move(os.path.join(directory, name), outside)
    os.symlink(outside, os.path.join(directory, name))
    with pytest.raises(UnsafeCheckpointError, match="symlink"):
        mcore.load_common_state_dict(directory)
