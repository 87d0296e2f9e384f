"""Reading the small JSON files of a checkpoint (manifest, state file, indexes) defensively.

Every such file goes through :func:`read_small_file` and :func:`parse_json`, so one hostile file
cannot hang, exhaust memory or crash a caller with a foreign exception type:

* the size is capped (``limit``) before anything is read, and a local file is opened with
  ``O_NONBLOCK`` (a FIFO cannot block the open) and must be a regular file (``fstat``), so a
  FIFO or ``/dev/zero`` is refused; with ``follow_symlinks=False`` a symlink is refused too
  (``O_NOFOLLOW``: ckptd never writes one);
* nesting depth is checked by scanning the brackets before :func:`json.loads` runs, so a
  200,000-deep document is refused without recursion;
* ``NaN`` / ``Infinity`` (not JSON) are refused where ckptd never writes them (state files,
  safetensors headers); a manifest may hold them in user metrics, and every structural field
  of it is type-checked.

Every failure is a :class:`~ckptd.errors.CorruptCheckpointError` (or
:class:`~ckptd.errors.UnsafeCheckpointError` for a symlink, a
:class:`~ckptd.errors.MissingFileError` for a missing file) naming the file.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import re
import stat
from typing import Any

from ..errors import ConfigError, CorruptCheckpointError, StorageError, UnsafeCheckpointError
from ..storage import Storage, storage_error
from .checksum import crc32c, format_crc

__all__ = [
    "DEFAULT_JSON_LIMIT",
    "MAX_JSON_DEPTH",
    "json_depth",
    "json_limit",
    "check_listed",
    "check_regular_file",
    "parse_json",
    "read_listed_file",
    "read_small_file",
    "read_small_json",
]

DEFAULT_JSON_LIMIT = 256 * 1024 * 1024
"""Largest manifest, state or index file read (bytes); ``CKPTD_MAX_JSON_BYTES`` overrides it."""


def json_limit(limit: int | None = None) -> int:
    """The size cap of a small JSON file: ``limit`` when given, else ``CKPTD_MAX_JSON_BYTES``,
    else :data:`DEFAULT_JSON_LIMIT`."""
    if limit is not None:
        return limit
    text = os.environ.get("CKPTD_MAX_JSON_BYTES")
    if not text:
        return DEFAULT_JSON_LIMIT
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"CKPTD_MAX_JSON_BYTES={text!r} is not a number of bytes") from None


MAX_JSON_DEPTH = 512
"""Deepest nesting of arrays and objects accepted (a save refuses state nested deeper)."""

_KEEP = b'[]{}"'
_DROP = bytes(range(256)).translate(None, _KEEP)  # every byte but brackets and quotes
_STRING = re.compile(rb'"[^"]*"')
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def json_depth(data: bytes) -> int:
    """The deepest nesting of arrays/objects in a JSON text, without recursion; brackets inside
    strings do not count.  For malformed text the value is only an estimate (the parser then
    rejects the text anyway)."""
    # Drop escaped backslashes, then escaped quotes: every remaining quote opens or closes a
    # string.  Keep only brackets and quotes, then drop strings: what is left is structure.
    skeleton = data.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _DROP)
    brackets = _STRING.sub(b"", skeleton).replace(b'"', b"")
    if not brackets:
        return 0
    return max(itertools.accumulate(map(_STEP.__getitem__, brackets)))


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def parse_json(data: bytes, where: str, what: str = "file", *, allow_constants: bool = False) -> Any:
    """Parse UTF-8 JSON; raises :class:`CorruptCheckpointError` naming ``where`` for invalid
    text, nesting deeper than :data:`MAX_JSON_DEPTH`, or (unless ``allow_constants``: manifests
    store a user's NaN metric as ``NaN``) ``NaN``/``Infinity`` constants."""
    depth = json_depth(data)
    if depth > MAX_JSON_DEPTH:
        raise CorruptCheckpointError(
            f"{where}: {what} is nested {depth} levels deep (limit {MAX_JSON_DEPTH}): the file is corrupt"
        )
    try:
        text = data.decode("utf-8")
        return json.loads(text) if allow_constants else json.loads(text, parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: {what} is not valid JSON ({type(e).__name__}: {e})") from e


def read_small_file(storage: Storage, path: str, *, limit: int | None = None, follow_symlinks: bool = True) -> bytes:
    """The bytes of a small file, refusing anything that is not a regular file of at most
    ``limit`` bytes (default :data:`DEFAULT_JSON_LIMIT`; and, with ``follow_symlinks=False``,
    a symlink)."""
    limit = json_limit(limit)
    if storage.local:
        return _read_local(path, limit, follow_symlinks)
    fetch_ranges = getattr(storage, "fetch_ranges", None)
    if fetch_ranges is not None:  # one ranged GET that cannot return more than limit + 1 bytes
        data = fetch_ranges(path, [(0, limit + 1)])[0]
        if len(data) > limit:
            raise _too_big(path, None, limit)
    else:
        size = storage.size(path)
        if size > limit:
            raise _too_big(path, size, limit)
        data = storage.read_bytes(path)
    if len(data) > limit:
        raise _too_big(path, len(data), limit)
    return data


def read_small_json(
    storage: Storage,
    path: str,
    *,
    what: str = "file",
    limit: int | None = None,
    follow_symlinks: bool = True,
    allow_constants: bool = False,
) -> Any:
    """:func:`read_small_file` then :func:`parse_json`."""
    data = read_small_file(storage, path, limit=limit, follow_symlinks=follow_symlinks)
    return parse_json(data, path, what, allow_constants=allow_constants)


def read_listed_file(storage: Storage, path: str, record: Any) -> bytes:
    """A small file the manifest lists (state file, index): read with :func:`read_small_file`
    (no symlinks) and checked against the record's ``size`` and ``crc32c`` on every read (it is
    small, and an edit must not load).  ``record`` ``None`` skips the check."""
    data = read_small_file(storage, path, follow_symlinks=False)
    return data if record is None else check_listed(data, record, path)


def check_listed(data: bytes, record: Any, where: str) -> bytes:
    """``data`` if its size and CRC32C are the manifest's ``record``'s, else
    :class:`CorruptCheckpointError` naming ``where``."""
    actual = format_crc(crc32c(data))
    if len(data) != record.size or actual != record.crc32c:
        raise CorruptCheckpointError(
            f"{where}: {len(data)} bytes with CRC32C {actual}, but the manifest says {record.size} bytes with "
            f"{record.crc32c}: the file was edited or is corrupt"
        )
    return data


def check_regular_file(path: str) -> None:
    """Refuse a local FIFO, device or directory where a data file should be (opening a FIFO
    blocks); a missing path is left to the open that follows."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode):
        raise CorruptCheckpointError(f"{path} is not a regular file (a FIFO, device or directory): refusing to read it")


def _too_big(path: str, size: int | None, limit: int) -> CorruptCheckpointError:
    amount = "" if size is None else f" ({size} bytes)"
    return CorruptCheckpointError(
        f"{path}{amount} is larger than the {limit}-byte limit for checkpoint metadata files "
        "(set CKPTD_MAX_JSON_BYTES to raise it if the file is genuine)"
    )


def _read_local(path: str, limit: int, follow_symlinks: bool) -> bytes:
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow_symlinks:
            raise UnsafeCheckpointError(
                f"{path} is a symlink; ckptd never writes one there: refusing to follow it"
            ) from e
        raise storage_error("open", path, e) from e
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CorruptCheckpointError(
                f"{path} is not a regular file (a FIFO, device or directory): refusing to read it"
            )
        if info.st_size > limit:
            raise _too_big(path, info.st_size, limit)
        chunks = []
        total = 0
        while True:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:  # grew while being read
                raise _too_big(path, total, limit)
        return b"".join(chunks)
    except (StorageError, CorruptCheckpointError):
        raise
    except OSError as e:
        raise storage_error("read", path, e) from e
    finally:
        os.close(fd)
