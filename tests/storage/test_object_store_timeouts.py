"""Bounded waits on object stores: every request has connect and read timeouts, so a frozen
endpoint becomes a retried request and then a ``StorageError``, never a hang.

The endpoints are real: a TCP server on loopback that accepts and never answers, and the loopback
S3 server (moto) behind the fault proxy, whose ``stall`` faults hold a request without reading
its body (a frozen server: the client is still sending) or without answering it (the body was
read).  The tests configure timeouts of about a second; the defaults are checked on the botocore
configuration the filesystem uses.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import S3Place, assert_same

import ckptd
from ckptd.errors import StorageError
from ckptd.options import CheckpointerOptions
from ckptd.storage.base import DEFAULT_CONNECT_TIMEOUT, DEFAULT_READ_TIMEOUT, StorageTuning
from ckptd.storage.retry import failure_bound

pytestmark = pytest.mark.objectstore
pytest.importorskip("s3fs")

FAST = {"connect_timeout": 1.0, "read_timeout": 1.0}  # Checkpointer options: short waits for the tests
PART = 5 * 1024 * 1024


def is_part(method: str, path: str) -> bool:
    return method == "PUT" and "partNumber=" in path


class SilentServer:
    """Accepts TCP connections on 127.0.0.1 and never reads from them nor answers."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.connections: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listener.getsockname()[1]}"

    @property
    def accepted(self) -> int:
        with self._lock:
            return len(self.connections)

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                self.connections.append(connection)

    def close(self) -> None:
        self.listener.close()
        with self._lock:
            for connection in self.connections:
                with contextlib.suppress(OSError):
                    connection.close()


@pytest.fixture
def silent() -> Iterator[SilentServer]:
    server = SilentServer()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def stall_proxy(moto_endpoint: str) -> Iterator[Any]:
    """The fault proxy with a 64 KiB receive buffer: a stalled part's body cannot vanish into the
    kernel's buffers, so the client is still sending it when the proxy stops reading."""
    from faultproxy import FaultProxy

    host, port = moto_endpoint.removeprefix("http://").split(":")
    proxy = FaultProxy(host, int(port), receive_buffer=64 * 1024).start()
    try:
        yield proxy
    finally:
        proxy.stop()


def silent_options(server: SilentServer) -> dict[str, Any]:
    return {"endpoint_url": server.url, "key": "testing", "secret": "testing"}


def test_an_endpoint_that_never_answers_fails_the_constructor_and_a_load_in_time(silent: SilentServer):
    started = time.monotonic()
    with pytest.raises(StorageError, match=r"cannot access s3://frozen-bucket after 2 attempts: .*Timeout"):
        ckptd.Checkpointer("s3://frozen-bucket/run", storage_options=silent_options(silent), retry_attempts=2, **FAST)
    elapsed = time.monotonic() - started
    assert silent.accepted == 2  # one connection per try: the retry policy ran, and gave up
    assert elapsed < 20, elapsed  # the bound is 2 x (1 + 1) s + backoff; generous for a busy machine

    # The functional API takes no tuning: the caller's own botocore config bounds the load
    # (it wins over ckptd's 5 s / 15 s defaults, which would take about 96 s here).
    options = {**silent_options(silent), "config_kwargs": {"connect_timeout": 1, "read_timeout": 0.5}}
    before = silent.accepted
    started = time.monotonic()
    with pytest.raises(StorageError, match=r"s3://frozen-bucket/run/checkpoint-1.*Timeout"):
        ckptd.load_checkpoint("s3://frozen-bucket/run/checkpoint-1", storage_options=options)
    elapsed = time.monotonic() - started
    assert silent.accepted - before == 6  # retry_attempts tries of the first request, then the error
    assert elapsed < 45, elapsed


def test_a_load_from_a_store_that_stops_answering_fails_in_time(s3: S3Place, proxy):
    state = {"w": torch.randn(1000)}
    with ckptd.Checkpointer(s3.url(), storage_options=s3.options(proxy.url), retry_attempts=2, **FAST) as ckpt:
        ckpt.save(1, {"model": state})
        proxy.inject("stall", 2)  # the next two requests are held, whatever they are
        started = time.monotonic()
        with pytest.raises(StorageError, match=r"s3://.*/run/checkpoint-1.* after 2 attempts: .*Timeout"):
            ckpt.load(1)
        assert time.monotonic() - started < 30
        assert [kind for kind, _, _ in proxy.injected] == ["stall", "stall"]  # two tries, both held
        assert_same(state, ckpt.load(1)["model"])  # the store answers again


@pytest.mark.parametrize("kind", ["stall", "stall-reply"])
def test_a_stalled_part_is_retried_and_the_save_is_bit_exact(s3: S3Place, stall_proxy, kind: str):
    """``stall``: the proxy stops reading a 5 MiB part after its head, so the client is stuck
    sending (aiohttp's read timeout has not started; the socket's TCP_USER_TIMEOUT ends it).
    ``stall-reply``: the part is read whole and never answered (the read timeout ends it)."""
    state = {"w": torch.randn(3 * 1024 * 1024 + 5)}  # 12 MiB: parts of 5, 5 and 2 MiB
    stall_proxy.inject(kind, 1, is_part)
    options = s3.options(stall_proxy.url)
    started = time.monotonic()
    with ckptd.Checkpointer(s3.url(), storage_options=options, part_size="5MiB", **FAST) as ckpt:
        ckpt.save(1, {"model": state})
        elapsed = time.monotonic() - started
        assert_same(state, ckpt.load(1, verify=True)["model"])
    [(injected, _, stalled_path)] = stall_proxy.injected
    assert injected == kind
    parts = stall_proxy.matching(is_part)
    assert [e.status for e in parts] == [200, 200, 200]  # three parts reached the store, once each
    assert stalled_path in [e.path for e in parts]  # the stalled part was sent again, and went through
    assert s3.uploads() == []
    assert elapsed < 60, elapsed


def test_a_part_that_stalls_on_every_try_fails_the_save_and_leaves_nothing(s3: S3Place, stall_proxy):
    previous = {"w": torch.randn(1000)}
    options = s3.options(stall_proxy.url)
    with ckptd.Checkpointer(s3.url(), storage_options=options, part_size="5MiB", retry_attempts=2, **FAST) as ckpt:
        ckpt.save(1, {"model": previous})
        stall_proxy.inject("stall", 1000, is_part)
        started = time.monotonic()
        with pytest.raises(StorageError, match=r"checkpoint-2/model-00001-of-00001\.safetensors after 2 attempts"):
            ckpt.save(2, {"model": {"w": torch.randn((15 * 1024 * 1024 - 1024) // 4)}})  # three ~5 MiB parts
        assert time.monotonic() - started < 60
        assert ckpt.steps() == [1]
        assert s3.uploads() == []
        assert s3.keys("run/checkpoint-2/") == []
        assert_same(previous, ckpt.load(1, verify=True)["model"])
    tries = Counter(path for kind, _, path in stall_proxy.injected if kind == "stall")
    assert max(tries.values()) >= 2  # the part that failed the save was tried again, and held again


def test_a_part_upload_that_runs_out_of_tries_aborts_its_multipart_upload(s3: S3Place, stall_proxy):
    """The storage itself aborts the upload when a part's retries end (no clean-up needed)."""
    from ckptd.storage.s3 import S3Storage

    tuning = StorageTuning(part_size=PART, retry_attempts=2, connect_timeout=1.0, read_timeout=1.0)
    storage = S3Storage(s3.url(), s3.options(stall_proxy.url), tuning)
    second_part = lambda m, p: is_part(m, p) and "partNumber=2" in p  # noqa: E731
    stall_proxy.inject("stall-reply", 1, second_part)  # the first try waits for an answer
    stall_proxy.inject("stall", 1000, second_part)  # the second is stuck sending
    view = memoryview(bytes(range(256)) * (3 * PART // 256))
    path = storage.join(s3.url(), "shard.bin")
    with pytest.raises(StorageError, match=r"upload part 2 of s3://.*/run/shard\.bin after 2 attempts"):
        storage.write_view(
            path, view, fsync=False, chunk_size=PART, should_stop=lambda: False, on_progress=lambda n: None
        )
    kinds = [kind for kind, _, _ in stall_proxy.injected]
    assert kinds[0] == "stall-reply" and set(kinds[1:]) == {"stall"}  # aiohttp may send a PUT twice
    assert storage.retry_counter.value == 1  # ckptd's policy: two tries
    assert s3.uploads() == []
    assert stall_proxy.count(lambda m, p: m == "DELETE" and "uploadId=" in p) == 1
    assert not storage.exists(path)


def kernel_send_queue_limit() -> int:
    """The most a TCP socket's send buffer autotunes to (``tcp_wmem``'s maximum)."""
    try:
        with open("/proc/sys/net/ipv4/tcp_wmem") as f:
            return int(f.read().split()[2])
    except (OSError, IndexError, ValueError):
        return 4 * 1024 * 1024


def test_a_slow_healthy_part_upload_is_not_cut_by_the_read_timeout(s3: S3Place, stall_proxy):
    """The read timeout bounds silence, not duration: a part read slowly but steadily, for twice
    the read timeout, goes through on its first try.  (The read timeout starts once the last byte
    is handed to the kernel: the rate is chosen so that its full send queue leaves within half
    the read timeout, and the other half is for the proxy and the server to answer: 2 s, which a
    machine under load needs; with 0.75 s, 1 run of the whole suite under stress-ng in 1 failed.)"""
    from ckptd.storage.s3 import S3Storage

    read_timeout = 4.0
    rate = 2 * (kernel_send_queue_limit() + 256 * 1024) / read_timeout
    part = -(-int(rate * 2 * read_timeout) // (1024 * 1024)) * 1024 * 1024
    tuning = StorageTuning(part_size=part, connect_timeout=1.0, read_timeout=read_timeout)
    storage = S3Storage(s3.url(), s3.options(stall_proxy.url), tuning)
    stall_proxy.slow_rate = rate
    stall_proxy.inject("slow", 1, is_part)
    view = memoryview(bytes(range(256)) * (2 * part // 256))
    path = storage.join(s3.url(), "slow.bin")
    started = time.monotonic()
    storage.write_view(path, view, fsync=False, chunk_size=part, should_stop=lambda: False, on_progress=lambda n: None)
    assert time.monotonic() - started > 2 * read_timeout  # it was slow...
    assert storage.retry_counter.value == 0  # ...and nothing was retried
    assert [e.status for e in stall_proxy.matching(is_part)] == [200, 200]
    assert storage.read_bytes(path) == bytes(view)


def test_default_timeouts_bound_a_frozen_endpoint_within_two_minutes(s3: S3Place, monkeypatch):
    from ckptd.storage.s3 import S3Storage, StallBoundSockets

    tuning = CheckpointerOptions().tuning
    assert (tuning.connect_timeout, tuning.read_timeout) == (DEFAULT_CONNECT_TIMEOUT, DEFAULT_READ_TIMEOUT) == (5, 15)
    assert tuning.retry_attempts * (tuning.connect_timeout + tuning.read_timeout) <= 120
    assert failure_bound(tuning) <= 127  # plus at most 6.2 s of backoff

    storage = S3Storage(s3.url(), s3.options(), tuning)
    config = storage._run(storage._client).meta.config  # the botocore config of every request
    assert (config.connect_timeout, config.read_timeout) == (5, 15)
    assert config.retries["total_max_attempts"] == 1  # one retry policy: ckptd's
    if StallBoundSockets.available:
        # Half the read timeout: aiohttp sends a PUT whose connection failed a second time.
        assert config.connector_args["socket_factory"] == StallBoundSockets(7.5)
        with contextlib.closing(StallBoundSockets(7.5)((socket.AF_INET, socket.SOCK_STREAM, 0, "", ()))) as sock:
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 7_500

    # The environment sets them; the caller's own botocore config wins over both.
    monkeypatch.setenv("CKPTD_CONNECT_TIMEOUT", "2")
    monkeypatch.setenv("CKPTD_READ_TIMEOUT", "7.5")
    tuning = CheckpointerOptions.from_env().tuning
    assert (tuning.connect_timeout, tuning.read_timeout) == (2, 7.5)
    mine = {**s3.options(), "config_kwargs": {"read_timeout": 60, "connector_args": {"keepalive_timeout": 3}}}
    storage = S3Storage(s3.url(), mine, tuning)
    config = storage._run(storage._client).meta.config
    assert (config.connect_timeout, config.read_timeout) == (2, 60)
    if StallBoundSockets.available:
        assert config.connector_args == {"keepalive_timeout": 3, "socket_factory": StallBoundSockets(30)}
    with pytest.raises(ckptd.errors.ConfigError, match="read_timeout"):
        CheckpointerOptions(read_timeout=0)


def test_gcs_requests_get_the_timeouts_unless_the_caller_set_one(gcs_endpoint):
    import aiohttp

    from ckptd.storage.remote import FsspecStorage

    options = {"endpoint_url": gcs_endpoint, "token": "anon", "project": "test"}
    storage = FsspecStorage("gs://ckptd/timeouts", options, StorageTuning(connect_timeout=2, read_timeout=3))
    assert storage.fs.requests_timeout == aiohttp.ClientTimeout(sock_connect=2, sock_read=3)
    storage.write_bytes("gs://ckptd/timeouts/a.bin", b"abc")  # gcsfs accepts it on every request
    assert storage.read_bytes("gs://ckptd/timeouts/a.bin") == b"abc"
    storage.remove_tree("gs://ckptd/timeouts")
    theirs = FsspecStorage("gs://ckptd/timeouts", {**options, "requests_timeout": 99}, StorageTuning())
    assert theirs.fs.requests_timeout == 99


def test_clean_up_does_not_retry_a_timed_out_request_but_retries_a_503(s3: S3Place, proxy):
    """A failed save's clean-up (``discard``) is retried as a whole in the background while the
    store is unreachable, so each of its requests gives up at its first timeout (a frozen store
    must not hold the failed save for another ``retry_attempts`` timeouts); a store that answers
    503 is still retried at once."""
    from ckptd.storage.s3 import S3Storage

    storage = S3Storage(s3.url(), s3.options(proxy.url), StorageTuning(connect_timeout=1.0, read_timeout=0.5))
    s3.client.put_object(Bucket=s3.bucket, Key="run/checkpoint-3/model.safetensors", Body=b"partial")
    s3.client.create_multipart_upload(Bucket=s3.bucket, Key="run/checkpoint-3/optimizer.safetensors")
    directory = storage.join(s3.url(), "checkpoint-3")
    proxy.inject("stall", 1)
    started = time.monotonic()
    with pytest.raises(StorageError, match=r"list uploads under s3://.*/run/checkpoint-3 after 1 attempts: .*Timeout"):
        storage.discard(directory)
    assert time.monotonic() - started < 15
    assert [kind for kind, _, _ in proxy.injected] == ["stall"]  # one try, not retry_attempts
    assert s3.uploads() != []
    proxy.inject("503", 2, lambda m, p: "uploads" in p)
    storage.discard(directory)  # the store answers: the 503s are retried
    assert [kind for kind, _, _ in proxy.injected] == ["stall", "503", "503"]
    assert s3.uploads() == [] and s3.keys("run/checkpoint-3/") == []
