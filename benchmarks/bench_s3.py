#!/usr/bin/env python
"""Benchmark ckptd's uploads to (and loads from) S3 against plain S3 clients and DCP.

The script starts one loopback S3-compatible server (moto's ``ThreadedMotoServer`` on
127.0.0.1, in this process unless ``--server-subprocess``), creates one bucket, builds the same
transformer-shaped state as ``bench_save.py`` (bf16 weights, fp32 Adam moments, an int64 step)
of about ``--gib`` GiB and measures, in one run and for the same bytes:

* ckptd ``Checkpointer("s3://...", max_shard_size="256MB").async_save(...)``: the total from the
  ``async_save`` call to ``result()`` and the writer's upload time (``req.timings["write"]``), the
  first save (writer start) separately from warm saves;
* s3fs ``fs.pipe({path: bytes, ...})`` of the same safetensors shards, serialised in memory
  beforehand (one call, all files at once);
* s3fs ``fs.put(local_files, remote_paths)`` of those shards written to local files beforehand;
* boto3 ``upload_fileobj`` from ``io.BytesIO`` with 64 MiB parts and ``max_concurrency=4``, the
  files one after another and 4 files at once in threads; and boto3's best configuration here,
  every file at once with 16 MiB parts and ``max_concurrency=8`` per file (the upload target's
  reference is the faster of the two "files at once" rows);
* DCP ``dcp.save(..., storage_writer=FsspecWriter("s3://..."), no_dist=True)``, synchronous;
* loads: ckptd ``ckpt.load(step)`` against boto3 parallel ranged GETs of the same files (16 MiB
  ranges, 16 threads, into preallocated buffers) and DCP ``dcp.load`` with ``FsspecReader`` into
  preallocated tensors (DCP's S3 load is very slow, so it runs once unless it is quick);
* request and byte counts: the server's WSGI application is wrapped in a counter (method, object
  key, request body bytes, response body bytes of every request), so ckptd's requests per file
  (limit: ``ceil(size / part_size) + 2``) and the bytes a load fetches (limit: 1.05x the tensor
  bytes it needs) are checked exactly; not with ``--server-subprocess``.

Every object is deleted after each repeat so the in-memory server does not grow.

Example::

    python benchmarks/bench_s3.py --gib 0.5 --repeats 3 --json results.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import math
import multiprocessing
import os
import shlex
import shutil
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_save import (  # the sibling script, importable once its directory is on the path
    GIB,
    LAYERS,
    MIB,
    VOCAB,
    Samples,
    State,
    build_state,
    dump_json,
    format_timings,
    free_memory,
    hidden_size_for,
    iter_tensors,
    machine_info,
    markdown_table,
    state_bytes,
    timed_phase,
)

GB = 1000**3  # throughput is reported in decimal GB/s
SHARD_SIZE = "256MB"
SHARD_BYTES = 256 * 1000**2  # "256MB" as ckptd parses it (decimal, like HF)
PART_BYTES = 64 * MIB
BOTO3_CONCURRENCY = 4
BUCKET = "ckptd-bench"
CREDENTIALS = {"key": "testing", "secret": "testing"}
DCP_LOAD_REPEAT_BELOW_S = 30.0  # repeat DCP's load only when one load takes less than this

Shards = dict[str, bytes]


# ---- results -------------------------------------------------------------------------------


@dataclass
class Row:
    """One line of the final table: seconds for ``nbytes``, optionally against a reference row."""

    what: str
    samples: Samples
    nbytes: int
    reference: Row | None = None
    reference_label: str = ""

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / GB / self.samples.median

    @property
    def ratio(self) -> float | None:
        """Throughput relative to the reference (> 1 means faster than the reference)."""
        return None if self.reference is None else self.gb_per_s / self.reference.gb_per_s


@dataclass
class Measured:
    """Samples of one client: a first round (connections, writer start) and warm rounds."""

    label: str
    nbytes: int = 0
    first: Samples = field(default_factory=lambda: Samples("first"))
    warm: Samples = field(default_factory=lambda: Samples("warm"))
    extra: dict[str, Samples] = field(default_factory=dict)
    note: str = ""
    counts: list[dict[str, Any]] = field(default_factory=list)  # per save: requests per file (ckptd)


# ---- server, bucket and clients ------------------------------------------------------------


@dataclass(frozen=True)
class Exchange:
    """One request the server answered: method, object path, query, body bytes in and out."""

    method: str
    path: str
    query: str
    received: int
    sent: int


class RequestLog:
    """Every request the loopback server answered (thread-safe append, read by index)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.exchanges: list[Exchange] = []

    def add(self, exchange: Exchange) -> None:
        with self._lock:
            self.exchanges.append(exchange)

    def mark(self) -> int:
        with self._lock:
            return len(self.exchanges)

    def since(self, mark: int) -> list[Exchange]:
        with self._lock:
            return list(self.exchanges[mark:])


def counting_app(app: Any, log: RequestLog) -> Any:
    """A WSGI application that forwards to ``app`` and records each request in ``log``."""

    def wrapped(environ: dict[str, Any], start_response: Any) -> Iterator[bytes]:
        received = environ.get("HTTP_X_AMZ_DECODED_CONTENT_LENGTH") or environ.get("CONTENT_LENGTH") or 0
        method, path, query = environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""), environ.get("QUERY_STRING", "")
        body = app(environ, start_response)
        sent = 0
        try:
            for chunk in body:
                sent += len(chunk)
                yield chunk
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()
            log.add(Exchange(method, path, query, int(received), sent))

    return wrapped


def counting_moto_server(log: RequestLog) -> Any:
    """moto's ``ThreadedMotoServer`` whose application records every request in ``log``."""
    from moto.server import DomainDispatcherApplication, MotoRequestHandler, ThreadedMotoServer, create_backend_app
    from werkzeug.serving import make_server

    class CountingMotoServer(ThreadedMotoServer):
        def _server_entry(self) -> None:
            app = counting_app(DomainDispatcherApplication(create_backend_app), log)
            self._server = make_server(self._ip_address, self._port, app, True, request_handler=MotoRequestHandler)
            self._server_ready_event.set()
            self._server.serve_forever()

    return CountingMotoServer(ip_address="127.0.0.1", port=0, verbose=False)


def s3_environment() -> None:
    """Credentials and region for every client (the ckptd writer process inherits them)."""
    os.environ["AWS_ACCESS_KEY_ID"] = "testing"
    os.environ["AWS_SECRET_ACCESS_KEY"] = "testing"
    os.environ["AWS_DEFAULT_REGION"] = "us-east-1"
    logging.getLogger("werkzeug").setLevel(logging.ERROR)


def serve_in_child(port_pipe: Any, stop: Any) -> None:
    """Entry point of ``--server-subprocess``: run the moto server until ``stop`` is set."""
    from moto.server import ThreadedMotoServer

    s3_environment()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    port_pipe.send(server.get_host_and_port()[1])
    stop.wait()
    server.stop()


@contextlib.contextmanager
def moto_server(in_subprocess: bool, log: RequestLog | None = None) -> Iterator[str]:
    """A loopback moto S3 server; yields its endpoint URL.  In this process, ``log`` records requests."""
    if not in_subprocess:
        server = counting_moto_server(log or RequestLog())
        server.start()
        try:
            yield f"http://127.0.0.1:{server.get_host_and_port()[1]}"
        finally:
            server.stop()
        return
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    stop = ctx.Event()
    child = ctx.Process(target=serve_in_child, args=(sender, stop), name="moto-server", daemon=True)
    child.start()
    try:
        if not receiver.poll(60):
            raise RuntimeError("the moto server process did not report its port within 60 s")
        yield f"http://127.0.0.1:{receiver.recv()}"
    finally:
        stop.set()
        child.join(30)
        if child.is_alive():
            child.terminate()
            child.join()


def boto3_client(endpoint: str) -> Any:
    """A boto3 S3 client for the loopback server, with a connection per transfer thread and more."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
        config=Config(max_pool_connections=32),
    )


def s3fs_filesystem(endpoint: str) -> Any:
    """An ``s3fs.S3FileSystem`` for the loopback server (fsspec caches it per arguments)."""
    import s3fs

    return s3fs.S3FileSystem(endpoint_url=endpoint, **CREDENTIALS)


def remove_prefix(fs: Any, path: str) -> None:
    """Delete every object under ``bucket/prefix`` and forget cached listings."""
    with contextlib.suppress(FileNotFoundError):
        fs.rm(path, recursive=True)
    fs.invalidate_cache()


def stored_bytes(fs: Any, path: str) -> int:
    """Total size of the objects under ``bucket/prefix``."""
    fs.invalidate_cache()
    return int(fs.du(path, total=True))


# ---- shards --------------------------------------------------------------------------------


def shard_state(state: State, limit: int = SHARD_BYTES) -> Shards:
    """The state as in-memory safetensors shards of at most ``limit`` payload bytes per component.

    Tensors go to shards in order; a shard is closed when the next tensor would not fit. Names
    follow HF's ``<component>-0000i-of-0000n.safetensors``, like ckptd's files.
    """
    from safetensors.torch import save

    shards: Shards = {}
    for component, tensors in state.items():
        groups: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for key, tensor in tensors.items():
            nbytes = tensor.numel() * tensor.element_size()
            if groups[-1] and size + nbytes > limit:
                groups.append({})
                size = 0
            groups[-1][key] = tensor
            size += nbytes
        for i, group in enumerate(groups, start=1):
            shards[f"{component}-{i:05d}-of-{len(groups):05d}.safetensors"] = save(group)
    return shards


def write_local_files(shards: Shards, directory: str) -> list[str]:
    """Write each shard to ``directory`` (untimed set-up of the ``put`` benchmark)."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for name, data in shards.items():
        path = os.path.join(directory, name)
        with open(path, "wb") as f:
            f.write(data)
        paths.append(path)
    return paths


# ---- a generic upload loop -----------------------------------------------------------------


def measure_rounds(
    label: str, repeats: int, upload: Callable[[int], Any], cleanup: Callable[[int], None], nbytes: int
) -> Measured:
    """Round 0 (first) and ``repeats`` warm rounds of ``upload(round)``; ``cleanup`` is untimed."""
    measured = Measured(label, nbytes)
    for i in range(repeats + 1):
        started = time.perf_counter()
        upload(i)
        seconds = time.perf_counter() - started
        (measured.first if i == 0 else measured.warm).add(seconds)
        kind = "first" if i == 0 else "warm "
        print(f"  {label} {i} ({kind}): {seconds:.3f} s, {nbytes / GB / seconds:.3f} GB/s", flush=True)
        cleanup(i)
    free_memory()
    return measured


# ---- ckptd ---------------------------------------------------------------------------------


def object_key(path: str) -> str:
    """``bucket/key`` of a request path (``/bucket/key``) or of an fsspec path."""
    return path.lstrip("/").removeprefix("s3://")


def count_save_requests(exchanges: list[Exchange], fs: Any, directory: str, part_size: int) -> dict[str, Any]:
    """Requests per file of a committed checkpoint against ``ceil(size / part_size) + 2``."""
    sizes = {object_key(info["name"]): int(info["size"]) for info in fs.ls(directory, detail=True, refresh=True)}
    per_file: dict[str, dict[str, Any]] = {}
    for key, size in sorted(sizes.items()):
        requests = [e for e in exchanges if object_key(e.path) == key]
        limit = max(1, math.ceil(size / part_size)) + 2
        per_file[key.rsplit("/", 1)[-1]] = {
            "bytes": size,
            "requests": len(requests),
            "methods": sorted({f"{e.method}{'?' + e.query.split('=')[0] if e.query else ''}" for e in requests}),
            "limit": limit,
            "passed": len(requests) <= limit,
        }
    others = [e for e in exchanges if object_key(e.path) not in sizes]
    return {
        "part_size": part_size,
        "files": per_file,
        "other_requests": len(others),
        "other_paths": sorted({f"{e.method} {e.path}" for e in others})[:20],
        "uploaded_bytes": sum(e.received for e in exchanges),
        "passed": all(f["passed"] for f in per_file.values()),
    }


def bench_ckptd_saves(
    ckpt: Any, state: State, fs: Any, repeats: int, setup: float, log: RequestLog | None = None
) -> tuple[Measured, int]:
    """ckptd saves: total (``async_save`` to ``result()``) and the writer's ``write`` time.

    The first save's total includes the constructor (``setup`` seconds, writer start). Every
    checkpoint but the last is deleted after its save; the last one is kept for the load and
    its step returned.
    """
    measured = Measured("ckptd")
    measured.extra = {"first write": Samples("first write"), "warm write": Samples("warm write")}
    measured.note = f"Checkpointer(max_shard_size={SHARD_SIZE!r}), part size/concurrency/files at once: defaults"
    counts: list[dict[str, Any]] = []
    for step in range(repeats + 1):
        first = step == 0
        mark = log.mark() if log is not None else 0
        started = time.perf_counter()
        request = ckpt.async_save(step, state)
        result = request.result()
        total = time.perf_counter() - started + (setup if first else 0.0)
        if log is not None:
            counted = count_save_requests(log.since(mark), fs, result.path, int(ckpt.options.part_size))
            counts.append(counted)
            print(
                "  ckptd requests per file (limit ceil(size/part)+2): "
                + ", ".join(f"{n} {f['requests']}/{f['limit']}" for n, f in counted["files"].items())
                + f"; other requests {counted['other_requests']}",
                flush=True,
            )
        write = request.timings["write"]
        (measured.first if first else measured.warm).add(total)
        measured.extra["first write" if first else "warm write"].add(write)
        measured.nbytes = result.bytes_written
        kind = "first" if first else "warm "
        print(
            f"  ckptd save {step} ({kind}): total {total:.3f} s ({result.bytes_written / GB / total:.3f} GB/s), "
            f"write {write:.3f} s ({result.bytes_written / GB / write:.3f} GB/s); "
            f"timings {format_timings(request.timings)}",
            flush=True,
        )
        if step < repeats:
            remove_prefix(fs, result.path)
    measured.counts = counts
    return measured, repeats


def count_load(exchanges: list[Exchange]) -> dict[str, int]:
    """Requests and response body bytes of a load."""
    gets = [e for e in exchanges if e.method == "GET"]
    return {
        "requests": len(exchanges),
        "gets": len(gets),
        "fetched_bytes": sum(e.sent for e in exchanges),
    }


def bench_ckptd_loads(
    ckpt: Any, step: int, state: State, repeats: int, log: RequestLog | None = None
) -> tuple[Samples, list[dict[str, int]]]:
    """Seconds for ``ckpt.load(step)`` (new CPU tensors) and what each load fetched; the first
    result is checked against ``state``."""
    samples = Samples("ckptd load")
    counts: list[dict[str, int]] = []
    for i in range(repeats):
        mark = log.mark() if log is not None else 0
        started = time.perf_counter()
        loaded = ckpt.load(step)
        seconds = time.perf_counter() - started
        samples.add(seconds)
        line = f"  ckptd load {i}: {seconds:.3f} s"
        if log is not None:
            counts.append(count_load(log.since(mark)))
            line += (
                f", {counts[-1]['requests']} requests, {counts[-1]['fetched_bytes'] / MIB:.1f} MiB fetched "
                f"for {state_bytes(state) / MIB:.1f} MiB of tensors"
            )
        print(line, flush=True)
        if i == 0:
            check_equal(state, loaded, "ckptd load")
        del loaded
        free_memory()
    return samples, counts


def flat_leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b.c": leaf}`` for a nested mapping."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flat_leaves(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def check_equal(expected: State, actual: Any, what: str) -> None:
    """Raise unless ``actual`` holds the same tensors (names, dtypes, values) as ``expected``."""
    want, got = flat_leaves(expected), flat_leaves(actual)
    if want.keys() != got.keys():
        raise AssertionError(f"{what}: keys differ: missing {sorted(want.keys() - got.keys())[:5]}...")
    for key, tensor in want.items():
        other = got[key]
        if not isinstance(other, torch.Tensor) or other.dtype != tensor.dtype or not torch.equal(other, tensor):
            raise AssertionError(f"{what}: {key} differs from the saved tensor")
    print(f"  {what}: all {len(want)} tensors equal the saved state", flush=True)


# ---- plain clients -------------------------------------------------------------------------


def bench_s3fs_pipe(fs: Any, shards: Shards, repeats: int) -> Measured:
    """One ``fs.pipe({path: bytes, ...})`` call uploading every shard at once."""

    def prefix(i: int) -> str:
        return f"{BUCKET}/pipe/{i}"

    def upload(i: int) -> None:
        fs.pipe({f"{prefix(i)}/{name}": data for name, data in shards.items()})

    nbytes = sum(len(d) for d in shards.values())
    return measure_rounds("s3fs pipe", repeats, upload, lambda i: remove_prefix(fs, prefix(i)), nbytes)


def bench_s3fs_put(fs: Any, shards: Shards, local_dir: str, repeats: int) -> Measured:
    """``fs.put(local_files, remote_paths)`` of the shards written to local files beforehand."""
    local = write_local_files(shards, local_dir)

    def prefix(i: int) -> str:
        return f"{BUCKET}/put/{i}"

    def upload(i: int) -> None:
        fs.put(local, [f"{prefix(i)}/{os.path.basename(p)}" for p in local])

    nbytes = sum(len(d) for d in shards.values())
    try:
        return measure_rounds("s3fs put", repeats, upload, lambda i: remove_prefix(fs, prefix(i)), nbytes)
    finally:
        shutil.rmtree(local_dir, ignore_errors=True)


def transfer_config() -> Any:
    """boto3's transfer settings of the reference: 64 MiB parts, 4 threads per file."""
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(
        multipart_threshold=PART_BYTES, multipart_chunksize=PART_BYTES, max_concurrency=BOTO3_CONCURRENCY
    )


BEST_PART_BYTES = 16 * MIB
BEST_CONCURRENCY = 8


def best_transfer_config() -> Any:
    """boto3's fastest settings found here: 16 MiB parts, 8 threads per file (used with every file at once)."""
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(
        multipart_threshold=BEST_PART_BYTES, multipart_chunksize=BEST_PART_BYTES, max_concurrency=BEST_CONCURRENCY
    )


def bench_boto3(client: Any, fs: Any, shards: Shards, repeats: int, files_at_once: int, best: bool = False) -> Measured:
    """``upload_fileobj`` of every shard from ``io.BytesIO``, ``files_at_once`` files concurrently."""
    config = best_transfer_config() if best else transfer_config()
    tag = ("best" if best else "") + ("seq" if files_at_once == 1 else f"par{files_at_once}")

    def key(i: int, name: str) -> str:
        return f"boto3-{tag}/{i}/{name}"

    def upload_one(i: int, name: str, data: bytes) -> None:
        client.upload_fileobj(io.BytesIO(data), BUCKET, key(i, name), Config=config)

    def upload(i: int) -> None:
        if files_at_once == 1:
            for name, data in shards.items():
                upload_one(i, name, data)
            return
        with ThreadPoolExecutor(files_at_once, thread_name_prefix="boto3-file") as pool:
            for future in [pool.submit(upload_one, i, name, data) for name, data in shards.items()]:
                future.result()

    label = (
        "boto3 upload_fileobj, files one after another"
        if files_at_once == 1
        else f"boto3 upload_fileobj, {files_at_once} files at once"
    )
    if best:
        label = f"boto3 best: every file at once ({files_at_once}), 16 MiB parts, {BEST_CONCURRENCY} threads/file"
    nbytes = sum(len(d) for d in shards.values())
    return measure_rounds(label, repeats, upload, lambda i: remove_prefix(fs, f"{BUCKET}/boto3-{tag}/{i}"), nbytes)


RANGE_BYTES = 16 * MIB
RANGE_THREADS = 16


def bench_boto3_ranged_loads(
    client: Any, fs: Any, directory: str, repeats: int, log: RequestLog | None = None
) -> tuple[Samples, list[dict[str, int]], int]:
    """Parallel ranged GETs (16 MiB ranges, 16 threads) of every ``.safetensors`` file of a
    checkpoint into preallocated buffers: the bytes only, no tensors."""
    files = {
        object_key(i["name"]): int(i["size"])
        for i in fs.ls(directory, detail=True, refresh=True)
        if i["name"].endswith(".safetensors")
    }
    buffers = {key: bytearray(size) for key, size in files.items()}
    ranges = [
        (key, start, min(start + RANGE_BYTES, size))
        for key, size in files.items()
        for start in range(0, size, RANGE_BYTES)
    ]

    def fetch(key: str, start: int, end: int) -> None:
        bucket, name = key.split("/", 1)
        body = client.get_object(Bucket=bucket, Key=name, Range=f"bytes={start}-{end - 1}")["Body"]
        view = memoryview(buffers[key])[start:end]
        offset = 0
        while offset < len(view):
            chunk = body.read(min(8 * MIB, len(view) - offset))
            if not chunk:
                raise OSError(f"{key}: short read at {start + offset}")
            view[offset : offset + len(chunk)] = chunk
            offset += len(chunk)

    samples = Samples("boto3 ranged GETs")
    counts: list[dict[str, int]] = []
    with ThreadPoolExecutor(RANGE_THREADS, thread_name_prefix="boto3-get") as pool:
        for i in range(repeats):
            mark = log.mark() if log is not None else 0
            started = time.perf_counter()
            for future in [pool.submit(fetch, *r) for r in ranges]:
                future.result()
            seconds = time.perf_counter() - started
            samples.add(seconds)
            if log is not None:
                counts.append(count_load(log.since(mark)))
            print(f"  boto3 ranged GETs {i}: {seconds:.3f} s, {len(ranges)} ranges", flush=True)
    nbytes = sum(files.values())
    buffers.clear()
    free_memory()
    return samples, counts, nbytes


# ---- torch.distributed.checkpoint ----------------------------------------------------------


def dcp_url(i: int) -> str:
    """URL of DCP checkpoint ``i``."""
    return f"s3://{BUCKET}/dcp/{i}"


def bench_dcp_saves(state: State, endpoint: str, fs: Any, repeats: int) -> Measured:
    """Synchronous ``dcp.save`` through ``FsspecWriter`` (default options: one thread, one file).

    The last checkpoint is kept for :func:`bench_dcp_load`.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter  # not re-exported by torch 2.13

    measured = Measured("DCP save (FsspecWriter)")
    measured.note = "dcp.save(no_dist=True), FsspecWriter defaults (thread_count=1, single_file_per_rank=True)"

    def upload(i: int) -> None:
        writer = FsspecWriter(dcp_url(i), endpoint_url=endpoint, key="testing", secret="testing")
        dcp.save(state, storage_writer=writer, no_dist=True)
        if i == 0:
            measured.nbytes = stored_bytes(fs, f"{BUCKET}/dcp/0")

    def cleanup(i: int) -> None:
        if i < repeats:
            remove_prefix(fs, f"{BUCKET}/dcp/{i}")

    # Per-round lines use the payload size; the table uses the stored size (a little larger).
    rounds = measure_rounds(measured.label, repeats, upload, cleanup, state_bytes(state))
    measured.first, measured.warm = rounds.first, rounds.warm
    return measured


def bench_dcp_load(state: State, endpoint: str, kept: int, repeats: int) -> tuple[Samples, str]:
    """``dcp.load`` of DCP checkpoint ``kept`` into preallocated tensors (checked against ``state``).

    One load first; more (up to ``repeats``) only when it took under ``DCP_LOAD_REPEAT_BELOW_S``.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    template = {c: {k: torch.empty_like(t) for k, t in tensors.items()} for c, tensors in state.items()}
    samples = Samples("DCP load")
    for i in range(repeats):
        started = time.perf_counter()
        reader = FsspecReader(dcp_url(kept), endpoint_url=endpoint, key="testing", secret="testing")
        dcp.load(template, storage_reader=reader, no_dist=True)
        seconds = time.perf_counter() - started
        samples.add(seconds)
        print(f"  DCP load {i}: {seconds:.3f} s", flush=True)
        if i == 0:
            check_equal(state, template, "DCP load")
            if seconds >= DCP_LOAD_REPEAT_BELOW_S:
                break
    note = "" if len(samples.values) == repeats else f"run once: the first load took >= {DCP_LOAD_REPEAT_BELOW_S:.0f} s"
    del template
    free_memory()
    return samples, note


# ---- report --------------------------------------------------------------------------------


def best_boto3(uploads: dict[str, Measured]) -> Measured | None:
    """The boto3 configuration with several files at once that was fastest (warm median)."""
    candidates = [uploads[k] for k in ("boto3-par", "boto3-best") if k in uploads]
    return min(candidates, key=lambda m: m.warm.median / max(m.nbytes, 1), default=None)


LOAD_LABELS = {
    "ckptd": "ckptd load (ckpt.load(step))",
    "boto3": "boto3 parallel ranged GETs of the same files (bytes only)",
    "DCP": "DCP load (FsspecReader, preallocated)",
}


def build_rows(uploads: dict[str, Measured], loads: dict[str, tuple[Samples, int]]) -> list[Row]:
    """Upload rows against boto3's best configuration (several files at once, several parts each),
    then load rows against DCP's load."""
    rows: list[Row] = []
    base = best_boto3(uploads)
    base_first = Row("boto3 best first", base.first, base.nbytes) if base else None
    base_warm = Row("boto3 best warm", base.warm, base.nbytes) if base else None
    for m in uploads.values():
        rows.append(Row(f"{m.label}: first", m.first, m.nbytes, base_first, "boto3 best first"))
        if m.label == "ckptd":
            rows.append(
                Row("ckptd: first, write only", m.extra["first write"], m.nbytes, base_first, "boto3 best first")
            )
        rows.append(Row(f"{m.label}: warm", m.warm, m.nbytes, base_warm, "boto3 best warm"))
        if m.label == "ckptd":
            rows.append(Row("ckptd: warm, write only", m.extra["warm write"], m.nbytes, base_warm, "boto3 best warm"))
    dcp = loads.get("DCP")
    dcp_row = Row("DCP load", dcp[0], dcp[1]) if dcp else None
    for name, (samples, nbytes) in loads.items():
        rows.append(
            Row(LOAD_LABELS[name], samples, nbytes, None if name == "DCP" else dcp_row, "DCP load" if dcp_row else "")
        )
    return rows


def format_table(rows: list[Row]) -> str:
    """A fixed-width text table (also valid Markdown); ratio = GB/s over the reference's GB/s."""
    header = ["what", "median s", "min s", "max s", "n", "GB/s", "ratio", "vs"]
    lines = []
    for row in rows:
        s = row.samples
        lines.append(
            [
                row.what,
                f"{s.median:.3f}",
                f"{s.low:.3f}",
                f"{s.high:.3f}",
                str(len(s.values)),
                f"{row.gb_per_s:.3f}",
                "" if row.ratio is None else f"{row.ratio:.2f}x",
                row.reference_label if row.ratio is not None else "",
            ]
        )
    return markdown_table(header, lines, left_aligned={0, 7})


# ---- main ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=0.5, help="state size in GiB (default 0.5; moto keeps it in RAM)")
    parser.add_argument("--repeats", type=int, default=3, help="warm repeats per measurement (default 3)")
    parser.add_argument(
        "--dir", default="/work", help="parent directory of the temporary directory of local files (default /work)"
    )
    parser.add_argument("--skip-dcp", action="store_true", help="do not benchmark torch.distributed.checkpoint")
    parser.add_argument(
        "--server-subprocess",
        action="store_true",
        help="run the moto server in a child process instead of threads of this process",
    )
    parser.add_argument("--quick", action="store_true", help="skip the s3fs pipe/put rows")
    parser.add_argument("--json", metavar="PATH", help="also write all samples and the table as JSON")
    args = parser.parse_args(argv)
    if args.gib <= 0 or args.repeats < 1:
        parser.error("--gib must be > 0 and --repeats >= 1")
    return args


def run_all(
    args: argparse.Namespace, endpoint: str, bench_dir: str, state: State, log: RequestLog | None
) -> dict[str, Any]:
    """Every measurement against the running server; returns what main prints and dumps."""
    import ckptd

    boto = boto3_client(endpoint)
    boto.create_bucket(Bucket=BUCKET)
    fs = s3fs_filesystem(endpoint)
    uploads: dict[str, Measured] = {}
    loads: dict[str, tuple[Samples, int]] = {}
    notes: dict[str, str] = {}
    load_counts: dict[str, list[dict[str, int]]] = {}

    def ckptd_phase() -> None:
        started = time.perf_counter()
        ckpt = ckptd.Checkpointer(
            f"s3://{BUCKET}/ckptd",
            storage_options={"endpoint_url": endpoint, **CREDENTIALS},
            max_shard_size=SHARD_SIZE,
        )
        setup = time.perf_counter() - started
        print(f"  ckptd constructor: {setup:.3f} s (counted in the first save's total)")
        try:
            measured, kept = bench_ckptd_saves(ckpt, state, fs, args.repeats, setup, log)
            uploads["ckptd"] = measured
            notes["ckptd"] = measured.note
            print(f"  ckptd files: {sorted(os.path.basename(p) for p in fs.ls(ckpt.path_for(kept)))}")
            samples, load_counts["ckptd"] = bench_ckptd_loads(ckpt, kept, state, args.repeats, log)
            loads["ckptd"] = (samples, measured.nbytes)
            samples, load_counts["boto3"], nbytes = timed_phase(
                "boto3 parallel ranged GETs of ckptd's files",
                lambda: bench_boto3_ranged_loads(boto, fs, ckpt.path_for(kept), args.repeats, log),
            )
            loads["boto3"] = (samples, nbytes)
            remove_prefix(fs, ckpt.path_for(kept))
        finally:
            ckpt.close()

    timed_phase("ckptd async_save + load", ckptd_phase)
    shards = timed_phase("serialising safetensors shards in memory (untimed)", lambda: shard_state(state))
    print(f"  {len(shards)} shards: " + ", ".join(f"{n} {len(d) / GB:.3f} GB" for n, d in shards.items()))
    if not args.quick:
        uploads["pipe"] = timed_phase("s3fs pipe", lambda: bench_s3fs_pipe(fs, shards, args.repeats))
        uploads["put"] = timed_phase(
            "s3fs put", lambda: bench_s3fs_put(fs, shards, os.path.join(bench_dir, "put"), args.repeats)
        )
    uploads["boto3"] = timed_phase(
        "boto3 upload_fileobj, files one after another", lambda: bench_boto3(boto, fs, shards, args.repeats, 1)
    )
    uploads["boto3-par"] = timed_phase(
        "boto3 upload_fileobj, 4 files at once", lambda: bench_boto3(boto, fs, shards, args.repeats, 4)
    )
    uploads["boto3-best"] = timed_phase(
        "boto3 best: every file at once, 16 MiB parts, 8 threads per file",
        lambda: bench_boto3(boto, fs, shards, args.repeats, len(shards), best=True),
    )
    shards.clear()
    free_memory()
    if not args.skip_dcp:
        uploads["dcp"] = timed_phase("DCP save", lambda: bench_dcp_saves(state, endpoint, fs, args.repeats))
        notes["DCP save"] = uploads["dcp"].note
        samples, note = timed_phase("DCP load", lambda: bench_dcp_load(state, endpoint, args.repeats, args.repeats))
        loads["DCP"] = (samples, uploads["dcp"].nbytes)
        if note:
            notes["DCP load"] = note
        remove_prefix(fs, f"{BUCKET}/dcp")
    notes["boto3"] = (
        f"TransferConfig(multipart_threshold=64 MiB, multipart_chunksize=64 MiB, max_concurrency={BOTO3_CONCURRENCY})"
    )
    notes["boto3 best"] = (
        f"every file at once; TransferConfig(multipart_threshold=16 MiB, multipart_chunksize=16 MiB, "
        f"max_concurrency={BEST_CONCURRENCY})"
    )
    notes["boto3 ranged GETs"] = f"{RANGE_BYTES // MIB} MiB ranges, {RANGE_THREADS} threads, into bytearrays"
    return {"uploads": uploads, "loads": loads, "notes": notes, "load_counts": load_counts}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(2)
    s3_environment()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # expected with no_dist=True
    os.makedirs(args.dir, exist_ok=True)
    bench_dir = tempfile.mkdtemp(prefix="ckptd-bench-s3-", dir=args.dir)
    wall = time.perf_counter()
    machine = machine_info(bench_dir)
    import boto3
    import moto
    import s3fs

    machine.update(moto=moto.__version__, s3fs=s3fs.__version__, boto3=boto3.__version__)
    machine["server"] = "moto ThreadedMotoServer on 127.0.0.1, " + (
        "child process" if args.server_subprocess else "threads of this process"
    )
    command = shlex.join([sys.executable, *sys.argv])
    print("command:", command)
    print("machine:", ", ".join(f"{k}={v}" for k, v in machine.items()))
    try:
        state = timed_phase("building state", lambda: build_state(args.gib))
        total = state_bytes(state)
        count = sum(1 for _ in iter_tensors(state))
        hidden = hidden_size_for(args.gib)
        print(
            f"state: {total / GIB:.3f} GiB ({total} bytes), {count} tensors; vocab {VOCAB}, hidden {hidden}, "
            f"{LAYERS} layers; bf16 weights + fp32 Adam exp_avg/exp_avg_sq + int64 step"
        )
        log = None if args.server_subprocess else RequestLog()
        with moto_server(args.server_subprocess, log) as endpoint:
            print(f"server: {endpoint}, bucket {BUCKET}")
            results = run_all(args, endpoint, bench_dir, state, log)
        rows = build_rows(results["uploads"], results["loads"])
        print(
            f"\n== results: {total / GIB:.3f} GiB payload, {count} tensors; first = 1, warm = {args.repeats}; "
            f"GB = 10^9 bytes of the files each client uploaded; ratio = GB/s / GB/s of the row named in vs"
        )
        for label, note in results["notes"].items():
            print(f"{label}: {note}")
        print(format_table(rows))
        print(f"(whole run: {time.perf_counter() - wall:.1f} s)")
        if args.json:
            dump_json(
                args.json,
                {
                    "command": command,
                    "machine": machine,
                    "state": {"bytes": total, "tensors": count, "vocab": VOCAB, "hidden": hidden, "layers": LAYERS},
                    "uploads": {k: asdict(v) for k, v in results["uploads"].items()},
                    "loads": {k: {"samples": asdict(s), "bytes": n} for k, (s, n) in results["loads"].items()},
                    "notes": results["notes"],
                    "save_counts": results["uploads"]["ckptd"].counts if "ckptd" in results["uploads"] else [],
                    "load_counts": results["load_counts"],
                    "payload_bytes": total,
                    "table": [
                        {
                            "what": r.what,
                            "median": r.samples.median,
                            "min": r.samples.low,
                            "max": r.samples.high,
                            "n": len(r.samples.values),
                            "bytes": r.nbytes,
                            "gb_per_s": r.gb_per_s,
                            "ratio": r.ratio,
                            "vs": r.reference_label if r.ratio is not None else "",
                        }
                        for r in rows
                    ],
                    "wall_seconds": time.perf_counter() - wall,
                },
            )
            print(f"wrote {args.json}")
    finally:
        shutil.rmtree(bench_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
