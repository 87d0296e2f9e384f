"""One version: what keeps every read of one :class:`~ckptd.load.reader.CheckpointReader` on the
version of the checkpoint it opened, while that checkpoint may be overwritten or deleted.

* Local: the checkpoint directory is opened once (:class:`~ckptd.storage.local_read.
  PinnedDirectory`) before its manifest is read, and every file (manifest, state file, indexes,
  shards, the size listing, ``verify`` and the direct-read pool) is opened relative to it; so are
  the sibling directories holding files an older incremental save referenced.  An overwrite
  swaps a new directory in and deletes the old one: files already open stay readable, a file not
  yet open is gone, which is :class:`~ckptd.errors.CheckpointReplacedError`.
* Object stores have no directory to hold: the manifest's version stamp (ETag, generation...) is
  taken before the manifest is read, checked again once every file of a read is open (before a
  byte of it is read) and after the reads (before any value is returned).  An overwrite removes
  the old manifest before it writes a byte of the new version, so files opened while the
  manifest was still the one read are of that version; S3 reads then ask ``If-Match`` the ETag
  each file had when it was opened, so no byte of another version reaches a target.  A changed
  or missing stamp is :class:`~ckptd.errors.CheckpointReplacedError`, and so is a failure (a
  size or CRC32C that does not match, a file gone) of a read whose checkpoint has since been
  replaced.  On stores without conditional reads (GCS, ``memory://``) the check after the reads
  is what notices a replacement that came between two reads.
"""

from __future__ import annotations

import contextlib
import errno as errno_codes
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

from ..catalog import sibling_checkpoint
from ..errors import (
    CheckpointNotFoundError,
    CheckpointReplacedError,
    ConfigError,
    CorruptCheckpointError,
    MissingFileError,
    StorageError,
)
from ..formats.json_files import check_listed, json_limit, read_listed_file, read_small_file
from ..formats.manifest import FileRecord
from ..formats.names import MANIFEST_NAME
from ..storage import Storage, check_file_name
from ..storage.held import in_held_memory
from ..storage.local_read import LocalReader, PinnedDirectory

if TYPE_CHECKING:
    import torch

__all__ = ["OneVersion", "holder"]


class OneVersion:
    """The version one reader reads: the pinned directories (local) or the manifest's stamp
    (object stores) of the checkpoint at ``directory``.

    Call order: 1. :meth:`open` (local: the directory is opened); 2. :meth:`take_stamp` right
    before the manifest is read (object stores); 3. the reads, each through :meth:`guard`, with
    :meth:`check_unchanged` once their files are open, before a byte is read; 4.
    :meth:`check_unchanged` after them, before their values are handed out; 5. :meth:`close`.
    """

    def __init__(self, storage: Storage, directory: str, pinned: PinnedDirectory | None = None) -> None:
        self.storage = storage
        self.directory = directory
        self.stamp: str | None = None
        # The checkpoint's directory (key None) and referenced siblings (their names).
        self._pins: dict[str | None, PinnedDirectory] = {} if pinned is None else {None: pinned}
        self._lock = threading.Lock()
        self._closed = False
        self._listings: dict[tuple[str | None, str], dict[str, int]] = {}
        self._size_checked: set[str] = set()
        self._held = storage.local and in_held_memory(directory)

    @classmethod
    def open(cls, storage: Storage, directory: str) -> OneVersion:
        """Local: ``directory`` opened now (a missing one is :class:`CheckpointNotFoundError`)."""
        return cls(storage, directory, _pin(directory) if storage.local else None)

    def close(self) -> None:
        """Release the directories held open; a later local read is a :class:`ConfigError` (it
        could only open whatever version is there now)."""
        with self._lock:
            self._closed = True
            for pinned in self._pins.values():
                pinned.close()
            self._pins.clear()

    # ---- local: pinned directories ----------------------------------------------------------

    def pinned(self, checkpoint: str | None = None) -> PinnedDirectory:
        """The open directory holding a file: the checkpoint's, or the sibling ``checkpoint`` an
        older incremental save referenced.  Opened on first use, then kept."""
        with self._lock:
            pinned = self._pins.get(checkpoint)
            if pinned is None:
                if self._closed:
                    raise ConfigError(f"{self.directory}: read after its CheckpointReader was closed")
                place = holder(self.storage, self.directory, checkpoint)
                pinned = self._pins[checkpoint] = _pin(place) if checkpoint is None else PinnedDirectory(place)
            return pinned

    def names(self) -> list[str]:
        """What is in the checkpoint directory (one listing)."""
        if self.storage.local:
            return self.pinned().names()
        return self.storage.list_names(self.directory)

    def sizes(self, checkpoint: str | None, subdirectory: str) -> dict[str, int]:
        """``{name: size}`` of the files in the checkpoint (or sibling ``checkpoint``), or in one of
        its subdirectories; empty where that directory does not exist."""
        if self.storage.local:
            try:
                return self.pinned(checkpoint).sizes(subdirectory)
            except MissingFileError:
                return {}  # a referenced sibling that is gone: its files are missing
        place = holder(self.storage, self.directory, checkpoint)
        return self.storage.sizes(self.storage.join(place, subdirectory) if subdirectory else place)

    def pin_siblings(self, files: Mapping[str, FileRecord]) -> None:
        """Locally, open now the sibling checkpoints that ``files`` (a manifest's records) are held
        in (checkpoints of ckptd < 0.2 referenced earlier ones), so that what is read later is
        what was there when the checkpoint was opened; a sibling already gone is left for the
        size check of a read that needs it."""
        if not self.storage.local:
            return
        for checkpoint in {record.checkpoint for record in files.values() if record.checkpoint is not None}:
            with contextlib.suppress(MissingFileError):
                self.pinned(checkpoint)

    def check_sizes(self, files: Mapping[str, FileRecord], names: Iterable[str] | None = None) -> None:
        """Raise :class:`~ckptd.errors.CorruptCheckpointError` unless each of ``names`` (every
        file of ``files``, the manifest's records, by default) exists with the size it records.

        One listing per directory (the checkpoint's, its spread subdirectories, and, for
        checkpoints of ckptd < 0.2, the siblings it references), kept; each file checked once."""
        where = self.storage.join(self.directory, MANIFEST_NAME)
        for name in files if names is None else dict.fromkeys(names):
            record = files.get(name)
            if record is None or name in self._size_checked:
                continue
            place = holder(self.storage, self.directory, record.checkpoint)
            path = self.storage.join(place, check_file_name(name, where))
            subdirectory, _, base = name.rpartition("/")  # "3f/model-...": the spread key layout
            key = (record.checkpoint, subdirectory)
            listing = self._listings.get(key)
            if listing is None:
                listing = self._listings[key] = self.sizes(record.checkpoint, subdirectory)
            actual = listing.get(base)
            if actual is None:
                raise CorruptCheckpointError(f"{path}: listed in the manifest but missing")
            if actual != record.size:
                raise CorruptCheckpointError(
                    f"{path}: file is {actual} bytes but the manifest says {record.size} (truncated or replaced)"
                )
            self._size_checked.add(name)

    def reader(self, name: str, checkpoint: str | None = None) -> LocalReader:
        """A local file of the checkpoint, opened in its pinned directory."""
        return self.pinned(checkpoint).reader(name)

    def read_small(self, name: str, *, follow_symlinks: bool) -> bytes:
        """A small file of the checkpoint directory (manifest, state file, index) with the checks
        of :func:`~ckptd.formats.json_files.read_small_file`."""
        where = self.storage.join(self.directory, name)
        if not self.storage.local:
            return read_small_file(self.storage, where, follow_symlinks=follow_symlinks)
        limit = json_limit()
        data = self.pinned().read_small(name, limit, follow_symlinks=follow_symlinks)
        if data is None:
            raise CorruptCheckpointError(
                f"{where} is larger than the {limit}-byte limit for checkpoint metadata files "
                "(set CKPTD_MAX_JSON_BYTES to raise it if the file is genuine)"
            )
        return data

    def read_listed(self, name: str, record: FileRecord | None) -> bytes:
        """A small file the manifest lists (state file, index), checked against its record as
        :func:`~ckptd.formats.json_files.read_listed_file` does."""
        where = self.storage.join(self.directory, name)
        if not self.storage.local:
            return read_listed_file(self.storage, where, record)
        data = self.read_small(name, follow_symlinks=False)
        return data if record is None else check_listed(data, record, where)

    def load_bin(
        self, name: str, path: str, checkpoint: str | None, load: Callable[[str], dict[str, torch.Tensor]] | None = None
    ) -> dict[str, torch.Tensor]:
        """A local ``.bin`` file, which torch opens by path (memory-mapped): the path must name
        the pinned directory's file before and after, so torch read that very file (its inode
        stays in use meanwhile, so no other file can take its identity).  ``load(path)`` reads
        it (default: :func:`~ckptd.formats.torch_bin.load_bin`, a flat mapping of tensors)."""
        pinned = self.pinned(checkpoint)
        if not pinned.same_file(name, path):
            raise _replaced_file(path, pinned)
        from ..formats.torch_bin import load_bin  # torch: only for the pickled formats

        tensors = (load or load_bin)(path)
        if not pinned.same_file(name, path):
            raise _replaced_file(path, pinned)
        return tensors

    # ---- object stores: the manifest's stamp ------------------------------------------------

    def take_stamp(self) -> None:
        """Object stores: the manifest's version, taken before the manifest is read."""
        if self.storage.local:
            return
        where = self.storage.join(self.directory, MANIFEST_NAME)
        try:
            self.stamp = self.storage.version(where)
        except MissingFileError as e:
            raise CheckpointReplacedError(f"{where}: removed while the checkpoint was opened") from e

    def replaced(self) -> bool:
        """Whether the checkpoint was replaced since it was opened: locally, a pinned directory
        is no longer at its path; on object stores, the manifest differs from (or lacks) the
        one opened (a store that cannot answer counts as unchanged: the caller's error stands)."""
        if self.storage.local:
            with self._lock:
                pins = list(self._pins.values())
            return any(pinned.replaced() for pinned in pins)
        if self.stamp is None:
            return False
        try:
            return self.storage.version(self.storage.join(self.directory, MANIFEST_NAME)) != self.stamp
        except MissingFileError:
            return True
        except StorageError:
            return False

    def check_unchanged(self) -> None:
        """Raise :class:`CheckpointReplacedError` if the manifest's stamp changed since
        :meth:`take_stamp` (one ``HEAD``).  Locally what was read came from the pinned
        directories, one version, even if it has been replaced since; except in a held-memory
        root, whose retired checkpoint's files the next save overwrites (their pages are reused,
        :data:`~ckptd.formats.names.SPARE_NAME`): there a pinned directory no longer at its path
        is a replacement too (it is renamed away before any of its files is reused)."""
        if (not self.storage.local or self._held) and self.replaced():
            raise CheckpointReplacedError(
                f"{self.directory}: replaced (overwritten or deleted) while it was read: its {MANIFEST_NAME} is not "
                "the one the read began with; load it again"
            )

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """A failure of the reads inside (no manifest, a size or checksum that does not match, a
        file gone: locally, the old directory is being deleted) while the checkpoint has since
        been replaced is that replacement."""
        try:
            yield
        except (CorruptCheckpointError, StorageError, CheckpointNotFoundError) as e:
            if self.replaced():
                raise CheckpointReplacedError(
                    f"{self.directory}: replaced (overwritten or deleted) while it was read ({e}); load it again"
                ) from e
            raise


def _pin(directory: str) -> PinnedDirectory:
    """``directory`` opened once (missing, or not a directory: :class:`CheckpointNotFoundError`)."""
    try:
        return PinnedDirectory(directory)
    except MissingFileError as e:
        raise CheckpointNotFoundError(f"{directory}: no such checkpoint directory") from e
    except StorageError as e:
        if e.errno == errno_codes.ENOTDIR:
            raise CheckpointNotFoundError(f"{directory}: not a checkpoint directory") from e
        raise


def _replaced_file(path: str, pinned: PinnedDirectory) -> CheckpointReplacedError:
    change = "was replaced" if pinned.replaced() else "holds another file of that name now"
    return CheckpointReplacedError(
        f"{path}: replaced while it was read (the checkpoint directory {pinned.path} {change}); load it again"
    )


def holder(storage: Storage, directory: str, checkpoint: str | None) -> str:
    """The directory holding a file: ``directory``, or its sibling ``checkpoint`` (which must be
    a real directory inside the same root: :func:`~ckptd.catalog.sibling_checkpoint`)."""
    return directory if checkpoint is None else sibling_checkpoint(storage, directory, checkpoint)
