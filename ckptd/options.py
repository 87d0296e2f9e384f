"""Tunables: defaults, explicit arguments and ``CKPTD_*`` environment overrides.

Each tunable has a ``DEFAULT_*`` constant, an argument that wins when given, and at most one
environment variable that wins over the default.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError
from .storage.base import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_PART_CONCURRENCY,
    DEFAULT_PART_SIZE,
    DEFAULT_READ_TIMEOUT,
    DEFAULT_RETRY_ATTEMPTS,
    MIN_PART_SIZE,
    StorageTuning,
)

__all__ = [
    "KEY_LAYOUTS",
    "STAGING_MODES",
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_MAX_IN_FLIGHT",
    "DEFAULT_MAX_SHARD_SIZE",
    "DEFAULT_WRITER_START_TIMEOUT",
    "CheckpointerOptions",
    "check_staging",
    "parse_size",
]

DEFAULT_MAX_SHARD_SIZE = 2 * 1000**3  # "2GB", as HF counts it
DEFAULT_CHUNK_SIZE = 16 * 1024**2
DEFAULT_MAX_IN_FLIGHT = 1
MIN_STREAM_CHUNKS = 4
"""``staging_memory`` holds at least this many write chunks (``chunk_size``, and ``part_size`` on
object stores): the copy and the writer then always find room to work in (ckptd.save.streamed)."""
DEFAULT_WRITER_START_TIMEOUT = 60.0
DEFAULT_WRITE_THREADS = 1
DEFAULT_REMOTE_WRITE_THREADS = 4
DEFAULT_CLEANUP_TIMEOUT = 60.0
DEFAULT_WRITER_NICE = 10
DEFAULT_WRITER_IONICE = 7  # best-effort class, lowest priority
DEFAULT_DIST_TIMEOUT = 600.0
DEFAULT_HOLD_AFTER_EXIT = 300.0  # seconds a held-memory root (shm://NAME) outlives its last trainer
DEFAULT_HELD_KEEP_LAST = 2  # keep_last of a held-memory root when none is given: memory is finite

# async_save's staging modes: when it returns, and whether the writer starts during the copy.
STAGING_MODES = ("blocking", "pipelined", "background")

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


def check_staging(mode: str) -> str:
    """``mode`` if it is one of :data:`STAGING_MODES`, else a :class:`ConfigError`."""
    if mode not in STAGING_MODES:
        raise ConfigError(f"staging must be one of {', '.join(map(repr, STAGING_MODES))}; got {mode!r}")
    return mode


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


_DURATION_UNITS = {"": 1.0, "s": 1.0, "sec": 1.0, "min": 60.0, "m": 60.0, "h": 3600.0}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_duration(value: float | str, what: str = "duration") -> float:
    """Turn ``300``, ``"90s"``, ``"5min"`` or ``"1h"`` into seconds (zero allowed)."""
    if isinstance(value, bool):
        raise ConfigError(f"{what} must be seconds or a string like '5min', got {value!r}")
    if isinstance(value, (int, float)):
        if value >= 0 and value == value and value != float("inf"):
            return float(value)
    elif isinstance(value, str):
        match = _DURATION_RE.match(value)
        if match and match.group(2).lower() in _DURATION_UNITS:
            return float(match.group(1)) * _DURATION_UNITS[match.group(2).lower()]
    raise ConfigError(f"{what} must be seconds >= 0 or a string like '90s', '5min', '1h', got {value!r}")


KEY_LAYOUTS = ("flat", "spread")
"""The values of ``CheckpointerOptions.key_layout``."""

_ENV_SIZES = {
    "max_shard_size": "CKPTD_MAX_SHARD_SIZE",
    "chunk_size": "CKPTD_CHUNK_SIZE",
    "max_in_flight": "CKPTD_MAX_IN_FLIGHT",
    "write_threads": "CKPTD_WRITE_THREADS",
    "part_size": "CKPTD_PART_SIZE",
    "part_concurrency": "CKPTD_PART_CONCURRENCY",
    "retry_attempts": "CKPTD_RETRY_ATTEMPTS",
    "staging_memory": "CKPTD_STAGING_MEMORY",
}
_ENV_SECONDS = {
    "writer_start_timeout": "CKPTD_WRITER_START_TIMEOUT",
    "cleanup_timeout": "CKPTD_CLEANUP_TIMEOUT",
    "dist_timeout": "CKPTD_DIST_TIMEOUT",
    "connect_timeout": "CKPTD_CONNECT_TIMEOUT",
    "read_timeout": "CKPTD_READ_TIMEOUT",
}


@dataclass(frozen=True)
class CheckpointerOptions:
    """Every setting of one :class:`ckptd.Checkpointer`, validated when built.

    ``CheckpointerOptions()`` holds the ``DEFAULT_*`` values; :meth:`from_env` lets ``CKPTD_*``
    environment variables replace defaults; ``Checkpointer(root, options, **overrides)`` and
    :meth:`with_overrides` let explicit values win over both.  Sizes may be given as bytes or as
    strings (``"2GB"`` decimal like HF, ``"512MiB"`` binary) and are stored as ints.

    Layout and durability:
        ``max_shard_size``: largest shard file (``CKPTD_MAX_SHARD_SIZE``).
        ``fsync``: make files durable before committing (local storage).
        ``keep_last``: keep only this many newest checkpoints (older ones are deleted after a commit;
        this run's own saves count as the newest, in the order it made them).
        ``allow_pickle``: allow arbitrary objects in the state (pickled); loading needs it too.
        ``incremental``: do not rewrite unchanged files of the previous save (``True``: files of
        frozen tensors; ``"hash"``: also any file whose SHA-256 the writer finds unchanged): each
        checkpoint still holds all its files, hard-linked on local disk (copied where links
        fail), copied server-side on object stores, so any checkpoint can be deleted, moved or
        read by HF tools on its own.  Disk use: linked files cost their bytes once, however many
        checkpoints hold them; ``keep_last=N`` keeps exactly N checkpoints.
        ``key_layout``: where shard files go in a checkpoint directory: ``"flat"`` (beside the
        manifest, HF's layout) or ``"spread"`` (under a two-hex-digit subdirectory hashed from
        the file name, ``checkpoint-N/3f/model-00001-of-00008.safetensors``), so many writers on
        one object-store bucket spread their requests over many key prefixes.  Every loader
        reads both (the manifest and the HF index record the relative paths).
    Staging and the writer process:
        ``staging``: default mode of ``async_save``: ``"blocking"`` (returns after the copy; the
        writer starts once the copy is over, so the copy has the CPU and memory to itself),
        ``"pipelined"`` (returns after the copy; the writer writes the first chunks while the
        copy goes on: sooner committed, a longer stall where the two compete) or
        ``"background"`` (returns at once; the copy runs beside training, pipelined).
        ``max_in_flight``: staging arenas, i.e. saves that may be staged while earlier ones are
        still being written (``CKPTD_MAX_IN_FLIGHT``); beyond it ``async_save`` waits.
        ``staging_memory``: the most host memory all staging arenas together may hold
        (``CKPTD_STAGING_MEMORY``, e.g. ``"4GiB"``; ``None``: the state's size per save in
        flight).  A save whose bytes do not fit streams through one arena of this size: the
        copy fills it as the writer frees it (:mod:`ckptd.save.streamed`), so ``async_save``
        returns once all but the last ``staging_memory`` bytes are written (``"background"``
        staging: at once, and the next optimizer step waits instead).  At least four times
        ``chunk_size`` (and ``part_size`` on object stores).
        ``write_threads``: files the writer writes at once (``CKPTD_WRITE_THREADS``; ``None``:
        1 for local storage, 4 for object stores).
        ``chunk_size``: bytes per write call in the writer (``CKPTD_CHUNK_SIZE``).
        ``writer_start_timeout``: seconds to wait for the writer's handshake.
        ``writer_nice``: CPU niceness increment of the writer (default 10: when training keeps
        the cores busy the writer yields; on idle cores it runs at full speed).
        ``writer_ionice``: best-effort I/O priority of the writer (0 highest, 7 lowest; ``None``: leave).
        ``throttle``: adaptive I/O throttle, on by default (``False`` or ``CKPTD_THROTTLE=0``
        turns it off): while a save is written, training steps are timed (optimizer steps, or
        ``mark_step()``) and the writer slows down while they are more than 10% slower than
        without a save (see :mod:`ckptd.save.throttle`).  Nothing is slowed while nobody trains.
        ``direct_io``: write local files with ``O_DIRECT`` (falls back to buffered writes where
        the filesystem refuses it).  ``drop_cache``: drop written files from the page cache once durable.
    Object stores:
        ``storage_options``: passed to fsspec unchanged (endpoint, credentials...).
        ``part_size`` (``CKPTD_PART_SIZE``), ``part_concurrency`` (parts in flight per save,
        ``CKPTD_PART_CONCURRENCY``), ``retry_attempts`` (tries per request, ``CKPTD_RETRY_ATTEMPTS``).
        ``connect_timeout`` (``CKPTD_CONNECT_TIMEOUT``, default 5 s) and ``read_timeout``
        (``CKPTD_READ_TIMEOUT``, default 15 s) bound every try of a request: opening the
        connection, and the silence of a peer that neither answers nor takes the bytes sent, so a
        frozen endpoint fails within ``retry_attempts * (connect_timeout + read_timeout)`` (2
        minutes by default) plus the backoff.  A client config given in ``storage_options``
        (``config_kwargs`` for S3, ``requests_timeout`` for GCS) wins.
        ``cache_dir``: local directory caching files of remote checkpoints read by ``load``.
        ``cleanup_timeout``: seconds ``close()`` keeps retrying removal of failed saves' leftovers.
    Distributed:
        ``coordinator_rank``: the rank that commits.  ``dist_timeout``: seconds any rank waits for
        another during a save, including the check-in before its collectives: a rank that does not
        arrive in time is named in a ``DistributedSaveError`` on every rank (``CKPTD_DIST_TIMEOUT``).
        ``no_dist``: save from this process alone even under torch.distributed (as DCP's ``no_dist``).
    Held-memory roots (``shm://NAME``, see :mod:`ckptd.writer.keeper`):
        ``hold_after_exit``: how long the root's checkpoints are kept in memory once no process
        uses it any longer (the trainer closed, crashed or was killed), so that a restarted
        trainer restores from memory: seconds, or a string such as ``"90s"``, ``"5min"``, ``"1h"``
        (``CKPTD_HOLD_AFTER_EXIT``; default 5 minutes; 0: released as soon as the last user is gone).
    """

    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE
    fsync: bool = True
    keep_last: int | None = None
    allow_pickle: bool = False
    incremental: bool | str = False
    key_layout: str = "flat"
    staging: str = "blocking"
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    staging_memory: int | str | None = None
    write_threads: int | None = None
    chunk_size: int | str = DEFAULT_CHUNK_SIZE
    writer_start_timeout: float = DEFAULT_WRITER_START_TIMEOUT
    writer_nice: int = DEFAULT_WRITER_NICE
    writer_ionice: int | None = DEFAULT_WRITER_IONICE
    throttle: bool = True
    direct_io: bool = True
    drop_cache: bool = True
    storage_options: dict[str, Any] = field(default_factory=dict)
    part_size: int | str = DEFAULT_PART_SIZE
    part_concurrency: int = DEFAULT_PART_CONCURRENCY
    retry_attempts: int = DEFAULT_RETRY_ATTEMPTS
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    read_timeout: float = DEFAULT_READ_TIMEOUT
    cache_dir: str | None = None
    cleanup_timeout: float = DEFAULT_CLEANUP_TIMEOUT
    coordinator_rank: int = 0
    dist_timeout: float = DEFAULT_DIST_TIMEOUT
    no_dist: bool = False
    hold_after_exit: float | str = DEFAULT_HOLD_AFTER_EXIT

    def __post_init__(self) -> None:
        object.__setattr__(self, "hold_after_exit", parse_duration(self.hold_after_exit, "hold_after_exit"))
        for name in ("max_shard_size", "chunk_size", "part_size"):
            object.__setattr__(self, name, parse_size(getattr(self, name), name))
        if self.staging_memory is not None:
            object.__setattr__(self, "staging_memory", parse_size(self.staging_memory, "staging_memory"))
        object.__setattr__(self, "storage_options", dict(self.storage_options or {}))
        if self.cache_dir is not None:
            object.__setattr__(self, "cache_dir", os.fspath(self.cache_dir))
        check_staging(self.staging)
        if self.incremental not in (False, True, "hash"):
            raise ConfigError(f"incremental must be False, True or 'hash', got {self.incremental!r}")
        if self.key_layout not in KEY_LAYOUTS:
            raise ConfigError(f"key_layout must be one of {', '.join(map(repr, KEY_LAYOUTS))}, got {self.key_layout!r}")
        if self.part_bytes < MIN_PART_SIZE:
            raise ConfigError(f"part_size must be at least 5 MiB (the S3 minimum), got {self.part_size}")
        if self.part_concurrency < 1 or self.retry_attempts < 1:
            raise ConfigError("part_concurrency and retry_attempts must be >= 1")
        if self.max_in_flight < 1:
            raise ConfigError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        if self.staging_memory is not None and int(self.staging_memory) < MIN_STREAM_CHUNKS * self.chunk_bytes:
            raise ConfigError(
                f"staging_memory must be at least {MIN_STREAM_CHUNKS} x chunk_size "
                f"({MIN_STREAM_CHUNKS * self.chunk_bytes} bytes), got {self.staging_memory}: "
                "raise it or lower chunk_size"
            )
        if self.write_threads is not None and self.write_threads < 1:
            raise ConfigError(f"write_threads must be >= 1, got {self.write_threads}")
        if self.keep_last is not None and self.keep_last < 1:
            raise ConfigError(f"keep_last must be >= 1 or None, got {self.keep_last}")
        if self.writer_ionice is not None and not 0 <= self.writer_ionice <= 7:
            raise ConfigError(f"writer_ionice must be 0..7 or None, got {self.writer_ionice}")
        if self.dist_timeout <= 0 or self.writer_start_timeout <= 0:
            raise ConfigError("dist_timeout and writer_start_timeout must be positive")
        if not (self.connect_timeout > 0 and self.read_timeout > 0):
            raise ConfigError(
                f"connect_timeout and read_timeout must be positive seconds, got "
                f"{self.connect_timeout!r} and {self.read_timeout!r}"
            )

    @property
    def shard_bytes(self) -> int:
        """``max_shard_size`` in bytes (the size fields hold ints once the options are built)."""
        return int(self.max_shard_size)

    @property
    def chunk_bytes(self) -> int:
        """``chunk_size`` in bytes."""
        return int(self.chunk_size)

    @property
    def staging_budget(self) -> int | None:
        """``staging_memory`` in bytes (``None``: no budget)."""
        return None if self.staging_memory is None else int(self.staging_memory)

    @property
    def part_bytes(self) -> int:
        """``part_size`` in bytes."""
        return int(self.part_size)

    @classmethod
    def from_env(cls, **overrides: Any) -> CheckpointerOptions:
        """Defaults, replaced by the ``CKPTD_*`` variables that are set, replaced by ``overrides``."""
        values: dict[str, Any] = {}
        for name, variable in _ENV_SIZES.items():
            raw = os.environ.get(variable)
            if raw:
                values[name] = parse_size(raw, variable)
        for name, variable in _ENV_SECONDS.items():
            raw = os.environ.get(variable)
            if raw:
                values[name] = _parse_seconds(raw, variable)
        raw = os.environ.get("CKPTD_HOLD_AFTER_EXIT")
        if raw:
            values["hold_after_exit"] = parse_duration(raw, "CKPTD_HOLD_AFTER_EXIT")
        raw = os.environ.get("CKPTD_THROTTLE")
        if raw:
            values["throttle"] = _parse_flag(raw, "CKPTD_THROTTLE")
        return cls().with_overrides(**values).with_overrides(**overrides)

    def with_overrides(self, **overrides: Any) -> CheckpointerOptions:
        """A copy with ``overrides`` applied (``None`` keeps the current value); unknown names
        are a :class:`~ckptd.errors.ConfigError` naming the valid ones."""
        unknown = sorted(set(overrides) - _FIELD_NAMES)
        if unknown:
            raise ConfigError(f"unknown Checkpointer option(s) {unknown}; valid options: {sorted(_FIELD_NAMES)}")
        given = {k: v for k, v in overrides.items() if v is not None or k in _NONE_IS_A_VALUE}
        return dataclasses.replace(self, **given) if given else self

    def for_location(self, remote: bool) -> CheckpointerOptions:
        """These options with the per-storage defaults filled in (``write_threads``)."""
        if self.write_threads is not None:
            return self
        threads = DEFAULT_REMOTE_WRITE_THREADS if remote else DEFAULT_WRITE_THREADS
        return dataclasses.replace(self, write_threads=threads)

    @property
    def tuning(self) -> StorageTuning:
        """The storage backends' share of these options."""
        return StorageTuning(
            part_size=int(self.part_size),
            part_concurrency=self.part_concurrency,
            retry_attempts=self.retry_attempts,
            connect_timeout=float(self.connect_timeout),
            read_timeout=float(self.read_timeout),
            direct_io=self.direct_io,
            drop_cache=self.drop_cache,
        )


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(CheckpointerOptions))
# Options whose explicit None means something (not "keep the current value").
_NONE_IS_A_VALUE = frozenset({"writer_ionice"})


def _parse_seconds(raw: str, variable: str) -> float:
    try:
        value = float(raw)
    except ValueError as e:
        raise ConfigError(f"{variable} must be a number of seconds, got {raw!r}") from e
    if not value > 0:
        raise ConfigError(f"{variable} must be positive, got {raw!r}")
    return value


def _parse_flag(raw: str, variable: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{variable} must be 1/0, true/false, yes/no or on/off, got {raw!r}")
