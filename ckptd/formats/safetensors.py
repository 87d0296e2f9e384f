"""The safetensors format: dtype sizes, header building and strict header parsing (no torch).

A safetensors file is ``u64 little-endian header length`` + ``JSON header`` (padded with spaces to
a multiple of 8 bytes) + the data section.  Each header entry gives a tensor's dtype, shape and
``data_offsets`` relative to the start of the data section.  ckptd builds the header itself so
the writer can stream a shard straight from the staging arena without materialising it.
"""

from __future__ import annotations

import itertools
import json
import math
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring as _json_string  # type: ignore[attr-defined,unused-ignore]
from typing import Any

from ..errors import CorruptCheckpointError, UnsupportedValueError
from .json_files import parse_json

__all__ = [
    "DTYPE_ITEMSIZE",
    "HEADER_ALIGNMENT",
    "HEADER_PREFETCH",
    "MAX_HEADER_SIZE",
    "MAX_TENSOR_BYTES",
    "TensorEntry",
    "SafetensorsHeader",
    "build_header",
    "header_bytes",
    "parse_header",
    "read_header",
    "shape_fits",
]

HEADER_ALIGNMENT = 8
MAX_HEADER_SIZE = 100 * 1024 * 1024  # the limit the reference implementation enforces
HEADER_PREFETCH = 64 * 1024  # bytes read at once when a header is read: most headers fit
MAX_TENSOR_BYTES = 2**62
"""Largest tensor a checkpoint may describe, in bytes, each zero dimension counted as one
(:func:`shape_fits`)."""

DTYPE_ITEMSIZE: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "I16": 2,
    "I32": 4,
    "I64": 8,
    "F16": 2,
    "BF16": 2,
    "F32": 4,
    "F64": 8,
    "C64": 8,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2FNUZ": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
}
"""Bytes per element of every safetensors dtype ckptd reads and writes (the torch dtypes they
stand for are in :mod:`ckptd.formats.torch_dtypes`)."""


def shape_fits(shape: Sequence[int], itemsize: int) -> bool:
    """True if torch can describe a tensor of ``shape``: its element count, each 0 dimension
    counted as 1, times ``itemsize`` is at most :data:`MAX_TENSOR_BYTES`.

    torch computes strides as products of trailing dimensions (a 0 counted as 1) and storage
    sizes as elements x item size, in 64-bit integers: ``torch.empty([0, 2**62, 2**62])`` raises
    "Stride calculation overflowed" though it holds nothing.  Bounding the product of all the
    dimensions bounds each of those products.  (A tensor that holds bytes is bounded by its byte
    range already; this matters for empty ones, and for shapes no file backs.)
    """
    total = itemsize
    for dim in shape:
        total *= dim or 1
        if total > MAX_TENSOR_BYTES:
            return False
    return True


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file; ``start``/``end`` are relative to the data section."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed header: absolute offset of the data section, entries by key, and metadata."""

    data_start: int
    entries: dict[str, TensorEntry]
    metadata: dict[str, str]

    @property
    def data_size(self) -> int:
        return max((e.end for e in self.entries.values()), default=0)


def build_header(entries: Iterable[TensorEntry], metadata: dict[str, str] | None = None) -> bytes:
    """The length prefix and padded JSON header for ``entries`` (data offsets already assigned)."""
    return header_bytes(((e.key, e.dtype, e.shape, e.start, e.end) for e in entries), metadata)


def header_bytes(
    rows: Iterable[tuple[str, str, Sequence[int], int, int]], metadata: dict[str, str] | None = None
) -> bytes:
    """:func:`build_header` of ``(key, dtype, shape, start, end)`` rows.

    The JSON is compact (as ``json.dumps`` with ``separators=(",", ":")`` and non-ASCII kept),
    written row by row: a checkpoint may hold 100,000 tensors and this runs on the save path, so
    the text of each dtype and of each shape is made once and reused (models repeat both).
    """
    meta = dict(metadata if metadata is not None else {"format": "pt"})
    parts = ['{"__metadata__":', json.dumps(meta, separators=(",", ":"), ensure_ascii=False)]
    append = parts.append
    dtype_texts: dict[str, str] = {}  # dtype -> ':{"dtype":"F32","shape":['
    shape_texts: dict[tuple[int, ...], str] = {}  # shape -> '2,3],"data_offsets":['
    seen: set[str] = {"__metadata__"}
    for key, dtype, shape, start, end in rows:
        if key in seen:
            raise UnsupportedValueError(f"tensor key {key!r} appears twice in one safetensors header")
        seen.add(key)
        dtype_text = dtype_texts.get(dtype)
        if dtype_text is None:
            dtype_text = dtype_texts[dtype] = f':{{"dtype":{_json_string(dtype)},"shape":['
        dims = shape if type(shape) is tuple else tuple(shape)
        shape_text = shape_texts.get(dims)
        if shape_text is None:
            shape_text = shape_texts[dims] = ",".join(map(str, dims)) + '],"data_offsets":['
        append(f",{_json_string(key)}{dtype_text}{shape_text}{start},{end}]}}")
    parts.append("}")
    text = "".join(parts).encode("utf-8")
    padded = text + b" " * (-len(text) % HEADER_ALIGNMENT)
    return struct.pack("<Q", len(padded)) + padded


def parse_header(prefix: bytes, body: bytes, file_size: int | None, name: str) -> SafetensorsHeader:
    """Validate and parse a header; ``name`` is used in error messages.

    Checks: sane length, valid UTF-8 JSON, known dtypes, byte counts matching shapes, offsets in
    bounds and not overlapping, and (when ``file_size`` is given) a data section that fits the file.
    """
    (length,) = struct.unpack("<Q", prefix)
    data_start = 8 + length
    raw = parse_json(body, name, "safetensors header")
    if not isinstance(raw, dict):
        raise CorruptCheckpointError(f"{name}: safetensors header is not a JSON object")
    metadata_raw = raw.pop("__metadata__", None) or {}
    if not isinstance(metadata_raw, dict):
        raise CorruptCheckpointError(f"{name}: safetensors __metadata__ is not an object")
    entries: dict[str, TensorEntry] = {}
    for key, info in raw.items():
        entries[key] = _parse_entry(key, info, name)
    spans = sorted((e.start, e.end, e.key) for e in entries.values() if e.nbytes)
    for (_, end_a, key_a), (start_b, _, key_b) in itertools.pairwise(spans):
        if start_b < end_a:
            raise CorruptCheckpointError(f"{name}: tensors {key_a!r} and {key_b!r} overlap in the data section")
    header = SafetensorsHeader(data_start, entries, {str(k): str(v) for k, v in metadata_raw.items()})
    if file_size is not None and data_start + header.data_size > file_size:
        raise CorruptCheckpointError(
            f"{name}: file is truncated: header needs {data_start + header.data_size} bytes, file has {file_size}"
        )
    return header


def _parse_entry(key: str, info: Any, name: str) -> TensorEntry:
    where = f" for tensor {key!r} in {name}"
    if not isinstance(info, dict):
        raise CorruptCheckpointError(f"malformed header entry{where}")
    dtype = info.get("dtype")
    shape = info.get("shape")
    offsets = info.get("data_offsets")
    if dtype not in DTYPE_ITEMSIZE:
        raise CorruptCheckpointError(f"unknown dtype {dtype!r}{where}")
    if not (
        isinstance(shape, list)
        and len(shape) <= 64
        and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= 2**62 for d in shape)
    ):
        raise CorruptCheckpointError(f"malformed shape {shape!r}{where}")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    ):
        raise CorruptCheckpointError(f"malformed data_offsets {offsets!r}{where}")
    start, end = offsets
    itemsize = DTYPE_ITEMSIZE[dtype]
    expected = math.prod(shape) * itemsize
    if expected > MAX_TENSOR_BYTES or (expected == 0 and not shape_fits(shape, itemsize)):
        raise CorruptCheckpointError(f"shape {shape} is beyond any tensor (over {MAX_TENSOR_BYTES} bytes){where}")
    if start < 0 or end - start != expected:
        raise CorruptCheckpointError(f"data_offsets {offsets} do not match {dtype}{shape} ({expected} bytes){where}")
    return TensorEntry(key, dtype, tuple(shape), start, end)


def read_header(
    read: Callable[[int, int], bytes], file_size: int, name: str, *, prefetch: int = HEADER_PREFETCH
) -> SafetensorsHeader:
    """Read and parse the header of a safetensors file of ``file_size`` bytes.

    ``read(offset, length)`` returns bytes of the file (a local file, a ranged GET...).  The first
    ``prefetch`` bytes are read at once, so a header that fits in them costs one read; a longer
    header costs a second.  ``name`` is used in error messages.
    """
    head = read(0, min(file_size, prefetch))
    if len(head) < 8:
        raise CorruptCheckpointError(f"{name}: file is too short to be safetensors ({file_size} bytes)")
    (length,) = struct.unpack("<Q", head[:8])
    if length > MAX_HEADER_SIZE or 8 + length > file_size:
        raise CorruptCheckpointError(
            f"{name}: safetensors header length {length} exceeds the file ({file_size} bytes) or the "
            f"{MAX_HEADER_SIZE}-byte limit: the file is truncated or not safetensors"
        )
    body = head[8 : 8 + length] if 8 + length <= len(head) else read(8, length)
    if len(body) != length:
        raise CorruptCheckpointError(f"{name}: file is truncated inside the safetensors header")
    return parse_header(head[:8], body, file_size, name)
