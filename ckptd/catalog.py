"""Checkpoints under a root: naming, listing, latest, retention, metrics and garbage collection.

Only directories (or prefixes) whose ``checkpoint_manifest.json`` parses are checkpoints; staging
directories (``.checkpoint-<step>.tmp-<host>-<pid>-<id>``) and anything else are ignored by
listing and removed by :func:`collect_garbage` once their owner is gone.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from datetime import datetime, timezone

from .errors import CorruptCheckpointError, StorageError
from .formats.manifest import Manifest, is_foreign_manifest
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
    "Leftover",
    "find_leftovers",
    "find_step",
    "latest_checkpoint",
    "list_checkpoints",
    "parse_step",
    "read_manifest",
    "remove_checkpoint",
    "staging_dir_name",
]

_STALE_SECONDS = 24 * 3600


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint found under a root."""

    step: int
    path: str
    manifest: Manifest

    @property
    def created_utc(self) -> str:
        return self.manifest.created_utc


def find_step(storage: Storage, root: str, step: int) -> str | None:
    """The checkpoint of ``step`` under ``root`` that has a manifest: ``checkpoint-<step>``, else
    the zero-padded ``checkpoint-<step:06d>`` older ckptd versions wrote (no listing needed)."""
    for name in dict.fromkeys((checkpoint_dir_name(step), f"checkpoint-{step:06d}")):
        path = storage.join(root, name)
        if storage.exists(storage.join(path, MANIFEST_NAME)):
            return path
    return None


def read_manifest(storage: Storage, path: str) -> Manifest | None:
    """The manifest of a checkpoint directory, or ``None`` if it has none or it is invalid."""
    where = storage.join(path, MANIFEST_NAME)
    try:
        return Manifest.from_json(storage.read_bytes(where), where)
    except (FileNotFoundError, NotADirectoryError, StorageError, CorruptCheckpointError):
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
        if read_manifest(storage, path) is not None or _foreign_checkpoint(storage, path):
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


def _foreign_checkpoint(storage: Storage, path: str) -> bool:
    """A checkpoint another tool committed (e.g. Forgather's manifest): never garbage."""
    try:
        return is_foreign_manifest(storage.read_bytes(storage.join(path, MANIFEST_NAME)))
    except (FileNotFoundError, NotADirectoryError, StorageError):
        return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---- leftovers (what ``ckptd ls`` warns about and ``collect_garbage`` removes) -------------------

_LEFTOVER_RE = re.compile(r"^\.(?P<base>.+)\.(?:tmp|replaced)-")


@dataclass(frozen=True)
class Leftover:
    """Something under a root that is not a committed checkpoint but looks like save debris.

    ``kind`` is ``"staging"`` (a hidden staging directory), ``"replaced"`` (an overwritten
    checkpoint not yet removed) or ``"incomplete"`` (a ``checkpoint-<step>`` without a valid
    manifest).  ``active`` is true when the save that owns it is still running on this host;
    ``collectable`` when :func:`collect_garbage` removes it once its owner is gone (staging
    directories on local disks, unfinished prefixes on object stores); others are left to people.
    """

    name: str
    path: str
    kind: str
    nbytes: int
    files: int
    active: bool
    collectable: bool


def find_leftovers(storage: Storage, root: str) -> list[Leftover]:
    """Staging directories, replaced checkpoints and uncommitted ``checkpoint-<step>`` prefixes
    under ``root`` (nothing is removed; :func:`collect_garbage` does that)."""
    found = []
    host = host_label()
    for name in storage.list_names(root):
        path = storage.join(root, name)
        staging = parse_staging_name(name)
        if staging:
            kind = "staging"
        elif _LEFTOVER_RE.match(name):
            kind = "replaced" if ".replaced-" in name else "staging"
        elif parse_step(name) is not None and read_manifest(storage, path) is None:
            kind = "incomplete"
        else:
            continue
        active = bool(staging and staging.host == host and _pid_alive(staging.pid))
        nbytes, files = _tree_size(storage, path)
        collectable = bool(staging) if storage.local else kind == "incomplete"
        found.append(Leftover(name, path, kind, nbytes, files, active, collectable))
    return found


def _tree_size(storage: Storage, path: str) -> tuple[int, int]:
    """Bytes and file count under a directory (local: the whole tree; object stores: the prefix)."""
    if not storage.local:
        sizes = storage.sizes(path)
        return sum(sizes.values()), len(sizes)
    total = count = 0
    for parent, _dirs, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(parent, name)).st_size
                count += 1
            except OSError:
                continue
    return total, count
