"""What every storage backend offers, and the helpers they share.

This module imports nothing heavy: the writer process uses it too.
"""

from __future__ import annotations

import errno as errno_codes
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from ..errors import StorageError, UnsafeCheckpointError

__all__ = [
    "DEFAULT_PART_CONCURRENCY",
    "DEFAULT_PART_SIZE",
    "DEFAULT_RETRY_ATTEMPTS",
    "MAX_PARTS",
    "MIN_PART_SIZE",
    "RangeReader",
    "Storage",
    "StorageTuning",
    "check_file_name",
    "read_chunks",
    "is_local",
    "local_path",
    "storage_error",
]

DEFAULT_PART_SIZE = 16 * 1024 * 1024
DEFAULT_PART_CONCURRENCY = 8  # parts in flight across all files of one save
DEFAULT_RETRY_ATTEMPTS = 6
MIN_PART_SIZE = 5 * 1024 * 1024
MAX_PARTS = 10_000


@dataclass(frozen=True)
class StorageTuning:
    """I/O knobs.

    Object stores: ``part_size`` is a floor (a file too large for ``MAX_PARTS`` parts of that
    size uses larger parts); ``part_concurrency`` bounds the parts in flight across all files of a
    save; ``retry_attempts`` counts every try of one request (parts are retried one by one),
    delays growing from ``retry_base_delay`` doubling up to ``retry_max_delay``, with full jitter.

    Local files: ``direct_io`` writes with ``O_DIRECT`` (bypassing the page cache, where the
    filesystem supports it); ``drop_cache`` tells the kernel to drop a file's cached pages once
    it is durable, so a save does not push the training job's memory out of the page cache.
    """

    part_size: int = DEFAULT_PART_SIZE
    part_concurrency: int = DEFAULT_PART_CONCURRENCY
    retry_attempts: int = DEFAULT_RETRY_ATTEMPTS
    retry_base_delay: float = 0.2
    retry_max_delay: float = 5.0
    direct_io: bool = True
    drop_cache: bool = True

    def part_size_for(self, size: int) -> int:
        """The part size for a file of ``size`` bytes: ≥ 5 MiB, ≥ ``part_size``, ≤ 10,000 parts."""
        needed = -(-size // MAX_PARTS)
        mib = 1024 * 1024
        return max(MIN_PART_SIZE, self.part_size, -(-needed // mib) * mib)


def is_local(url: str) -> bool:
    """True for plain paths and ``file://`` URLs."""
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> str:
    """The absolute filesystem path of a local path or ``file://`` URL."""
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
    """Refuse names that could leave the checkpoint directory (``..``, separators, absolute)."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\x00" in name:
        raise UnsafeCheckpointError(f"{where}: file name {name!r} is not a plain name inside the checkpoint")
    return name


def storage_error(action: str, path: str, error: BaseException, code: int | None = None) -> StorageError:
    """A :class:`StorageError` naming the action, the path and the cause."""
    number = code if code is not None else getattr(error, "errno", None) or errno_codes.EIO
    reason = (
        os.strerror(error.errno) if isinstance(error, OSError) and error.errno else str(error) or type(error).__name__
    )
    result = StorageError(number, f"cannot {action} {path}: {reason}")
    result.filename = path
    return result


class RangeReader(Protocol):
    """An open file that serves byte ranges."""

    size: int

    def read_into(self, offset: int, buffer: memoryview) -> None: ...

    def read_many(self, requests: Sequence[tuple[int, memoryview]]) -> None: ...

    def read(self, offset: int, length: int) -> bytes: ...

    def close(self) -> None: ...


def read_chunks(reader: RangeReader, size: int, chunk_size: int = 16 * 1024 * 1024) -> Iterator[memoryview]:
    """The first ``size`` bytes of an open file, in order, through one reused buffer (each chunk
    is valid until the next one is read)."""
    buffer = memoryview(bytearray(min(chunk_size, max(size, 1))))
    for start in range(0, size, len(buffer)):
        chunk = buffer[: min(len(buffer), size - start)]
        reader.read_into(start, chunk)
        yield chunk


class Storage(Protocol):
    """Operations ckptd needs from a store.  Paths are full paths or URLs built with ``join``.

    Save-side call order (the writer and the commit use it so):
    1. ``check_access(root)`` once, before any staging work.
    2. ``makedirs`` / ``write_view`` for every shard (writer process), then ``write_bytes`` for
       indexes and state (commit), then ``write_bytes(manifest, create_only=...)`` last.
    3. ``publish_directory`` (local rename; a no-op on object stores).
    4. On failure, ``discard(directory)`` removes whatever was written (and, on object stores,
       aborts unfinished multipart uploads).
    """

    local: bool

    def join(self, *parts: str) -> str: ...

    def check_access(self, path: str) -> None: ...

    def exists(self, path: str) -> bool: ...

    def list_names(self, path: str) -> list[str]: ...

    def sizes(self, path: str) -> dict[str, int]: ...

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

    def open_reader(self, path: str) -> RangeReader: ...

    def write_bytes(self, path: str, data: bytes, *, fsync: bool = True, create_only: bool = False) -> None: ...

    def write_stream(self, path: str, pieces: Iterable[memoryview]) -> int: ...

    def read_bytes(self, path: str) -> bytes: ...

    def size(self, path: str) -> int: ...

    def remove(self, path: str) -> None: ...

    def remove_tree(self, path: str) -> None: ...

    def discard(self, path: str) -> None: ...

    def publish_directory(self, staging: str, final: str) -> None: ...


class Stopped(Exception):
    """``write_view`` noticed ``should_stop()``; the partial object was removed."""
