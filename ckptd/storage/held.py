"""The ``shm://NAME`` namespace: checkpoint roots in this user's private shared memory.

``shm://run42`` is the directory ``<base>/ckptd-<uid>/run42``, where ``<base>`` is ``/dev/shm``
(a tmpfs: its files are memory) or ``CKPTD_HELD_DIR``.  Files there outlive the process that
wrote them, which is what lets a new training process restore from memory after the old one died
(:mod:`ckptd.writer.keeper` bounds how long they are held).  The per-user directory is the
security boundary: it is created ``0700``, and a directory that is not a real directory owned by
this user and closed to everyone else is refused, never used (another user could have created it
to read or plant snapshots).  ``memory://`` is something else: fsspec's in-process filesystem,
gone with the process.

Next to the roots, ``.hold/`` holds each name's control files (:func:`control_path`): the lease
lock that live trainers share, the keeper's lock and the hold settings.
"""

from __future__ import annotations

import os
import re
import stat

from ..errors import ConfigError, UnsafeCheckpointError

__all__ = [
    "HELD_BASE_VARIABLE",
    "HELD_SCHEME",
    "control_path",
    "held_name",
    "held_names",
    "held_path",
    "in_held_memory",
    "is_held",
    "private_directory",
]

HELD_SCHEME = "shm://"
HELD_BASE_VARIABLE = "CKPTD_HELD_DIR"
DEFAULT_HELD_BASE = "/dev/shm"
CONTROL_DIRECTORY = ".hold"
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")


def is_held(url: str) -> bool:
    """True for ``shm://NAME`` roots."""
    return url.startswith(HELD_SCHEME)


def held_name(url: str) -> str:
    """The NAME of ``shm://NAME`` (a trailing slash allowed); a :class:`ConfigError` for anything
    that is not one plain name (no ``/``, no ``..``, at most 128 characters)."""
    name = url[len(HELD_SCHEME) :].rstrip("/") if is_held(url) else url
    if not _NAME.match(name):
        raise ConfigError(
            f"{url!r}: a held-memory root is shm://NAME with NAME made of letters, digits, '.', '_' "
            "and '-' (no '/', at most 128 characters)"
        )
    return name


def private_directory(create: bool = True) -> str:
    """This user's directory of held roots, created ``0700`` if missing (unless ``create`` is
    false); an :class:`UnsafeCheckpointError` when it is a link, not a directory, not this
    user's, or open to the group or others."""
    base = os.path.abspath(os.environ.get(HELD_BASE_VARIABLE) or DEFAULT_HELD_BASE)
    path = os.path.join(base, f"ckptd-{os.getuid()}")
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as e:
            where = (
                f"{HELD_BASE_VARIABLE}={os.environ[HELD_BASE_VARIABLE]} names a directory that does not exist"
                if os.environ.get(HELD_BASE_VARIABLE) and not os.path.isdir(base)
                else f"{e.strerror} (set {HELD_BASE_VARIABLE} to a memory filesystem this user can write)"
            )
            raise ConfigError(f"cannot create {path} for held-memory roots: {where}") from e
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return path
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise UnsafeCheckpointError(
            f"{path} is not a private directory of uid {os.getuid()} (a link, another user's, or open to "
            f"others: mode {stat.filemode(info.st_mode)}, owner uid {info.st_uid}); held-memory roots are "
            f"refused there: remove it, or set {HELD_BASE_VARIABLE} to another base"
        )
    return path


def held_path(url: str) -> str:
    """The directory of the held root ``shm://NAME`` (its parent checked private)."""
    return os.path.join(private_directory(), held_name(url))


def bytes_under(root: str, *, allocated: bool = False) -> int:
    """Bytes of the files under ``root``, each file once however many names it has (a held
    root's staging files are also its checkpoints' shard files, an incremental save links a
    file into several checkpoints): their sizes, or with ``allocated`` the memory they take."""
    total = 0
    seen: set[tuple[int, int]] = set()
    for directory, _, files in os.walk(root):
        for name in files:
            try:
                info = os.lstat(os.path.join(directory, name))
            except OSError:
                continue
            if (info.st_dev, info.st_ino) not in seen:
                seen.add((info.st_dev, info.st_ino))
                total += info.st_blocks * 512 if allocated else info.st_size
    return total


def in_held_memory(path: str) -> bool:
    """Whether the local ``path`` lies in this user's held-memory directory (a tmpfs by default)."""
    try:
        directory = private_directory(create=False)
    except UnsafeCheckpointError:
        return False
    return os.path.abspath(path).startswith(directory + os.sep)


def control_path(name: str, kind: str) -> str:
    """The control file ``kind`` (``inuse``, ``keeper``, ``settings``) of held root ``name``,
    in the private ``.hold`` directory (created ``0700`` if missing)."""
    directory = os.path.join(private_directory(), CONTROL_DIRECTORY)
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    return os.path.join(directory, f"{held_name(name)}.{kind}")


def held_names() -> list[str]:
    """The names of this user's held roots (directories and control files), sorted."""
    directory = private_directory(create=False)
    names: set[str] = set()
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        return []
    names.update(entry for entry in entries if _NAME.match(entry) and os.path.isdir(os.path.join(directory, entry)))
    try:
        controls = os.listdir(os.path.join(directory, CONTROL_DIRECTORY))
    except FileNotFoundError:
        controls = []
    names.update(entry.rsplit(".", 1)[0] for entry in controls if entry.endswith(".settings"))
    return sorted(name for name in names if _NAME.match(name))
