"""Checkpoints under a root: naming, listing, latest, retention, metrics and garbage collection.

Only directories (or prefixes) whose ``checkpoint_manifest.json`` parses are checkpoints; staging
directories (``.checkpoint-<step>.tmp-<host>-<pid>-<id>``) and anything else are ignored by
listing and removed by :func:`collect_garbage` once their owner is gone.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from dataclasses import dataclass
from datetime import datetime, timezone

from .errors import CkptdError, MissingFileError
from .formats.json_files import read_small_file
from .formats.manifest import Manifest
from .formats.names import (
    CLAIM_NAME,
    MANIFEST_NAME,
    checkpoint_dir_name,
    host_label,
    parse_staging_name,
    parse_step,
    staging_dir_name,
)
from .storage import Storage, base_name

__all__ = [
    "CheckpointInfo",
    "apply_retention",
    "checkpoint_dir_name",
    "collect_garbage",
    "latest_checkpoint",
    "list_checkpoints",
    "parse_step",
    "read_manifest",
    "remove_checkpoint",
    "staging_dir_name",
]

logger = logging.getLogger(__name__)

_STALE_SECONDS = 24 * 3600
_reported: set[str] = set()  # bad manifests already logged


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint found under a root."""

    step: int
    path: str
    manifest: Manifest

    @property
    def created_utc(self) -> str:
        return self.manifest.created_utc


def read_manifest(storage: Storage, path: str) -> Manifest | None:
    """The manifest of a checkpoint directory, or ``None`` if it has none or it is invalid.

    A bad manifest (malformed, edited, a FIFO, a symlink, huge, deeply nested) never stops a
    caller listing the root: it is logged as a warning naming the file, and skipped.
    """
    where = storage.join(path, MANIFEST_NAME)
    try:
        return Manifest.from_json(read_small_file(storage, where, follow_symlinks=False), where)
    except (MissingFileError, FileNotFoundError, NotADirectoryError):
        return None
    except (CkptdError, OSError) as e:
        if isinstance(e, OSError) and e.errno == errno.ENOTDIR:
            return None  # a plain file named like a checkpoint
        report = f"{path}: {e}"
        if report not in _reported:  # once per process, not on every listing
            if len(_reported) < 10_000:
                _reported.add(report)
            logger.warning("skipping %s (not a valid checkpoint): %s", path, e)
        return None


def list_checkpoints(storage: Storage, root: str) -> list[CheckpointInfo]:
    """Committed checkpoints under ``root``, oldest step first."""
    found = []
    for name in storage.list_names(root):
        step = parse_step(name)
        if step is None:
            continue
        path = storage.join(root, name)
        manifest = read_manifest(storage, path)
        if manifest is not None:
            found.append(CheckpointInfo(step, path, manifest))
    found.sort(key=lambda info: (info.step, info.manifest.created_utc))
    return found


def latest_checkpoint(storage: Storage, root: str) -> CheckpointInfo | None:
    """The committed checkpoint with the highest step (reads manifests newest first)."""
    candidates = sorted(
        ((step, name) for name in storage.list_names(root) if (step := parse_step(name)) is not None), reverse=True
    )
    for step, name in candidates:
        path = storage.join(root, name)
        manifest = read_manifest(storage, path)
        if manifest is not None:
            return CheckpointInfo(step, path, manifest)
    return None


def remove_checkpoint(storage: Storage, path: str) -> None:
    """Delete a checkpoint: manifest first (it stops being a checkpoint at once), then the rest."""
    storage.remove(storage.join(path, MANIFEST_NAME))
    storage.remove_tree(path)


def apply_retention(storage: Storage, root: str, keep_last: int, protect: set[str] | None = None) -> list[str]:
    """Keep the ``keep_last`` newest checkpoints (plus any in ``protect``, and any whose files
    the kept ones reference after incremental saves); delete the older ones."""
    protect = protect or set()
    checkpoints = list_checkpoints(storage, root)
    cut = max(0, len(checkpoints) - keep_last)
    kept = [info for info in checkpoints[cut:]] + [info for info in checkpoints[:cut] if info.path in protect]
    referenced = {f.checkpoint for info in kept for f in info.manifest.files.values() if f.checkpoint}
    removed = []
    for info in checkpoints[:cut]:
        name = base_name(info.path)
        if info.path in protect or name in referenced:
            continue
        remove_checkpoint(storage, info.path)
        removed.append(info.path)
    return removed


def collect_garbage(storage: Storage, root: str, *, older_than: float = _STALE_SECONDS) -> list[str]:
    """Remove what crashed saves left under ``root``.

    Local: staging directories whose process is gone (this host) or older than ``older_than``
    seconds (other hosts).  Object stores: ``checkpoint-<step>`` prefixes without a valid
    manifest whose claim is older than ``older_than`` (their multipart uploads are aborted too).
    """
    if not storage.local:
        return _collect_object_store_garbage(storage, root, older_than)
    removed = []
    host = host_label()
    for name in storage.list_names(root):
        staging = parse_staging_name(name)
        if staging is None:
            continue
        path = storage.join(root, name)
        stale = False
        if staging.host == host:
            stale = not _pid_alive(staging.pid)
        else:
            try:
                stale = time.time() - os.stat(path).st_mtime > older_than
            except OSError:
                stale = False
        if stale:
            storage.remove_tree(path)
            removed.append(path)
    return removed


def _collect_object_store_garbage(storage: Storage, root: str, older_than: float) -> list[str]:
    removed = []
    for name in storage.list_names(root):
        if parse_step(name) is None:
            continue
        path = storage.join(root, name)
        if read_manifest(storage, path) is not None:
            continue
        try:
            claimed = storage.read_bytes(storage.join(path, CLAIM_NAME)).decode().rsplit(" ", 1)[-1]
            age = (
                time.time()
                - datetime.strptime(claimed, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc).timestamp()
            )
        except (FileNotFoundError, ValueError, UnicodeDecodeError):
            age = float("inf")  # no readable claim: not a save in progress
        if age > older_than:
            storage.discard(path)
            removed.append(path)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
