"""How long a held-memory root (``shm://NAME``) outlives its trainers: leases and the keeper.

A checkpoint saved to ``shm://NAME`` is a set of files in this user's private tmpfs directory
(:mod:`ckptd.storage.held`): committed like any local checkpoint (manifest last, renamed into
place), so a half-written one is never visible, and readable by the ordinary reader.  Files in
a tmpfs survive the death of the process that wrote them (exception, SIGKILL, the OOM killer,
torchrun's ``killpg``); what must not survive forever is the memory they take.  Two pieces bound it:

1. **The lease.**  Every process with a :class:`~ckptd.Checkpointer` on ``shm://NAME`` holds a
   shared ``flock`` on the name's ``inuse`` file (:class:`HoldLease`).  The kernel drops it when
   the process closes it or dies, however it dies: no pid files, no heartbeat to miss.
2. **The keeper.**  A small daemon per name (``python -m ckptd.writer.keeper NAME``), started by
   the lease in a session of its own, so the signals that kill the trainer's process group do not
   reach it.  One keeper runs per name (an exclusive ``flock`` on the ``keeper`` file; a second
   one waits on it and exits at once when its turn comes with nothing left to keep).  Every
   :data:`POLL_SECONDS` it tries the ``inuse`` lock exclusively: while a trainer holds a lease it
   cannot, and the hold clock stays at zero.  Once no trainer holds one for ``hold_after_exit``
   seconds (the ``settings`` file, written by the newest lease), it removes the root while it
   holds the lock (a trainer arriving then waits for the removal and starts afresh) and exits.
   It also exits when the root was removed by someone else (:func:`drop_held`, ``ckptd memory
   drop``).

**Control files go with the root.**  A lock file is unlinked only by a process that holds it
exclusively (the keeper or :func:`drop_held` the ``inuse`` file, the keeper its ``keeper`` file, as
they finish), and every process that locks one checks afterwards that the file it locked is still
the one at its path, else opens the path again (:func:`_lock_control`): a process that waited on
an unlinked file never holds a lock nobody else can see.  A keeper that exits and a drop also
remove what earlier removals left: the lock files of names that have neither a root nor settings
(versions before this one never removed them), settings files a lease died writing, and roots
renamed out of sight for deletion that a process killed meanwhile did not finish deleting.

A new trainer on the same host and name takes a lease, and its ``load("latest")`` reads the held
checkpoint like any other, with CRC32C verification and the fallback to slower tiers (see
:mod:`ckptd.tiers`).  Only this user can open the directory (``0700``), so only this user's
processes can take a lease or read a snapshot.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import CheckpointNotFoundError, ConfigError, HeldRootInUseError, UnsafeCheckpointError
from ..options import DEFAULT_HOLD_AFTER_EXIT
from ..storage.held import (
    CONTROL_DIRECTORY,
    HELD_SCHEME,
    bytes_under,
    control_path,
    held_name,
    held_names,
    held_path,
    private_directory,
)
from .launch import helper_command, helper_environment

__all__ = ["HeldRoot", "HoldLease", "drop_held", "held_roots", "main"]

POLL_SECONDS = 0.25
"""How often the keeper looks for a live trainer."""

_START_TIMEOUT = 30.0


@dataclass(frozen=True)
class HeldRoot:
    """One held-memory root of this user: its URL and directory, the bytes its files take, whether
    a live process holds a lease on it, the keeper's pid (``None``: no keeper runs) and the seconds
    it is held once unused."""

    url: str
    path: str
    nbytes: int
    in_use: bool
    keeper_pid: int | None
    hold_after_exit: float | None


class HoldLease:
    """This process's claim on the held root ``name``: a shared lock on its ``inuse`` file, held
    until :meth:`close` or the process's death; taking it records ``hold_after_exit`` and makes
    sure a keeper runs.  Taking it waits while a keeper is removing the root."""

    def __init__(self, name: str, hold_after_exit: float) -> None:
        self.name = held_name(name)
        fd = _lock_control(self.name, "inuse", fcntl.LOCK_SH)  # waits while a keeper removes the root
        assert fd is not None
        self._release = weakref.finalize(self, os.close, fd)  # a lease dropped unclosed is let go too
        try:
            _write_settings(self.name, hold_after_exit)
            self.keeper_pid = start_keeper(self.name)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Let go of the lease (the hold clock starts once no process holds one)."""
        self._release()


def start_keeper(name: str) -> int:
    """Start a keeper for ``name`` in a session of its own and return its pid (it may be one that
    waits for the running keeper and exits)."""
    try:
        started = subprocess.run(
            helper_command("ckptd.writer.keeper", held_name(name)),
            stdin=subprocess.DEVNULL,
            env=helper_environment(),
            capture_output=True,
            start_new_session=True,
            timeout=_START_TIMEOUT,
            check=True,
            text=True,
        )
        return int(started.stdout.split()[0])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError) as e:
        detail = getattr(e, "stderr", None) or str(e)
        raise ConfigError(f"cannot start the keeper of {HELD_SCHEME}{name}: {detail.strip()}") from e


def held_roots() -> list[HeldRoot]:
    """This user's held-memory roots (``shm://NAME``), with their size, lease and keeper state."""
    return [_describe(name) for name in held_names()]


def drop_held(url: str, force: bool = False) -> HeldRoot:
    """Remove the held-memory root ``url`` (``shm://NAME`` or NAME) and its control files, which
    frees its memory; its keeper exits.  Refused with :class:`~ckptd.errors.HeldRootInUseError`
    while a live process holds a lease on it, unless ``force``; a
    :class:`~ckptd.errors.CheckpointNotFoundError` when there is no such root."""
    name = held_name(url)
    if name not in held_names():
        _remove_leftovers()  # e.g. the lock files of a removal killed after it removed the settings
        raise CheckpointNotFoundError(f"{HELD_SCHEME}{name}: no such held-memory root")
    described = _describe(name)
    fd = _lock_unless_leased(name)
    if fd is None and not force:
        raise HeldRootInUseError(
            f"{HELD_SCHEME}{name} is in use by a running trainer; stop it first, or drop it anyway with force"
        )
    try:
        _forget(name, locked=fd is not None)  # a lease still holds the lock file when forced: it stays
    finally:
        if fd is not None:
            os.close(fd)
    _remove_leftovers()
    return described


# ---- the keeper process -------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ckptd.writer.keeper NAME``: print the keeper's pid and leave it running."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        sys.stderr.write("usage: python -m ckptd.writer.keeper NAME\n")
        return 2
    name = held_name(args[0])
    control_path(name, "keeper")  # the private directory, checked before forking
    child = os.fork()
    if child:
        sys.stdout.write(f"{child}\n")
        sys.stdout.flush()
        return 0
    try:
        for signal_number in (signal.SIGINT, signal.SIGHUP):
            signal.signal(signal_number, signal.SIG_IGN)
        os.chdir("/")
        devnull = os.open(os.devnull, os.O_RDWR)
        for stream in (0, 1, 2):
            os.dup2(devnull, stream)
        keep(name)
    finally:
        os._exit(0)


def keep(name: str) -> None:
    """The keeper's loop (see the module docstring); returns once the root and its control files
    are removed."""
    keeper = _lock_control(name, "keeper", fcntl.LOCK_EX)  # one keeper per name: the next one waits here
    assert keeper is not None
    try:
        os.ftruncate(keeper, 0)
        os.pwrite(keeper, f"{os.getpid()}\n".encode(), 0)
        unused_since: float | None = None
        while True:
            inuse = _lock_control(name, "inuse", fcntl.LOCK_EX, wait=False)  # the file at the path now
            if inuse is not None:
                try:
                    if not os.path.isdir(held_path(name)):  # dropped, or nothing was ever saved there
                        _forget(name, locked=True)
                        return
                    now = time.monotonic()
                    unused_since = now if unused_since is None else unused_since
                    if now - unused_since >= _hold_seconds(name):
                        _forget(name, locked=True)
                        return
                finally:
                    os.close(inuse)
            else:
                unused_since = None
            time.sleep(POLL_SECONDS)
    finally:
        _unlink_control(name, "keeper")  # while this keeper holds it: a keeper waiting on it opens anew
        os.close(keeper)
        _remove_leftovers()


# ---- helpers ------------------------------------------------------------------------------------


def _try_lock(fd: int, mode: int) -> bool:
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _lock_control(name: str, kind: str, mode: int, *, wait: bool = True, create: bool = True) -> int | None:
    """A descriptor of ``name``'s control file ``kind`` locked with ``mode`` (``flock``), the file
    that is at its path once locked; ``None`` if the lock is taken and not ``wait``.  A file is
    unlinked only by a holder of its exclusive lock, so one locked after it was unlinked is closed
    and the path opened again.  Without ``create``, a missing file raises ``FileNotFoundError``."""
    path = control_path(name, kind)
    flags = os.O_CLOEXEC | (os.O_RDWR | os.O_CREAT if create else os.O_RDONLY)
    while True:
        fd = os.open(path, flags, 0o600)
        try:
            if wait:
                fcntl.flock(fd, mode)
            elif not _try_lock(fd, mode):
                os.close(fd)
                return None
            opened = os.fstat(fd)
            with contextlib.suppress(FileNotFoundError):
                current = os.stat(path)
                if (current.st_dev, current.st_ino) == (opened.st_dev, opened.st_ino):
                    return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _unlink_control(name: str, kind: str) -> None:
    """Remove ``name``'s control file ``kind``; the caller holds it exclusively (or it is not a lock)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(control_path(name, kind))


def _lock_unless_leased(name: str, create: bool = True) -> int | None:
    """``name``'s ``inuse`` file locked exclusively, or ``None`` while a lease holds it.  Leases hold
    it shared; a keeper or drop removing the root (or another ``ls`` looking) holds it
    exclusively, for as long as that takes: then this waits (up to :data:`_REMOVAL_WAIT_SECONDS`)
    instead of taking the removal for a lease.  A shared holder seen on a few tries 20 ms apart is
    a lease."""
    deadline = time.monotonic() + _REMOVAL_WAIT_SECONDS
    shared = 0
    while True:
        fd = _lock_control(name, "inuse", fcntl.LOCK_EX, wait=False, create=create)
        if fd is not None:
            return fd
        if _held_shared(name):
            shared += 1
            if shared >= 5:
                return None
        elif time.monotonic() > deadline:
            return None
        time.sleep(0.02)


def _held_shared(name: str) -> bool:
    """Whether ``name``'s ``inuse`` file can be locked shared now (nobody holds it exclusively),
    which after a failed exclusive try means a lease holds it."""
    try:
        fd = os.open(control_path(name, "inuse"), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        return _try_lock(fd, fcntl.LOCK_SH)
    finally:
        os.close(fd)


_REMOVAL_WAIT_SECONDS = 30.0
"""How long a drop or ``ls`` waits for a removal in progress to end."""


def _write_settings(name: str, hold_after_exit: float) -> None:
    path = control_path(name, "settings")
    staging = f"{path}.{_SETTINGS_STAGING}{os.getpid()}-{threading.get_ident()}"  # one per writing thread
    with open(staging, "w") as f:
        json.dump({"hold_after_exit": float(hold_after_exit)}, f)
    os.replace(staging, path)


def _hold_seconds(name: str) -> float:
    try:
        with open(control_path(name, "settings")) as f:
            return float(json.load(f)["hold_after_exit"])
    except (OSError, ValueError, KeyError, TypeError):
        return DEFAULT_HOLD_AFTER_EXIT


def _forget(name: str, *, locked: bool) -> None:
    """Remove the root (if any), its hold settings and, when the caller holds it (``locked``), the
    ``inuse`` file."""
    _remove_root(name)
    _unlink_control(name, "settings")
    if locked:
        _unlink_control(name, "inuse")


def _remove_leftovers() -> None:
    """Remove what removals cut short left behind: lock files of names with neither a root nor
    settings (versions before this one never removed them; a process killed between the unlinks),
    each while holding it; settings files a lease died writing; and roots renamed out of sight
    for deletion (tmpfs memory nothing would ever free otherwise: a doomed root is anyone's to
    delete, so one whose remover still runs is deleted by both)."""
    try:
        directory = private_directory(create=False)
        entries = os.listdir(directory)
    except (FileNotFoundError, UnsafeCheckpointError):
        return
    for entry in entries:
        if entry.startswith(_DOOMED_PREFIX):
            shutil.rmtree(os.path.join(directory, entry), ignore_errors=True)
    try:
        controls = os.listdir(os.path.join(directory, CONTROL_DIRECTORY))
    except FileNotFoundError:
        return
    for entry in controls:
        name, _, kind = entry.rpartition(".")
        if kind.startswith(_SETTINGS_STAGING):  # _write_settings's staging file: lives for microseconds
            with contextlib.suppress(FileNotFoundError):
                staged = os.path.join(directory, CONTROL_DIRECTORY, entry)
                if time.time() - os.stat(staged).st_mtime > _STALE_SETTINGS_SECONDS:
                    os.unlink(staged)
            continue
        if kind not in ("inuse", "keeper") or not _orphan(name):
            continue
        with contextlib.suppress(FileNotFoundError):
            fd = _lock_control(name, kind, fcntl.LOCK_EX, wait=False, create=False)
            if fd is not None:
                try:
                    if _orphan(name):  # a lease that came meanwhile has written its settings
                        _unlink_control(name, kind)
                finally:
                    os.close(fd)


_DOOMED_PREFIX = ".dropping-"
"""How :func:`_remove_root` names a root renamed out of sight for deletion."""

_SETTINGS_STAGING = "staging-"
"""What follows ``NAME.settings.`` in the name of settings being written (never a control file's
kind: those are ``inuse``, ``keeper`` and ``settings``)."""

_STALE_SETTINGS_SECONDS = 60.0


def _orphan(name: str) -> bool:
    try:
        return not os.path.exists(control_path(name, "settings")) and not os.path.isdir(held_path(name))
    except ConfigError:  # not a name of ours
        return False


def _remove_root(name: str) -> None:
    """Rename the root out of sight, then delete it (a reader never sees half a root)."""
    path = held_path(name)
    doomed = os.path.join(os.path.dirname(path), f"{_DOOMED_PREFIX}{name}-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.rename(path, doomed)
    except FileNotFoundError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


def _describe(name: str) -> HeldRoot:
    path = held_path(name)
    nbytes = bytes_under(path, allocated=True)
    in_use = False
    with contextlib.suppress(FileNotFoundError):
        fd = _lock_unless_leased(name, create=False)
        if fd is None:
            in_use = True
        else:
            os.close(fd)
    keeper_pid = None
    with contextlib.suppress(FileNotFoundError, ValueError, IndexError):  # IndexError: pid not written yet
        fd = os.open(control_path(name, "keeper"), os.O_RDONLY | os.O_CLOEXEC)
        try:
            if not _try_lock(fd, fcntl.LOCK_EX):
                keeper_pid = int(os.pread(fd, 32, 0).split()[0])
        finally:
            os.close(fd)
    hold = _hold_seconds(name) if os.path.exists(control_path(name, "settings")) else None
    return HeldRoot(HELD_SCHEME + name, path, nbytes, in_use, keeper_pid, hold)


if __name__ == "__main__":
    sys.exit(main())
