"""Object storage: S3 on a real loopback server (moto), faults through a proxy, memory://, GCS."""

from __future__ import annotations

import base64
import json
import os
import threading

import crc32c
import pytest
import torch
from conftest import S3Place, assert_same, clone_state

import ckptd
from ckptd.errors import CheckpointExistsError, ConfigError, ForeignFilesError, StorageError

pytestmark = pytest.mark.objectstore
pytest.importorskip("s3fs")


def model_state(n: int = 6, size: int = 64 * 1024, seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(size) for i in range(n)}


def is_shard(method: str, path: str) -> bool:
    return method == "GET" and ".safetensors" in path and "index" not in path


def test_async_save_and_load_round_trip_on_s3(s3: S3Place, trained):
    model, optimizer, scheduler = trained
    expected = {"model": clone_state(model.state_dict()), "optimizer": clone_state(optimizer.state_dict())}
    with ckptd.Checkpointer(s3.url(), storage_options=s3.options(), max_shard_size="3KB") as ckpt:
        request = ckpt.async_save(
            3, {"model": model, "optimizer": optimizer, "scheduler": scheduler, "extra": {"a": 1}}
        )
        result = request.wait(120)
        assert result.path == f"s3://{s3.bucket}/run/checkpoint-3"
        assert ckpt.steps() == [3]
        loaded = ckpt.load(3)
        assert_same(expected["model"], loaded["model"])
        assert_same(expected["optimizer"], loaded["optimizer"])
        assert loaded["scheduler"] == scheduler.state_dict() and loaded["extra"] == {"a": 1}
        ckpt.load(3, verify=True)
    keys = s3.keys("run/checkpoint-3/")
    assert "run/checkpoint-3/checkpoint_manifest.json" in keys
    assert "run/checkpoint-3/model.safetensors.index.json" in keys
    assert len([k for k in keys if k.split("/")[-1].startswith("model-")]) > 1
    assert s3.uploads() == []
    # HF tooling reads it with plain s3fs, without ckptd
    import s3fs
    from safetensors.torch import load as load_bytes

    fs = s3fs.S3FileSystem(**s3.options())
    index = json.loads(fs.cat(f"{s3.bucket}/run/checkpoint-3/model.safetensors.index.json"))
    merged = {}
    for name in set(index["weight_map"].values()):
        merged.update(load_bytes(fs.cat(f"{s3.bucket}/run/checkpoint-3/{name}")))
    assert_same({k: v for k, v in expected["model"].items() if k != "head.weight"}, merged)


def test_large_shard_is_uploaded_in_concurrent_multipart_parts(s3: S3Place, proxy):
    state = {"w": torch.randn(6 * 1024 * 1024)}  # 24 MiB: five 5 MiB parts
    options = s3.options(proxy.url)
    with ckptd.Checkpointer(s3.url(), storage_options=options, part_size="5MiB", part_concurrency=4) as ckpt:
        ckpt.save(1, {"model": state})
        assert_same(state["w"], ckpt.load(1)["model"]["w"])
    parts = proxy.count(lambda m, p: m == "PUT" and "partNumber=" in p)
    assert parts == 5
    assert proxy.count(lambda m, p: m == "POST" and "uploads" in p) == 1
    assert s3.uploads() == []


def crc32c_b64(data: bytes) -> str:
    return base64.b64encode(crc32c.crc32c(data).to_bytes(4, "big")).decode("ascii")


def stored_checksum(s3: S3Place, key: str) -> dict[str, object]:
    head = s3.client.head_object(Bucket=s3.bucket, Key=key, ChecksumMode="ENABLED")
    return {name: head.get(name) for name in ("ChecksumCRC32C", "ChecksumCRC32")}


def test_every_part_carries_the_crc32c_of_its_bytes(s3: S3Place, proxy):
    state = {"w": torch.randn(3 * 1024 * 1024 + 7)}  # 12 MiB + 28 bytes: three 5 MiB parts
    options = s3.options(proxy.url)
    with ckptd.Checkpointer(s3.url(), storage_options=options, part_size="5MiB") as ckpt:
        ckpt.save(1, {"model": state, "small": {"b": torch.arange(10)}}, sharing={"small": "per_rank"})
    # What the store checks each part against: the header sent with it is the CRC32C of the
    # bytes that went over the wire.
    parts = proxy.matching(lambda m, p: m == "PUT" and "partNumber=" in p)
    small_puts = proxy.matching(lambda m, p: m == "PUT" and "/small" in p and p.endswith(".safetensors"))
    assert len(parts) == 3 and len(small_puts) == 1
    assert all(e.sent_crc32c == e.body_crc32c for e in parts + small_puts), parts + small_puts
    # The object keeps the composite checksum: the CRC32C of its parts' CRC32Cs.
    [shard] = [k for k in s3.keys("run/checkpoint-1/") if k.split("/")[-1].startswith("model-")]
    body = s3.client.get_object(Bucket=s3.bucket, Key=shard)["Body"].read()
    part = 5 * 1024 * 1024
    digests = b"".join(crc32c.crc32c(body[i : i + part]).to_bytes(4, "big") for i in range(0, len(body), part))
    assert stored_checksum(s3, shard) == {"ChecksumCRC32C": crc32c_b64(digests), "ChecksumCRC32": None}


def test_a_client_configured_when_required_sends_no_checksums(s3: S3Place):
    # For S3-compatible stores that reject checksum headers, users set botocore's
    # request_checksum_calculation="when_required"; ckptd then adds none of its own.
    options = {**s3.options(), "config_kwargs": {"request_checksum_calculation": "when_required"}}
    state = {"w": torch.randn(3 * 1024 * 1024)}
    with ckptd.Checkpointer(s3.url(), storage_options=options, part_size="5MiB") as ckpt:
        ckpt.save(1, {"model": state})
        assert_same(state["w"], ckpt.load(1)["model"]["w"])
    [shard] = [k for k in s3.keys("run/checkpoint-1/") if k.split("/")[-1].startswith("model-")]
    assert stored_checksum(s3, shard) == {"ChecksumCRC32C": None, "ChecksumCRC32": None}


def test_keys_load_fetches_only_the_requested_byte_ranges(s3: S3Place, proxy):
    state = model_state(n=8, size=64 * 1024)  # 256 KiB tensors, 4 per shard
    with ckptd.Checkpointer(s3.url(), storage_options=s3.options(proxy.url), max_shard_size="1MiB") as ckpt:
        ckpt.save(1, {"model": state})
        before = proxy.bytes_received(is_shard)
        out = ckpt.load(1, keys=["model.layers.5.weight"])
        fetched = proxy.bytes_received(is_shard) - before
    assert_same(state["layers.5.weight"], out["model"]["layers.5.weight"])
    requested = state["layers.5.weight"].numel() * 4
    assert 0 < fetched < 2 * requested
    assert fetched < sum(t.numel() * 4 for t in state.values()) / 4


def test_hf_checkpoint_on_s3_reads_header_then_ranges(s3: S3Place, proxy, tmp_path):
    state = model_state(n=4, size=128 * 1024)
    ckptd.save_checkpoint(s3.url("hf"), state, safetensors=True, storage_options=s3.options())
    # drop the manifest: a plain HF checkpoint on S3
    s3.client.delete_object(Bucket=s3.bucket, Key="hf/checkpoint_manifest.json")
    subset = ckptd.load_checkpoint(s3.url("hf"), keys={"layers.2.weight"}, storage_options=s3.options(proxy.url))
    assert_same(state["layers.2.weight"], subset["layers.2.weight"])
    assert proxy.bytes_received(is_shard) < 2 * 128 * 1024 * 4 + 64 * 1024


def test_cache_dir_makes_the_second_load_read_local_disk(s3: S3Place, proxy, tmp_path):
    state = model_state(n=4)
    with ckptd.Checkpointer(s3.url(), storage_options=s3.options(proxy.url), cache_dir=str(tmp_path / "cache")) as ckpt:
        ckpt.save(1, {"model": state})
        assert_same(state, ckpt.load(1)["model"])
        first = proxy.bytes_received(is_shard)
        assert first > 0
        assert_same(state, ckpt.load(1)["model"])
        assert proxy.bytes_received(is_shard) == first


def test_two_concurrent_saves_of_different_steps(s3: S3Place):
    states = [model_state(seed=1), model_state(seed=2)]
    with ckptd.Checkpointer(s3.url(), storage_options=s3.options(), max_in_flight=2) as ckpt:
        requests = [ckpt.async_save(step, {"model": states[step - 1]}) for step in (1, 2)]
        for request in requests:
            request.wait(120)
        assert ckpt.steps() == [1, 2]
        for step in (1, 2):
            assert_same(states[step - 1], ckpt.load(step)["model"])
    with (
        ckptd.Checkpointer(s3.url(), storage_options=s3.options()) as a,
        ckptd.Checkpointer(s3.url(), storage_options=s3.options()) as b,
    ):
        results: dict[str, object] = {}
        contenders = {"a": model_state(seed=3), "b": model_state(seed=4)}

        def save(name: str, ckpt: ckptd.Checkpointer) -> None:
            try:
                results[name] = ckpt.save(7, {"model": contenders[name]})
            except CheckpointExistsError as e:
                results[name] = e

        threads = [threading.Thread(target=save, args=("a", a)), threading.Thread(target=save, args=("b", b))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        outcomes = sorted(type(v).__name__ for v in results.values())
        assert outcomes == ["CheckpointExistsError", "SaveResult"], results
        winner = "b" if isinstance(results["a"], Exception) else "a"
        a.load(7, verify=True)
        assert_same(contenders[winner], a.load(7)["model"])


def test_listing_ignores_prefixes_without_manifest(s3: S3Place):
    with ckptd.Checkpointer(s3.url(), storage_options=s3.options()) as ckpt:
        ckpt.save(1, {"model": model_state(n=1)})
        ckpt.save(2, {"model": model_state(n=1, seed=5)})
        s3.client.delete_object(Bucket=s3.bucket, Key="run/checkpoint-2/checkpoint_manifest.json")
        s3.client.put_object(Bucket=s3.bucket, Key="run/checkpoint-9/model.safetensors", Body=b"junk")
        assert ckpt.steps() == [1]
        assert ckpt.latest_step() == 1
        assert_same(model_state(n=1), ckpt.load()["model"])
        with pytest.raises(ckptd.errors.CheckpointNotFoundError):
            ckpt.load(2)


def test_burst_of_503s_and_resets_during_upload_still_commits(s3: S3Place, proxy):
    state = {"w": torch.randn(4 * 1024 * 1024), "b": torch.randn(1000)}
    is_part = lambda m, p: m == "PUT" and "partNumber=" in p  # noqa: E731
    proxy.inject("503", 3, is_part)
    proxy.inject("reset", 2, is_part)
    proxy.inject("503", 1, lambda m, p: m == "PUT" and "checkpoint_manifest" in p)
    with ckptd.Checkpointer(s3.url(), storage_options=s3.options(proxy.url), part_size="5MiB") as ckpt:
        result = ckpt.save(1, {"model": state})
        assert result.step == 1
        assert_same(state, ckpt.load(1, verify=True)["model"])
    kinds = sorted(kind for kind, _, _ in proxy.injected)
    assert kinds == ["503", "503", "503", "503", "reset", "reset"]
    assert s3.uploads() == []


def test_server_gone_mid_upload_fails_cleanly_and_cleans_up_when_back(s3: S3Place, proxy):
    previous = model_state(n=1)
    ckpt = ckptd.Checkpointer(s3.url(), storage_options=s3.options(proxy.url), part_size="5MiB", retry_attempts=3)
    try:
        ckpt.save(1, {"model": previous})
        is_part = lambda m, p: m == "PUT" and "partNumber=" in p  # noqa: E731
        proxy.go_down_after(2, is_part)
        request = ckpt.async_save(2, {"model": {"w": torch.randn(8 * 1024 * 1024)}})
        with pytest.raises(StorageError, match=r"s3://.*checkpoint-2/model-00001-of-00001\.safetensors"):
            request.wait(120)
        assert proxy.down_event.is_set()
        assert s3.uploads() != [] or s3.keys("run/checkpoint-2/") != []  # the mess exists while down
        proxy.restart()
    finally:
        ckpt.close()
    assert s3.uploads() == []
    assert s3.keys("run/checkpoint-2/") == []
    with ckptd.Checkpointer(s3.url(), storage_options=s3.options()) as again:
        assert again.steps() == [1]
        assert_same(previous, again.load()["model"])


def test_unknown_bucket_is_one_clear_error_before_staging(s3: S3Place):
    with pytest.raises(StorageError, match="bucket does not exist") as info:
        ckptd.Checkpointer("s3://no-such-bucket-here/run", storage_options=s3.options())
    assert info.value.errno == 2


def test_unsupported_protocol_is_a_config_error():
    with pytest.raises(ConfigError, match="nosuchfs"):
        ckptd.Checkpointer("nosuchfs://bucket/run")


def test_wrong_credentials_are_one_clear_error(s3: S3Place):
    import urllib.request

    def set_unauthenticated_requests(count: bytes) -> None:
        url = f"{s3.endpoint}/moto-api/reset-auth"
        headers = {"Content-Type": "text/plain"}
        urllib.request.urlopen(urllib.request.Request(url, data=count, headers=headers, method="POST")).read()

    set_unauthenticated_requests(b"0")  # from now on the server checks every signature
    try:
        with pytest.raises(StorageError, match=r"access denied.*credentials") as info:
            ckptd.Checkpointer(s3.url(), storage_options={**s3.options(), "key": "AKIAWRONG", "secret": "nope"})
        assert info.value.errno == 13
    finally:
        set_unauthenticated_requests(b"inf")


def test_functional_api_and_manager_helpers_accept_urls(s3: S3Place):
    state = model_state(n=3)
    url = s3.url("models/m1")
    ckptd.save_checkpoint(url, state, safetensors=True, storage_options=s3.options())
    assert_same(state, ckptd.load_checkpoint(url, storage_options=s3.options()))
    os.environ["AWS_ENDPOINT_URL"] = s3.endpoint  # the seed signatures take credentials from the environment
    try:
        assert ckptd.is_in_safetensors_format(url)
        assert ckptd.validate_checkpoint(url)
        assert_same(
            {"layers.1.weight": state["layers.1.weight"]}, ckptd.load_sharded_state_dict(url, ["layers.1.weight"])
        )
        assert ckptd.get_checkpoint_metadata(url) == ckptd.CheckpointMeta("model.safetensors.index.json", True, True)
    finally:
        del os.environ["AWS_ENDPOINT_URL"]


def test_memory_filesystem_round_trip():
    state = model_state(n=2)
    with ckptd.Checkpointer("memory://ckptd-test/run", max_shard_size="100KB") as ckpt:
        ckpt.save(5, {"model": state, "extra": {"x": (1, 2)}})
        assert ckpt.steps() == [5]
        loaded = ckpt.load()
        assert_same(state, loaded["model"])
        assert loaded["extra"] == {"x": (1, 2)}
        assert ckpt.health_check()["writer_pid"] == os.getpid()


def test_gcs_round_trip_and_listing_on_an_emulator(gcs_endpoint):
    options = {"endpoint_url": gcs_endpoint, "token": "anon", "project": "test"}
    state = model_state(n=3)
    url = f"gs://ckptd/run-{os.getpid()}"
    with ckptd.Checkpointer(url, storage_options=options, max_shard_size="300KB") as ckpt:
        ckpt.async_save(1, {"model": state, "extra": {"k": [1, 2]}}).wait(120)
        ckpt.save(2, {"model": model_state(n=3, seed=9)})
        assert ckpt.steps() == [1, 2]
        loaded = ckpt.load(1, verify=True)
        assert_same(state, loaded["model"])
        assert loaded["extra"] == {"k": [1, 2]}
        assert_same(
            {"layers.1.weight": state["layers.1.weight"]}, ckpt.load(1, keys=["model.layers.1.weight"])["model"]
        )
        ckpt.storage.remove(f"{url}/checkpoint-2/checkpoint_manifest.json")
        assert ckpt.steps() == [1] and ckpt.latest_step() == 1


def test_cli_lists_verifies_and_collects_garbage_on_s3(s3: S3Place, capsys):
    from ckptd.cli import main

    options = json.dumps(s3.options())
    with ckptd.Checkpointer(s3.url(), storage_options=s3.options()) as ckpt:
        ckpt.save(4, {"model": model_state(n=1)})
    old, fresh = "run/checkpoint-5/", "run/checkpoint-6/"
    s3.client.put_object(Bucket=s3.bucket, Key=old + ".ckptd-claim", Body=b"host 1 2020-01-01T00:00:00.000000Z")
    s3.client.put_object(Bucket=s3.bucket, Key=old + "model-00001-of-00001.safetensors", Body=b"partial")
    s3.client.create_multipart_upload(Bucket=s3.bucket, Key=old + "optimizer-00001-of-00001.safetensors")
    s3.client.put_object(
        Bucket=s3.bucket, Key=fresh + ".ckptd-claim", Body=f"host 1 {ckptd.formats.manifest.utc_now()}".encode()
    )
    assert main(["--storage-options", options, "ls", s3.url()]) == 0
    assert "checkpoint-4" in capsys.readouterr().out
    assert main(["--storage-options", options, "verify", s3.url() + "/checkpoint-4"]) == 0
    assert main(["--storage-options", options, "gc", s3.url(), "--older-than", "3600"]) == 0
    assert "checkpoint-5" in capsys.readouterr().out
    assert s3.keys(old) == [] and s3.uploads() == []
    assert s3.keys(fresh) == [fresh + ".ckptd-claim"]


def test_existing_step_on_s3_is_refused_unless_overwrite(s3: S3Place):
    with ckptd.Checkpointer(s3.url(), storage_options=s3.options()) as ckpt:
        ckpt.save(1, {"model": model_state(n=1)})
        with pytest.raises(CheckpointExistsError, match="overwrite=True"):
            ckpt.save(1, {"model": model_state(n=1, seed=3)})
        assert_same(model_state(n=1), ckpt.load(1)["model"])
        ckpt.save(1, {"model": model_state(n=1, seed=3)}, overwrite=True)
        assert_same(model_state(n=1, seed=3), ckpt.load(1, verify=True)["model"])
        assert s3.uploads() == []


def test_a_failed_claim_never_deletes_the_checkpoint_already_there(s3: S3Place, proxy):
    with ckptd.Checkpointer(s3.url(), storage_options=s3.options(proxy.url), retry_attempts=2) as ckpt:
        ckpt.save(1, {"model": model_state(n=2)})
        before = s3.keys("run/checkpoint-1/")
        proxy.inject("503", 10, lambda m, p: m == "PUT" and ".ckptd-claim" in p)
        with pytest.raises(StorageError, match=r"\.ckptd-claim"):
            ckpt.save(1, {"model": model_state(n=2, seed=7)}, overwrite=True)
        assert s3.keys("run/checkpoint-1/") == before
        assert_same(model_state(n=2), ckpt.load(1, verify=True)["model"])


def test_a_create_only_write_whose_answer_was_lost_still_commits(s3: S3Place, proxy):
    proxy.inject("lost-reply", 1, lambda m, p: m == "PUT" and "checkpoint_manifest.json" in p)
    with ckptd.Checkpointer(s3.url(), storage_options=s3.options(proxy.url)) as ckpt:
        result = ckpt.save(1, {"model": model_state(n=1)})
        assert result.step == 1 and ckpt.steps() == [1]
        assert_same(model_state(n=1), ckpt.load(1, verify=True)["model"])
    assert [kind for kind, _, _ in proxy.injected] == ["lost-reply"]


def test_a_prefix_of_someone_elses_objects_is_never_written_into(s3: S3Place):
    """An HF upload at ``checkpoint-4/`` (no manifest, no claim): a save there is refused before
    any byte, whatever ``overwrite`` says, and a failed save's clean-up cannot remove it."""
    theirs = {
        "run/checkpoint-4/model-00001-of-00001.safetensors": b"their weights",
        "run/checkpoint-4/config.json": b"{}",
    }
    for key, body in theirs.items():
        s3.client.put_object(Bucket=s3.bucket, Key=key, Body=body)
    with ckptd.Checkpointer(s3.url(), storage_options=s3.options()) as ckpt:
        for overwrite in (False, True):
            with pytest.raises(ForeignFilesError, match=r"checkpoint-4 holds objects that are not a ckptd checkpoint"):
                ckpt.save(4, {"model": model_state(n=1)}, overwrite=overwrite)
        assert ckpt.steps() == []
    assert s3.keys("run/checkpoint-4/") == sorted(theirs)
    for key, body in theirs.items():
        assert s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read() == body
    assert s3.uploads() == []


def test_a_prefix_of_safetensors_objects_alone_is_not_taken_for_ckptds(s3: S3Place):
    key = "run/checkpoint-6/model-00001-of-00001.safetensors"
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=b"their weights")
    with ckptd.Checkpointer(s3.url(), storage_options=s3.options()) as ckpt:
        with pytest.raises(ForeignFilesError):
            ckpt.save(6, {"model": model_state(n=1)})
    assert s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read() == b"their weights"


def test_ckptd_objects_left_without_claim_or_manifest_are_taken(s3: S3Place):
    """What a clean-up cut short leaves (the claim and manifest gone, a shard and the ckptd
    state file left) is garbage to the next save of that step."""
    with ckptd.Checkpointer(s3.url(), storage_options=s3.options()) as ckpt:
        ckpt.save(2, {"model": model_state(n=1)})
        for name in ("checkpoint_manifest.json", ".ckptd-claim"):
            s3.client.delete_object(Bucket=s3.bucket, Key=f"run/checkpoint-2/{name}")
        assert ckpt.steps() == []
        ckpt.save(2, {"model": model_state(n=1, seed=4)})  # neither CheckpointExistsError nor ForeignFilesError
        assert_same(model_state(n=1, seed=4), ckpt.load(2, verify=True)["model"])


def test_consolidate_into_someone_elses_prefix_is_refused_before_reading_the_source(s3: S3Place, tmp_path):
    source = str(tmp_path / "source")
    with ckptd.Checkpointer(source) as ckpt:
        path = ckpt.save(1, {"model": model_state(n=1)}).path
    shard = next(name for name in os.listdir(path) if name.endswith(".safetensors"))
    with open(os.path.join(path, shard), "r+b") as f:  # verify=True would fail on this byte first
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    s3.client.put_object(Bucket=s3.bucket, Key="hf-export/config.json", Body=b"{}")
    with pytest.raises(ForeignFilesError, match="hf-export holds objects that are not a ckptd checkpoint"):
        ckptd.consolidate(path, s3.url("hf-export"), destination_storage_options=s3.options(), verify=True)
    assert s3.keys("hf-export/") == ["hf-export/config.json"]
    assert s3.uploads() == []


def test_a_save_lists_its_prefix_in_one_request(s3: S3Place, proxy):
    """The prefix check before the claim costs one GET (a ListObjectsV2), not s3fs's two (its
    ``ls`` of an empty prefix also lists the parent, every checkpoint of the root); so does
    ``sizes()``, which lists the same way."""
    with ckptd.Checkpointer(s3.url(), storage_options=s3.options(proxy.url)) as ckpt:
        ckpt.save(1, {"model": model_state(n=1)})
        before = len(proxy.matching(lambda m, p: True))
        names = ckpt.storage.list_names(ckpt.path_for(2))
        listings = proxy.matching(lambda m, p: True)[before:]
        assert names == []
        assert [(e.method, "list-type=2" in e.path) for e in listings] == [("GET", True)]
        before = len(proxy.matching(lambda m, p: True))
        assert ckpt.storage.sizes(ckpt.path_for(2)) == {}
        assert len(proxy.matching(lambda m, p: True)[before:]) == 1  # sizes() lists the same way
        in_checkpoint = sorted(key.rsplit("/", 1)[-1] for key in s3.keys("run/checkpoint-1/"))
        assert "checkpoint_manifest.json" in in_checkpoint
        assert ckpt.storage.list_names(ckpt.path_for(1)) == in_checkpoint
        assert ckpt.storage.list_names(s3.url()) == ["checkpoint-1"]
