"""Retrying object-store requests: which errors are transient, and exponential backoff with jitter.

Transient: HTTP 408/429/500/502/503/504, ``SlowDown``/``RequestTimeout``/``InternalError``-style
codes, resets, refused or dropped connections and timeouts.  Everything else (403, 404, bad
request, bad credentials) is permanent and fails at once.

Every try is bounded in time by the backend (``StorageTuning.connect_timeout`` and
``read_timeout``; see :mod:`ckptd.storage.s3`), and a timeout is transient, so a request to an
endpoint that never answers fails after at most :func:`failure_bound` seconds.

Each storage object that retries owns a :class:`RetryCounter` (``storage.retry_counter``) that
counts the retries it made; :func:`retries_of` reads it (0 for backends that never retry).
"""

from __future__ import annotations

import asyncio
import errno as errno_codes
import logging
import random
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from .base import StorageTuning

__all__ = [
    "RetryCounter",
    "backoff_bound",
    "error_code",
    "failure_bound",
    "http_status",
    "is_timeout",
    "is_transient",
    "retries_of",
    "retry_async",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
_TRANSIENT_CODES = {
    "SlowDown",
    "RequestTimeout",
    "RequestTimeoutException",
    "InternalError",
    "ServiceUnavailable",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "BadDigest",
    "XAmzContentSHA256Mismatch",
    "IncompleteBody",
}
_TRANSIENT_ERRNOS = {
    errno_codes.ECONNRESET,
    errno_codes.ECONNREFUSED,
    errno_codes.ECONNABORTED,
    errno_codes.EPIPE,
    errno_codes.ETIMEDOUT,
    errno_codes.EHOSTUNREACH,
    errno_codes.ENETUNREACH,
}
_TRANSIENT_NAMES = {
    # botocore / aiohttp / urllib3 exception class names (matched by name: those packages are optional)
    "EndpointConnectionError",
    "ConnectionClosedError",
    "ReadTimeoutError",
    "ConnectTimeoutError",
    "HTTPClientError",
    "ResponseStreamingError",
    "IncompleteReadError",
    "ServerDisconnectedError",
    "ClientOSError",
    "ClientConnectorError",
    "ClientPayloadError",
    "ServerTimeoutError",
    "ProtocolError",
    "ResponseParserError",
    "FSTimeoutError",
    "IncompleteRead",
}


_TIMEOUT_NAMES = {
    "ReadTimeoutError",
    "ConnectTimeoutError",
    "ServerTimeoutError",
    "SocketTimeoutError",
    "ConnectionTimeoutError",
    "FSTimeoutError",
}


class RetryCounter:
    """A thread-safe count of the retries one storage object made (pass it as ``on_retry``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0

    def __call__(self, error: BaseException | None = None) -> None:
        with self._lock:
            self._count += 1

    @property
    def value(self) -> int:
        """Retries counted so far."""
        with self._lock:
            return self._count


def retries_of(storage: object) -> int:
    """The retries ``storage`` made so far (0 for a backend without a :class:`RetryCounter`)."""
    counter = getattr(storage, "retry_counter", None)
    return counter.value if isinstance(counter, RetryCounter) else 0


def http_status(error: BaseException) -> int | None:
    """The HTTP status of a botocore ``ClientError`` (or anything with a similar ``response``)."""
    response = getattr(error, "response", None)
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(status, int):
            return status
    code = getattr(error, "code", None) or getattr(error, "status", None)
    return code if isinstance(code, int) else None


def error_code(error: BaseException) -> str | None:
    """The service error code (``SlowDown``, ``NoSuchBucket``...) of a botocore ``ClientError``."""
    response = getattr(error, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        return str(code) if code is not None else None
    return None


def is_transient(error: BaseException) -> bool:
    """True if retrying the same request may succeed."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (asyncio.TimeoutError, TimeoutError, ConnectionError)):
            return True
        if isinstance(current, OSError) and current.errno in _TRANSIENT_ERRNOS:
            return True
        if any(cls.__name__ in _TRANSIENT_NAMES for cls in type(current).__mro__):
            return True
        status = http_status(current)
        if status in _TRANSIENT_STATUS or error_code(current) in _TRANSIENT_CODES:
            return True
        current = current.__cause__ or current.__context__
    return False


def backoff_bound(tuning: StorageTuning) -> float:
    """The longest :func:`retry_async` can sleep in all between the tries of one request."""
    return sum(
        min(tuning.retry_max_delay, tuning.retry_base_delay * 2 ** (attempt - 1))
        for attempt in range(1, tuning.retry_attempts)
    )


def failure_bound(tuning: StorageTuning) -> float:
    """How long one request can take to fail when every try times out: ``retry_attempts`` tries
    of ``connect_timeout + read_timeout`` each, plus the longest backoff (126.2 s by default)."""
    return tuning.retry_attempts * (tuning.connect_timeout + tuning.read_timeout) + backoff_bound(tuning)


def is_timeout(error: BaseException) -> bool:
    """True if ``error`` (or its cause) is a try that ran out of time: the peer went silent."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (asyncio.TimeoutError, TimeoutError)):
            return True
        if isinstance(current, OSError) and current.errno == errno_codes.ETIMEDOUT:
            return True
        if any(cls.__name__ in _TIMEOUT_NAMES for cls in type(current).__mro__):
            return True
        current = current.__cause__ or current.__context__
    return False


async def retry_async(
    call: Callable[[], Awaitable[T]],
    what: str,
    tuning: StorageTuning,
    *,
    on_retry: Callable[[BaseException], Any] | None = None,
    give_up: Callable[[BaseException], bool] | None = None,
) -> T:
    """Await ``call()`` until it succeeds, retrying transient errors with capped exponential
    backoff and full jitter; the last error (or the first permanent one, or the first for which
    ``give_up`` is true) propagates."""
    attempt = 0
    while True:
        attempt += 1
        try:
            return await call()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if attempt >= tuning.retry_attempts or not is_transient(e) or (give_up is not None and give_up(e)):
                raise
            delay = random.uniform(0, min(tuning.retry_max_delay, tuning.retry_base_delay * 2 ** (attempt - 1)))
            logger.debug("retrying %s after %s (attempt %d, sleeping %.2fs)", what, type(e).__name__, attempt, delay)
            if on_retry is not None:
                on_retry(e)
            await asyncio.sleep(delay)
