"""Slower tiers: committed checkpoints copied to other roots in the background, each tier with its
own cadence and retention, and loads that take the newest step from whichever tier holds it.

A :class:`~ckptd.Checkpointer` saves to its root (the fastest tier: every save, ``keep_last``).
Each :class:`Tier` given in ``tiers=[...]`` receives the checkpoints whose step is a multiple of
its ``every``: once a save has committed, :class:`Promoter` (one thread per Checkpointer, on the
coordinator rank) copies the committed files from the root to the tier, checking every byte's
CRC32C against the manifest as it goes, writes the manifest last and publishes the copy as that
tier's ``checkpoint-<step>`` (whole or invisible, as a save: a staging directory renamed on local
disk, a claimed prefix and a create-only manifest on object stores), then applies the tier's
``keep_last``.  Nothing is staged again and training never waits for a promotion: the copy reads
the files the writer committed.  While a checkpoint is being promoted the root's retention keeps
it (:class:`~ckptd.retention.RunRecord` in-use pins).  A crash during a promotion leaves the
tier's previous checkpoints as they were and a staging leftover that ``ckptd gc`` removes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._version import __version__
from .catalog import CheckpointInfo, list_checkpoints, read_manifest
from .errors import CheckpointExistsError, CheckpointReplacedError, ConfigError, CorruptCheckpointError
from .formats.checksum import crc32c, format_crc
from .formats.manifest import MANIFEST_NAME, Manifest
from .formats.names import TIERS_RECORD_NAME, checkpoint_dir_name
from .load.pinning import OneVersion
from .retention import RunRecord, apply_retention
from .save.commit import publish, staging_directory
from .save.file_arena import mapped_staging_file
from .storage import RangeReader, Storage, normalize_location, storage_for
from .storage.held import is_held
from .writer.priority import lower_priority

__all__ = [
    "LoadSource",
    "PromotionResult",
    "Promoter",
    "Tier",
    "committed_steps",
    "promote_checkpoint",
    "record_tiers",
]

logger = logging.getLogger(__name__)

COPY_PIECE = 8 * 1024 * 1024
"""Bytes read from the source and handed to the tier's storage at a time."""


@dataclass(frozen=True)
class Tier:
    """A slower tier of a :class:`~ckptd.Checkpointer`: another root that receives a copy of every
    committed checkpoint whose step is a multiple of ``every``, and keeps the ``keep_last``
    newest of them (``None``: all).

    ``root`` is a path or an fsspec URL (``s3://bucket/run1``); ``storage_options`` are passed to
    fsspec for it (default: none).  Example: ``Tier("s3://bucket/run1", every=1000, keep_last=5)``.
    """

    root: str
    every: int = 1
    keep_last: int | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", os.fspath(self.root))
        if is_held(self.root):
            raise ConfigError(
                f"Tier({self.root!r}): a held-memory root is the fastest tier: give it as the Checkpointer's root "
                "and the slower roots as its tiers"
            )
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ConfigError(f"Tier.every must be a positive number of steps, got {self.every!r}")
        if self.keep_last is not None and (isinstance(self.keep_last, bool) or self.keep_last < 1):
            raise ConfigError(f"Tier.keep_last must be >= 1 or None, got {self.keep_last!r}")
        object.__setattr__(self, "storage_options", dict(self.storage_options or {}))

    def receives(self, step: int | None) -> bool:
        """Whether the checkpoint of ``step`` is promoted to this tier."""
        return step is not None and step % self.every == 0


@dataclass(frozen=True)
class PromotionResult:
    """A finished promotion: the step, the source checkpoint, the tier's copy and its outcome
    (``error`` is ``None`` when the copy was committed; ``removed``: what the tier's retention
    deleted after it)."""

    step: int
    source: str
    path: str
    tier: int
    seconds: float
    bytes_copied: int
    error: BaseException | None = None
    removed: tuple[str, ...] = ()


class _OpenTier:
    """A tier with its storage and its own run timeline (for its retention)."""

    def __init__(self, index: int, tier: Tier) -> None:
        self.index = index
        self.tier = tier
        self.root = normalize_location(tier.root)
        self.storage = storage_for(self.root, tier.storage_options)
        self.run = RunRecord()


class Promoter:
    """Copies committed checkpoints of ``source_root`` to the slower tiers, in commit order, on a
    thread of its own.

    :meth:`submit` is called by the save's completion after the commit, with the root's
    :class:`RunRecord`: the source is pinned there until every tier due has its copy (or failed),
    then ``after_release`` runs on the promoter's thread (the root's ``keep_last``, so that a
    checkpoint kept only for its copy goes now, not at the next commit).
    Failures are logged and kept in :attr:`results`; the next promotion goes on.  :meth:`close`
    waits for the queued promotions, or with ``wait=False`` stops after the file being copied
    (the unfinished copy is discarded).
    """

    def __init__(self, source: Storage, tiers: Sequence[Tier], *, nice: int = 0, ionice: int | None = None) -> None:
        self.source = source
        self._priority = (nice, ionice)
        self.tiers = [_OpenTier(index, tier) for index, tier in enumerate(tiers, start=1)]
        for opened in self.tiers:
            opened.storage.check_access(opened.root)
        self.results: list[PromotionResult] = []
        self.after_release: Callable[[], None] | None = None
        self._queue: queue.Queue[tuple[int, str, RunRecord, bool] | None] = queue.Queue()
        self._stop = threading.Event()
        self._idle = threading.Condition()
        self._queued = 0
        self._thread = threading.Thread(target=self._run, name="ckptd-promote", daemon=True)
        self._thread.start()

    def due(self, step: int | None) -> list[int]:
        """The tiers (numbered from 1) that receive ``step``."""
        return [t.index for t in self.tiers if t.tier.receives(step)]

    def submit(self, step: int | None, path: str, run: RunRecord, overwrite: bool = False) -> bool:
        """Queue the promotion of the committed checkpoint at ``path``; pins it in ``run`` until
        done.  ``overwrite``: the save replaced a checkpoint of that step, and so does its copy
        in each tier (else a tier would keep the older version under the same step).  Returns
        whether any tier receives it."""
        if step is None or not self.due(step) or self._stop.is_set():
            return False
        run.acquire([path])
        with self._idle:
            self._queued += 1
        self._queue.put((step, path, run, overwrite))
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every queued promotion is done; returns False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._queued:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, wait: bool = True) -> None:
        if not wait:
            self._stop.set()
        self._queue.put(None)
        self._thread.join()

    # ---- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        lower_priority(*self._priority, thread=True)  # the copies yield the CPU and the disk to training
        while True:
            item = self._queue.get()
            if item is None:
                return
            step, path, run, overwrite = item
            try:
                for opened in self.tiers:
                    if opened.tier.receives(step) and not self._stop.is_set():
                        self.results.append(self._promote(step, path, opened, overwrite))
            finally:
                run.release([path])
                self._after_release()
                with self._idle:
                    self._queued -= 1
                    self._idle.notify_all()

    def _after_release(self) -> None:
        if self.after_release is None:
            return
        try:
            self.after_release()
        except Exception as e:  # noqa: BLE001 - retention runs again after the next commit
            logger.warning("ckptd: keep_last after a tier copy failed: %s", e)

    def _promote(self, step: int, source: str, opened: _OpenTier, overwrite: bool) -> PromotionResult:
        started = time.perf_counter()
        final = opened.storage.join(opened.root, checkpoint_dir_name(step))

        def outcome(copied: int, error: BaseException | None = None, removed: Sequence[str] = ()) -> PromotionResult:
            return PromotionResult(
                step, source, final, opened.index, time.perf_counter() - started, copied, error, tuple(removed)
            )

        try:
            copied = promote_checkpoint(
                self.source, source, opened.storage, final, overwrite=overwrite, stop=self._stop.is_set
            )
        except (CheckpointExistsError, CheckpointReplacedError, PromotionStopped) as e:
            # The tier holds the step already; the source was overwritten (its replacement's copy
            # follows); close(wait=False).  Nothing was committed, nothing is wrong.
            logger.info("ckptd: step %d not copied to tier %d (%s): %s", step, opened.index, opened.root, e)
            return outcome(0, e)
        except Exception as e:  # noqa: BLE001 - reported; the next promotion goes on
            logger.error("ckptd: promotion of %s to tier %d (%s) failed: %s", source, opened.index, opened.root, e)
            return outcome(0, e)
        opened.run.committed(final)
        removed: list[str] = []
        if opened.tier.keep_last is not None:
            try:
                removed = apply_retention(opened.storage, opened.root, opened.tier.keep_last, opened.run)
            except Exception as e:  # noqa: BLE001 - the copy is committed; retention runs again after the next
                logger.error("ckptd: tier %d keep_last=%d failed: %s", opened.index, opened.tier.keep_last, e)
            if removed:
                logger.info("ckptd: tier %d keep_last=%d removed %s", opened.index, opened.tier.keep_last, removed)
        result = outcome(copied, None, removed)
        logger.info("ckptd: promoted step %d to tier %d (%s) in %.2f s", step, opened.index, final, result.seconds)
        return result


class PromotionStopped(Exception):
    """The Checkpointer was closed without waiting: the copy in progress is given up."""


def promote_checkpoint(
    source_storage: Storage,
    source: str,
    target_storage: Storage,
    final: str,
    *,
    overwrite: bool = False,
    stop: Callable[[], bool] = lambda: False,
) -> int:
    """Copy the committed checkpoint at ``source`` to ``final`` on ``target_storage`` (another
    root), whole or invisible: every file listed in the manifest is copied and its CRC32C checked
    against the manifest (a mismatch raises :class:`CorruptCheckpointError` and nothing is
    committed), then the manifest is written last and the copy published.  Returns the bytes
    copied.  Raises :class:`CheckpointExistsError` if ``final`` is a checkpoint already, unless
    ``overwrite`` (then it is replaced as a save's overwrite replaces one)."""
    version = OneVersion.open(source_storage, source)  # one version of the source, even if it is overwritten
    try:
        return _promote_version(version, target_storage, final, overwrite=overwrite, stop=stop)
    finally:
        version.close()


def _promote_version(
    version: OneVersion, target_storage: Storage, final: str, *, overwrite: bool, stop: Callable[[], bool]
) -> int:
    source_storage, source = version.storage, version.directory
    with version.guard():
        version.take_stamp()
        manifest = Manifest.from_json(
            version.read_small(MANIFEST_NAME, follow_symlinks=False), source_storage.join(source, MANIFEST_NAME)
        )
    referencing = sorted(name for name, record in manifest.files.items() if record.checkpoint)
    if referencing:
        raise CorruptCheckpointError(
            f"{source}: written by a ckptd version before 0.2 that references other checkpoints' files "
            f"({referencing[0]}...); it is not promoted"
        )
    if target_storage.local and not overwrite and read_manifest(target_storage, final) is not None:
        raise CheckpointExistsError(f"{final} already exists")  # object stores: the claim refuses it
    copied = 0
    with staging_directory(target_storage, final, overwrite=overwrite) as staging:
        for subdirectory in sorted({name.rpartition("/")[0] for name in manifest.files} - {""}):
            target_storage.makedirs(target_storage.join(staging, subdirectory))
        for name, record in sorted(manifest.files.items()):
            if stop():
                raise PromotionStopped(f"promotion of {source} stopped by close(wait=False)")
            path = source_storage.join(source, name)
            with version.guard():  # a failure because the source was replaced meanwhile says so
                reader = version.reader(name) if source_storage.local else source_storage.open_reader(path)
                with _mapped_source(reader, record.size, target_storage.local) as mapped:
                    pieces = _checked_pieces(
                        reader, path, record.size, record.crc32c, reuse=target_storage.local, mapped=mapped, stop=stop
                    )
                    written = target_storage.write_stream(target_storage.join(staging, name), pieces)
            if written != record.size:
                what = f"{source}/{name}"
                raise CorruptCheckpointError(f"{what}: copied {written} bytes, the manifest lists {record.size}")
            copied += written
        version.check_unchanged()  # object stores: every byte copied is of the manifest read
        promoted = dataclasses.replace(
            manifest,
            files={name: dataclasses.replace(record, reused=None) for name, record in manifest.files.items()},
            metadata={**manifest.metadata, "promoted_from": source, "promoted_by": __version__},
        )
        target_storage.write_bytes(
            target_storage.join(staging, MANIFEST_NAME),
            promoted.to_json(),
            create_only=not target_storage.local and not overwrite,
        )
        publish(target_storage, staging, final, overwrite=overwrite)
    return copied


def _mapped_source(
    reader: RangeReader, size: int, local_target: bool
) -> contextlib.AbstractContextManager[memoryview | None]:
    """The trainer's own mapping of a held-memory source file (its staging file), for a copy to a
    local tier (whose writes are done with each piece before the next); else ``None``."""
    fd = getattr(reader, "fd", -1)
    if not local_target or fd < 0:
        return contextlib.nullcontext(None)
    return mapped_staging_file(fd, size)


def _checked_pieces(
    reader: RangeReader,
    path: str,
    size: int,
    expected: str,
    reuse: bool = False,
    mapped: memoryview | None = None,
    stop: Callable[[], bool] = lambda: False,
) -> Iterator[memoryview]:
    """The bytes of ``path`` in pieces, the last one only after the file's CRC32C matched; the
    reader is closed at the end.  Pieces are page-aligned (for ``O_DIRECT`` writes); with
    ``reuse`` (a consumer done with each piece before it asks for the next: local files) one
    buffer serves every piece, so no new memory is touched per piece.  ``mapped``: the file's
    bytes already mapped in this process (:func:`~ckptd.save.file_arena.mapped_staging_file`),
    handed out in place instead of read (only to a consumer done with each piece before the
    next).  ``stop`` is asked before each piece: true raises :class:`PromotionStopped` (the
    consumer then removes what it wrote, as for any failure of the pieces)."""
    try:
        if reader.size != size:
            raise CorruptCheckpointError(f"{path}: {reader.size} bytes, the manifest lists {size}")
        checksum, offset = 0, 0
        buffer = memoryview(mmap.mmap(-1, min(COPY_PIECE, size))) if reuse and size and mapped is None else None
        while offset < size:
            if stop():
                raise PromotionStopped(f"the copy of {path} stopped by close(wait=False)")
            length = min(COPY_PIECE, size - offset)
            if mapped is not None:
                piece = mapped[offset : offset + length]
            else:
                piece = buffer[:length] if buffer is not None else memoryview(mmap.mmap(-1, length))
                reader.read_into(offset, piece)
            checksum = crc32c(piece, checksum)
            offset += len(piece)
            if offset == size and format_crc(checksum) != expected:
                raise CorruptCheckpointError(f"{path}: CRC32C {format_crc(checksum)}, the manifest lists {expected}")
            yield piece
            if mapped is not None:
                piece.release()  # the consumer is done with it (a local write)
        if size == 0 and format_crc(checksum) != expected:
            raise CorruptCheckpointError(f"{path}: CRC32C {format_crc(checksum)}, the manifest lists {expected}")
    finally:
        reader.close()


def record_tiers(storage: Storage, root: str, tiers: Sequence[Tier]) -> None:
    """Write :data:`~ckptd.formats.names.TIERS_RECORD_NAME` under ``root``: each tier's root,
    ``every`` and ``keep_last`` (not its ``storage_options``, which may hold credentials), so
    that ``ckptd ls ROOT`` finds the tiers.  A failure is logged: the record is a convenience."""
    record = {
        "schema": 1,
        "written_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "tiers": [
            {"tier": index, "root": normalize_location(t.root), "every": t.every, "keep_last": t.keep_last}
            for index, t in enumerate(tiers, start=1)
        ],
    }
    try:
        storage.write_bytes(storage.join(root, TIERS_RECORD_NAME), json.dumps(record, indent=1).encode() + b"\n")
    except OSError as e:
        logger.warning("ckptd: could not record the tiers under %s (ckptd ls will not list them): %s", root, e)


# ---- loads across tiers --------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadSource:
    """Where a :meth:`~ckptd.Checkpointer.load` read from: the step (``None`` for a path that
    names none), the tier (0: the Checkpointer's root; 1, 2...: its ``tiers``) and the path."""

    step: int | None
    tier: int
    path: str


def committed_steps(roots: Sequence[tuple[int, Storage, str]]) -> list[int]:
    """The steps committed in any of the tiers ``(number, storage, root)``, newest first.  A tier
    that cannot be listed is skipped with a warning (another may hold the step)."""
    steps: set[int] = set()
    for tier, storage, root in roots:
        try:
            listed: list[CheckpointInfo] = list_checkpoints(storage, root)
        except Exception as e:  # noqa: BLE001 - an unreachable tier is one copy fewer, said in the log
            logger.warning("ckptd: cannot list tier %d (%s): %s", tier, root, e)
            continue
        steps.update(info.step for info in listed)
    return sorted(steps, reverse=True)
