"""A local cache of remote checkpoint files, so loading the same checkpoint twice reads disk.

A file is downloaded whole, in ranges, into ``<cache_dir>/<hash of the checkpoint URL>/``, its
CRC32C checked against the manifest while it streams (when there is one), and renamed into
place; later loads use the local copy when its size matches.  Only files a load needs are
fetched.
"""

from __future__ import annotations

import hashlib
import os
import secrets

from ..errors import CorruptCheckpointError
from ..formats.checksum import crc32c, format_crc
from ..formats.manifest import FileRecord
from ..storage import LocalStorage, RangeReader, Storage, read_chunks

__all__ = ["FileCache"]

_CHUNK = 64 * 1024 * 1024


class FileCache:
    """Caches files of the checkpoint at ``source`` under ``cache_dir``."""

    def __init__(self, cache_dir: str, source: str) -> None:
        digest = hashlib.sha256(source.encode()).hexdigest()[:20]
        self.directory = os.path.join(os.path.abspath(os.path.expanduser(cache_dir)), digest)
        self.local = LocalStorage()

    def path(self, file_name: str) -> str:
        return os.path.join(self.directory, file_name)

    def open(self, storage: Storage, remote_path: str, file_name: str, record: FileRecord | None) -> RangeReader:
        """A local reader on ``file_name``, downloading it first unless a matching copy exists."""
        cached = self.path(file_name)
        expected = record.size if record is not None else None
        if os.path.exists(cached) and (expected is None or os.path.getsize(cached) == expected):
            return self.local.open_reader(cached)
        os.makedirs(self.directory, exist_ok=True)
        source = storage.open_reader(remote_path)
        tmp = f"{cached}.part-{secrets.token_hex(4)}"
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
            os.replace(tmp, cached)
        finally:
            source.close()
            if os.path.exists(tmp):
                os.unlink(tmp)
        return self.local.open_reader(cached)
