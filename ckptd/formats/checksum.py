"""CRC32C (Castagnoli) checksums, and the SHA-256 digests that ``incremental="hash"`` compares
files by.

CRC32C itself comes from :mod:`ckptd._crc32c` (``fastcrc`` where it is installed, else the
``crc32c`` package; both release the GIL, so the writer checksums one buffer while another
thread writes it); this module adds chunked checksums of views, the combination of checksums
without the data, and the manifest's hex form.  It imports nothing heavy: the writer process
uses it too.

CRC32C detects accidental damage, not deliberate edits: bytes can be changed to keep their
CRC32C.  Deciding that a file is unchanged (and linking the old one instead of writing the new
bytes) needs a digest nobody can collide on purpose: SHA-256 (about 1.6 GB/s on one core with
the SHA extensions; BLAKE2b measured 0.75 GB/s on the benchmark VM).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from .._crc32c import crc32c

__all__ = [
    "CHECKSUM_CHUNK",
    "DIGEST_PREFIX",
    "crc32c",
    "crc32c_combine",
    "crc32c_concat",
    "crc32c_of_view",
    "format_crc",
    "sha256_of_view",
]

CHECKSUM_CHUNK = 64 * 1024 * 1024


def crc32c_of_view(view: memoryview, chunk: int = CHECKSUM_CHUNK) -> int:
    """CRC32C of a (possibly huge) memoryview, computed in chunks."""
    value = 0
    for start in range(0, len(view), chunk):
        value = crc32c(view[start : start + chunk], value)
    return value


DIGEST_PREFIX = "sha256:"


def sha256_of_view(view: memoryview, chunk: int = CHECKSUM_CHUNK) -> str:
    """``"sha256:<64 hex digits>"`` of a (possibly huge) memoryview, computed in chunks."""
    hasher = hashlib.sha256()
    for start in range(0, len(view), chunk):
        hasher.update(view[start : start + chunk])
    return DIGEST_PREFIX + hasher.hexdigest()


def format_crc(value: int) -> str:
    """Eight lowercase hex digits, the form used in manifests and messages."""
    return f"{value:08x}"


_POLY = 0x82F63B78  # CRC32C, reflected


def _gf2_times(matrix: list[int], vector: int) -> int:
    total = 0
    row = 0
    while vector:
        if vector & 1:
            total ^= matrix[row]
        vector >>= 1
        row += 1
    return total


def _gf2_square(matrix: list[int]) -> list[int]:
    return [_gf2_times(matrix, matrix[n]) for n in range(32)]


def _zero_operators() -> list[list[int]]:
    """The operators that append 2**k zero bytes to a CRC, k = 0..63 (built once: each combine
    then costs one matrix-vector product per set bit of the length)."""
    operator = [_POLY] + [1 << n for n in range(31)]  # one zero bit
    for _ in range(3):
        operator = _gf2_square(operator)  # 2, 4, 8 zero bits: one byte
    out = [operator]
    for _ in range(63):
        out.append(_gf2_square(out[-1]))
    return out


def crc32c_concat(parts: Iterable[tuple[int, int]]) -> int:
    """CRC32C of consecutive byte runs, from each run's ``(CRC32C, length)`` in order (the
    first run's length is not needed); 0, the CRC32C of no bytes, for no runs."""
    value: int | None = None
    for crc, length in parts:
        value = crc if value is None else crc32c_combine(value, crc, length)
    return value or 0


_ZERO_OPERATORS: list[list[int]] = []


def crc32c_combine(crc_a: int, crc_b: int, length_b: int) -> int:
    """CRC32C of ``A + B`` from CRC32C(A), CRC32C(B) and ``len(B)``, without the data.

    Lets ranks that wrote different parts of one shared file checksum only their own bytes.
    (The GF(2) matrix method of zlib's ``crc32_combine``, with the Castagnoli polynomial; the
    powers of the zero-byte operator are computed once per process.)
    """
    if length_b <= 0:
        return crc_a
    if not _ZERO_OPERATORS:
        _ZERO_OPERATORS.extend(_zero_operators())
    bit = 0
    while length_b:
        if length_b & 1:
            crc_a = _gf2_times(_ZERO_OPERATORS[bit], crc_a)
        length_b >>= 1
        bit += 1
    return crc_a ^ crc_b
