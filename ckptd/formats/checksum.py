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
    "crc32c_overlay",
    "crc32c_spread",
    "crc32c_zeros",
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
    """The operators that append 2**k zero bytes to a CRC, k = 0..63, as matrices (32 columns)."""
    operator = [_POLY] + [1 << n for n in range(31)]  # one zero bit
    for _ in range(3):
        operator = _gf2_square(operator)  # 2, 4, 8 zero bits: one byte
    out = [operator]
    for _ in range(63):
        out.append(_gf2_square(out[-1]))
    return out


def _byte_tables(matrix: list[int]) -> tuple[list[int], ...]:
    """A 32x32 GF(2) matrix as four 256-entry tables, one per byte of the vector: the product is
    then four lookups and three XORs instead of up to 32 steps."""
    tables = []
    for byte in range(4):
        columns = matrix[8 * byte : 8 * byte + 8]
        table = [0] * 256
        for value in range(1, 256):
            low = value & -value
            table[value] = table[value ^ low] ^ columns[low.bit_length() - 1]
        tables.append(table)
    return tuple(tables)


def _zero_table(bit: int) -> tuple[list[int], ...]:
    """The byte tables of the operator that appends ``2**bit`` zero bytes (built on first use)."""
    tables = _ZERO_TABLES[bit]
    if tables is None:
        if not _ZERO_OPERATORS:
            _ZERO_OPERATORS[:] = _zero_operators()  # one assignment: a racing thread builds the same
        tables = _ZERO_TABLES[bit] = _byte_tables(_ZERO_OPERATORS[bit])
    return tables


_ZERO_OPERATORS: list[list[int]] = []
_ZERO_TABLES: list[tuple[list[int], ...] | None] = [None] * 64


def crc32c_concat(parts: Iterable[tuple[int, int]]) -> int:
    """CRC32C of consecutive byte runs, from each run's ``(CRC32C, length)`` in order (the
    first run's length is not needed); 0, the CRC32C of no bytes, for no runs."""
    value: int | None = None
    for crc, length in parts:
        value = crc if value is None else crc32c_combine(value, crc, length)
    return value or 0


def crc32c_combine(crc_a: int, crc_b: int, length_b: int) -> int:
    """CRC32C of ``A + B`` from CRC32C(A), CRC32C(B) and ``len(B)``, without the data.

    Lets ranks that wrote different parts of one shared file checksum only their own bytes.
    (The GF(2) matrix method of zlib's ``crc32_combine``, with the Castagnoli polynomial: ``A``'s
    CRC is moved past ``len(B)`` zero bytes by the operator of each set bit of the length, each
    applied as four table lookups: about 0.6 us per set bit.)
    """
    if length_b <= 0:
        return crc_a
    while length_b:
        low = length_b & -length_b
        length_b ^= low
        t0, t1, t2, t3 = _ZERO_TABLES[low.bit_length() - 1] or _zero_table(low.bit_length() - 1)
        crc_a = t0[crc_a & 0xFF] ^ t1[(crc_a >> 8) & 0xFF] ^ t2[(crc_a >> 16) & 0xFF] ^ t3[crc_a >> 24]
    return crc_a ^ crc_b


def crc32c_zeros(length: int) -> int:
    """CRC32C of ``length`` zero bytes, without the bytes."""
    return crc32c_combine(0xFFFFFFFF, 0xFFFFFFFF, length) if length > 0 else 0


def crc32c_spread(runs: Iterable[tuple[int, int, int]]) -> tuple[int, int]:
    """``(CRC32C, end)`` of the bytes ``[0, end)`` that hold byte runs at their offsets and zeros
    between them, from each run's ``(offset, CRC32C, length)`` in ascending offset order (``end``:
    where the last run ends).  One rank's pieces of a file the ranks write parts of, as if the
    others' parts were zeros: see :func:`crc32c_overlay`."""
    value, end = 0, 0
    for offset, crc, length in runs:
        if offset < end:
            raise ValueError(f"byte runs overlap or are out of order at offset {offset} (the last ended at {end})")
        value = crc32c_combine(value, crc32c_zeros(offset - end), offset - end)
        value = crc32c_combine(value, crc, length)
        end = offset + length
    return value, end


def crc32c_overlay(spreads: Iterable[tuple[int, int]], length: int) -> int:
    """CRC32C of a ``length``-byte file made of disjoint parts, from each part's spread
    (:func:`crc32c_spread`: its bytes at their offsets, zeros elsewhere, up to ``end``).

    CRC32C is affine over GF(2): for equal-length inputs ``crc(X ^ Y) = crc(X) ^ crc(Y) ^
    crc(zeros)``.  Parts that do not overlap XOR into the file, so its CRC32C is the XOR of the
    spreads, each extended with zeros to ``length``, and of ``crc32c_zeros(length)`` once per
    spread but the first.  Disjointness is the caller's to know: overlapping parts give a wrong
    value, not an error.  Cost: two combines per spread, whatever each spread holds.
    """
    value, count = 0, 0
    for crc, end in spreads:
        if end > length:
            raise ValueError(f"a part ends at {end}, beyond the {length} bytes of the whole")
        value ^= crc32c_combine(crc, crc32c_zeros(length - end), length - end)
        count += 1
    return value ^ (crc32c_zeros(length) if count % 2 == 0 and count else 0)
