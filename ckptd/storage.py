"""The storage backend: local POSIX paths directly, everything else through fsspec.

Both backends offer the same small surface: sinks that stream a file (removing it on failure),
range readers, small whole-file reads and writes, listing, deletion and publishing a finished
checkpoint directory.  Local paths bypass fsspec so that files can be fsynced, renamed atomically
and read with ``pread`` straight into tensor memory.

This module imports nothing heavy (fsspec only when a URL needs it): the writer process uses it.
"""

from __future__ import annotations

import errno as errno_codes
import os
import shutil
from typing import Any, Protocol

from .errors import CheckpointExistsError, ConfigError, StorageError, UnsafeCheckpointError

__all__ = [
    "FsspecStorage",
    "LocalStorage",
    "RangeReader",
    "Sink",
    "Storage",
    "check_file_name",
    "is_local",
    "local_path",
    "storage_for",
]


def is_local(url: str) -> bool:
    """True for plain paths and ``file://`` URLs."""
    return "://" not in url or url.startswith("file://")


def check_file_name(name: str, where: str) -> str:
    """Refuse names that could leave the checkpoint directory (``..``, separators, absolute)."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\x00" in name:
        raise UnsafeCheckpointError(f"{where}: file name {name!r} is not a plain name inside the checkpoint")
    return name


class Sink(Protocol):
    """A file being written.  Call ``write`` any number of times, then ``finish`` or ``abort``."""

    def write(self, data: memoryview) -> None: ...

    def finish(self) -> None: ...

    def abort(self) -> None: ...


class RangeReader(Protocol):
    """An open file that serves byte ranges."""

    size: int

    def read_into(self, offset: int, buffer: memoryview) -> None: ...

    def read(self, offset: int, length: int) -> bytes: ...

    def close(self) -> None: ...


class Storage(Protocol):
    """Operations ckptd needs from a store.  Paths are full paths or URLs built with ``join``."""

    local: bool

    def join(self, *parts: str) -> str: ...

    def exists(self, path: str) -> bool: ...

    def list_names(self, path: str) -> list[str]: ...

    def makedirs(self, path: str) -> None: ...

    def open_sink(self, path: str, *, fsync: bool) -> Sink: ...

    def open_reader(self, path: str) -> RangeReader: ...

    def write_bytes(self, path: str, data: bytes, *, fsync: bool = True) -> None: ...

    def read_bytes(self, path: str) -> bytes: ...

    def size(self, path: str) -> int: ...

    def remove(self, path: str) -> None: ...

    def remove_tree(self, path: str) -> None: ...

    def publish_directory(self, staging: str, final: str) -> None: ...


def _storage_error(action: str, path: str, e: OSError) -> StorageError:
    reason = os.strerror(e.errno) if e.errno else str(e)
    err = StorageError(e.errno or 0, f"cannot {action} {path}: {reason}")
    err.filename = path
    return err


class _LocalSink:
    def __init__(self, path: str, fsync: bool) -> None:
        self.path = path
        self.fsync = fsync
        try:
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise _storage_error("create", path, e) from e

    def write(self, data: memoryview) -> None:
        try:
            while data:
                written = os.write(self.fd, data)
                data = data[written:]
        except OSError as e:
            raise _storage_error("write", self.path, e) from e

    def finish(self) -> None:
        try:
            if self.fsync:
                os.fsync(self.fd)
        except OSError as e:
            raise _storage_error("fsync", self.path, e) from e
        finally:
            os.close(self.fd)
            self.fd = -1

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class _LocalReader:
    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            self.size = os.fstat(self.fd).st_size
        except OSError as e:
            raise _storage_error("open", path, e) from e

    def read_into(self, offset: int, buffer: memoryview) -> None:
        buffer = buffer.cast("B") if buffer.format != "B" else buffer
        try:
            while buffer:
                got = os.preadv(self.fd, [buffer], offset)
                if got == 0:
                    raise StorageError(errno_codes.EIO, f"unexpected end of file in {self.path} at byte {offset}")
                buffer = buffer[got:]
                offset += got
        except StorageError:
            raise
        except OSError as e:
            raise _storage_error("read", self.path, e) from e

    def read(self, offset: int, length: int) -> bytes:
        out = bytearray(length)
        self.read_into(offset, memoryview(out))
        return bytes(out)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class LocalStorage:
    """Local files: fsync on write, atomic rename on publish, ``pread`` on read."""

    local = True

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def list_names(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise _storage_error("list", path, e) from e

    def makedirs(self, path: str) -> None:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise _storage_error("create directory", path, e) from e

    def open_sink(self, path: str, *, fsync: bool) -> Sink:
        return _LocalSink(path, fsync)

    def open_reader(self, path: str) -> RangeReader:
        return _LocalReader(path)

    def write_bytes(self, path: str, data: bytes, *, fsync: bool = True) -> None:
        sink = _LocalSink(path, fsync)
        try:
            sink.write(memoryview(data))
            sink.finish()
        except BaseException:
            sink.abort()
            raise

    def read_bytes(self, path: str) -> bytes:
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise _storage_error("read", path, e) from e

    def size(self, path: str) -> int:
        try:
            return os.stat(path).st_size
        except OSError as e:
            raise _storage_error("stat", path, e) from e

    def remove(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise _storage_error("remove", path, e) from e

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def fsync_directory(self, path: str) -> None:
        """Make a directory's entries durable (after creating or renaming files in it)."""
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        except OSError as e:
            raise _storage_error("fsync directory", path, e) from e
        finally:
            os.close(fd)

    def publish_directory(self, staging: str, final: str) -> None:
        """fsync ``staging``, rename it to ``final`` and fsync the parent: the local commit point."""
        self.fsync_directory(staging)
        try:
            os.rename(staging, final)
        except OSError as e:
            if e.errno in (errno_codes.ENOTEMPTY, errno_codes.EEXIST, errno_codes.EISDIR):
                raise CheckpointExistsError(f"checkpoint {final} already exists") from e
            raise _storage_error("rename to", final, e) from e
        self.fsync_directory(os.path.dirname(final) or ".")


class _FsspecSink:
    def __init__(self, fs: Any, path: str) -> None:
        self.fs = fs
        self.path = path
        try:
            self.file = fs.open(path, "wb")
        except OSError as e:
            raise _storage_error("create", path, e) from e

    def write(self, data: memoryview) -> None:
        try:
            self.file.write(data)
        except OSError as e:
            raise _storage_error("write", self.path, e) from e

    def finish(self) -> None:
        try:
            self.file.close()
        except OSError as e:
            raise _storage_error("finish", self.path, e) from e

    def abort(self) -> None:
        discard = getattr(self.file, "discard", None)
        try:
            if callable(discard):
                discard()
            else:
                self.file.close()
            if self.fs.exists(self.path):
                self.fs.rm(self.path)
        except OSError:
            pass


class _FsspecReader:
    def __init__(self, fs: Any, path: str) -> None:
        self.path = path
        try:
            self.file = fs.open(path, "rb")
            self.size = int(fs.size(path))
        except OSError as e:
            raise _storage_error("open", path, e) from e

    def read_into(self, offset: int, buffer: memoryview) -> None:
        target = buffer.cast("B") if buffer.format != "B" else buffer
        target[:] = self.read(offset, len(target))

    def read(self, offset: int, length: int) -> bytes:
        try:
            self.file.seek(offset)
            data = self.file.read(length)
        except OSError as e:
            raise _storage_error("read", self.path, e) from e
        if len(data) != length:
            raise StorageError(errno_codes.EIO, f"unexpected end of file in {self.path} at byte {offset + len(data)}")
        return bytes(data)

    def close(self) -> None:
        self.file.close()


class FsspecStorage:
    """Any fsspec filesystem (``memory://``, ``s3://``, ``gs://``...).  No renames: publishing a
    directory is a no-op because the manifest, written last, is the commit point."""

    local = False

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        try:
            import fsspec
        except ImportError as e:  # pragma: no cover - fsspec is a dependency
            raise ConfigError("fsspec is needed for URL storage; pip install fsspec") from e
        protocol = url.split("://", 1)[0]
        try:
            self.fs = fsspec.filesystem(protocol, **(storage_options or {}))
        except (ImportError, ValueError) as e:
            raise ConfigError(f"unsupported storage URL {url!r}: {e}") from e
        self.protocol = protocol

    def _strip(self, path: str) -> str:
        return str(self.fs._strip_protocol(path))

    def join(self, *parts: str) -> str:
        return "/".join(p.rstrip("/") for p in parts)

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(self._strip(path)))

    def list_names(self, path: str) -> list[str]:
        try:
            entries = self.fs.ls(self._strip(path), detail=False)
        except FileNotFoundError:
            return []
        return sorted(str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(self._strip(path), exist_ok=True)

    def open_sink(self, path: str, *, fsync: bool) -> Sink:
        return _FsspecSink(self.fs, self._strip(path))

    def open_reader(self, path: str) -> RangeReader:
        return _FsspecReader(self.fs, self._strip(path))

    def write_bytes(self, path: str, data: bytes, *, fsync: bool = True) -> None:
        try:
            self.fs.pipe_file(self._strip(path), data)
        except OSError as e:
            raise _storage_error("write", path, e) from e

    def read_bytes(self, path: str) -> bytes:
        try:
            return bytes(self.fs.cat_file(self._strip(path)))
        except FileNotFoundError:
            raise
        except OSError as e:
            raise _storage_error("read", path, e) from e

    def size(self, path: str) -> int:
        return int(self.fs.size(self._strip(path)))

    def remove(self, path: str) -> None:
        try:
            self.fs.rm(self._strip(path))
        except FileNotFoundError:
            pass

    def remove_tree(self, path: str) -> None:
        try:
            self.fs.rm(self._strip(path), recursive=True)
        except FileNotFoundError:
            pass

    def publish_directory(self, staging: str, final: str) -> None:
        if staging != final:
            raise ConfigError("object stores write checkpoints in place; staging and final must match")


def storage_for(url: str, storage_options: dict[str, Any] | None = None) -> Storage:
    """The backend for ``url``: :class:`LocalStorage` for paths and ``file://``, else fsspec."""
    if is_local(url):
        return LocalStorage()
    return FsspecStorage(url, storage_options)


def local_path(url: str) -> str:
    """The absolute filesystem path of a local path or ``file://`` URL."""
    path = url[len("file://") :] if url.startswith("file://") else url
    return os.path.abspath(os.path.expanduser(path))
