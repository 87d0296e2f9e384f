"""Shared fixtures and helpers: small models, bit-exact comparisons, pausing the writer."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
import torch

import ckptd

pytest_plugins = ["leftover_processes"]


class TinyLM(torch.nn.Module):
    """A small language-model-shaped module with a tied embedding / output head."""

    def __init__(self, vocab: int = 64, width: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("position", torch.arange(8), persistent=True)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(self.norm(x))


def train_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 2) -> None:
    """Run a few optimizer steps so that optimizer state exists."""
    for _ in range(steps):
        tokens = torch.randint(0, 64, (4, 8))
        model(tokens).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def assert_same(a: Any, b: Any, where: str = "state") -> None:
    """Recursive equality; tensors must match bit for bit, with dtype and shape."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: expected a tensor, got {type(b).__name__}"
        assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{where}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert torch.equal(_bits(a), _bits(b)), f"{where}: values differ"
        return
    if isinstance(a, Mapping):
        assert isinstance(b, Mapping), f"{where}: expected a mapping, got {type(b).__name__}"
        assert set(a) == set(b), f"{where}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
        return
    if isinstance(a, (list, tuple)):
        assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
        return
    if isinstance(a, float) and a != a:
        assert isinstance(b, float) and b != b, f"{where}: {a!r} != {b!r}"
        return
    assert a == b and type(a) is type(b), f"{where}: {a!r} ({type(a).__name__}) != {b!r} ({type(b).__name__})"


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor (so NaNs and signed zeros compare exactly)."""
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def clone_state(value: Any) -> Any:
    """A deep copy of nested state with tensors cloned (the expected value of a save)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, Mapping):
        return {k: clone_state(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clone_state(v) for v in value]
    if isinstance(value, tuple):
        return tuple(clone_state(v) for v in value)
    return value


@contextlib.contextmanager
def paused(pid: int) -> Iterator[None]:
    """Freeze a process (SIGSTOP) for the duration of the block."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


OSHOOK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reliability", "oshook")


@contextlib.contextmanager
def writers_strike(op: str, pattern: str, whom: str = "self", when: str = "after") -> Iterator[None]:
    """Arm the writer processes started inside the block: at their first ``op`` call (``write``,
    ``create``, ``fsync``, ...) on a path matching ``pattern``, each SIGKILLs (``whom="self"``)
    or SIGSTOPs (``whom="stop"``) itself, ``before`` or ``after`` the call.

    This is the OS-call hook of ``tests/reliability/oshook``, put on the ``PYTHONPATH`` the
    writer inherits: the writer is struck at an exact point of its work, which stepping a stopped
    writer in time slices cannot promise on a busy machine (one slice may finish the save).
    """
    with _oshook_armed("CKPTD_TEST_KILL", f"{op}|{pattern}|1|{when}|{whom}"):
        yield


@contextlib.contextmanager
def writers_fail(op: str, pattern: str, code: int) -> Iterator[None]:
    """Writer processes started inside the block fail every ``op`` call on a path matching
    ``pattern`` with errno ``code``, without making it (``CKPTD_TEST_FAIL`` of the same hook)."""
    with _oshook_armed("CKPTD_TEST_FAIL", f"{op}|{pattern}|{code}"):
        yield


@contextlib.contextmanager
def _oshook_armed(variable: str, value: str) -> Iterator[None]:
    """``variable=value`` and the OS-call hook first on ``PYTHONPATH``, for the processes started
    inside the block (they inherit both); restored after."""
    saved = {name: os.environ.get(name) for name in (variable, "PYTHONPATH")}
    os.environ[variable] = value
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (OSHOOK, saved["PYTHONPATH"]) if p)
    try:
        yield
    finally:
        for name, previous in saved.items():
            if previous is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = previous


def process_state(pid: int) -> str | None:
    """The state letter of ``pid`` in ``/proc/<pid>/stat`` (``R``, ``S``, ``T``, ``Z``...), or
    ``None`` once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def process_stopped(pid: int) -> bool:
    """True while ``pid`` is stopped by a signal."""
    return process_state(pid) == "T"


def staging_dirs(root: str) -> list[str]:
    """The staging directories (``.checkpoint-<step>.tmp-*``) under ``root``, as paths."""
    return [os.path.join(root, n) for n in os.listdir(root) if n.startswith(".checkpoint-")]


def bytes_read() -> int:
    """Bytes this process's read calls have returned so far (``rchar`` of ``/proc/self/io``)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def wait_for(condition: Callable[[], bool], timeout: float = 30.0, interval: float = 0.01) -> None:
    """Poll until ``condition()`` is true; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    return process_state(pid) not in (None, "Z")


@pytest.fixture
def root(tmp_path: Any) -> str:
    """A fresh checkpoint root directory."""
    path = tmp_path / "ckpts"
    return str(path)


@pytest.fixture
def checkpointer(root: str) -> Iterator[ckptd.Checkpointer]:
    """A Checkpointer on a fresh root, closed after the test."""
    ckpt = ckptd.Checkpointer(root)
    try:
        yield ckpt
    finally:
        ckpt.close(wait=False)


@pytest.fixture
def dcp_checkpoint(tmp_path: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer, str]:
    """A model and its SGD-with-momentum optimizer after one step, saved by PyTorch DCP itself
    (``{"model", "optim", "step": 7}``, one process) under ``tmp_path / "dcp"``."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    source = str(tmp_path / "dcp")
    state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": 7}
    with pytest.warns(UserWarning):  # "torch.distributed is ... uninitialized": a single-process save
        dcp.save(state, checkpoint_id=source, no_dist=True)
    return model, optimizer, source


@pytest.fixture
def trained() -> tuple[TinyLM, torch.optim.Optimizer, Any]:
    """A TinyLM with AdamW state after two steps and a scheduler."""
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    train_steps(model, optimizer)
    scheduler.step()
    return model, optimizer, scheduler


# ---- object storage: a real S3-compatible server (moto) and a GCS emulator on loopback ----------

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # the emulator has no gRPC control API


class S3Place:
    """A fresh bucket on the loopback S3 server, reached directly or through a proxy."""

    def __init__(self, endpoint: str, bucket: str, client: Any) -> None:
        self.endpoint = endpoint
        self.bucket = bucket
        self.client = client  # boto3, straight to the server (never through a proxy)

    def url(self, prefix: str = "run") -> str:
        return f"s3://{self.bucket}/{prefix}"

    def options(self, endpoint: str | None = None) -> dict[str, Any]:
        return {"endpoint_url": endpoint or self.endpoint, "key": "testing", "secret": "testing"}

    def keys(self, prefix: str = "") -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return sorted(obj["Key"] for page in pages for obj in page.get("Contents", []))

    def uploads(self) -> list[dict[str, Any]]:
        return list(self.client.list_multipart_uploads(Bucket=self.bucket).get("Uploads", []))


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """A real S3-compatible HTTP server (moto's ThreadedMotoServer) on 127.0.0.1."""
    server_module = pytest.importorskip("moto.server")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(name, "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3(moto_endpoint: str) -> S3Place:
    """A new, empty bucket."""
    boto3 = pytest.importorskip("boto3")
    client = boto3.client(
        "s3",
        endpoint_url=moto_endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    bucket = f"ckptd-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    return S3Place(moto_endpoint, bucket, client)


@pytest.fixture
def proxy(moto_endpoint: str) -> Iterator[Any]:
    """A fault-injecting, byte-counting HTTP proxy in front of the S3 server."""
    from faultproxy import FaultProxy

    host, port = moto_endpoint.removeprefix("http://").split(":")
    fault_proxy = FaultProxy(host, int(port)).start()
    try:
        yield fault_proxy
    finally:
        fault_proxy.stop()


@pytest.fixture(scope="session")
def gcs_endpoint(tmp_path_factory: Any) -> Iterator[str]:
    """A GCS emulator (the gcp-storage-emulator package) on 127.0.0.1 with a bucket ``ckptd``."""
    pytest.importorskip("gcp_storage_emulator")
    pytest.importorskip("gcsfs")
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = open(tmp_path_factory.mktemp("gcs") / "emulator.log", "wb")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gcp_storage_emulator",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--in-memory",
            "--default-bucket",
            "ckptd",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:

        def listening() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0

        wait_for(listening, timeout=30)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait()
        log.close()


# ---- every storage backend, for the conformance suite -----------------------------------------


class StoragePlace:
    """One backend and a fresh, empty root on it."""

    def __init__(self, backend: str, root: str, options: dict[str, Any]) -> None:
        from ckptd.storage import storage_for

        self.backend = backend
        self.root = root
        self.options = options
        self.storage = storage_for(root, options)

    def path(self, *parts: str) -> str:
        """A path under the root, joined the backend's way."""
        return self.storage.join(self.root, *parts)


STORAGE_BACKENDS = [
    "local",
    "memory",
    pytest.param("s3", marks=pytest.mark.objectstore),
    pytest.param("gcs", marks=pytest.mark.objectstore),
]


@pytest.fixture(params=STORAGE_BACKENDS)
def storage_place(request: Any, tmp_path: Any) -> Iterator[StoragePlace]:
    """A fresh root on each backend in turn: a temporary directory, ``memory://``, a new bucket on
    the loopback S3 server, a new prefix on the loopback GCS emulator."""
    backend = request.param
    unique = uuid.uuid4().hex[:12]
    options: dict[str, Any] = {}
    if backend == "local":
        root = str(tmp_path / "store")
    elif backend == "memory":
        root = f"memory://ckptd-conformance/{unique}"
    elif backend == "s3":
        pytest.importorskip("s3fs")
        bucket: S3Place = request.getfixturevalue("s3")
        root, options = bucket.url(unique), bucket.options()
    else:
        endpoint = request.getfixturevalue("gcs_endpoint")
        root, options = f"gs://ckptd/{unique}", {"endpoint_url": endpoint, "token": "anon", "project": "test"}
    place = StoragePlace(backend, root, options)
    place.storage.makedirs(root)
    try:
        yield place
    finally:
        if backend in ("memory", "gcs"):  # shared by the whole session: leave nothing behind
            place.storage.remove_tree(root)


# ---- checkpoints written by older ckptd versions ------------------------------------------------

LEGACY_INCREMENTAL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "save", "data", "legacy_incremental")


@pytest.fixture
def legacy_root(tmp_path: Any) -> str:
    """A copy of a root written by ckptd at 645fdbc, before checkpoints were self-contained:
    ``incremental=True``, steps 1-3 of a model with a frozen ``base`` (Linear 8x8) and a
    trainable ``adapter`` (Linear 8x4) whose bias is filled with the step, plus ``{"data":
    {"step": step}}``; the manifests of 2 and 3 reference checkpoint-1's frozen shard."""
    import shutil

    target = str(tmp_path / "legacy")
    shutil.copytree(LEGACY_INCREMENTAL, target)
    return target
