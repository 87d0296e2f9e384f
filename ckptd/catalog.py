"""Checkpoints under a root: naming, listing, latest, retention, metrics and garbage collection.

Only directories (or prefixes) whose ``checkpoint_manifest.json`` parses are checkpoints; staging
directories (``.checkpoint-<step>.tmp-<host>-<pid>-<id>``) and anything else are ignored by
listing and removed by :func:`collect_garbage` once their owner is gone.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from .errors import CorruptCheckpointError, StorageError
from .formats.manifest import MANIFEST_NAME, Manifest
from .storage import Storage, base_name, is_local, normalize_location, storage_for

__all__ = [
    "METRICS_NAME",
    "CheckpointInfo",
    "apply_retention",
    "checkpoint_dir_name",
    "collect_garbage",
    "find_leftovers",
    "Leftover",
    "find_latest_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint_metrics",
    "maybe_delete_oldest_checkpoint",
    "next_checkpoint_path",
    "parse_step",
    "read_manifest",
    "remove_checkpoint",
    "save_checkpoint_metrics",
    "staging_dir_name",
]

METRICS_NAME = "metrics.json"
_DIR_RE = re.compile(r"^checkpoint-(\d+)$")
_STAGING_RE = re.compile(r"^\.checkpoint-(\d+)\.tmp-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]+$")
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


def checkpoint_dir_name(step: int) -> str:
    """``checkpoint-000120`` for step 120 (zero-padded so names sort by step)."""
    return f"checkpoint-{step:06d}"


def parse_step(name: str) -> int | None:
    """The step of a ``checkpoint-<step>`` name, else ``None``."""
    match = _DIR_RE.match(name)
    return int(match.group(1)) if match else None


def _host() -> str:
    """This host's name as it appears in staging directory names (no '-', the field separator)."""
    return socket.gethostname().replace("-", "_") or "host"


def staging_dir_name(step: int) -> str:
    """A hidden, unique staging directory name recording this host and process."""
    return f".checkpoint-{step:06d}.tmp-{_host()}-{os.getpid()}-{secrets.token_hex(4)}"


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
    host = _host()
    for name in storage.list_names(root):
        match = _STAGING_RE.match(name)
        if not match:
            continue
        path = storage.join(root, name)
        stale = False
        if match.group("host") == host:
            stale = not _pid_alive(int(match.group("pid")))
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
    from .save.commit import CLAIM_NAME

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


# ---- Forgather-compatible helpers (a model directory with a ``checkpoints/`` folder) -----------


def _checkpoints_root(model_dir: str) -> tuple[Storage, str]:
    root = normalize_location(model_dir)
    storage = storage_for(root)
    sub = storage.join(root, "checkpoints")
    return storage, (sub if "checkpoints" in storage.list_names(root) else root)


def find_latest_checkpoint(model_dir: str) -> str | None:
    """Path of the newest committed checkpoint in ``model_dir/checkpoints`` (or ``model_dir``)."""
    storage, root = _checkpoints_root(model_dir)
    info = latest_checkpoint(storage, root)
    return info.path if info else None


def next_checkpoint_path(model_dir: str, checkpoint_id: int | str) -> str:
    """``model_dir/checkpoints/checkpoint-<id>``: where the next checkpoint goes."""
    name = checkpoint_dir_name(checkpoint_id) if isinstance(checkpoint_id, int) else f"checkpoint-{checkpoint_id}"
    if is_local(model_dir):
        return os.path.join(model_dir, "checkpoints", name)
    return f"{model_dir.rstrip('/')}/checkpoints/{name}"


def maybe_delete_oldest_checkpoint(
    model_dir: str,
    max_checkpoints: int,
    best_checkpoint: str | None = None,
    preserved_checkpoints: list[str] | None = None,
) -> None:
    """Delete the oldest checkpoints beyond ``max_checkpoints``, keeping the best and preserved ones."""
    storage, root = _checkpoints_root(model_dir)
    keep = [p for p in [best_checkpoint, *(preserved_checkpoints or [])] if p]
    protect = {normalize_location(p) for p in keep}
    apply_retention(storage, root, max_checkpoints, protect)


def save_checkpoint_metrics(checkpoint_path: str, metrics: dict[str, float]) -> None:
    """Write ``metrics.json`` beside a checkpoint (atomically on local disk)."""
    path = normalize_location(checkpoint_path)
    storage = storage_for(path)
    storage.write_stream(storage.join(path, METRICS_NAME), [memoryview(json.dumps(metrics).encode())])


def load_checkpoint_metrics(checkpoint_path: str) -> dict[str, Any] | None:
    """Metrics saved with :func:`save_checkpoint_metrics`, else those recorded in the manifest."""
    path = normalize_location(checkpoint_path)
    storage = storage_for(path)
    try:
        return dict(json.loads(storage.read_bytes(storage.join(path, METRICS_NAME))))
    except FileNotFoundError:
        pass
    manifest = read_manifest(storage, path)
    return dict(manifest.metrics) if manifest is not None and manifest.metrics else None


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
    host = _host()
    for name in storage.list_names(root):
        path = storage.join(root, name)
        staging = _STAGING_RE.match(name)
        if staging:
            kind = "staging"
        elif _LEFTOVER_RE.match(name):
            kind = "replaced" if ".replaced-" in name else "staging"
        elif parse_step(name) is not None and read_manifest(storage, path) is None:
            kind = "incomplete"
        else:
            continue
        active = bool(staging and staging.group("host") == host and _pid_alive(int(staging.group("pid"))))
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
