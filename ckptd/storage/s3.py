"""S3 (and S3-compatible stores) through s3fs's client, with ckptd's own upload path.

* A shard is streamed straight from the staging arena as a multipart upload: parts of
  ``StorageTuning.part_size_for(size)`` bytes, ``part_concurrency`` of them in flight, each retried
  on its own; a failed or abandoned upload is aborted.  Each part carries its CRC32C
  (``ChecksumCRC32C``, computed off the event loop), which S3 checks before it stores the part.
* The manifest is written with ``If-None-Match: *`` (create-only) so two writers cannot both
  commit the same step.
* ``discard`` aborts every unfinished multipart upload under a prefix and deletes its objects.
* Retries are ckptd's (see :mod:`ckptd.storage.retry`): botocore's own retries are switched off
  unless the caller configured them, so one policy bounds every request.
* Every try is bounded in time: botocore's ``connect_timeout`` and ``read_timeout`` (from
  :class:`StorageTuning`, unless the caller's ``config_kwargs`` set them) and, on Linux, sockets
  with ``TCP_USER_TIMEOUT`` (:class:`StallBoundSockets`), because ``read_timeout`` (aiohttp's
  ``sock_read``) only starts once a request body is sent: a peer that stops taking a part's
  bytes would otherwise hold the upload forever.  The socket's timeout is half the read timeout:
  aiohttp sends an idempotent request (a PUT) a second time, on a new connection, when the first
  connection fails, so a try stuck sending still ends after ``read_timeout`` of silence in all.
  A slow upload is not cut: the read timeout starts once aiohttp has handed the body's last byte
  to the kernel, whose send queue (autotuned to a few round trips of data, at most ``tcp_wmem``'s
  4 MiB here) then still has to leave; the socket timeout restarts with every byte the peer takes.
  (``TCP_NOTSENT_LOWAT`` would shorten that queue, at about 20% more CPU per byte sent on
  loopback: not worth it.)
* ``copy_file`` copies on the server: ``CopyObject``, or ``UploadPartCopy`` parts above
  ``copy_threshold`` bytes.

This module is longer than 450 lines on purpose: the upload, the server-side copy and the
clean-up share one multipart machinery (``_call``, the part limit, ``_finish``, ``_complete``,
``_abort``) on one client and one event loop; retries live in :mod:`.retry`, the generic fsspec
paths in :mod:`.remote`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno as errno_codes
import logging
import socket
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from .._crc32c import crc32c
from ..errors import CheckpointExistsError, MissingFileError, StorageError
from .base import MAX_PARTS, MIN_PART_SIZE, Stopped, StorageTuning, missing_file
from .remote import FsspecStorage
from .retry import RetryCounter, error_code, http_status, is_timeout, is_transient, retry_async

__all__ = ["S3Storage", "StallBoundSockets", "part_payload", "s3_error"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_POOL_CONNECTIONS = 64
_GIB = 1024**3
_MIB = 1024**2


class StallBoundSockets:
    """An aiohttp ``socket_factory``: TCP sockets with ``TCP_USER_TIMEOUT`` of ``seconds`` (Linux).

    The kernel drops a connection whose sent bytes stay unacknowledged, or whose peer keeps its
    receive window shut, that long: the request fails with ``ETIMEDOUT`` and is retried.  The
    clock restarts with every byte the peer takes, so a slow transfer that keeps moving is never
    cut.  ``repr`` names the value, so equal settings share one cached s3fs filesystem.
    """

    available = hasattr(socket, "TCP_USER_TIMEOUT")

    def __init__(self, seconds: float) -> None:
        self.seconds = float(seconds)

    def __call__(self, addr_info: tuple[Any, ...]) -> socket.socket:
        family, kind, proto = addr_info[:3]
        sock = socket.socket(family, kind, proto)
        with contextlib.suppress(OSError, AttributeError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, round(self.seconds * 1000)))
        return sock

    def __repr__(self) -> str:
        return f"StallBoundSockets({self.seconds!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StallBoundSockets) and other.seconds == self.seconds

    def __hash__(self) -> int:
        return hash(self.seconds)


_SENDING_AT_ONCE: weakref.WeakSet[Any] = weakref.WeakSet()  # clients with _send_at_once registered


def _send_at_once(params: dict[str, Any], **_: Any) -> None:
    """Drop the ``Expect: 100-continue`` botocore puts on every PUT and POST with a body.

    aiohttp waits for the server's ``100 Continue`` with no timeout at all (its read timeout
    starts once the body is sent, and no byte is unacknowledged meanwhile), so a frozen server
    held every upload forever.  Sent at once, a body that the server does not take is caught by
    the socket's ``TCP_USER_TIMEOUT``, and one it takes without answering by the read timeout.
    (The cost: a request refused before its body is read, a 403 say, still sends its body.)
    """
    headers = params.get("headers")
    if isinstance(headers, dict):
        for name in [name for name in headers if name.lower() == "expect"]:
            del headers[name]


def s3_error(action: str, url: str, error: BaseException, attempts: int | None = None) -> Exception:
    """A ckptd error for a failed S3 request, naming the object and the cause."""
    status = http_status(error)
    code = error_code(error) or ""
    if status == 403 or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
        result = StorageError(
            errno_codes.EACCES, f"cannot {action} {url}: access denied ({code or status}); check the credentials"
        )
    elif code == "NoSuchBucket" or (status == 404 and action in ("access",)):
        result = StorageError(errno_codes.ENOENT, f"cannot {action} {url}: the bucket does not exist")
    elif status == 404 or code in ("NoSuchKey", "NotFound"):
        return missing_file(action, url)
    else:
        tried = f" after {attempts} attempts" if attempts and is_transient(error) else ""
        cause = f"{code} (HTTP {status})" if code or status else f"{type(error).__name__}: {error}"
        result = StorageError(errno_codes.EIO, f"cannot {action} {url}{tried}: {cause}")
    result.filename = url
    return result


def part_payload(view: memoryview, checksum: bool) -> tuple[bytes, dict[str, str]]:
    """The request body for one part (or a whole small file) and, if ``checksum``, the
    ``ChecksumCRC32C`` parameter S3 verifies it against: base64 of the big-endian CRC32C."""
    body = bytes(view)
    if not checksum:
        return body, {}
    value = crc32c(body).to_bytes(4, "big")  # releases the GIL
    return body, {"ChecksumCRC32C": base64.b64encode(value).decode("ascii")}


class S3Storage(FsspecStorage):
    """``s3://bucket/prefix`` storage.

    ``copy_threshold``: ``copy_file`` copies larger objects in parts (S3's ``CopyObject`` takes up
    to 5 GiB); ``copy_part_size``: their part size (at least 5 MiB, and large enough for 10,000
    parts to hold the object).
    """

    copy_threshold = 5 * _GIB
    copy_part_size = 256 * _MIB
    uploads_parts = True  # write_view reads several parts of a view at once (a streamed save's ring holds them)

    def __init__(
        self, url: str, storage_options: dict[str, Any] | None = None, tuning: StorageTuning | None = None
    ) -> None:
        super().__init__(url, storage_options, tuning)
        self._parts_in_flight: asyncio.Semaphore | None = None
        self.retry_counter = RetryCounter()  # every retry this storage object made
        self._run(self._client)  # now, so that s3fs's own requests (write_stream, rm) send at once too

    def _make_filesystem(self, options: dict[str, Any]) -> Any:
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("max_pool_connections", _POOL_CONNECTIONS)
        if "retries" not in config:
            config["retries"] = {"total_max_attempts": 1}
        config.setdefault("connect_timeout", self.tuning.connect_timeout)
        config.setdefault("read_timeout", self.tuning.read_timeout)
        read_timeout = config["read_timeout"]
        if read_timeout and StallBoundSockets.available and "http_session_cls" not in config:
            # aiohttp's read timeout waits for the answer only; this bounds the sending of a body
            # to a peer that stopped reading it (half each for aiohttp's two sends of a PUT).  A
            # socket factory of the caller's wins.
            connector = dict(config.get("connector_args") or {})
            connector.setdefault("socket_factory", StallBoundSockets(read_timeout / 2))
            config["connector_args"] = connector
        options["config_kwargs"] = config
        return super()._make_filesystem(options)

    # ---- plumbing --------------------------------------------------------------------------

    def _split(self, path: str) -> tuple[str, str]:
        bucket, _, key = self._strip(path).partition("/")
        return bucket, key

    def _url(self, path: str) -> str:
        return f"s3://{self._strip(path)}"

    def _run(self, coroutine: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        from fsspec.asyn import sync

        return sync(self.fs.loop, coroutine, *args, **kwargs)

    async def _client(self) -> Any:
        await self.fs.set_session()
        client = self.fs.s3
        if client not in _SENDING_AT_ONCE:
            client.meta.events.register_last("before-call.s3", _send_at_once)
            _SENDING_AT_ONCE.add(client)
        return client

    async def _call(self, what: str, url: str, method: str, **kwargs: Any) -> Any:
        """One request, retried by ckptd's policy; failures become a ckptd error naming ``url``."""
        return await self._request(what, url, method, kwargs)

    async def _cleanup_call(self, what: str, url: str, method: str, **kwargs: Any) -> Any:
        """A clean-up request (abort, list uploads): retried like any other, except that a try
        that timed out is not tried again: the store is unreachable, and the clean-up as a whole
        is retried in the background (:class:`~ckptd.storage.cleanup.Cleanup`), so a frozen
        store does not hold a failed save for another ``retry_attempts`` timeouts."""
        return await self._request(what, url, method, kwargs, give_up=is_timeout)

    async def _request(
        self,
        what: str,
        url: str,
        method: str,
        kwargs: dict[str, Any],
        give_up: Callable[[BaseException], bool] | None = None,
    ) -> Any:
        client = await self._client()
        attempts = 0

        async def attempt() -> Any:
            nonlocal attempts
            attempts += 1
            return await getattr(client, method)(**kwargs)

        try:
            return await retry_async(
                attempt, f"{what} {url}", self.tuning, on_retry=self.retry_counter, give_up=give_up
            )
        except (Stopped, asyncio.CancelledError):
            raise
        except Exception as e:
            raise s3_error(what, url, e, attempts) from e

    # ---- checks ----------------------------------------------------------------------------

    def check_access(self, path: str) -> None:
        bucket, _ = self._split(path)
        self._run(self._call, "access", f"s3://{bucket}", "head_bucket", Bucket=bucket)

    def exists(self, path: str) -> bool:
        """An object, or a prefix with objects under it (the bucket itself for ``s3://bucket``)."""
        return bool(self._run(self._exists, path))

    async def _exists(self, path: str) -> bool:
        bucket, key = self._split(path)
        url = self._url(path)
        try:
            if not key.strip("/"):
                await self._call("check", url, "head_bucket", Bucket=bucket)
                return True
            if not key.endswith("/"):
                try:
                    await self._call("check", url, "head_object", Bucket=bucket, Key=key)
                    return True
                except MissingFileError:
                    pass
            page = await self._call(
                "check", url, "list_objects_v2", Bucket=bucket, Prefix=key.rstrip("/") + "/", MaxKeys=1
            )
            return bool(page.get("Contents") or page.get("CommonPrefixes"))
        except StorageError as e:
            if e.errno == errno_codes.ENOENT:  # no such object, or no such bucket
                return False
            raise

    def size(self, path: str) -> int:
        bucket, key = self._split(path)
        head = self._run(self._call, "stat", self._url(path), "head_object", Bucket=bucket, Key=key)
        return int(head.get("ContentLength", 0))

    def _ls(self, path: str) -> list[dict[str, Any]]:
        """The entries directly under ``path`` (for ``list_names`` and ``sizes``), in one
        ``ListObjectsV2`` request per 1,000 entries: s3fs's ``ls`` of an empty prefix lists its
        parent too, to tell a file from a missing path (a second request, and a long one under a
        root of many checkpoints)."""
        return self._run(self._list_entries, path)

    async def _list_entries(self, path: str) -> list[dict[str, Any]]:
        bucket, key = self._split(path)
        prefix = key.rstrip("/") + "/" if key.strip("/") else ""
        url = self._url(path)
        entries: list[dict[str, Any]] = []
        page_token: dict[str, str] = {}
        while True:
            page = await self._call(
                "list", url, "list_objects_v2", Bucket=bucket, Prefix=prefix, Delimiter="/", **page_token
            )
            for item in page.get("Contents") or []:
                if item["Key"] != prefix:  # a "directory marker" object named like the prefix itself
                    entries.append({"name": f"{bucket}/{item['Key']}", "size": item.get("Size", 0), "type": "file"})
            for item in page.get("CommonPrefixes") or []:
                entries.append({"name": f"{bucket}/{item['Prefix']}", "size": 0, "type": "directory"})
            if not page.get("IsTruncated"):
                return entries
            page_token = {"ContinuationToken": page["NextContinuationToken"]}

    # ---- writing ---------------------------------------------------------------------------

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
        try:
            self._run(self._upload, path, view, should_stop, on_progress)
        except (Stopped, StorageError):
            raise  # nothing was committed: the upload was aborted or never finished
        except BaseException:
            self._forget(self._strip(path))  # a callback failed after a single-request upload
            raise

    async def _upload(
        self, path: str, view: memoryview, should_stop: Callable[[], bool], on_progress: Callable[[int], None]
    ) -> None:
        bucket, key = self._split(path)
        url = self._url(path)
        size = len(view)
        part_size = self.tuning.part_size_for(size)
        checksums = await self._sends_checksums()
        algorithm = {"ChecksumAlgorithm": "CRC32C"} if checksums else {}
        loop = asyncio.get_running_loop()
        if size <= part_size:
            if should_stop():
                raise Stopped(path)
            body, checksum = await loop.run_in_executor(None, part_payload, view, checksums)
            await self._call("upload", url, "put_object", Bucket=bucket, Key=key, Body=body, **algorithm, **checksum)
            on_progress(size)
            return
        created = await self._call(
            "start upload of", url, "create_multipart_upload", Bucket=bucket, Key=key, **algorithm
        )
        upload_id = created["UploadId"]
        limit = self._part_limit()

        async def upload_part(number: int, start: int) -> dict[str, Any]:
            async with limit:
                if should_stop():
                    raise Stopped(path)
                # The copy and its checksum are made off the event loop (the checksum releases
                # the GIL), which stays free for the other parts' requests.
                body, checksum = await loop.run_in_executor(
                    None, part_payload, view[start : start + part_size], checksums
                )
                answer = await self._call(
                    f"upload part {number} of",
                    url,
                    "upload_part",
                    Bucket=bucket,
                    Key=key,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=body,
                    **algorithm,
                    **checksum,
                )
                on_progress(len(body))
                return {"PartNumber": number, "ETag": answer["ETag"], **checksum}

        tasks = [asyncio.ensure_future(upload_part(n, s)) for n, s in enumerate(range(0, size, part_size), start=1)]
        await self._finish(tasks, bucket, key, upload_id, size, url)

    async def _finish(
        self,
        tasks: Sequence[asyncio.Future[dict[str, Any]]],
        bucket: str,
        key: str,
        upload_id: str,
        size: int,
        url: str,
    ) -> None:
        """Complete a multipart upload once every part is in; if a part fails (its retries spent)
        or the upload is cancelled, cancel the other parts and abort the upload."""
        try:
            parts = await asyncio.gather(*tasks)
            await self._complete(bucket, key, upload_id, list(parts), size, url)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._abort(bucket, key, upload_id, url)
            raise

    async def _sends_checksums(self) -> bool:
        """Whether shard uploads carry a CRC32C of each part: when the client is left to its
        default ``request_checksum_calculation="when_supported"``, under which botocore would
        otherwise compute a CRC32 of every part itself on the event loop.  A client configured
        ``"when_required"`` (for S3-compatible stores that reject checksum headers) sends none."""
        client = await self._client()
        return getattr(client.meta.config, "request_checksum_calculation", None) == "when_supported"

    def _part_limit(self) -> asyncio.Semaphore:
        """One bound on the parts in flight for every file this storage uploads (the writer
        uploads several files at once through one storage object, on fsspec's one event loop)."""
        if self._parts_in_flight is None:
            self._parts_in_flight = asyncio.Semaphore(self.tuning.part_concurrency)
        return self._parts_in_flight

    async def _complete(
        self, bucket: str, key: str, upload_id: str, parts: list[dict[str, Any]], size: int, url: str
    ) -> None:
        try:
            await self._call(
                "complete upload of",
                url,
                "complete_multipart_upload",
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
            )
        except FileNotFoundError:
            # A retried completion whose first try succeeded finds no upload: accept it if the
            # object is there with the right size.
            client = await self._client()
            head = await client.head_object(Bucket=bucket, Key=key)
            if int(head.get("ContentLength", -1)) != size:
                raise

    async def _abort(self, bucket: str, key: str, upload_id: str, url: str) -> None:
        """Abort a failed upload; what is left (the store unreachable) the failed save's
        ``discard()`` aborts."""
        try:
            await self._cleanup_call(
                "abort upload of", url, "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id
            )
        except FileNotFoundError:
            pass
        except Exception as e:  # noqa: BLE001 - the failed save's discard() retries it
            logger.warning("could not abort the multipart upload of %s yet: %s", url, e)

    def write_bytes(self, path: str, data: bytes, *, fsync: bool = True, create_only: bool = False) -> None:
        bucket, key = self._split(path)
        condition = {"IfNoneMatch": "*"} if create_only else {}
        try:
            self._run(
                self._call, "write", self._url(path), "put_object", Bucket=bucket, Key=key, Body=data, **condition
            )
        except StorageError as e:
            cause = e.__cause__
            status, code = (http_status(cause), error_code(cause)) if cause is not None else (None, None)
            if status == 412 or code in ("PreconditionFailed", "ConditionalRequestConflict"):
                # A retried PUT whose first answer was lost finds its own object: that is success.
                if self._holds(path, data):
                    return
                raise CheckpointExistsError(f"{self._url(path)} already exists (written by another save)") from e
            if create_only and status == 501:
                logger.warning("this S3 store has no create-only writes; writing %s unconditionally", self._url(path))
                self.write_bytes(path, data)
                return
            raise

    def _holds(self, path: str, data: bytes) -> bool:
        try:
            return self.size(path) == len(data) and self.read_bytes(path) == data
        except OSError:
            return False

    # ---- copying ---------------------------------------------------------------------------

    def copy_file(self, source: str, target: str, *, fsync: bool = True) -> str:
        """Make ``target`` hold exactly the bytes of ``source``, copied by S3 itself (no byte
        passes through this process): one ``CopyObject`` up to ``copy_threshold`` bytes, else a
        multipart copy of ``UploadPartCopy`` ranges, each request retried on its own and the
        upload aborted on failure.  Every request copies the version measured first (``If-Match``
        on its ETag); where the source has a CRC32C the copy keeps one.  Returns
        ``"server_copy"``; a missing source raises :class:`~ckptd.errors.MissingFileError`."""
        self._run(self._copy, source, target)
        return "server_copy"

    async def _copy(self, source: str, target: str) -> None:
        source_bucket, source_key = self._split(source)
        bucket, key = self._split(target)
        source_url, url = self._url(source), self._url(target)
        checksums = await self._sends_checksums()
        mode = {"ChecksumMode": "ENABLED"} if checksums else {}
        head = await self._call("copy", source_url, "head_object", Bucket=source_bucket, Key=source_key, **mode)
        size = int(head.get("ContentLength", 0))
        origin: dict[str, Any] = {"CopySource": {"Bucket": source_bucket, "Key": source_key}}
        if head.get("ETag"):
            origin["CopySourceIfMatch"] = head["ETag"]
        algorithm = {"ChecksumAlgorithm": "CRC32C"} if checksums and head.get("ChecksumCRC32C") else {}
        what = f"copy {source_url} to"
        try:
            if size <= self.copy_threshold:
                await self._call(what, url, "copy_object", Bucket=bucket, Key=key, **origin, **algorithm)
            else:
                await self._copy_parts(bucket, key, url, source_url, size, origin, algorithm)
        except StorageError as e:
            cause = e.__cause__
            code = error_code(cause) if cause is not None else None
            if code == "NoSuchKey":  # removed since it was measured
                raise missing_file("copy", source_url) from e
            if code == "PreconditionFailed" or (cause is not None and http_status(cause) == 412):
                raise StorageError(
                    errno_codes.EIO, f"cannot copy {source_url} to {url}: the source changed while it was copied"
                ) from e
            raise

    async def _copy_parts(
        self,
        bucket: str,
        key: str,
        url: str,
        source_url: str,
        size: int,
        origin: dict[str, Any],
        algorithm: dict[str, str],
    ) -> None:
        created = await self._call(
            f"start copy of {source_url} to", url, "create_multipart_upload", Bucket=bucket, Key=key, **algorithm
        )
        upload_id = created["UploadId"]
        part_size = self.copy_part_size_for(size)
        limit = self._part_limit()

        async def copy_part(number: int, start: int) -> dict[str, Any]:
            last = min(size, start + part_size) - 1
            async with limit:
                answer = await self._call(
                    f"copy part {number} of {source_url} to",
                    url,
                    "upload_part_copy",
                    Bucket=bucket,
                    Key=key,
                    UploadId=upload_id,
                    PartNumber=number,
                    CopySourceRange=f"bytes={start}-{last}",
                    **origin,
                )
            result = answer.get("CopyPartResult") or {}
            part = {"PartNumber": number, "ETag": result["ETag"]}
            if algorithm and result.get("ChecksumCRC32C"):
                part["ChecksumCRC32C"] = result["ChecksumCRC32C"]
            return part

        tasks = [asyncio.ensure_future(copy_part(n, s)) for n, s in enumerate(range(0, size, part_size), start=1)]
        await self._finish(tasks, bucket, key, upload_id, size, url)

    def copy_part_size_for(self, size: int) -> int:
        """The part size of a multipart copy of ``size`` bytes: ≥ 5 MiB, ≥ ``copy_part_size``,
        ≤ 10,000 parts."""
        needed = -(-size // MAX_PARTS)
        return max(MIN_PART_SIZE, self.copy_part_size, -(-needed // _MIB) * _MIB)

    # ---- reading ---------------------------------------------------------------------------

    def _stat(self, path: str) -> tuple[int, str | None]:
        """Size and ETag of the object now at ``path`` (one ``HeadObject``): what a reader opened
        on it reads, ``If-Match`` that ETag."""
        bucket, key = self._split(path)
        head = self._run(self._call, "stat", self._url(path), "head_object", Bucket=bucket, Key=key)
        return int(head.get("ContentLength", 0)), head.get("ETag") or None

    def fetch_ranges(self, path: str, ranges: Sequence[tuple[int, int]], *, if_match: str | None = None) -> list[bytes]:
        """The bytes of each range; with ``if_match`` (an ETag), only of that version of the
        object (``If-Match``): one replaced since fails at once, naming the change."""
        return self._run(self._fetch_ranges, path, list(ranges), if_match)

    async def _fetch_ranges(self, path: str, ranges: list[tuple[int, int]], if_match: str | None) -> list[bytes]:
        bucket, key = self._split(path)
        url = self._url(path)
        limit = asyncio.Semaphore(self.tuning.part_concurrency)
        client = await self._client()
        condition = {"IfMatch": if_match} if if_match else {}

        async def fetch(start: int, end: int) -> bytes:
            async def attempt() -> bytes:
                answer = await client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", **condition)
                async with answer["Body"] as body:
                    return bytes(await body.read())

            async with limit:
                try:
                    return await retry_async(attempt, f"read {url}", self.tuning, on_retry=self.retry_counter)
                except Exception as e:
                    if condition and http_status(e) == 412:
                        changed = StorageError(
                            errno_codes.EIO, f"cannot read {url}: replaced since it was opened (no longer {if_match})"
                        )
                        changed.filename = url
                        raise changed from e
                    raise s3_error(f"read bytes {start}-{end} of", url, e, self.tuning.retry_attempts) from e

        return list(await asyncio.gather(*(fetch(s, e) for s, e in ranges if e > s)))

    def read_bytes(self, path: str) -> bytes:
        size = self.size(path)
        return self.fetch_ranges(path, [(0, size)])[0] if size else b""

    # ---- cleaning up -----------------------------------------------------------------------

    def discard(self, path: str) -> None:
        """Abort every unfinished multipart upload under ``path`` and delete its objects (a
        timed-out request is not retried here: see :meth:`_cleanup_call`)."""
        self._run(self._abort_uploads, path)
        self.remove_tree(path)

    async def _abort_uploads(self, path: str) -> None:
        bucket, key = self._split(path)
        prefix = key.rstrip("/") + "/"
        url = self._url(path)
        for upload in await self._list_uploads(bucket, prefix, url):
            try:
                await self._cleanup_call(
                    "abort upload of",
                    f"s3://{bucket}/{upload['Key']}",
                    "abort_multipart_upload",
                    Bucket=bucket,
                    Key=upload["Key"],
                    UploadId=upload["UploadId"],
                )
            except FileNotFoundError:
                pass  # aborted meanwhile (by the writer that started it, say): nothing left to do

    async def _list_uploads(self, bucket: str, prefix: str, url: str) -> list[dict[str, Any]]:
        uploads: list[dict[str, Any]] = []
        marker: dict[str, str] = {}
        while True:
            page = await self._cleanup_call(
                "list uploads under", url, "list_multipart_uploads", Bucket=bucket, Prefix=prefix, **marker
            )
            uploads.extend(page.get("Uploads") or [])
            if not page.get("IsTruncated"):
                return uploads
            marker = {"KeyMarker": page.get("NextKeyMarker", ""), "UploadIdMarker": page.get("NextUploadIdMarker", "")}
