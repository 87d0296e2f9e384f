"""Staging arenas that become the checkpoint: one file per shard, in a held-memory root.

A save to a held-memory root (``shm://NAME``) used to copy twice: the trainer's copy into the
arena, then the writer's copy of the arena into the shard files, both in memory.  The second
copy is the writer's CPU, taken from training on a busy host.  A :class:`FileArena` stages each
shard file the rank writes into a file of its own, of exactly the shard's size, in the root's
``.ckptd-arenas`` directory (the same tmpfs as the checkpoints).  The writer checksums it and
hard-links it into the save's staging directory instead of writing it
(:class:`~ckptd.writer.protocol.FileSpec` ``adopt``): the staging copy is the only copy.

Once linked, the files are the checkpoint's.  The arena is **lent**: no save copies into it while
any of its files has another name (:attr:`FileArena.lent`, the link count).  When retention
deletes that checkpoint (or makes it the root's spare, which drops linked files), the link count
falls back to one and the next save with the same layout copies into the same, already mapped,
pages.  So a held root with ``keep_last=K`` holds K checkpoints and one arena, where it held K
checkpoints, an arena and a spare.  A reader of a deleted checkpoint whose pages are reused is
told (``CheckpointReplacedError``): a checkpoint of a held root is always renamed away before
its pages are reused, and the reader's last check sees that.

A copy of such a checkpoint to a local tier, by the same trainer, writes these pages as they
are mapped (:func:`mapped_staging_file`), instead of reading the files into a buffer first;
meanwhile the arena counts as lent.

Only plans whose every piece is a whole file get one (no file shared by several ranks, no
reused file, no budget): :func:`adoptable` decides.  The files are created by
:meth:`~ckptd.writer.shm.SharedSegment.create_file`, whose creator unlinks its names at close; a
killed trainer's are removed by the next Checkpointer that opens the root
(:func:`~ckptd.writer.shm.remove_abandoned_files`, from ``collect_garbage``) or with the whole
root by the keeper.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import stat
import threading
from collections.abc import Iterator

import torch

from ..errors import ConfigError, WriterError
from ..formats.names import ARENAS_NAME
from ..writer.shm import SharedSegment
from .arena import StagingArena, pin_pages, unpin_pages
from .arena_views import ArenaView, lay_out_piece
from .plan import RankPlan

__all__ = ["FileArena", "adoptable", "arena_directory", "mapped_staging_file"]

_registry_lock = threading.Lock()
_mapped_files: dict[tuple[int, int], tuple[FileArena, SharedSegment]] = {}
"""This process's staging files by (device, inode): what :func:`mapped_staging_file` finds."""


def adoptable(plan: RankPlan) -> bool:
    """Whether ``plan`` can be staged in files that become the checkpoint's: every piece a whole
    file starting on a page (each is its own file, mapped from its start)."""
    return bool(plan.pieces) and all(p.whole_file and p.arena_offset % mmap.PAGESIZE == 0 for p in plan.pieces)


def arena_directory(root: str) -> str:
    """The directory of ``root``'s staging files (``.ckptd-arenas``, mode ``0700``), created if
    missing.  (The files a dead trainer left there are removed by ``collect_garbage``, which
    every Checkpointer runs when it opens the root.)"""
    directory = os.path.join(root, ARENAS_NAME)
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise ConfigError(f"cannot create the staging directory {directory} of held root {root}: {e}") from e
    try:
        info = os.lstat(directory)
    except OSError as e:
        raise ConfigError(f"cannot use the staging directory {directory} of held root {root}: {e}") from e
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        what = "a symlink" if stat.S_ISLNK(info.st_mode) else "not a directory of this user"
        raise ConfigError(f"the staging directory {directory} of held root {root} is {what}: remove it")
    return directory


class FileArena(StagingArena):
    """An arena of one file per piece (see the module docstring), laid out for one plan only.

    ``writer_ids`` gives each file the id under which the writer maps it
    (:attr:`writer_segments`); ``arena_id`` names the arena in messages and logs only.
    """

    def __init__(
        self, arena_id: int, plan: RankPlan, directory: str, writer_ids: Iterator[int], populate: bool = True
    ) -> None:
        if not adoptable(plan):
            raise WriterError(f"staging arena {arena_id}: shared or unaligned pieces need a shared-memory arena")
        self.arena_id = arena_id
        self.plan = plan
        self.busy = False
        self.new_memory = not populate
        self.last_used = 0  # the pool's counter at the last save staged here
        self._owner = os.getpid()  # a fork()ed child neither unpins (CUDA is unusable there) nor unlinks
        self._stream_parts = []
        self._stream = None
        self._base = None  # no single segment: each file has its own (below)
        self.files: dict[str, tuple[int, SharedSegment, torch.Tensor]] = {}  # name -> writer id, segment, bytes
        self._pinned: set[str] = set()
        self.pinned = False
        prefix = f"{os.getpid()}-{secrets.token_hex(4)}-{arena_id}"
        try:
            for index, piece in enumerate(plan.pieces):
                segment = SharedSegment.create_file(os.path.join(directory, f"{prefix}-{index}"), piece.size)
                base = torch.frombuffer(segment.mmap, dtype=torch.uint8)
                self.files[piece.file_name] = (next(writer_ids), segment, base)
                if populate:
                    base.zero_()  # faulted in now: the first copy only copies (prepare())
        except BaseException:
            self._close_files()
            raise
        self._pinned = {name for name, (_, _, base) in self.files.items() if pin_pages(base)}
        self.pinned = bool(self.files) and len(self._pinned) == len(self.files)
        self._views = self._build_views(plan)
        self.borrowed = 0  # files read by mapped_staging_file() now: no save copies into the arena
        with _registry_lock:
            for _, segment, _ in self.files.values():
                _mapped_files[_identity(segment.fd)] = (self, segment)

    @property
    def size(self) -> int:
        return self.plan.arena_size if self.plan is not None else 0

    @property
    def streamed(self) -> bool:
        return False

    @property
    def lent(self) -> bool:
        """A file of this arena is also a checkpoint's, or is being read through the mapping
        (:func:`mapped_staging_file`): no save may copy into it now."""
        return self.borrowed > 0 or any(segment.links() > 1 for _, segment, _ in self.files.values())

    @property
    def writer_segments(self) -> list[tuple[int, SharedSegment]]:
        return [(writer_id, segment) for writer_id, segment, _ in self.files.values()]

    def writer_id(self, file_name: str) -> int:
        """The writer's id of the file staged for ``file_name``."""
        return self.files[file_name][0]

    def layout(self, plan: RankPlan) -> None:
        if self.plan is None or self.plan.signature != plan.signature:
            raise WriterError(f"staging arena {self.arena_id} holds the files of another layout")

    def _build_views(self, plan: RankPlan) -> list[ArenaView]:
        views: list[ArenaView] = []
        strides: dict[tuple[int, ...], tuple[int, ...]] = {}
        for piece in plan.pieces:  # each file is its own base, from its first byte
            lay_out_piece(self.files[piece.file_name][2], 0, piece, views, {}, strides)
        views.sort(key=lambda v: v[0])
        return views

    def close(self) -> None:
        """Drop the views, unpin, unmap and unlink this arena's names (a checkpoint that links a
        file keeps its bytes)."""
        self._views = []
        self.plan = None
        self._close_files()

    def _close_files(self) -> None:
        files, self.files = self.files, {}
        with _registry_lock:
            for _, segment, _ in files.values():
                if segment.fd >= 0:
                    _mapped_files.pop(_identity(segment.fd), None)
        for name in list(files):
            _, segment, base = files.pop(name)
            if name in self._pinned and os.getpid() == self._owner:
                unpin_pages(base)
            del base  # the last export of the mapping: it can be unmapped now
            segment.close()
        self._pinned = set()
        self.pinned = False


def _identity(fd: int) -> tuple[int, int]:
    info = os.fstat(fd)
    return info.st_dev, info.st_ino


@contextlib.contextmanager
def mapped_staging_file(fd: int, size: int) -> Iterator[memoryview | None]:
    """This process's own mapping of the file open as ``fd`` when it is one of its staging
    files, of ``size`` bytes, still linked into a checkpoint; else ``None``.

    A copy of a committed held-memory checkpoint to a slower tier reads its bytes from there:
    the pages are mapped already, so an ``O_DIRECT`` write takes them as they are, where a
    ``pread`` copies them first and a fresh mapping faults every page in.  While the view is
    out, the arena counts as lent: no save copies into it, so bytes checked are bytes written.
    (An arena closed meanwhile keeps its mapping until the view is released.)"""
    try:
        key = _identity(fd)
    except OSError:
        yield None
        return
    with _registry_lock:
        entry = _mapped_files.get(key)
        if entry is not None:
            entry[0].borrowed += 1
    if entry is None:
        yield None
        return
    arena, segment = entry
    view: memoryview | None = None
    try:
        # checked once borrowed: a save that picked the arena before saw it lent or took it now
        if segment.mmap is not None and segment.size == size and segment.links() > 1 and not arena.busy:
            view = memoryview(segment.mmap)
        yield view
    finally:
        if view is not None:
            view.release()
        with _registry_lock:
            arena.borrowed -= 1
