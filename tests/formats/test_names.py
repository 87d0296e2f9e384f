"""File and directory names (ckptd.formats.names): the HF names, ckptd's own, round trips."""

from __future__ import annotations

import os

import pytest

from ckptd.formats import names


def test_hf_names():
    assert names.shard_file_name("model", 1, 2) == "model-00001-of-00002.safetensors"
    assert names.shard_file_name("optim", 12, 340) == "optim-00012-of-00340.safetensors"
    assert names.seed_shard_name(True, 3, 4) == "model-00003-of-00004.safetensors"
    assert names.seed_shard_name(False, 3, 4) == "pytorch_model-00003-of-00004.bin"
    assert names.hf_index_name("model") == names.SAFETENSORS_INDEX == "model.safetensors.index.json"
    assert names.hf_index_name("model", "torch_bin") == names.TORCH_BIN_INDEX == "pytorch_model.bin.index.json"
    assert names.hf_index_name("ema", "torch_bin") == "ema.bin.index.json"
    assert names.index_file_name(True) == names.SAFETENSORS_INDEX
    assert names.index_file_name(False) == names.TORCH_BIN_INDEX
    assert (names.SAFETENSORS_SINGLE, names.TORCH_BIN_SINGLE) == ("model.safetensors", "pytorch_model.bin")
    assert names.MANIFEST_NAME == "checkpoint_manifest.json"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("model-00001-of-00002.safetensors", True),
        ("pytorch_model-00002-of-00002.bin", True),
        ("model-1-of-2.safetensors", False),
        ("optim-00001-of-00002.safetensors", False),
        ("model.safetensors", False),
    ],
)
def test_seed_shard_names_are_recognised(name, expected):
    assert names.is_seed_shard_name(name) is expected


def test_checkpoint_and_staging_names_round_trip():
    assert names.checkpoint_dir_name(120) == "checkpoint-120"
    assert names.parse_step("checkpoint-000120") == 120  # older, zero-padded names still parse
    assert names.parse_step("checkpoint-7") == 7
    assert names.parse_step(".checkpoint-000120.tmp-x-1-ab") is None
    assert names.parse_step("checkpoint-12a") is None

    staging = names.staging_dir_name(42)
    assert staging.startswith(".checkpoint-42.tmp-")
    assert names.parse_step(staging) is None  # never listed as a checkpoint
    parsed = names.parse_staging_name(staging)
    assert parsed == names.StagingName(42, names.host_label(), os.getpid())
    assert "-" not in names.host_label()
    assert names.staging_dir_name(42) != staging  # unique per call
    assert names.parse_staging_name("checkpoint-000042") is None
