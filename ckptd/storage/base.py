"""What every storage backend offers, and the helpers they share.

This module imports nothing heavy: the writer process uses it too.
"""

from __future__ import annotations

import errno as errno_codes
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ..errors import MissingFileError, StorageError, UnsafeCheckpointError
from .held import HELD_SCHEME, held_path, is_held

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_PART_CONCURRENCY",
    "DEFAULT_PART_SIZE",
    "DEFAULT_READ_TIMEOUT",
    "DEFAULT_RETRY_ATTEMPTS",
    "MAX_PARTS",
    "MIN_PART_SIZE",
    "Deleting",
    "Listing",
    "ObjectWriter",
    "Publishing",
    "RangeReader",
    "RangeReading",
    "Stopped",
    "Storage",
    "StorageTuning",
    "base_name",
    "check_file_name",
    "is_local",
    "local_path",
    "missing_file",
    "normalize_location",
    "read_chunks",
    "storage_error",
]

DEFAULT_PART_SIZE = 16 * 1024 * 1024
DEFAULT_PART_CONCURRENCY = 8  # parts in flight across all files of one save
DEFAULT_RETRY_ATTEMPTS = 6
# Seconds.  A frozen endpoint fails a request within retry_attempts x (connect + read) = 120 s,
# plus at most 6.2 s of backoff (see StorageTuning).
DEFAULT_CONNECT_TIMEOUT = 5.0
DEFAULT_READ_TIMEOUT = 15.0
MIN_PART_SIZE = 5 * 1024 * 1024
MAX_PARTS = 10_000


@dataclass(frozen=True)
class StorageTuning:
    """I/O knobs.

    Object stores: ``part_size`` is a floor (a file too large for ``MAX_PARTS`` parts of that
    size uses larger parts); ``part_concurrency`` bounds the parts in flight across all files of a
    save; ``retry_attempts`` counts every try of one request (parts are retried one by one),
    delays growing from ``retry_base_delay`` doubling up to ``retry_max_delay``, with full jitter.
    Every try is bounded: ``connect_timeout`` seconds to open a connection, ``read_timeout``
    seconds without a byte from the peer while waiting for an answer, and (Linux,
    ``TCP_USER_TIMEOUT``) without the peer taking a byte while a request body is sent; a slow
    transfer that keeps moving is never cut.  So a frozen endpoint fails a request within
    ``retry_attempts * (connect_timeout + read_timeout)`` plus the backoff.

    Local files: ``direct_io`` writes with ``O_DIRECT`` (bypassing the page cache, where the
    filesystem supports it); ``drop_cache`` tells the kernel to drop a file's cached pages once
    it is durable, so a save does not push the training job's memory out of the page cache.
    """

    part_size: int = DEFAULT_PART_SIZE
    part_concurrency: int = DEFAULT_PART_CONCURRENCY
    retry_attempts: int = DEFAULT_RETRY_ATTEMPTS
    retry_base_delay: float = 0.2
    retry_max_delay: float = 5.0
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    read_timeout: float = DEFAULT_READ_TIMEOUT
    direct_io: bool = True
    drop_cache: bool = True

    def part_size_for(self, size: int) -> int:
        """The part size for a file of ``size`` bytes: ≥ 5 MiB, ≥ ``part_size``, ≤ 10,000 parts."""
        needed = -(-size // MAX_PARTS)
        mib = 1024 * 1024
        return max(MIN_PART_SIZE, self.part_size, -(-needed // mib) * mib)


def is_local(url: str) -> bool:
    """True for plain paths, ``file://`` URLs and held-memory roots (``shm://NAME``)."""
    return "://" not in url or url.startswith("file://") or is_held(url)


def local_path(url: str) -> str:
    """The absolute filesystem path of a local path, ``file://`` URL or ``shm://`` root (of a
    checkpoint under it: ``shm://run42/checkpoint-5``)."""
    if is_held(url):
        name, _, rest = url[len(HELD_SCHEME) :].partition("/")
        root = held_path(HELD_SCHEME + name)
        path = os.path.normpath(os.path.join(root, rest))
        if path != root and not path.startswith(root + os.sep):
            raise UnsafeCheckpointError(f"{url!r} leaves its held-memory root {HELD_SCHEME}{name}")
        return path
    path = url[len("file://") :] if url.startswith("file://") else url
    return os.path.abspath(os.path.expanduser(path))


def normalize_location(url: str) -> str:
    """One spelling per location: an absolute path for local paths and ``file://`` URLs, the URL
    without a trailing slash otherwise."""
    return local_path(url) if is_local(url) else url.rstrip("/")


def base_name(path: str) -> str:
    """The last component of a path or URL (``checkpoint-5`` of ``s3://b/run/checkpoint-5/``)."""
    return path.rstrip("/").rsplit("/", 1)[-1].rsplit(os.sep, 1)[-1]


def check_file_name(name: str, where: str) -> str:
    """Refuse names that could leave the checkpoint directory (``..``, backslashes, absolute).

    A name is a plain file name, or one subdirectory and a plain file name (``3f/model-00001-of-
    00002.safetensors``: the ``spread`` key layout); neither part may be empty, ``.`` or ``..``.
    """
    parts = name.split("/")
    if len(parts) > 2 or any(not part or part in (".", "..") for part in parts) or "\\" in name or "\x00" in name:
        raise UnsafeCheckpointError(f"{where}: file name {name!r} is not a plain name inside the checkpoint")
    return name


def storage_error(action: str, path: str, error: BaseException, code: int | None = None) -> StorageError:
    """A :class:`StorageError` naming the action, the path and the cause.

    A missing file or object (a ``FileNotFoundError`` cause, or ``code`` ENOENT) gives a
    :class:`MissingFileError`, so every backend reports it the same way.
    """
    missing = code == errno_codes.ENOENT or (code is None and isinstance(error, FileNotFoundError))
    if missing:
        return missing_file(action, path)
    number = code if code is not None else getattr(error, "errno", None) or errno_codes.EIO
    reason = (
        os.strerror(error.errno) if isinstance(error, OSError) and error.errno else str(error) or type(error).__name__
    )
    result = StorageError(number, f"cannot {action} {path}: {reason}")
    result.filename = path
    return result


def missing_file(action: str, path: str) -> MissingFileError:
    """The :class:`MissingFileError` every backend raises when ``path`` does not exist."""
    what = "no such object" if "://" in path and not path.startswith("file://") else "no such file or directory"
    result = MissingFileError(errno_codes.ENOENT, f"cannot {action} {path}: {what}")
    result.filename = path
    return result


class RangeReader(Protocol):
    """An open file that serves byte ranges (what :meth:`RangeReading.open_reader` returns).

    ``size`` is the file's length when it was opened.  Reads are absolute (no cursor), so one
    reader may serve several threads.  A range past ``size`` raises :class:`StorageError`
    (``EIO``); a zero-length range reads nothing and succeeds.
    """

    size: int

    def read_into(self, offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` with the bytes at ``offset``."""
        ...

    def read_many(self, requests: Sequence[tuple[int, memoryview]]) -> None:
        """Fill every ``(offset, buffer)``; backends may merge neighbouring ranges into one read."""
        ...

    def read(self, offset: int, length: int) -> bytes:
        """The ``length`` bytes at ``offset``."""
        ...

    def close(self) -> None:
        """Release the file; reads after this are undefined."""
        ...


def read_chunks(reader: RangeReader, size: int, chunk_size: int = 16 * 1024 * 1024) -> Iterator[memoryview]:
    """The first ``size`` bytes of an open file, in order, through one reused buffer (each chunk
    is valid until the next one is read)."""
    buffer = memoryview(bytearray(min(chunk_size, max(size, 1))))
    for start in range(0, size, len(buffer)):
        chunk = buffer[: min(len(buffer), size - start)]
        reader.read_into(start, chunk)
        yield chunk


@runtime_checkable
class ObjectWriter(Protocol):
    """Writing files.  Paths are full paths or URLs built with :meth:`Storage.join`.

    Call order in a save (who calls each step):

    1. ``makedirs(directory)``: the coordinator, before anything is written into a checkpoint
       directory (the staging directory on local disk).  A no-op where directories do not exist.
    2. ``write_view(path, view, ...)``: the writer process (or the in-process writer for
       ``memory://``) of every rank, once per shard file it owns whole, streamed from the staging
       arena.  It polls ``should_stop()`` between chunks: when it turns true the partial file is
       removed and :class:`Stopped` is raised.  On any failure no partial file is left behind.
    3. ``write_at(path, offset, view, ...)``: the writer process of every rank whose tensors
       share one file with other ranks, each at its own offset (no truncation).  Only where
       ``supports_write_at`` is true; elsewhere it raises :class:`~ckptd.errors.ConfigError`,
       and planners must give every file a single writer (``write_view``).
    4. ``write_bytes(path, data)``: the coordinator, for indexes and the state file; then
       ``write_bytes(manifest, create_only=...)`` last (see :class:`Publishing`).  With
       ``create_only`` the write is refused with :class:`~ckptd.errors.CheckpointExistsError`
       when ``path`` already exists, atomically where the store can.
    5. ``write_stream(path, pieces)``: tools and the functional API, for a file produced piece by
       piece (consolidation, HF shards); the file appears whole or not at all.  Returns the bytes
       written.
    6. ``copy_file(source, target, fsync=...)``: the writer process of an incremental save, for a file the
       save reuses from the last committed checkpoint: ``target`` (a new name in the checkpoint
       being written) gets exactly the bytes of ``source`` without them passing through this
       process where the store can: a hard link on local disk (a copy where links fail, e.g.
       across devices), a server-side copy on object stores.  Returns how: ``"link"``,
       ``"copy"`` or ``"server_copy"``.  A missing ``source`` raises
       :class:`~ckptd.errors.MissingFileError`.

    Writes never modify an existing file's bytes in place except ``write_at`` into a file of the
    save being written: a checkpoint's files may be hard links shared with other checkpoints, so
    rewriting a name replaces it with a new file instead of truncating the one it names.

    Failures are :class:`~ckptd.errors.StorageError` naming the path.
    """

    supports_write_at: bool

    def makedirs(self, path: str) -> None: ...

    def write_view(
        self,
        path: str,
        view: memoryview,
        *,
        fsync: bool,
        chunk_size: int,
        should_stop: Callable[[], bool],
        on_progress: Callable[[int], None],
    ) -> None: ...

    def write_at(
        self,
        path: str,
        offset: int,
        view: memoryview,
        *,
        fsync: bool,
        chunk_size: int,
        should_stop: Callable[[], bool],
        on_progress: Callable[[int], None],
    ) -> None: ...

    def write_bytes(self, path: str, data: bytes, *, fsync: bool = True, create_only: bool = False) -> None: ...

    def write_stream(self, path: str, pieces: Iterable[memoryview]) -> int: ...

    def copy_file(self, source: str, target: str, *, fsync: bool = True) -> str: ...


@runtime_checkable
class RangeReading(Protocol):
    """Reading files, whole or by byte range.

    Call order in a load (every rank calls these for what it needs):

    1. ``read_bytes(manifest)`` then ``read_bytes`` of the state file and indexes: small files,
       whole.
    2. ``sizes(directory)``: once per checkpoint directory, to check every file's length against
       the manifest before reading it.
    3. ``open_reader(path)`` per shard file, then ``read_many`` / ``read_into`` for the byte
       ranges of the tensors wanted, then ``close()``.
    ``size(path)`` answers for one file.

    Object stores have no directory to hold open, so a load pins its version with
    ``version(manifest)``: once before step 1 and again after the reads of step 3 (before any
    value is handed back); a different answer, or a missing manifest, means the checkpoint was
    replaced meanwhile (:class:`~ckptd.errors.CheckpointReplacedError`).  ``version`` is a stamp
    of the object's current version (ETag, generation, version id, modification time: whatever
    the store gives; ``None`` where it gives nothing); it is asked of the store, never of a cache.
    Local loads open the directory once instead (:class:`~ckptd.storage.local_read.PinnedDirectory`).

    A missing file raises :class:`~ckptd.errors.MissingFileError` (a ``FileNotFoundError``)
    from ``read_bytes``, ``size``, ``version`` and ``open_reader`` alike; other failures are
    :class:`~ckptd.errors.StorageError`.  ``sizes`` of a missing directory is empty.
    """

    def open_reader(self, path: str) -> RangeReader: ...

    def read_bytes(self, path: str) -> bytes: ...

    def size(self, path: str) -> int: ...

    def sizes(self, path: str) -> dict[str, int]: ...

    def version(self, path: str) -> str | None: ...


@runtime_checkable
class Publishing(Protocol):
    """Making a written checkpoint visible, whole or not at all.

    Call order (the coordinator only, after every rank's files are written):

    1. Object stores (``local`` false), before any shard is written: a create-only claim object
       in the final directory (``ObjectWriter.write_bytes(..., create_only=True)``), so a second
       writer of the same step fails before it writes a byte.
    2. ``write_bytes(manifest, create_only=...)``: the manifest is written last.  On object
       stores this is the commit point: a prefix without a manifest is not a checkpoint.
    3. ``publish_directory(staging, final)``: on local disk, fsync the staging directory, rename
       it to ``final`` and fsync the parent (the commit point), refusing with
       :class:`~ckptd.errors.CheckpointExistsError` if ``final`` exists.  Object stores write in
       place: ``staging`` must equal ``final`` and nothing happens, else
       :class:`~ckptd.errors.ConfigError`.
    """

    def publish_directory(self, staging: str, final: str) -> None: ...


@runtime_checkable
class Listing(Protocol):
    """Finding what exists.

    Called by the catalog (listing checkpoints: ``list_names(root)``, then a manifest read per
    ``checkpoint-<step>`` name), the loader (``exists`` for a path given by the user) and the
    garbage collector.  ``list_names`` returns the sorted names directly under a directory or
    prefix (files and subdirectories alike), fresh from the store (never from a listing cache);
    a missing directory, or a path that is a file, lists as empty.
    """

    def exists(self, path: str) -> bool: ...

    def list_names(self, path: str) -> list[str]: ...


@runtime_checkable
class Deleting(Protocol):
    """Removing files.  Removing what is already gone succeeds (every call is idempotent).

    1. ``remove(path)``: one file (retention removes a checkpoint's manifest first, so it stops
       being a checkpoint at once).
    2. ``remove_tree(path)``: a directory or prefix and everything in it (retention, garbage
       collection, a replaced checkpoint).
    3. ``discard(path)``: after a failed save, by the coordinator's clean-up (retried in the
       background while the store is unreachable) or the writer process: what ``remove_tree``
       does, and on object stores also aborts unfinished multipart uploads under ``path``.
    """

    def remove(self, path: str) -> None: ...

    def remove_tree(self, path: str) -> None: ...

    def discard(self, path: str) -> None: ...


@runtime_checkable
class Storage(ObjectWriter, RangeReading, Publishing, Listing, Deleting, Protocol):
    """Everything ckptd needs from a store: the union of the five protocols above, plus naming.

    ``local`` is true for POSIX files (staging directory renamed into place) and false for object
    stores (written in place, committed by a create-only manifest).  ``join`` builds paths;
    ``check_access(root)`` is called once by the coordinator before any staging work and raises
    :class:`~ckptd.errors.StorageError` naming the root and the cause (missing bucket, denied).

    Save, in order: ``check_access`` → ``Publishing`` step 1 (object stores) → ``ObjectWriter``
    steps 1-4 → ``Publishing`` steps 2-3; on failure ``Deleting.discard(directory)``.
    Load: the ``RangeReading`` steps, after ``Listing`` found the checkpoint.
    """

    local: bool

    def join(self, *parts: str) -> str: ...

    def check_access(self, path: str) -> None: ...


class Stopped(Exception):
    """``write_view`` noticed ``should_stop()``; the partial object was removed."""
