"""Stream shard files from a staging arena into storage, checksumming as they go.

Shared by the writer process and the in-process writer (for ``memory://``).  Torch-free.
"""

from __future__ import annotations

import errno
import hashlib
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import cast

from ..errors import StorageError
from ..formats.checksum import CHECKSUM_CHUNK, DIGEST_PREFIX, crc32c, crc32c_of_view, sha256_of_view
from ..storage import Stopped, Storage, StorageTuning, storage_for
from ..storage.local import LocalStorage
from ..storage.retry import retries_of
from .adopt import adopt_file
from .gate import StagingGate, chunk_gate, gated_crc32c
from .protocol import CopySpec, FileResult, FileSpec, FilesWritten, WriteFiles
from .ring import RingArena, RingReader
from .shm import SharedSegment

__all__ = ["write_files"]


def write_files(
    request: WriteFiles,
    arena: memoryview,
    *,
    checksums: Executor,
    should_stop: Callable[[], bool],
    on_progress: Callable[[int], None],
    gate: StagingGate | None = None,
    on_freed: Callable[[int], None] | None = None,
    segments: Mapping[int, SharedSegment] | None = None,
) -> FilesWritten:
    """Write every file of ``request`` from ``arena`` and make its ``copies``; raises on the
    first failure.

    Each file's CRC32C (and SHA-256, when asked) is computed on another thread while the file is
    written (the arena does not change meanwhile).  ``request.threads`` files are written at
    once.  When ``should_stop()`` turns true the current files are removed and
    :class:`~ckptd.storage.Stopped` is raised.

    With a ``gate`` (a pipelined request) every read of the arena waits until the gate says its
    bytes are staged: chunk by chunk on local storage (its ``write_view`` reads the view in
    order, polling ``should_stop()`` before each chunk), the whole file first elsewhere.

    A ``streamed`` request reads ``arena`` as a ring (:mod:`ckptd.writer.ring`) and reports with
    ``on_freed(upto)`` the logical offset below which it needs no byte any more.

    ``copies`` (files an incremental save takes from the last committed checkpoint) are made by
    the storage's ``copy_file``: hard links on local disk, server-side copies on object stores.

    A file with ``adopt`` is the attached segment of that id in ``segments``: it is checksummed
    and linked into place (:func:`_adopt_file`), not written.
    """
    started = time.perf_counter()
    storage = storage_for(request.directory, request.storage_options, StorageTuning(**request.tuning))
    readers: dict[int, _FileReaders] = {}
    if request.streamed:
        ring = RingArena(
            arena,
            gate,
            should_stop=should_stop,
            on_freed=on_freed or _ignore,
            notice_bytes=_notice_bytes(request.chunk_size, len(arena)),
        )
        readers = {id(spec): _FileReaders.of(ring, spec, copying=not storage.local) for spec in request.files}

    def write_one(spec: FileSpec, fsync: bool = request.fsync) -> FileResult:
        if spec.adopt is not None:
            segment = (segments or {}).get(spec.adopt)
            return adopt_file(storage, request, spec, segment, checksums, should_stop, on_progress, gate)
        if request.streamed:
            return _write_streamed(
                storage, request, spec, readers[id(spec)], checksums, should_stop, on_progress, fsync
            )
        return _write_file(storage, request, spec, arena, checksums, should_stop, on_progress, gate, fsync)

    def copy_one(spec: CopySpec) -> FileResult:
        return _copy_file(storage, request, spec, should_stop)

    try:
        results = _write_all(storage, request, write_one, copy_one)
    finally:
        for file_readers in readers.values():
            file_readers.close()  # a failed request holds nothing back either
    return FilesWritten(request.request_id, results, time.perf_counter() - started, retries_of(storage))


def _write_all(
    storage: Storage,
    request: WriteFiles,
    write_one: Callable[..., FileResult],
    copy_one: Callable[[CopySpec], FileResult],
) -> list[FileResult]:
    if request.threads > 1 and len(request.files) + len(request.copies) > 1:
        count = min(request.threads, len(request.files) + len(request.copies))
        with ThreadPoolExecutor(count, thread_name_prefix="ckptd-file") as pool:
            futures = [pool.submit(copy_one, spec) for spec in request.copies]
            futures += [pool.submit(write_one, spec) for spec in request.files]
            try:
                results = [f.result() for f in futures]
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
    else:
        results = [copy_one(spec) for spec in request.copies]
        if request.fsync and isinstance(storage, LocalStorage) and len(request.files) > 1:
            results += _write_syncing_behind(storage, request, write_one)
        else:
            results += [write_one(spec) for spec in request.files]
    return results


def _notice_bytes(chunk: int, ring: int) -> int:
    """How much the writer frees between two notices to the trainer: a quarter of the ring.

    Each notice wakes the trainer's threads, which preempt the niced writer on a busy machine
    (measured on 2 cores, 2 GiB through 256 MiB: a notice per 16 MiB chunk made the save 1.5x
    slower than unbounded, one per 64 MiB left it level).  The ring still always has room to go
    on: a read slice, a copy chunk and a notice's quarter fit (ckptd.save.streamed)."""
    return max(chunk, ring // 4)


def _ignore(upto: int) -> None:
    """No one to tell what the ring freed."""


@dataclass(frozen=True)
class _FileReaders:
    """The readers of one file of a streamed request: the storage's write, the CRC32C, and the
    SHA-256 when the request asks for it."""

    write: RingReader
    crc: RingReader
    digest: RingReader | None

    @classmethod
    def of(cls, ring: RingArena, spec: FileSpec, copying: bool) -> _FileReaders:
        def reader(copy: bool) -> RingReader:
            return ring.reader(spec.arena_offset, spec.size, spec.name, copying=copy)

        return cls(reader(copying), reader(False), reader(False) if spec.digest and spec.whole_file else None)

    def close(self) -> None:
        for reader in (self.write, self.crc, self.digest):
            if reader is not None:
                reader.close()


def _write_streamed(
    storage: Storage,
    request: WriteFiles,
    spec: FileSpec,
    readers: _FileReaders,
    checksums: Executor,
    should_stop: Callable[[], bool],
    on_progress: Callable[[int], None],
    fsync: bool,
) -> FileResult:
    """Write one file of a streamed request from the ring, its checksums read beside the write.
    (An unchanged file is not looked for: that needs all of its bytes before the first write.)"""
    started = time.perf_counter()
    path = storage.join(request.directory, spec.name)
    checksum = checksums.submit(_crc32c_of_spans, readers.crc, request.chunk_size)
    digest = checksums.submit(_sha256_of_spans, readers.digest, request.chunk_size) if readers.digest else None
    data = cast(memoryview, readers.write)  # reads like a memoryview: len(), slices, bytes()
    try:
        _store(storage, request, spec, path, data, fsync, should_stop, should_stop, on_progress)
    except BaseException:
        readers.close()  # the checksum threads stop waiting for bytes no one will stage
        raise
    finally:
        readers.write.close()
    return _written(spec, started, checksum, digest)


def _crc32c_of_spans(reader: RingReader, chunk: int) -> int:
    value = 0
    try:
        for span in reader.spans(chunk):
            value = crc32c(span, value)
    finally:
        reader.close()
    return value


def _sha256_of_spans(reader: RingReader, chunk: int) -> str:
    hasher = hashlib.sha256()
    try:
        for span in reader.spans(chunk):
            hasher.update(span)
    finally:
        reader.close()
    return DIGEST_PREFIX + hasher.hexdigest()


def _copy_file(storage: Storage, request: WriteFiles, spec: CopySpec, should_stop: Callable[[], bool]) -> FileResult:
    """Make ``spec.name`` from the earlier checkpoint's file, and check its size."""
    if should_stop():
        raise Stopped(spec.name)
    started = time.perf_counter()
    path = storage.join(request.directory, spec.name)
    how = _copy_checked(storage, spec.source, path, spec.size, request.fsync)
    return FileResult(spec.name, spec.size, spec.crc32c, time.perf_counter() - started, how=how, digest=spec.digest)


def _copy_checked(storage: Storage, source: str, path: str, size: int, fsync: bool) -> str:
    """``storage.copy_file(source, path)``, then check that the copy has the ``size`` bytes the
    source's manifest records (a file edited after its commit is not reused)."""
    how = storage.copy_file(source, path, fsync=fsync)
    found = storage.size(path)
    if found != size:
        storage.remove(path)
        raise StorageError(
            errno.EIO,
            f"{source} holds {found} bytes, but the checkpoint it belongs to records {size}: "
            "it changed after its commit; this save cannot reuse it",
        )
    return how


def _write_syncing_behind(
    storage: LocalStorage, request: WriteFiles, write_one: Callable[[FileSpec, bool], FileResult]
) -> list[FileResult]:
    """Write the files one after another, each one's fsync on a second thread while the next is
    written (an fsync waits for the journal and the device cache: up to a second on a slow disk,
    during which the writer would otherwise write nothing).  Returns once every file is durable."""
    results: list[FileResult] = []
    syncs: list[Future[None]] = []
    with ThreadPoolExecutor(1, thread_name_prefix="ckptd-fsync") as syncer:
        try:
            for spec in request.files:
                result = write_one(spec, False)
                results.append(result)
                if not result.reused:  # an unchanged file (incremental save) was not written
                    syncs.append(syncer.submit(storage.sync_file, storage.join(request.directory, spec.name)))
            for sync in syncs:
                sync.result()
        except BaseException:
            for sync in syncs:
                sync.cancel()
            raise
    return results


def _write_file(
    storage: Storage,
    request: WriteFiles,
    spec: FileSpec,
    arena: memoryview,
    checksums: Executor,
    should_stop: Callable[[], bool],
    on_progress: Callable[[int], None],
    gate: StagingGate | None,
    fsync: bool,
) -> FileResult:
    started = time.perf_counter()
    data = arena[spec.arena_offset : spec.arena_offset + spec.size]
    path = storage.join(request.directory, spec.name)
    end = spec.arena_offset + spec.size
    before_chunk = should_stop
    if gate is not None and not gate.complete:
        if storage.local and spec.whole_file and spec.unchanged_if is None:
            before_chunk = chunk_gate(gate, spec.arena_offset, spec.size, request.chunk_size, path, should_stop)
        else:
            gate.wait(end, path, should_stop)
    digest: Future[str] | None = None
    if spec.unchanged_if is not None and spec.source is not None and spec.whole_file:
        # incremental="hash": the bytes are in the arena; unchanged ones are linked or copied
        # from the last checkpoint instead of being written again.
        value = sha256_of_view(data)
        if value == spec.unchanged_if:
            how = _copy_checked(storage, spec.source, path, spec.size, request.fsync)
            crc = crc32c_of_view(data)
            return FileResult(spec.name, spec.size, crc, time.perf_counter() - started, how=how, digest=value)
        digest = _done(value)
    elif spec.digest and spec.whole_file:
        digest = checksums.submit(_gated_digest, data, gate, spec.arena_offset, path, should_stop)
    if gate is not None and not gate.complete:
        checksum: Future[int] = checksums.submit(gated_crc32c, data, gate, spec.arena_offset, path, should_stop)
    else:
        checksum = checksums.submit(crc32c_of_view, data)
    try:
        _store(storage, request, spec, path, data, fsync, before_chunk, should_stop, on_progress)
    except BaseException:
        checksum.cancel()
        if digest is not None:
            digest.cancel()
        raise
    return _written(spec, started, checksum, digest)


def _store(
    storage: Storage,
    request: WriteFiles,
    spec: FileSpec,
    path: str,
    data: memoryview,
    fsync: bool,
    before_chunk: Callable[[], bool],
    should_stop: Callable[[], bool],
    on_progress: Callable[[int], None],
) -> None:
    """Write ``data`` as ``spec`` says: the whole file (``before_chunk`` polled before each
    chunk), or its piece of a file several ranks write into."""
    if spec.whole_file and spec.recycle is not None and isinstance(storage, LocalStorage):
        storage.write_view(
            path,
            data,
            fsync=fsync,
            chunk_size=request.chunk_size,
            should_stop=before_chunk,
            on_progress=on_progress,
            recycle=spec.recycle,
        )
    elif spec.whole_file:
        storage.write_view(
            path, data, fsync=fsync, chunk_size=request.chunk_size, should_stop=before_chunk, on_progress=on_progress
        )
    else:
        # A file shared by several ranks: backends without ``supports_write_at`` refuse it
        # with a ConfigError naming the file (the storage contract, ObjectWriter step 3).
        storage.write_at(
            path,
            spec.file_offset,
            data,
            fsync=fsync,
            chunk_size=request.chunk_size,
            should_stop=should_stop,
            on_progress=on_progress,
        )


def _written(spec: FileSpec, started: float, checksum: Future[int], digest: Future[str] | None) -> FileResult:
    """The result of a file written from the arena, once its checksums are done."""
    return FileResult(
        spec.name,
        spec.size,
        checksum.result(),
        time.perf_counter() - started,
        spec.file_offset,
        digest=digest.result() if digest is not None else None,
    )


def _done(value: str) -> Future[str]:
    future: Future[str] = Future()
    future.set_result(value)
    return future


def _gated_digest(
    data: memoryview, gate: StagingGate | None, arena_offset: int, what: str, should_stop: Callable[[], bool]
) -> str:
    """SHA-256 of ``data`` (at ``arena_offset`` of the arena), each chunk once it is staged (with
    a ``gate``: a pipelined request)."""
    hasher = hashlib.sha256()
    for start in range(0, len(data), CHECKSUM_CHUNK):
        stop = min(len(data), start + CHECKSUM_CHUNK)
        if gate is not None:
            gate.wait(arena_offset + stop, what, should_stop)
        hasher.update(data[start:stop])
    return DIGEST_PREFIX + hasher.hexdigest()
