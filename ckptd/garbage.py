"""Garbage under a root: what crashed saves, overwrites, deletions and consolidations left
(staging directories, replaced and half-deleted checkpoints, unfinished object-store prefixes),
found for ``ckptd ls`` (:func:`find_leftovers`) and removed or recovered by
:func:`collect_garbage` once their owner is gone (a lock it no longer holds, or its pid and age).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone

from .catalog import discard_directory, read_manifest
from .errors import CkptdError
from .formats.json_files import read_small_file
from .formats.manifest import Manifest, is_foreign_manifest
from .formats.names import (
    ARENAS_NAME,
    CLAIM_NAME,
    MANIFEST_NAME,
    host_label,
    match_leftover_name,
    parse_step,
)
from .storage import Storage
from .storage.liveness import Hold, claim, is_held
from .storage.local import LocalStorage
from .writer.shm import remove_abandoned_files

logger = logging.getLogger(__name__)

__all__ = ["Collected", "Leftover", "RemovalFailure", "collect_garbage", "find_leftovers"]

_STALE_SECONDS = 24 * 3600


@dataclass(frozen=True)
class RemovalFailure:
    """A leftover :func:`collect_garbage` could not remove (or recover), and why."""

    path: str
    error: str  # the cause: "<file>: Read-only file system", "Permission denied"...
    errno: int | None = None


class Collected(list[str]):
    """What :func:`collect_garbage` did: the list of the paths it removed (each really gone), with
    ``failures``, the leftovers still there and why (:class:`RemovalFailure`), and ``recovered``,
    the leftovers published as checkpoints (leftover path -> checkpoint path)."""

    def __init__(
        self,
        removed: Iterable[str] = (),
        failures: Iterable[RemovalFailure] = (),
        recovered: dict[str, str] | None = None,
    ) -> None:
        super().__init__(removed)
        self.failures: tuple[RemovalFailure, ...] = tuple(failures)
        self.recovered: dict[str, str] = dict(recovered or {})


# Leftovers their owner locks from creation to the end (storage.liveness): a staging directory
# or temporary file (``tmp``), an overwrite's old checkpoint renamed aside (``replaced``).
_LOCKED_KINDS = frozenset({"tmp", "replaced"})


def collect_garbage(storage: Storage, root: str, *, older_than: float = _STALE_SECONDS) -> Collected:
    """Remove, or recover, what crashed saves, overwrites, deletions and consolidations left.

    Local: hidden leftovers (``.<name>.tmp-*`` staging directories and files,
    ``.<name>.replaced-*``, ``.<name>.deleting-*``) whose owner is gone, and a held root's
    staging files (``.ckptd-arenas``) no live process holds.  A leftover whose lock
    (:mod:`ckptd.storage.liveness`) another process holds is live and never touched, whatever
    its name says; a free lock means the owner is gone for this host's staging and ``replaced``
    leftovers (whatever PID namespace the owner ran in).  Where the lock cannot tell, for other
    hosts' leftovers (a network filesystem's locks may be local to each host), names without an
    owner and ``deleting`` ones (their owner takes no lock): this host's by their pid, the others
    once older than ``older_than`` seconds.  Each leftover collected is claimed (locked) until
    the end, so two collections never work on one.  Before removing, a ``<name>`` without a valid
    manifest is recovered: a leftover staging directory holding a complete manifest is published
    (the newest), else the newest complete ``replaced`` one is restored.  A staging directory
    holding a valid manifest is never deleted unless ``<name>`` is a committed checkpoint.
    Object stores: ``checkpoint-<step>`` prefixes without a valid manifest whose claim is older
    than ``older_than`` (their multipart uploads are aborted too).

    Returns the paths removed, each really gone (:class:`Collected`, a list), with the leftovers
    that could not be removed or recovered and why in its ``failures`` (also logged).
    """
    if not isinstance(storage, LocalStorage):
        return Collected(_collect_object_store_garbage(storage, root, older_than))
    removed: list[str] = []
    failures: list[RemovalFailure] = []
    recovered: dict[str, str] = {}
    claims: list[Hold] = []
    arenas = storage.join(root, ARENAS_NAME)  # a held root's staging files whose trainer died
    removed.extend(storage.join(arenas, name) for name in remove_abandoned_files(arenas))
    try:
        groups: dict[str, list[tuple[str, str]]] = {}
        for name in storage.list_names(root):
            match = match_leftover_name(name)
            if match is None:
                continue
            path = storage.join(root, name)
            claimed = _leftover_stale(match, path, older_than)
            if claimed is not None:
                claims.append(claimed)
                groups.setdefault(match.group("base"), []).append((match.group("kind"), path))
        for base, leftovers in groups.items():
            target = storage.join(root, base)
            try:
                if read_manifest(storage, target) is None:
                    chosen = _recover(storage, target, leftovers)
                    if chosen is not None:
                        recovered[chosen] = target
            except (CkptdError, OSError) as e:  # keep every copy for the next run
                logger.warning("ckptd: could not recover %s from its leftovers: %s", target, e)
                cause = f"kept: recovering {target} from it failed ({_cause(e)})"
                failures.extend(RemovalFailure(path, cause, getattr(e, "errno", None)) for _, path in leftovers)
                continue
            for _, path in leftovers:
                error = _remove_leftover(path)
                if error is None:
                    removed.append(path)
                else:
                    logger.warning("ckptd: could not remove %s: %s", path, _cause(error))
                    failures.append(RemovalFailure(path, _cause(error), error.errno))
    finally:
        for held in claims:
            held.release()
    return Collected(removed, failures, recovered)


def _remove_leftover(path: str) -> OSError | None:
    """Remove a leftover file or directory tree: ``None`` once it is gone (also when another
    process removed some of it meanwhile), else the first error that kept it there."""
    errors: list[OSError] = []

    def failed(where: str, error: BaseException) -> None:
        if isinstance(error, OSError) and not isinstance(error, FileNotFoundError):
            if error.filename != where:  # rmtree works relative to directory descriptors
                error = OSError(error.errno, error.strerror, where)
            errors.append(error)

    try:
        if os.path.isdir(path) and not os.path.islink(path):
            if sys.version_info >= (3, 12):
                shutil.rmtree(path, onexc=lambda _function, where, error: failed(where, error))
            else:
                shutil.rmtree(path, onerror=lambda _function, where, info: failed(where, info[1]))
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        errors.append(e)
    if not os.path.lexists(path):
        return None
    if errors:
        return errors[0]
    return OSError(errno.ENOTEMPTY, "still there after its removal (recreated meanwhile?)", path)


def _cause(error: BaseException) -> str:
    """Why an operation failed, naming the file: ``<file>: Read-only file system``."""
    if isinstance(error, OSError) and not isinstance(error, CkptdError) and error.strerror:
        return f"{error.filename}: {error.strerror}" if error.filename else error.strerror
    return str(error) or type(error).__name__


def _leftover_stale(match: re.Match[str], path: str, older_than: float) -> Hold | None:
    """A claim on a leftover whose owner is gone (this process holds its lock until the claim is
    released, where the filesystem can lock), else ``None``: its owner is alive, it is too
    recent, or it is gone already.  See :func:`collect_garbage` for the rules."""
    held = claim(path)
    if held is None:
        return None  # a live process holds its lock (any PID namespace), or it is gone
    this_host = match.group("host") == host_label() and match.group("pid") is not None
    if held.locked and this_host and match.group("kind") in _LOCKED_KINDS:
        return held  # its owner locked it from the start, and no process of this host holds it
    if _stale_by_name(match, path, older_than):
        return held
    held.release()
    return None


def _stale_by_name(match: re.Match[str], path: str, older_than: float) -> bool:
    """Whether a leftover's owner is gone by what its name says (same host: its pid; else by age)."""
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


def _recover(storage: LocalStorage, target: str, leftovers: list[tuple[str, str]]) -> str | None:
    """Publish the best complete leftover as ``target`` (which has no valid manifest) and take it
    out of ``leftovers``; returns its path, ``None`` when no leftover is complete.  Raises
    (:class:`~ckptd.errors.StorageError`, ``OSError``) when publishing it fails."""
    candidates = []
    for kind, path in leftovers:
        if kind == "deleting":
            continue  # deliberately removed: never brought back
        manifest = _complete_manifest(storage, path)
        if manifest is not None:
            candidates.append((kind == "tmp", manifest.created_utc, path))
    if not candidates:
        return None
    candidates.sort(reverse=True)
    chosen = candidates[0][2]
    if os.path.lexists(target):
        discard_directory(storage, target)  # no valid manifest: garbage
    storage.rename_directory(chosen, target)
    logger.warning("ckptd: recovered %s from %s (left by a crashed save)", target, chosen)
    leftovers.remove(next(item for item in leftovers if item[1] == chosen))
    return chosen


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
    (a ``checkpoint-<step>`` without a valid manifest).  ``active`` is true when a live process
    holds its lock (:mod:`ckptd.storage.liveness`: the save, overwrite or consolidation that owns
    it, in any PID namespace of any host the filesystem's locks reach) or, where the lock cannot
    tell, its owner's pid is alive on this host; ``collectable`` when :func:`collect_garbage` removes
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
        active = False
        if hidden:
            held = is_held(path) if isinstance(storage, LocalStorage) else None
            mine = hidden.group("host") == host and hidden.group("pid") is not None
            if held:
                active = True
            elif held is None or hidden.group("kind") not in _LOCKED_KINDS:  # the name decides
                active = mine and _pid_alive(int(hidden.group("pid")))
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
