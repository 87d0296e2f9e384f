"""``copy_file`` on object stores: the store copies, no byte of the object passes through ckptd.

S3 on the loopback server (moto) behind the fault proxy, which shows what went over the wire:
``CopyObject`` (a PUT with ``x-amz-copy-source`` and an empty body), or above the threshold a
multipart copy of ``UploadPartCopy`` requests; ``memory://`` and the GCS emulator use the
filesystem's own copy (gcsfs: the rewrite API).
"""

from __future__ import annotations

import base64
import os
import uuid
from typing import Any

import crc32c
import pytest

from ckptd.errors import MissingFileError, StorageError
from ckptd.storage.base import StorageTuning

pytestmark = pytest.mark.objectstore

MIB = 1024 * 1024


def s3_storage(s3: Any, endpoint: str, **tuning: Any) -> Any:
    pytest.importorskip("s3fs")
    from ckptd.storage.s3 import S3Storage

    return S3Storage(s3.url(), s3.options(endpoint), StorageTuning(**tuning))


def upload(storage: Any, path: str, data: bytes) -> None:
    """Write ``data`` the way a save does (multipart, CRC32C per part, above one part)."""
    view = memoryview(data)
    storage.write_view(path, view, fsync=False, chunk_size=MIB, should_stop=lambda: False, on_progress=lambda n: None)


def crc32c_b64(data: bytes) -> str:
    return base64.b64encode(crc32c.crc32c(data).to_bytes(4, "big")).decode("ascii")


def test_s3_copy_object_is_done_by_the_server(s3, proxy):
    storage = s3_storage(s3, proxy.url)
    data = os.urandom(3 * MIB + 17)
    source, target = storage.join(s3.url(), "a/model.safetensors"), storage.join(s3.url(), "b/model.safetensors")
    upload(storage, source, data)
    before = len(proxy.exchanges)
    assert storage.copy_file(source, target) == "server_copy"
    seen = proxy.exchanges[before:]
    assert [(e.method, e.status) for e in seen] == [("HEAD", 200), ("PUT", 200)]
    _, copy = seen
    assert copy.path.startswith(f"/{s3.bucket}/run/b/model.safetensors")
    assert copy.request_headers["x-amz-copy-source"] == f"{s3.bucket}/run/a/model.safetensors"
    assert copy.request_headers["x-amz-copy-source-if-match"]  # the version measured by the HEAD
    assert copy.request_bytes == 0  # the bytes never left the server
    assert sum(e.response_bytes for e in seen) < 4096
    assert s3.client.get_object(Bucket=s3.bucket, Key="run/b/model.safetensors")["Body"].read() == data
    # The source carried a CRC32C (ckptd uploads with one): the copy keeps one, of its own bytes.
    assert copy.request_headers.get("x-amz-checksum-algorithm") == "CRC32C"
    kept = s3.client.head_object(Bucket=s3.bucket, Key="run/b/model.safetensors", ChecksumMode="ENABLED")
    assert kept.get("ChecksumCRC32C") == crc32c_b64(data)


def test_s3_copy_of_an_object_without_a_crc32c_asks_for_none(s3, proxy):
    storage = s3_storage(s3, proxy.url)
    s3.client.put_object(Bucket=s3.bucket, Key="run/plain.bin", Body=b"plain bytes", ChecksumAlgorithm="SHA256")
    before = len(proxy.exchanges)
    storage.copy_file(storage.join(s3.url(), "plain.bin"), storage.join(s3.url(), "copy.bin"))
    [copy] = [e for e in proxy.exchanges[before:] if e.method == "PUT"]
    assert "x-amz-checksum-algorithm" not in copy.request_headers
    assert s3.client.get_object(Bucket=s3.bucket, Key="run/copy.bin")["Body"].read() == b"plain bytes"


def test_s3_copy_above_the_threshold_is_a_multipart_copy(s3, proxy):
    storage = s3_storage(s3, proxy.url, part_size=5 * MIB)
    storage.copy_threshold = 8 * MIB
    storage.copy_part_size = 5 * MIB
    data = os.urandom(12 * MIB)
    source, target = storage.join(s3.url(), "big.bin"), storage.join(s3.url(), "big-copy.bin")
    upload(storage, source, data)
    before = len(proxy.exchanges)
    assert storage.copy_file(source, target) == "server_copy"
    seen = proxy.exchanges[before:]
    parts = [e for e in seen if e.method == "PUT"]
    assert [e.request_headers.get("x-amz-copy-source-range") for e in sorted(parts, key=lambda e: e.path)] == [
        "bytes=0-5242879",
        "bytes=5242880-10485759",
        "bytes=10485760-12582911",
    ]
    assert all(e.request_bytes == 0 and "partNumber=" in e.path for e in parts)
    assert all(e.request_headers["x-amz-copy-source"] == f"{s3.bucket}/run/big.bin" for e in parts)
    assert [e.method for e in seen if e.method == "POST"] == ["POST", "POST"]  # create, complete
    assert sum(e.request_bytes for e in seen) < 4096  # the completion's XML: no data went up...
    assert sum(e.response_bytes for e in seen) < 8192  # ...and none came down
    assert s3.client.get_object(Bucket=s3.bucket, Key="run/big-copy.bin")["Body"].read() == data
    assert s3.uploads() == []


def test_a_transient_503_on_a_copy_part_is_retried(s3, proxy):
    storage = s3_storage(s3, proxy.url, part_size=5 * MIB)
    storage.copy_threshold = 8 * MIB
    storage.copy_part_size = 5 * MIB
    data = os.urandom(11 * MIB)
    source, target = storage.join(s3.url(), "src.bin"), storage.join(s3.url(), "dst.bin")
    upload(storage, source, data)
    second = lambda m, p: m == "PUT" and "partNumber=2" in p and "dst.bin" in p  # noqa: E731
    proxy.inject("503", 2, second)
    retries = storage.retry_counter.value
    assert storage.copy_file(source, target) == "server_copy"
    assert [e.status for e in proxy.matching(second)] == [503, 503, 200]
    assert storage.retry_counter.value - retries == 2
    assert s3.client.get_object(Bucket=s3.bucket, Key="run/dst.bin")["Body"].read() == data
    assert s3.uploads() == []


def test_a_copy_part_that_keeps_failing_aborts_the_multipart_copy(s3, proxy):
    storage = s3_storage(s3, proxy.url, part_size=5 * MIB, retry_attempts=2)
    storage.copy_threshold = 8 * MIB
    storage.copy_part_size = 5 * MIB
    source, target = storage.join(s3.url(), "src.bin"), storage.join(s3.url(), "dst.bin")
    upload(storage, source, os.urandom(11 * MIB))
    proxy.inject("503", 1000, lambda m, p: m == "PUT" and "partNumber=3" in p and "dst.bin" in p)
    with pytest.raises(StorageError, match=r"copy part 3 of s3://.*/run/src\.bin to s3://.*/run/dst\.bin after 2 att"):
        storage.copy_file(source, target)
    assert s3.uploads() == []
    assert not storage.exists(target)


def test_a_missing_source_is_a_missing_file_error_naming_it(s3, proxy):
    storage = s3_storage(s3, proxy.url)
    source = storage.join(s3.url(), "gone.bin")
    with pytest.raises(MissingFileError, match=r"cannot copy s3://.*/run/gone\.bin: no such object") as info:
        storage.copy_file(source, storage.join(s3.url(), "copy.bin"))
    assert info.value.filename == source
    assert proxy.count(lambda m, p: m == "PUT") == 0  # nothing was written
    assert not storage.exists(storage.join(s3.url(), "copy.bin"))


def test_memory_copy_and_missing_source():
    from ckptd.storage.remote import FsspecStorage

    root = f"memory://ckptd-copy/{uuid.uuid4().hex[:12]}"
    storage = FsspecStorage(root)
    try:
        storage.write_bytes(f"{root}/a.bin", b"memory bytes")
        assert storage.copy_file(f"{root}/a.bin", f"{root}/sub/b.bin") == "server_copy"
        assert storage.read_bytes(f"{root}/sub/b.bin") == b"memory bytes"
        with pytest.raises(MissingFileError, match=r"cannot copy memory://.*/nope\.bin") as info:
            storage.copy_file(f"{root}/nope.bin", f"{root}/c.bin")
        assert info.value.filename == f"{root}/nope.bin"
    finally:
        storage.remove_tree(root)


def test_gcs_copy_and_missing_source(gcs_endpoint):
    from ckptd.storage.remote import FsspecStorage

    root = f"gs://ckptd/copy-{uuid.uuid4().hex[:12]}"
    storage = FsspecStorage(root, {"endpoint_url": gcs_endpoint, "token": "anon", "project": "test"})
    data = os.urandom(2 * MIB + 3)
    try:
        storage.write_bytes(f"{root}/a.bin", data)
        assert storage.copy_file(f"{root}/a.bin", f"{root}/b.bin") == "server_copy"
        assert storage.read_bytes(f"{root}/b.bin") == data
        with pytest.raises(MissingFileError, match=r"cannot copy gs://.*/nope\.bin") as info:
            storage.copy_file(f"{root}/nope.bin", f"{root}/c.bin")
        assert info.value.filename == f"{root}/nope.bin"
    finally:
        storage.remove_tree(root)
