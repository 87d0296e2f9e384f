"""Whether a hidden leftover still has a live owner: an ``flock`` the owning process holds.

A save's staging directory, the ``.replaced-`` directory of an overwrite and a temporary file of
``write_stream`` are locked (``flock(LOCK_EX)`` on their own descriptor) by the process that owns
them, from their creation until they are published, renamed or removed.  Garbage collection asks
with ``LOCK_EX | LOCK_NB``: a lock held elsewhere means a live owner, whatever the process id in
the name says (a pid means nothing in another PID namespace: a sidecar container on the same
host numbers processes differently).  The kernel drops the lock when the owning process dies,
``kill -9`` included.

The lock belongs to the open file description, so:

* child processes started with ``exec`` (the writer process, ``subprocess``) never get it: the
  descriptor is ``O_CLOEXEC``;
* a child made by ``os.fork()`` (multiprocessing's DataLoader workers) would share it; this
  module closes its copies in the child (``os.register_at_fork``), so a save's directory is not
  kept alive by a worker that outlives its trainer.  A child forked by C code that bypasses
  Python's fork hooks keeps a copy until it exits or execs: the leftover then looks live, and is
  collected once that child is gone (never the reverse);
* :meth:`Hold.release` unlocks explicitly (``LOCK_UN``), which frees the lock even where a
  descriptor was copied.

Where ``flock`` cannot answer (some network filesystems: ``ENOLCK``, ``EOPNOTSUPP``, or NFS's
``EBADF`` on a read-only descriptor; a symlink, a special file, no permission), a :class:`Hold`
has ``locked=False`` and :func:`is_held` returns ``None``: callers fall back to the host, pid
and age rules of :func:`ckptd.garbage.collect_garbage`.  Nothing here needs torch.
"""

from __future__ import annotations

import errno as errno_codes
import fcntl
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from types import TracebackType

from ..errors import StorageError
from .base import storage_error

__all__ = ["DEFAULT_LOCK_WAIT", "Hold", "claim", "hold", "hold_new_directory", "is_held", "lock_new_file"]

logger = logging.getLogger(__name__)

DEFAULT_LOCK_WAIT = 60.0
"""Seconds :func:`hold` and :func:`hold_new_directory` wait for another process's lock."""

_POLL = 0.01
# flock cannot answer here: no lock manager, not implemented, or (NFS, which emulates flock with
# whole-file POSIX locks) a descriptor not open for writing, as every directory descriptor is.
_UNSUPPORTED = {
    errno_codes.ENOLCK,
    errno_codes.EOPNOTSUPP,
    errno_codes.ENOTSUP,
    errno_codes.EINVAL,
    errno_codes.ENOSYS,
    errno_codes.EBADF,
}

_held: dict[int, Hold] = {}  # id(hold) -> hold, for the fork hook
_registry = threading.Lock()


class Hold:
    """A lock this process holds on a file or directory (``locked``), or, where the filesystem
    cannot lock, the record that it holds none (``locked=False``).  :meth:`release` (or the end
    of a ``with`` block) lets go; so does the death of the process."""

    def __init__(self, path: str, fd: int, locked: bool) -> None:
        self.path = path
        self.locked = locked
        self._fd = fd
        if fd >= 0:
            with _registry:
                _held[id(self)] = self

    def release(self) -> None:
        """Unlock and close (idempotent)."""
        with _registry:  # no fork() between the unlock and the close: a child never keeps a copy
            fd, self._fd = self._fd, -1
            _held.pop(id(self), None)
            if fd < 0:
                return
            try:
                if self.locked:
                    fcntl.flock(fd, fcntl.LOCK_UN)
            except OSError as e:  # closing drops it anyway
                logger.debug("ckptd: unlocking %s: %s", self.path, e)
            finally:
                os.close(fd)

    def __enter__(self) -> Hold:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"Hold({self.path!r}, locked={self.locked})"


def _before_fork() -> None:
    _registry.acquire()


def _after_fork_in_parent() -> None:
    _registry.release()


def _after_fork_in_child() -> None:
    """Close the child's copies of the parent's lock descriptors (closing, not unlocking: the
    parent keeps its locks), so that no forked child keeps a save's leftovers alive."""
    global _registry
    for held in _held.values():
        if held._fd >= 0:
            try:
                os.close(held._fd)
            except OSError:
                pass
            held._fd = -1
    _held.clear()
    _registry = threading.Lock()  # the parent's thread that held it does not exist here


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


def _open(path: str) -> tuple[int, bool] | None:
    """A read-only descriptor of a regular file or directory (never through a symlink, never a
    device or FIFO: opening those can block or have effects), and whether it is a directory;
    ``None`` for anything else.  Raises ``FileNotFoundError`` when ``path`` is gone."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise
    except OSError:
        return None
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        return None
    directory = stat.S_ISDIR(mode)
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
    try:
        fd = os.open(path, flags | (os.O_DIRECTORY if directory else 0))
    except FileNotFoundError:
        raise
    except OSError:
        return None
    return fd, directory


def _lock(fd: int) -> bool:
    """``LOCK_EX | LOCK_NB`` on ``fd``: True when taken, False where flock cannot answer; raises
    ``BlockingIOError`` when another open file holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise
    except OSError as e:
        if e.errno in _UNSUPPORTED:
            return False
        raise
    return True


def _probe(path: str, keep: bool) -> tuple[str, Hold | None]:
    """``("held", None)``, ``("missing", None)``, ``("unknown", hold or None)`` or
    ``("free", hold or None)``; with ``keep`` the hold of a free path stays locked."""
    try:
        opened = _open(path)
    except FileNotFoundError:
        return "missing", None
    if opened is None:
        return "unknown", Hold(path, -1, False) if keep else None
    fd = opened[0]
    try:
        taken = _lock(fd)
    except BlockingIOError:
        os.close(fd)
        return "held", None
    except OSError:
        os.close(fd)
        return "unknown", Hold(path, -1, False) if keep else None
    if not taken:
        os.close(fd)
        return "unknown", Hold(path, -1, False) if keep else None
    if keep:
        return "free", Hold(path, fd, True)
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
    return "free", None


def is_held(path: str) -> bool | None:
    """True while another open file (a live process) holds ``path``'s lock, False when nobody
    does (its owner, if it had one, is gone), ``None`` when flock cannot tell here or ``path``
    does not exist.  Takes the lock for an instant when it is free."""
    state, _ = _probe(path, keep=False)
    return {"held": True, "free": False}.get(state)


def claim(path: str) -> Hold | None:
    """Garbage collection: take a leftover's lock without waiting.

    ``None`` when a live process holds it, or ``path`` is gone; else a :class:`Hold`, ``locked``
    when this process now holds the lock (nobody held it: no other collection can claim it until
    :meth:`Hold.release`), not ``locked`` where flock cannot tell (decide by other rules).
    """
    return _probe(path, keep=True)[1]


def hold(path: str, *, timeout: float = DEFAULT_LOCK_WAIT) -> Hold:
    """Lock an existing file or directory for this process, waiting up to ``timeout`` seconds
    while another process holds it (:class:`~ckptd.errors.StorageError` then)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            opened = _open(path)
        except FileNotFoundError as e:
            raise storage_error("lock", path, e) from e
        if opened is None:
            return Hold(path, -1, False)
        fd = opened[0]
        try:
            taken = _lock(fd)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() > deadline:
                raise StorageError(
                    errno_codes.EWOULDBLOCK, f"cannot lock {path}: another process held its lock for {timeout:g} s"
                ) from None
            time.sleep(_POLL)
            continue
        except OSError as e:
            os.close(fd)
            raise storage_error("lock", path, e) from e
        if not taken:
            os.close(fd)
        return Hold(path, fd if taken else -1, taken)


def hold_new_directory(path: str, make: Callable[[str], None], *, timeout: float = DEFAULT_LOCK_WAIT) -> Hold:
    """Create the directory ``path`` with ``make`` (e.g. ``LocalStorage.makedirs``) and lock it
    for this process.

    A garbage collection may look at it between its creation and the lock: finding it unlocked
    on this host, it takes the lock and removes it.  So the lock is taken without waiting and
    then checked to be on the directory that ``path`` names; if a collection got there first the
    directory is made again once the collection lets go (up to ``timeout`` seconds).
    """
    deadline = time.monotonic() + timeout
    while True:
        make(path)
        try:
            opened = _open(path)
        except FileNotFoundError:
            opened = None  # a collection removed it already: make it again
        else:
            if opened is None:
                raise StorageError(errno_codes.ENOTDIR, f"cannot lock {path}: not a directory of its own")
            fd = opened[0]
            try:
                taken = _lock(fd)
            except BlockingIOError:
                os.close(fd)  # a collection holds it and will remove it
            except OSError as e:
                os.close(fd)
                raise storage_error("lock", path, e) from e
            else:
                if _same_file(path, fd):
                    if not taken:
                        os.close(fd)
                    return Hold(path, fd if taken else -1, taken)
                os.close(fd)
        if time.monotonic() > deadline:
            raise StorageError(
                errno_codes.EWOULDBLOCK, f"cannot lock the new directory {path}: another process holds its lock"
            )
        time.sleep(_POLL)


def lock_new_file(fd: int) -> bool:
    """Lock a file this process has just created (``O_EXCL``), for as long as ``fd`` is open;
    returns whether it is locked.  Best effort: a garbage collection looking at that instant
    finds the file too recent to remove anyway (temporary files name no owner: they go by age)."""
    try:
        return _lock(fd)
    except OSError:
        return False


def _same_file(path: str, fd: int) -> bool:
    try:
        named = os.lstat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)
