"""The ``spread`` key layout on S3 (a real S3-compatible server on loopback): shard objects get
keys ``<prefix>/checkpoint-N/<2 hex digits>/model-...``, and loading, ``keys=``, verification,
incremental saves and retention work on them as on flat checkpoints."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import S3Place, assert_same, clone_state

import ckptd

pytest.importorskip("s3fs")

_SPREAD_KEY = re.compile(r"^run/checkpoint-\d+/[0-9a-f]{2}/[a-z]+-\d{5}-of-\d{5}\.safetensors$")


def _state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(16, 16, generator=generator) for i in range(6)}


def _json_object(s3: S3Place, key: str) -> dict:
    return json.loads(s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())


def test_spread_round_trip_on_s3_with_keys_verify_incremental_and_retention(s3: S3Place):
    state = _state()
    expected = clone_state(state)
    frozen = {"model": ["layers.[0-3].*"]}
    options = {"storage_options": s3.options(), "max_shard_size": "2KB", "key_layout": "spread"}
    with ckptd.Checkpointer(s3.url(), incremental=True, keep_last=1, **options) as ckpt:
        ckpt.save(1, {"model": state}, frozen=frozen)
        keys = s3.keys("run/checkpoint-1/")
        shards = [k for k in keys if k.endswith(".safetensors")]
        assert len(shards) == 6 and all(_SPREAD_KEY.match(k) for k in shards)
        assert len({k.split("/")[2] for k in shards}) > 1, "the shards are spread over several prefixes"
        index = json.loads(
            s3.client.get_object(Bucket=s3.bucket, Key="run/checkpoint-1/model.safetensors.index.json")["Body"].read()
        )
        assert {f"run/checkpoint-1/{name}" for name in index["weight_map"].values()} == set(shards)

        assert_same(expected, ckpt.load(1, verify=True)["model"])
        some = ckpt.load(1, keys=["model.layers.2.weight"])
        assert list(some["model"]) == ["layers.2.weight"]
        assert torch.equal(some["model"]["layers.2.weight"], expected["layers.2.weight"])

        state["layers.5.weight"].add_(1)
        result = ckpt.save(2, {"model": state}, frozen=frozen)  # copies step 1's frozen files server-side
        manifest = json.loads(
            s3.client.get_object(Bucket=s3.bucket, Key="run/checkpoint-2/checkpoint_manifest.json")["Body"].read()
        )
        copied = [n for n, f in manifest["files"].items() if f.get("reused") == "server_copy"]
        assert copied and all(f"run/checkpoint-1/{n}" in shards for n in copied), "copied into their spread keys"
        assert all(f"run/checkpoint-2/{n}" in s3.keys("run/checkpoint-2/") for n in copied)
        assert ckpt.steps() == [2], "step 2 holds its own copies: step 1 goes"
        assert result.bytes_copied > 0
        assert_same(state, ckpt.load(2, verify=True)["model"])
        assert result.path.endswith("/run/checkpoint-2")

        state["layers.0.weight"].add_(1)
        ckpt.save(3, {"model": state})  # nothing frozen: step 1 and 2 can go
        assert ckpt.steps() == [3]
    assert s3.keys("run/checkpoint-1/") == [] and s3.keys("run/checkpoint-2/") == []
    assert all(_SPREAD_KEY.match(k) for k in s3.keys("run/checkpoint-3/") if k.endswith(".safetensors"))
    assert_same(state, ckptd.load_checkpoint(s3.url("run/checkpoint-3"), storage_options=s3.options()))
