"""The storage seam: local POSIX paths directly, everything else through fsspec.

The contract is :class:`Storage`, the union of :class:`ObjectWriter`, :class:`RangeReading`,
:class:`Publishing`, :class:`Listing` and :class:`Deleting` (each says its call order); every
backend passes ``tests/storage/test_conformance.py``.  :func:`storage_for` picks the backend from
a path or URL.  This package imports nothing heavy
(fsspec and its plugins only when a URL needs them): the writer process uses it too.
"""

from __future__ import annotations

from typing import Any

from .base import (
    Deleting,
    Listing,
    ObjectWriter,
    Publishing,
    RangeReader,
    RangeReading,
    Stopped,
    Storage,
    StorageTuning,
    base_name,
    check_file_name,
    is_local,
    local_path,
    missing_file,
    normalize_location,
    read_chunks,
    storage_error,
)
from .local import LocalStorage

__all__ = [
    "Deleting",
    "Listing",
    "LocalStorage",
    "ObjectWriter",
    "Publishing",
    "RangeReader",
    "RangeReading",
    "Stopped",
    "Storage",
    "StorageTuning",
    "base_name",
    "check_file_name",
    "in_process_only",
    "is_local",
    "local_path",
    "missing_file",
    "normalize_location",
    "read_chunks",
    "storage_error",
    "storage_for",
]


def in_process_only(url: str) -> bool:
    """True for filesystems that exist only inside one process (``memory://``)."""
    return url.startswith("memory://")


def storage_for(
    url: str, storage_options: dict[str, Any] | None = None, tuning: StorageTuning | None = None
) -> Storage:
    """The backend for ``url``: local for paths and ``file://``, S3 for ``s3://``, else fsspec."""
    if is_local(url):
        return LocalStorage(tuning)
    protocol = url.split("://", 1)[0]
    if protocol in ("s3", "s3a"):
        from .s3 import S3Storage

        return S3Storage(url, storage_options, tuning)
    from .remote import FsspecStorage

    return FsspecStorage(url, storage_options, tuning)
