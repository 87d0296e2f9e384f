"""Checkpoints under a root: naming, listing, latest, reading manifests, and deleting one.

Only directories (or prefixes) whose ``checkpoint_manifest.json`` parses are checkpoints; staging
directories (``.checkpoint-<step>.tmp-<host>-<pid>-<id>``) and anything else are ignored by
listing and removed by :func:`~ckptd.garbage.collect_garbage` once their owner is gone.  Which
checkpoints retention keeps is :mod:`ckptd.retention`'s.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
from dataclasses import dataclass

from .errors import CkptdError, MissingFileError, UnsafeCheckpointError
from .formats.json_files import read_small_file
from .formats.manifest import Manifest, is_foreign_manifest
from .formats.names import (
    CLAIM_NAME,
    MANIFEST_NAME,
    SPARE_NAME,
    checkpoint_dir_name,
    leftover_name,
    parse_step,
    staging_dir_name,
)
from .storage import Storage
from .storage.local import LocalStorage

logger = logging.getLogger(__name__)

__all__ = [
    "CLAIM_NAME",
    "CheckpointInfo",
    "checkpoint_dir_name",
    "ManifestCache",
    "find_step",
    "is_linked_checkpoint",
    "discard_directory",
    "leftover_name",
    "latest_checkpoint",
    "list_checkpoints",
    "parse_step",
    "read_manifest",
    "remove_checkpoint",
    "retire_to_spare",
    "spare_files",
    "sibling_checkpoint",
    "staging_dir_name",
]

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
        if not is_linked_checkpoint(storage, path) and storage.exists(storage.join(path, MANIFEST_NAME)):
            return path
    return None


def is_linked_checkpoint(storage: Storage, path: str) -> bool:
    """True when the checkpoint directory ``path`` of a local root is a symlink.

    A root's checkpoints are its own directories: a ``checkpoint-N`` that links elsewhere (outside
    the root, or to another step's directory) is never listed, loaded by step or deleted by
    retention (which would rename the link and leave or remove what it leads to).
    """
    return storage.local and os.path.islink(path.rstrip(os.sep))


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


def sibling_checkpoint(storage: Storage, directory: str, name: str) -> str:
    """The path of the checkpoint ``name`` beside ``directory`` (what an older version's file
    reference names), which must be a real directory inside the same parent, not a symlink
    leading elsewhere (:class:`~ckptd.errors.UnsafeCheckpointError`)."""
    parent = os.path.dirname(directory) if storage.local else directory.rstrip("/").rsplit("/", 1)[0]
    holder = storage.join(parent, name)
    if storage.local:
        real_parent = os.path.realpath(parent)
        if os.path.islink(holder) or os.path.dirname(os.path.realpath(holder)) != real_parent:
            raise UnsafeCheckpointError(f"{holder}: a referenced checkpoint must be a directory beside {directory}")
    return holder


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
        _warn_once(path, str(e))
        return None


def _warn_once(path: str, reason: str, message: str = "skipping %s (not a valid checkpoint): %s") -> None:
    report = f"{path}: {reason}"
    if report not in _reported:  # once per process, not on every listing
        if len(_reported) < 10_000:
            _reported.add(report)
        logger.warning(message, path, reason)


def _listed_manifest(storage: Storage, path: str, cache: ManifestCache | None = None) -> Manifest | None:
    """The manifest of the entry ``path`` of a root, ``None`` (with a warning) for a symlink."""
    if is_linked_checkpoint(storage, path):
        _warn_once(path, "a symlink: a checkpoint under a root must be a directory of the root")
        return None
    return read_manifest(storage, path, cache)


def list_checkpoints(storage: Storage, root: str, cache: ManifestCache | None = None) -> list[CheckpointInfo]:
    """Committed checkpoints under ``root``, oldest step first (manifests parsed once per
    content with a ``cache``)."""
    found = []
    for name in storage.list_names(root):
        step = parse_step(name)
        if step is None:
            continue
        path = storage.join(root, name)
        manifest = _listed_manifest(storage, path, cache)
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
        manifest = _listed_manifest(storage, path)
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


def retire_to_spare(storage: LocalStorage, root: str, path: str) -> None:
    """Remove the checkpoint at ``path`` of a held-memory ``root`` by making its files the
    root's spare (:data:`~ckptd.formats.names.SPARE_NAME`, replacing an older spare), for the
    next save to reuse their pages.  Atomic as :func:`remove_checkpoint`: the directory is renamed
    aside first (it stops being a checkpoint at once), its manifest is removed (the spare can never
    be taken for a checkpoint), then it becomes the spare."""
    parent, base = os.path.split(path)
    aside = os.path.join(parent, leftover_name(base, "deleting"))  # gc removes it after a crash
    storage.rename_directory(path, aside)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(aside, MANIFEST_NAME))
    _drop_shared_files(aside)
    spare = os.path.join(root, SPARE_NAME)
    if os.path.lexists(spare):
        discard_directory(storage, spare, label="ckptd-spare")
    try:
        os.rename(aside, spare)
    except OSError:  # another retirement won the name: this one is only deleted
        discard_directory(storage, aside)


def _drop_shared_files(directory: str) -> None:
    """Unlink the files of a retired checkpoint that have other links: a spare never reuses
    them (:func:`~ckptd.storage.local.open_recycled`), and a staging file a trainer maps
    (:mod:`ckptd.save.file_arena`) becomes free for its next save only once no checkpoint, the
    spare included, links it."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        path = os.path.join(directory, name)
        with contextlib.suppress(OSError):
            info = os.lstat(path)
            if stat.S_ISREG(info.st_mode) and info.st_nlink > 1:
                os.unlink(path)


def spare_files(root: str) -> dict[str, str]:
    """The files of a held-memory ``root``'s spare by name (``{name: path}``; empty when it has
    none).  Whether one can be reused (a regular file, no other link, no larger than the new
    one) is decided where it is taken: :func:`~ckptd.storage.local.open_recycled`."""
    directory = os.path.join(root, SPARE_NAME)
    if os.path.islink(directory):  # not the root's: its files are never taken over
        _warn_once(directory, "a symlink, not a directory of the root", "not reusing the files of %s: %s")
        return {}
    try:
        return {name: os.path.join(directory, name) for name in os.listdir(directory)}
    except OSError:
        return {}


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
