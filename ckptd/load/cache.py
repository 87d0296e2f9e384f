"""A local cache of remote checkpoint files, so loading the same checkpoint twice reads disk.

A file is downloaded whole, in ranges, into ``<cache_dir>/<hash of the checkpoint URL>/``, its
CRC32C checked against the manifest while it streams (when there is one), and renamed into
place; later loads use the local copy.  Only files a load needs are fetched.

A cached copy is named by the version it holds, never by its name alone: a checkpoint
overwritten in place keeps its files' names (and often their sizes), and serving the old copy
beside the new manifest would mix two versions.  The version is the manifest's record of the
file (size and CRC32C), or, for files no manifest lists, the store's version stamp of the object
(checked again once it is downloaded: a file replaced meanwhile is
:class:`~ckptd.errors.CheckpointReplacedError`).  Copies of a file's older versions are removed
when a newer one is cached.
"""

from __future__ import annotations

import hashlib
import os
import secrets

from ..errors import CheckpointReplacedError, CorruptCheckpointError, MissingFileError
from ..formats.checksum import crc32c, format_crc
from ..formats.manifest import FileRecord
from ..storage import LocalStorage, RangeReader, Storage, read_chunks

__all__ = ["FileCache"]

_CHUNK = 64 * 1024 * 1024
_PART = ".part-"


class FileCache:
    """Caches files of the checkpoint at ``source`` under ``cache_dir``."""

    def __init__(self, cache_dir: str, source: str) -> None:
        digest = hashlib.sha256(source.encode()).hexdigest()[:20]
        self.directory = os.path.join(os.path.abspath(os.path.expanduser(cache_dir)), digest)
        self.local = LocalStorage()

    def path(self, file_name: str, tag: str) -> str:
        """Where the version ``tag`` of ``file_name`` is cached."""
        return os.path.join(self.directory, f"{file_name}.v-{tag}")

    def open(self, storage: Storage, remote_path: str, file_name: str, record: FileRecord | None) -> RangeReader:
        """A local reader on the version of ``file_name`` that ``record`` describes (without a
        record: the version the store holds now), downloading it unless it is cached."""
        stamp = None
        if record is not None:
            tag = f"{record.size}-{record.crc32c}"
        else:
            stamp = storage.version(remote_path)
            tag = hashlib.sha256(stamp.encode()).hexdigest()[:20] if stamp is not None else ""
        if tag:  # a store that names no version is downloaded afresh
            try:
                return self.local.open_reader(self.path(file_name, tag))
            except MissingFileError:
                pass
        return self._download(storage, remote_path, file_name, record, tag, stamp)

    def _download(
        self,
        storage: Storage,
        remote_path: str,
        file_name: str,
        record: FileRecord | None,
        tag: str,
        stamp: str | None,
    ) -> RangeReader:
        cached = self.path(file_name, tag or secrets.token_hex(8))
        os.makedirs(os.path.dirname(cached), exist_ok=True)  # spread names hold a subdirectory
        source = storage.open_reader(remote_path)
        tmp = f"{cached}{_PART}{secrets.token_hex(4)}"
        try:
            value = 0
            with open(tmp, "wb") as out:
                for chunk in read_chunks(source, source.size, _CHUNK):
                    value = crc32c(chunk, value)
                    out.write(chunk)
            if record is not None and (source.size != record.size or format_crc(value) != record.crc32c):
                raise CorruptCheckpointError(
                    f"{remote_path}: downloaded {source.size} bytes with CRC32C {format_crc(value)}, "
                    f"the manifest says {record.size} bytes, {record.crc32c}"
                )
            if stamp is not None and storage.version(remote_path) != stamp:
                raise CheckpointReplacedError(f"{remote_path}: replaced while it was downloaded; load it again")
            reader = self.local.open_reader(tmp)
            os.replace(tmp, cached)
        finally:
            source.close()
            if os.path.exists(tmp):
                os.unlink(tmp)
        reader.path = cached
        if tag:
            self._forget_others(file_name, cached)
        else:
            os.unlink(cached)  # not reusable: no version to know it by (the open reader keeps it)
        return reader

    def _forget_others(self, file_name: str, keep: str) -> None:
        """Remove the cached copies of ``file_name``'s other versions (a reader holding one open
        keeps reading it; downloads in progress are left alone)."""
        folder, prefix = os.path.dirname(keep), os.path.basename(file_name) + ".v-"
        try:
            names = os.listdir(folder)
        except OSError:
            return
        for name in names:
            path = os.path.join(folder, name)
            if name.startswith(prefix) and _PART not in name and path != keep:
                try:
                    os.unlink(path)
                except OSError:
                    pass
