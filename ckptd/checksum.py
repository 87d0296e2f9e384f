"""CRC32C (Castagnoli) checksums, hardware-accelerated through the ``crc32c`` package.

The C implementation releases the GIL, so the writer checksums one buffer while another thread
writes it.  This module imports nothing heavy: the writer process uses it too.
"""

from __future__ import annotations

import crc32c as _crc32c

Buffer = bytes | bytearray | memoryview

__all__ = ["CHECKSUM_CHUNK", "crc32c", "crc32c_of_view", "format_crc"]

CHECKSUM_CHUNK = 64 * 1024 * 1024


def crc32c(data: Buffer, value: int = 0) -> int:
    """Extend the running CRC32C ``value`` with ``data``."""
    return int(_crc32c.crc32c(data, value))


def crc32c_of_view(view: memoryview, chunk: int = CHECKSUM_CHUNK) -> int:
    """CRC32C of a (possibly huge) memoryview, computed in chunks."""
    value = 0
    for start in range(0, len(view), chunk):
        value = crc32c(view[start : start + chunk], value)
    return value


def format_crc(value: int) -> str:
    """Eight lowercase hex digits, the form used in manifests and messages."""
    return f"{value:08x}"
