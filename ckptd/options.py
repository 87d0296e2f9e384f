"""Tunables: defaults, explicit arguments and ``CKPTD_*`` environment overrides.

Each tunable has a ``DEFAULT_*`` constant, an argument that wins when given, and at most one
environment variable that wins over the default.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError
from .storage.base import (
    DEFAULT_PART_CONCURRENCY,
    DEFAULT_PART_SIZE,
    DEFAULT_RETRY_ATTEMPTS,
    MIN_PART_SIZE,
    StorageTuning,
)

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_MAX_IN_FLIGHT",
    "DEFAULT_MAX_SHARD_SIZE",
    "DEFAULT_WRITER_START_TIMEOUT",
    "CheckpointerOptions",
    "parse_size",
]

DEFAULT_MAX_SHARD_SIZE = 2 * 1000**3  # "2GB", as HF counts it
DEFAULT_CHUNK_SIZE = 16 * 1024**2
DEFAULT_MAX_IN_FLIGHT = 1
DEFAULT_WRITER_START_TIMEOUT = 60.0
DEFAULT_WRITE_THREADS = 1
DEFAULT_REMOTE_WRITE_THREADS = 4
DEFAULT_CLEANUP_TIMEOUT = 60.0

_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
    "KIB": 1024,
    "MIB": 1024**2,
    "GIB": 1024**3,
    "TIB": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*$", re.IGNORECASE)


def parse_size(value: int | str, what: str = "size") -> int:
    """Turn ``2**31``, ``"2GB"`` (decimal, like HF) or ``"512MiB"`` (binary) into bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"{what} must be an int or a string like '2GB', got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ConfigError(f"{what} must be positive, got {value}")
        return value
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match:
            number, unit = match.groups()
            size = int(float(number) * _SIZE_UNITS[(unit or "").upper()])
            if size > 0:
                return size
    raise ConfigError(f"{what} must be a positive int or a string like '2GB' or '512MiB', got {value!r}")


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    return parse_size(raw, name)


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError as e:
        raise ConfigError(f"{name} must be a number, got {raw!r}") from e


@dataclass(frozen=True)
class CheckpointerOptions:
    """Resolved settings of one :class:`ckptd.Checkpointer`.

    ``chunk_size``: bytes per write call in the writer (``CKPTD_CHUNK_SIZE``).
    ``max_in_flight``: staging arenas, i.e. saves that may be staged while earlier ones are still
    being written (``CKPTD_MAX_IN_FLIGHT``); beyond it ``async_save`` waits (back-pressure).
    ``write_threads``: files the writer writes at once (``CKPTD_WRITE_THREADS``).
    ``writer_start_timeout``: seconds to wait for the writer's handshake.
    ``tuning``: object-store part size (``CKPTD_PART_SIZE``), parts in flight per file
    (``CKPTD_PART_CONCURRENCY``) and attempts per request (``CKPTD_RETRY_ATTEMPTS``).
    ``cache_dir``: local directory caching files of remote checkpoints read by ``load``.
    ``incremental``: reuse unchanged files of the previous save (``True``: files of frozen
    tensors; ``"hash"``: also any file whose CRC32C the writer finds unchanged).
    """

    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE
    chunk_size: int = DEFAULT_CHUNK_SIZE
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    write_threads: int = DEFAULT_WRITE_THREADS
    writer_start_timeout: float = DEFAULT_WRITER_START_TIMEOUT
    fsync: bool = True
    keep_last: int | None = None
    allow_pickle: bool = False
    storage_options: dict[str, Any] = field(default_factory=dict)
    tuning: StorageTuning = field(default_factory=StorageTuning)
    cache_dir: str | None = None
    cleanup_timeout: float = DEFAULT_CLEANUP_TIMEOUT
    staging: str = "blocking"
    incremental: bool | str = False

    @classmethod
    def resolve(
        cls,
        *,
        max_shard_size: int | str | None = None,
        chunk_size: int | str | None = None,
        max_in_flight: int | None = None,
        write_threads: int | None = None,
        writer_start_timeout: float | None = None,
        fsync: bool = True,
        keep_last: int | None = None,
        allow_pickle: bool = False,
        storage_options: dict[str, Any] | None = None,
        part_size: int | str | None = None,
        part_concurrency: int | None = None,
        retry_attempts: int | None = None,
        cache_dir: str | None = None,
        remote: bool = False,
        staging: str = "blocking",
        direct_io: bool = True,
        drop_cache: bool = True,
        incremental: bool | str = False,
    ) -> CheckpointerOptions:
        """Combine explicit arguments (which win), ``CKPTD_*`` variables and defaults."""
        resolved_in_flight = (
            max_in_flight if max_in_flight is not None else _env_int("CKPTD_MAX_IN_FLIGHT", DEFAULT_MAX_IN_FLIGHT)
        )
        resolved_threads = (
            write_threads
            if write_threads is not None
            else _env_int("CKPTD_WRITE_THREADS", DEFAULT_REMOTE_WRITE_THREADS if remote else DEFAULT_WRITE_THREADS)
        )
        tuning = StorageTuning(
            part_size=parse_size(part_size, "part_size")
            if part_size is not None
            else _env_int("CKPTD_PART_SIZE", DEFAULT_PART_SIZE),
            part_concurrency=part_concurrency
            if part_concurrency is not None
            else _env_int("CKPTD_PART_CONCURRENCY", DEFAULT_PART_CONCURRENCY),
            retry_attempts=retry_attempts
            if retry_attempts is not None
            else _env_int("CKPTD_RETRY_ATTEMPTS", DEFAULT_RETRY_ATTEMPTS),
            direct_io=direct_io,
            drop_cache=drop_cache,
        )
        if staging not in ("blocking", "background"):
            raise ConfigError(f"staging must be 'blocking' or 'background', got {staging!r}")
        if incremental not in (False, True, "hash"):
            raise ConfigError(f"incremental must be False, True or 'hash', got {incremental!r}")
        if tuning.part_size < MIN_PART_SIZE:
            raise ConfigError(f"part_size must be at least 5 MiB (the S3 minimum), got {tuning.part_size}")
        if tuning.part_concurrency < 1 or tuning.retry_attempts < 1:
            raise ConfigError("part_concurrency and retry_attempts must be >= 1")
        if resolved_in_flight < 1:
            raise ConfigError(f"max_in_flight must be >= 1, got {resolved_in_flight}")
        if resolved_threads < 1:
            raise ConfigError(f"write_threads must be >= 1, got {resolved_threads}")
        if keep_last is not None and keep_last < 1:
            raise ConfigError(f"keep_last must be >= 1 or None, got {keep_last}")
        return cls(
            max_shard_size=parse_size(max_shard_size, "max_shard_size")
            if max_shard_size is not None
            else _env_int("CKPTD_MAX_SHARD_SIZE", DEFAULT_MAX_SHARD_SIZE),
            chunk_size=parse_size(chunk_size, "chunk_size")
            if chunk_size is not None
            else _env_int("CKPTD_CHUNK_SIZE", DEFAULT_CHUNK_SIZE),
            max_in_flight=resolved_in_flight,
            write_threads=resolved_threads,
            writer_start_timeout=writer_start_timeout
            if writer_start_timeout is not None
            else _env_float("CKPTD_WRITER_START_TIMEOUT", DEFAULT_WRITER_START_TIMEOUT),
            fsync=fsync,
            keep_last=keep_last,
            allow_pickle=allow_pickle,
            storage_options=dict(storage_options or {}),
            tuning=tuning,
            cache_dir=cache_dir,
            cleanup_timeout=_env_float("CKPTD_CLEANUP_TIMEOUT", DEFAULT_CLEANUP_TIMEOUT),
            staging=staging,
            incremental=incremental,
        )
