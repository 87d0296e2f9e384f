"""Storage on any fsspec filesystem (``memory://``, ``gs://``, ``s3://``...): no renames; the
manifest, written last, is the commit point.  :mod:`ckptd.storage.s3` specialises it for S3.

Timeouts (``StorageTuning.connect_timeout`` / ``read_timeout``) reach the filesystems that take
one: gcsfs as its ``requests_timeout`` (an aiohttp ``ClientTimeout`` with ``sock_connect`` and
``sock_read``: a slow transfer that keeps moving is never cut), fsspec's HTTP filesystem as its
session's timeout.  A value the caller put in ``storage_options`` wins.  Other filesystems have no
common timeout option; they keep their own defaults.
"""

from __future__ import annotations

import errno as errno_codes
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..errors import CheckpointExistsError, ConfigError, StorageError
from .base import Stopped, StorageTuning, missing_file, storage_error

__all__ = ["FsspecStorage", "coalesce", "version_stamp"]

logger = logging.getLogger(__name__)

_MERGE_GAP = 256 * 1024
_MERGE_LIMIT = 64 * 1024 * 1024


def coalesce(
    requests: Sequence[tuple[int, memoryview]],
) -> list[tuple[int, int, list[tuple[int, memoryview]]]]:
    """Group byte-range requests into fewer, larger reads.

    Two neighbouring ranges merge when the gap between them is at most 256 KiB *and* no larger
    than the smaller of them, so a merged read never fetches more than twice the bytes asked for;
    merged reads stay under 64 MiB.  Returns ``(start, end, members)`` groups.
    """
    ordered = sorted(((offset, buffer) for offset, buffer in requests if len(buffer)), key=lambda r: r[0])
    groups: list[tuple[int, int, list[tuple[int, memoryview]]]] = []
    for offset, buffer in ordered:
        end = offset + len(buffer)
        if groups:
            start, last_end, members = groups[-1]
            gap = offset - last_end
            smaller = min(len(buffer), len(members[-1][1]))
            if 0 <= gap <= min(_MERGE_GAP, smaller) and end - start <= _MERGE_LIMIT:
                members.append((offset, buffer))
                groups[-1] = (start, max(end, last_end), members)
                continue
        groups.append((offset, end, [(offset, buffer)]))
    return groups


_VERSION_FIELDS = ("generation", "VersionId", "ETag", "etag", "LastModified", "updated", "mtime", "created")


def version_stamp(info: dict[str, Any]) -> str | None:
    """What identifies one version of an object among an fsspec ``info()`` or an S3 ``HeadObject``
    answer's fields (``None`` if it has none of them)."""
    found = [f"{name}={info[name]}" for name in _VERSION_FIELDS if info.get(name) not in (None, "")]
    return " ".join(found) or None


def scatter(groups: list[tuple[int, int, list[tuple[int, memoryview]]]], blobs: Sequence[bytes], path: str) -> None:
    """Copy each fetched blob into the buffers of its group."""
    for (start, end, members), blob in zip(groups, blobs, strict=True):
        if len(blob) != end - start:
            raise StorageError(errno_codes.EIO, f"short read of {path}: asked bytes {start}-{end}, got {len(blob)}")
        view = memoryview(blob)
        for offset, buffer in members:
            target = buffer.cast("B") if buffer.format != "B" else buffer
            target[:] = view[offset - start : offset - start + len(target)]


def _abandon(file: Any) -> None:
    """Cancel an unfinished upload: closing the file would upload what it buffered and finish it.

    fsspec's buffered files (s3fs, gcsfs) can ``discard()`` their upload and are then marked
    closed so that leaving the ``with`` block uploads nothing; other files (``memory://``) are
    closed as usual and the caller removes what they wrote.
    """
    from fsspec.spec import AbstractBufferedFile

    if isinstance(file, AbstractBufferedFile):
        file.discard()
        file.closed = True


class _Reader:
    """An object opened for ranged reads: its size and (where the store can condition reads)
    its version are those of the moment it was opened; every read asks for that version, so a
    reader never returns bytes of two versions of one object."""

    def __init__(self, storage: FsspecStorage, path: str) -> None:
        self.storage = storage
        self.path = path
        self.size, self.version = storage._stat(path)

    def read_into(self, offset: int, buffer: memoryview) -> None:
        self.read_many([(offset, buffer)])

    def read_many(self, requests: Sequence[tuple[int, memoryview]]) -> None:
        # Measure and fill in bytes: a typed view (a tensor's buffer) has fewer items than bytes.
        requests = [(offset, buffer.cast("B") if buffer.format != "B" else buffer) for offset, buffer in requests]
        for offset, buffer in requests:
            if offset + len(buffer) > self.size:
                raise StorageError(errno_codes.EIO, f"unexpected end of file in {self.path} at byte {self.size}")
        groups = coalesce(requests)
        if groups:
            ranges = [(s, e) for s, e, _ in groups]
            scatter(groups, self.storage.fetch_ranges(self.path, ranges, if_match=self.version), self.path)

    def read(self, offset: int, length: int) -> bytes:
        out = bytearray(length)
        self.read_into(offset, memoryview(out))
        return bytes(out)

    def close(self) -> None:
        pass


class FsspecStorage:
    """Any fsspec filesystem: :class:`~ckptd.storage.Storage` without ``write_at`` (an object
    has one writer).  Writes stream through ``fs.open(path, "wb")``; reads fetch byte ranges
    (concurrently on async filesystems); listing always bypasses fsspec's listing cache."""

    local = False
    supports_write_at = False

    def __init__(
        self, url: str, storage_options: dict[str, Any] | None = None, tuning: StorageTuning | None = None
    ) -> None:
        self.protocol = url.split("://", 1)[0]
        self.tuning = tuning or StorageTuning()
        self.fs = self._make_filesystem(dict(storage_options or {}))

    def _make_filesystem(self, options: dict[str, Any]) -> Any:
        import fsspec

        self._bound_requests(options)
        try:
            return fsspec.filesystem(self.protocol, **options)
        except ImportError as e:
            extra = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}.get(self.protocol)
            hint = f"; pip install 'ckptd[{extra}]'" if extra else ""
            raise ConfigError(f"storage {self.protocol}:// needs a package that is not installed{hint}") from e
        except ValueError as e:
            raise ConfigError(f"unsupported storage URL protocol {self.protocol!r}: {e}") from e

    def _bound_requests(self, options: dict[str, Any]) -> None:
        """Put the tuning's connect and read timeouts into ``options`` where the filesystem takes
        them and the caller set none.  gcsfs passes ``requests_timeout`` to every request
        (``None``, its default, means no timeout at all, whatever the session says); its own
        retries (6 tries, sleeping up to 32 s) stay its own."""
        if self.protocol not in ("gs", "gcs", "http", "https"):
            return
        try:
            import aiohttp
        except ImportError:
            return
        timeout = aiohttp.ClientTimeout(sock_connect=self.tuning.connect_timeout, sock_read=self.tuning.read_timeout)
        if self.protocol in ("gs", "gcs"):
            options.setdefault("requests_timeout", timeout)
        else:
            client = dict(options.get("client_kwargs") or {})
            client.setdefault("timeout", timeout)
            options["client_kwargs"] = client

    def _strip(self, path: str) -> str:
        return str(self.fs._strip_protocol(path))

    def join(self, *parts: str) -> str:
        return "/".join(p.rstrip("/") for p in parts)

    def check_access(self, path: str) -> None:
        try:
            self.fs.ls(self._strip(path).split("/", 1)[0], detail=False)
        except FileNotFoundError:
            if self.protocol != "memory":
                raise StorageError(errno_codes.ENOENT, f"{path}: bucket or container does not exist") from None
        except PermissionError as e:
            raise storage_error("access", path, e, errno_codes.EACCES) from e
        except OSError as e:
            raise storage_error("access", path, e) from e

    def exists(self, path: str) -> bool:
        try:
            return bool(self.fs.exists(self._strip(path)))
        except OSError as e:
            raise storage_error("check", path, e) from e

    def _ls(self, path: str) -> list[dict[str, Any]]:
        target = self._strip(path).rstrip("/")
        try:
            try:
                entries = list(self.fs.ls(target, detail=True, refresh=True))
            except TypeError:  # a filesystem without the refresh flag
                entries = list(self.fs.ls(target, detail=True))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise storage_error("list", path, e) from e
        # Listing a file gives the file itself: like a local file, it has nothing under it.
        return [e for e in entries if self._strip(str(e["name"])).rstrip("/") != target]

    def list_names(self, path: str) -> list[str]:
        return sorted({str(e["name"]).rstrip("/").rsplit("/", 1)[-1] for e in self._ls(path)})

    def sizes(self, path: str) -> dict[str, int]:
        return {
            str(e["name"]).rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0)
            for e in self._ls(path)
            if e.get("type") == "file"
        }

    def makedirs(self, path: str) -> None:
        if self.protocol == "memory":  # object stores have no directories to create
            self.fs.makedirs(self._strip(path), exist_ok=True)

    def write_view(
        self,
        path: str,
        view: memoryview,
        *,
        fsync: bool,
        chunk_size: int,
        should_stop: Callable[[], bool],
        on_progress: Callable[[int], None],
    ) -> None:
        target = self._strip(path)
        try:
            with self.fs.open(target, "wb", block_size=max(chunk_size, self.tuning.part_size)) as f:
                try:
                    for start in range(0, len(view), chunk_size):
                        if should_stop():
                            raise Stopped(path)
                        chunk = view[start : start + chunk_size]
                        f.write(bytes(chunk))
                        on_progress(len(chunk))
                except BaseException:
                    _abandon(f)
                    raise
        except OSError as e:
            self._forget(target)
            raise storage_error("write", path, e) from e
        except BaseException:  # Stopped, or a failing callback: no partial object stays
            self._forget(target)
            raise

    def write_at(
        self,
        path: str,
        offset: int,
        view: memoryview,
        *,
        fsync: bool,
        chunk_size: int,
        should_stop: Callable[[], bool],
        on_progress: Callable[[int], None],
    ) -> None:
        """Refused: an object is written whole by one writer (``supports_write_at`` is false)."""
        raise ConfigError(
            f"{path}: {self.protocol}:// storage cannot write one file from several ranks at offsets; "
            "plan one writer per file (shared files need local storage)"
        )

    def write_stream(self, path: str, pieces: Iterable[memoryview]) -> int:
        """Stream ``pieces`` into one object (multipart as the filesystem sees fit)."""
        target = self._strip(path)
        total = 0
        try:
            with self.fs.open(target, "wb", block_size=self.tuning.part_size) as f:
                try:
                    for piece in pieces:
                        f.write(bytes(piece))
                        total += len(piece)
                except BaseException:
                    _abandon(f)
                    raise
        except OSError as e:
            self._forget(target)
            raise storage_error("write", path, e) from e
        except BaseException:  # the producer of the pieces failed: no partial object stays
            self._forget(target)
            raise
        return total

    def copy_file(self, source: str, target: str, *, fsync: bool = True) -> str:
        """The filesystem's own copy (gcsfs: the GCS rewrite API, on the server; ``memory://``:
        in memory).  Returns ``"server_copy"``; a missing ``source`` raises
        :class:`~ckptd.errors.MissingFileError`; a filesystem without a copy of its own is a
        :class:`~ckptd.errors.StorageError` (``EOPNOTSUPP``): its bytes are not streamed through
        this process instead."""
        try:
            self.fs.cp_file(self._strip(source), self._strip(target))
        except NotImplementedError as e:
            error = StorageError(
                errno_codes.EOPNOTSUPP, f"cannot copy {source} to {target}: {self.protocol}:// has no server-side copy"
            )
            error.filename = source
            raise error from e
        except FileNotFoundError as e:
            if not self.exists(source):
                raise missing_file("copy", source) from e
            raise storage_error(f"copy {source} to", target, e) from e
        except OSError as e:
            raise storage_error(f"copy {source} to", target, e) from e
        return "server_copy"

    def _forget(self, target: str) -> None:
        try:
            self.fs.rm_file(target)
        except (OSError, NotImplementedError):
            pass

    def open_reader(self, path: str) -> _Reader:
        return _Reader(self, path)

    def _stat(self, path: str) -> tuple[int, str | None]:
        """Size of the file now at ``path``, and the version its reads must still find (``None``:
        fsspec has no conditional reads; :class:`~ckptd.storage.s3.S3Storage` has)."""
        return self.size(path), None

    def fetch_ranges(self, path: str, ranges: Sequence[tuple[int, int]], *, if_match: str | None = None) -> list[bytes]:
        """The bytes of each ``[start, end)`` range of one file (concurrent where fsspec can);
        ``if_match`` (a version from ``_stat``) is ignored: fsspec cannot condition a read."""
        target = self._strip(path)
        try:
            out = self.fs.cat_ranges([target] * len(ranges), [s for s, _ in ranges], [e for _, e in ranges])
        except OSError as e:
            raise storage_error("read", path, e) from e
        for blob in out:  # fsspec returns a failed range's exception in its place
            if isinstance(blob, BaseException):
                raise storage_error("read", path, blob) from blob
        return [bytes(blob) for blob in out]

    def write_bytes(self, path: str, data: bytes, *, fsync: bool = True, create_only: bool = False) -> None:
        target = self._strip(path)
        try:
            if create_only:
                self._create_only(target, data, path)
            else:
                self.fs.pipe_file(target, data)
        except CheckpointExistsError:
            raise
        except OSError as e:
            raise storage_error("write", path, e) from e

    def _create_only(self, target: str, data: bytes, path: str) -> None:
        try:
            self.fs.pipe_file(target, data, mode="create")
            return
        except FileExistsError as e:
            raise CheckpointExistsError(f"{path} already exists (written by someone else)") from e
        except TypeError:
            pass  # this filesystem has no create-only writes: check, then write
        if self.fs.exists(target):
            raise CheckpointExistsError(f"{path} already exists (written by someone else)")
        self.fs.pipe_file(target, data)

    def read_bytes(self, path: str) -> bytes:
        try:
            return bytes(self.fs.cat_file(self._strip(path)))
        except OSError as e:
            raise storage_error("read", path, e) from e

    def size(self, path: str) -> int:
        try:
            return int(self.fs.size(self._strip(path)))
        except OSError as e:
            raise storage_error("stat", path, e) from e

    def version(self, path: str) -> str | None:
        """A stamp of the object now at ``path``, from the store (fsspec's listing cache is
        dropped first): generation (GCS), version id, ETag, modification or creation time,
        whichever the filesystem reports; ``None`` if it reports none of them."""
        target = self._strip(path)
        try:
            self.fs.invalidate_cache(target)
            info = self.fs.info(target)
        except OSError as e:
            raise storage_error("stat", path, e) from e
        return version_stamp(info)

    def remove(self, path: str) -> None:
        try:
            self.fs.rm_file(self._strip(path))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise storage_error("remove", path, e) from e

    def remove_tree(self, path: str) -> None:
        try:
            self.fs.rm(self._strip(path), recursive=True)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise storage_error("remove", path, e) from e

    def discard(self, path: str) -> None:
        self.remove_tree(path)

    def publish_directory(self, staging: str, final: str) -> None:
        if staging != final:
            raise ConfigError("object stores write checkpoints in place; staging and final must match")
