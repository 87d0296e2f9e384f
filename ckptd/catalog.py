"""Checkpoints under a root: naming, listing, latest, retention, metrics and garbage collection.

Only directories (or prefixes) whose ``checkpoint_manifest.json`` parses are checkpoints; staging
directories (``.checkpoint-<step>.tmp-<host>-<pid>-<id>``) and anything else are ignored by
listing and removed by :func:`collect_garbage` once their owner is gone.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone

from .errors import CheckpointExistsError, CkptdError, MissingFileError, StorageError
from .formats.json_files import read_small_file
from .formats.manifest import Manifest, is_foreign_manifest
from .formats.names import (
    CLAIM_NAME,
    MANIFEST_NAME,
    checkpoint_dir_name,
    host_label,
    leftover_name,
    match_leftover_name,
    parse_step,
    staging_dir_name,
)
from .storage import Storage, base_name
from .storage.local import LocalStorage

logger = logging.getLogger(__name__)

__all__ = [
    "CLAIM_NAME",
    "CheckpointInfo",
    "apply_retention",
    "checkpoint_dir_name",
    "collect_garbage",
    "Leftover",
    "ManifestCache",
    "find_leftovers",
    "find_step",
    "discard_directory",
    "leftover_name",
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


def find_step(storage: Storage, root: str, step: int) -> str | None:
    """The checkpoint of ``step`` under ``root`` that has a manifest: ``checkpoint-<step>``, else
    the zero-padded ``checkpoint-<step:06d>`` older ckptd versions wrote (no listing needed)."""
    for name in dict.fromkeys((checkpoint_dir_name(step), f"checkpoint-{step:06d}")):
        path = storage.join(root, name)
        if storage.exists(storage.join(path, MANIFEST_NAME)):
            return path
    return None


class ManifestCache:
    """Parsed manifests, reused while a manifest's bytes are unchanged.

    Retention lists the root after every save; parsing and checking every manifest again each
    time was most of the completion thread's CPU for small saves (competing with training for
    the GIL).  A save also leaves the manifest it just committed here (:meth:`put`, with the
    bytes it wrote), so the listing after it parses nothing: with 30,000 tensors that parse cost
    about 0.3 s per manifest.  A hit still reads the file and compares its bytes, so an edited or
    replaced manifest is always parsed and checked again.  Safe to share between threads (the
    saver's completion thread and a :class:`~ckptd.CheckpointManager`'s retention thread).
    Internal: the manifests it hands out are shared between listings and must not be modified.
    """

    def __init__(self) -> None:
        self._parsed: dict[str, tuple[bytes, Manifest]] = {}
        self._lock = threading.Lock()

    def get(self, where: str, data: bytes) -> Manifest | None:
        with self._lock:
            found = self._parsed.get(where)
        return found[1] if found is not None and found[0] == data else None

    def put(self, where: str, data: bytes, manifest: Manifest) -> None:
        """Remember ``manifest`` as what the file at ``where`` holding ``data`` parses to."""
        with self._lock:
            self._parsed[where] = (data, manifest)

    def keep_only(self, wheres: set[str]) -> None:
        """Forget the manifests of checkpoints no longer listed."""
        with self._lock:
            for where in [w for w in self._parsed if w not in wheres]:
                del self._parsed[where]


def read_manifest(storage: Storage, path: str, cache: ManifestCache | None = None) -> Manifest | None:
    """The manifest of a checkpoint directory, or ``None`` if it has none or it is invalid.

    A bad manifest (malformed, edited, a FIFO, a symlink, huge, deeply nested) never stops a
    caller listing the root: it is logged as a warning naming the file, and skipped.
    """
    where = storage.join(path, MANIFEST_NAME)
    try:
        data = read_small_file(storage, where, follow_symlinks=False)
        if cache is not None and (known := cache.get(where, data)) is not None:
            return known
        if is_foreign_manifest(data):
            return None  # another tool's commit record (Forgather's trainer): not a ckptd checkpoint
        manifest = Manifest.from_json(data, where)
        if cache is not None:
            cache.put(where, data, manifest)
        return manifest
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


def list_checkpoints(storage: Storage, root: str, cache: ManifestCache | None = None) -> list[CheckpointInfo]:
    """Committed checkpoints under ``root``, oldest step first (manifests parsed once per
    content with a ``cache``)."""
    found = []
    for name in storage.list_names(root):
        step = parse_step(name)
        if step is None:
            continue
        path = storage.join(root, name)
        manifest = read_manifest(storage, path, cache)
        if manifest is not None:
            found.append(CheckpointInfo(step, path, manifest))
    if cache is not None:
        cache.keep_only({storage.join(info.path, MANIFEST_NAME) for info in found})
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


def discard_directory(storage: Storage, path: str, label: str | None = None) -> None:
    """Remove a directory so that a crash at any moment leaves either all of it or nothing visible.

    Local: renamed to a hidden ``.<label>.deleting-`` name first (one atomic step, made durable;
    ``label`` defaults to the directory's name), then removed; :func:`collect_garbage` finishes
    what a crash interrupts.  Object stores: ``remove_tree``.
    """
    if not isinstance(storage, LocalStorage):
        storage.remove_tree(path)
        return
    parent, base = os.path.split(path.rstrip(os.sep))
    hidden = os.path.join(parent, leftover_name(label or base, "deleting"))
    try:
        storage.rename_directory(path, hidden)
    except FileNotFoundError:
        return  # already gone
    storage.remove_tree(hidden)


def remove_checkpoint(storage: Storage, path: str) -> None:
    """Delete a checkpoint, atomically: it stops being one at once and never lingers half-deleted.

    Local: renamed aside to a hidden name, then removed (:func:`discard_directory`).  Object
    stores: the manifest first (it stops being a checkpoint at once), then the rest.
    """
    if isinstance(storage, LocalStorage):
        discard_directory(storage, path)
        return
    storage.remove(storage.join(path, MANIFEST_NAME))
    storage.remove_tree(path)


def apply_retention(
    storage: Storage,
    root: str,
    keep_last: int,
    protect: set[str] | None = None,
    cache: ManifestCache | None = None,
) -> list[str]:
    """Keep the ``keep_last`` newest checkpoints (plus any in ``protect``, and any whose files
    the kept ones reference after incremental saves); delete the older ones."""
    protect = protect or set()
    checkpoints = list_checkpoints(storage, root, cache)
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
    """Remove, or recover, what crashed saves, overwrites, deletions and consolidations left.

    Local: hidden leftovers (``.<name>.tmp-*`` staging directories and files,
    ``.<name>.replaced-*``, ``.<name>.deleting-*``) whose process is gone (this host) or older
    than ``older_than`` seconds (other hosts, and names without an owner).  Before removing, a
    ``<name>`` without a valid manifest is recovered: a leftover staging directory holding a
    complete manifest is published (the newest), else the newest complete ``replaced`` one is
    restored.  A staging directory holding a valid manifest is never deleted unless ``<name>``
    is a committed checkpoint.  Object stores: ``checkpoint-<step>`` prefixes without a valid
    manifest whose claim is older than ``older_than`` (their multipart uploads are aborted too).
    Returns the paths removed.
    """
    if not isinstance(storage, LocalStorage):
        return _collect_object_store_garbage(storage, root, older_than)
    groups: dict[str, list[tuple[str, str]]] = {}
    for name in storage.list_names(root):
        match = match_leftover_name(name)
        if match is None:
            continue
        path = storage.join(root, name)
        if _leftover_stale(match, path, older_than):
            groups.setdefault(match.group("base"), []).append((match.group("kind"), path))
    removed = []
    for base, leftovers in groups.items():
        target = storage.join(root, base)
        if read_manifest(storage, target) is None and not _recover(storage, target, leftovers):
            if any(kind != "deleting" and _complete_manifest(storage, path) for kind, path in leftovers):
                continue  # recovery failed: keep every complete copy for the next run
        for _, path in leftovers:
            if os.path.lexists(path):
                if os.path.isdir(path) and not os.path.islink(path):
                    storage.remove_tree(path)
                else:
                    storage.remove(path)
                removed.append(path)
    return removed


def _leftover_stale(match: re.Match[str], path: str, older_than: float) -> bool:
    """Whether a leftover's owner is gone (same host: its pid; else by age)."""
    if match.group("host") == host_label() and match.group("pid"):
        return not _pid_alive(int(match.group("pid")))
    if match.group("pid") is None and match.group("kind") == "replaced":
        return True  # an overwrite by an older version: nothing else will ever finish it
    try:
        return time.time() - os.lstat(path).st_mtime > older_than
    except OSError:
        return False


def _complete_manifest(storage: Storage, path: str) -> Manifest | None:
    """The manifest of a leftover directory if every file it lists (bar reused ones) is there
    at its recorded size, else ``None``."""
    if not os.path.isdir(path) or os.path.islink(path):
        return None
    manifest = read_manifest(storage, path)
    if manifest is None:
        return None
    sizes = dict(storage.sizes(path))
    for name, record in manifest.files.items():
        if record.checkpoint is not None:
            continue
        if "/" in name and name not in sizes:  # a file of the spread key layout: in a subdirectory
            subdirectory = name.rpartition("/")[0]
            sizes.update({f"{subdirectory}/{n}": s for n, s in storage.sizes(storage.join(path, subdirectory)).items()})
        if sizes.get(name) != record.size:
            return None
    return manifest


def _recover(storage: LocalStorage, target: str, leftovers: list[tuple[str, str]]) -> bool:
    """Publish the best complete leftover as ``target`` (which has no valid manifest)."""
    candidates = []
    for kind, path in leftovers:
        if kind == "deleting":
            continue  # deliberately removed: never brought back
        manifest = _complete_manifest(storage, path)
        if manifest is not None:
            candidates.append((kind == "tmp", manifest.created_utc, path))
    if not candidates:
        return False
    candidates.sort(reverse=True)
    chosen = candidates[0][2]
    try:
        if os.path.lexists(target):
            discard_directory(storage, target)  # no valid manifest: garbage
        storage.rename_directory(chosen, target)
    except (CheckpointExistsError, StorageError, OSError) as e:
        logger.warning("ckptd: could not recover %s from %s: %s", target, chosen, e)
        return False
    logger.warning("ckptd: recovered %s from %s (left by a crashed save)", target, chosen)
    leftovers.remove(next(item for item in leftovers if item[1] == chosen))
    return True


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
        return is_foreign_manifest(read_small_file(storage, storage.join(path, MANIFEST_NAME), follow_symlinks=False))
    except (FileNotFoundError, NotADirectoryError, CkptdError, OSError):
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


@dataclass(frozen=True)
class Leftover:
    """Something under a root that is not a committed checkpoint but looks like save debris.

    ``kind`` is ``"staging"`` (a hidden staging directory), ``"replaced"`` (an overwritten
    checkpoint not yet removed), ``"deleting"`` (a checkpoint being removed) or ``"incomplete"``
    (a ``checkpoint-<step>`` without a valid manifest).  ``active`` is true when the save that
    owns it is still running on this host; ``collectable`` when :func:`collect_garbage` removes
    it once its owner is gone (hidden leftovers on local disks, unfinished prefixes on object
    stores); others are left to people.
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
        hidden = match_leftover_name(name)
        if hidden:
            kind = {"tmp": "staging"}.get(hidden.group("kind"), hidden.group("kind"))
        elif parse_step(name) is not None and read_manifest(storage, path) is None:
            kind = "incomplete"
        else:
            continue
        owner = hidden.group("pid") if hidden else None
        active = bool(hidden and owner and hidden.group("host") == host and _pid_alive(int(owner)))
        nbytes, files = _tree_size(storage, path)
        # Local disks: gc removes hidden leftovers once their owner is gone; object stores:
        # unfinished prefixes.  A visible manifest-less directory on disk is left to people.
        collectable = bool(hidden) if storage.local else kind == "incomplete"
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
