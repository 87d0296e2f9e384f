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
"""

from __future__ import annotations

import asyncio
import base64
import errno as errno_codes
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import crc32c as _crc32c

from ..errors import CheckpointExistsError, StorageError
from .base import Stopped, StorageTuning, missing_file
from .remote import FsspecStorage
from .retry import RetryCounter, error_code, http_status, is_transient, retry_async

__all__ = ["S3Storage", "part_payload", "s3_error"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_POOL_CONNECTIONS = 64


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
    value = int(_crc32c.crc32c(body)).to_bytes(4, "big")  # the C code releases the GIL
    return body, {"ChecksumCRC32C": base64.b64encode(value).decode("ascii")}


class S3Storage(FsspecStorage):
    """``s3://bucket/prefix`` storage."""

    def __init__(
        self, url: str, storage_options: dict[str, Any] | None = None, tuning: StorageTuning | None = None
    ) -> None:
        super().__init__(url, storage_options, tuning)
        self._parts_in_flight: asyncio.Semaphore | None = None
        self.retry_counter = RetryCounter()  # every retry this storage object made

    def _make_filesystem(self, options: dict[str, Any]) -> Any:
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("max_pool_connections", _POOL_CONNECTIONS)
        if "retries" not in config:
            config["retries"] = {"total_max_attempts": 1}
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
        return self.fs.s3

    async def _call(self, what: str, url: str, method: str, **kwargs: Any) -> Any:
        client = await self._client()
        attempts = 0

        async def attempt() -> Any:
            nonlocal attempts
            attempts += 1
            return await getattr(client, method)(**kwargs)

        try:
            return await retry_async(attempt, f"{what} {url}", self.tuning, on_retry=self.retry_counter)
        except (Stopped, asyncio.CancelledError):
            raise
        except Exception as e:
            raise s3_error(what, url, e, attempts) from e

    # ---- checks ----------------------------------------------------------------------------

    def check_access(self, path: str) -> None:
        bucket, _ = self._split(path)
        self._run(self._call, "access", f"s3://{bucket}", "head_bucket", Bucket=bucket)

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
        try:
            parts = await asyncio.gather(*tasks)
            await self._complete(bucket, key, upload_id, parts, size, url)
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
        try:
            await self._call(
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

    # ---- reading ---------------------------------------------------------------------------

    def fetch_ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        return self._run(self._fetch_ranges, path, list(ranges))

    async def _fetch_ranges(self, path: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        bucket, key = self._split(path)
        url = self._url(path)
        limit = asyncio.Semaphore(self.tuning.part_concurrency)
        client = await self._client()

        async def fetch(start: int, end: int) -> bytes:
            async def attempt() -> bytes:
                answer = await client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")
                async with answer["Body"] as body:
                    return bytes(await body.read())

            async with limit:
                try:
                    return await retry_async(attempt, f"read {url}", self.tuning, on_retry=self.retry_counter)
                except Exception as e:
                    raise s3_error(f"read bytes {start}-{end} of", url, e, self.tuning.retry_attempts) from e

        return list(await asyncio.gather(*(fetch(s, e) for s, e in ranges if e > s)))

    def read_bytes(self, path: str) -> bytes:
        size = self.size(path)
        return self.fetch_ranges(path, [(0, size)])[0] if size else b""

    # ---- cleaning up -----------------------------------------------------------------------

    def discard(self, path: str) -> None:
        """Abort every unfinished multipart upload under ``path`` and delete its objects."""
        self._run(self._abort_uploads, path)
        self.remove_tree(path)

    async def _abort_uploads(self, path: str) -> None:
        bucket, key = self._split(path)
        prefix = key.rstrip("/") + "/"
        url = self._url(path)
        for upload in await self._list_uploads(bucket, prefix, url):
            await self._call(
                "abort upload of",
                f"s3://{bucket}/{upload['Key']}",
                "abort_multipart_upload",
                Bucket=bucket,
                Key=upload["Key"],
                UploadId=upload["UploadId"],
            )

    async def _list_uploads(self, bucket: str, prefix: str, url: str) -> list[dict[str, Any]]:
        uploads: list[dict[str, Any]] = []
        marker: dict[str, str] = {}
        while True:
            page = await self._call(
                "list uploads under", url, "list_multipart_uploads", Bucket=bucket, Prefix=prefix, **marker
            )
            uploads.extend(page.get("Uploads") or [])
            if not page.get("IsTruncated"):
                return uploads
            marker = {"KeyMarker": page.get("NextKeyMarker", ""), "UploadIdMarker": page.get("NextUploadIdMarker", "")}
