"""The commit record (``checkpoint_manifest.json``), the non-tensor state file and HF indexes.

The manifest is written last; a directory (or prefix) without a manifest that parses and
validates is not a checkpoint.  It describes everything needed to load without listing the
store: every file with size and CRC32C, every tensor with dtype, shape, file and byte range.

This module is longer than 450 lines on purpose: each record is parsed from untrusted bytes,
and its field-by-field checks (types, bounds, names) stay beside the schema they guard.
"""

from __future__ import annotations

import itertools
import json
import math
import operator
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from json.encoder import encode_basestring as _json_string  # type: ignore[attr-defined,unused-ignore]
from typing import Any

from ..errors import CkptdError, CorruptCheckpointError, UnsupportedValueError
from ..storage import check_file_name
from .checksum import DIGEST_PREFIX, crc32c, format_crc
from .json_files import MAX_JSON_DEPTH, json_depth, parse_json
from .manifest_text import canonical_text, indented_text
from .names import MANIFEST_NAME, parse_step
from .safetensors import DTYPE_ITEMSIZE, shape_fits

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "ChunkRecord",
    "ComponentRecord",
    "FileRecord",
    "Manifest",
    "TensorRecord",
    "MAX_DIMENSION",
    "REUSE_KINDS",
    "STATE_FORMAT",
    "check_tensor_record",
    "check_tied_groups",
    "hf_index",
    "parse_hf_index",
    "is_foreign_manifest",
    "parse_state_file",
    "sharing_aliases",
    "state_file_bytes",
    "utc_now",
]

FORMAT_NAME = "ckptd"
FORMAT_VERSION = 1
MAX_DIMENSION = 2**62
"""Largest tensor dimension (and byte offset) a manifest may state."""
STATE_FORMAT = "ckptd-state"
"""The ``"format"`` field of every ``state.json`` a save writes."""
_MAX_RANK = 64
_CHECKSUM_KEY = "checksum"
_ZEROS = tuple((0,) * rank for rank in range(_MAX_RANK + 1))  # the offset of a whole tensor, by rank


def zero_offset(rank: int) -> tuple[int, ...]:
    """``(0,) * rank``, the offset of a whole tensor: one shared tuple per rank."""
    return _ZEROS[rank] if rank <= _MAX_RANK else (0,) * rank


_new_record = object.__new__
_set = object.__setattr__  # how a frozen dataclass's __init__ sets its fields


def is_foreign_manifest(data: bytes) -> bool:
    """True if ``checkpoint_manifest.json`` bytes are another tool's manifest (Forgather's trainer
    writes one under the same name: ``timestamp``, ``components``, no ``format``).

    Told apart by content: a JSON object whose ``format`` is not ``"ckptd"`` and that has no
    ``format_version`` is foreign.  Anything else (ckptd's own, or bytes that do not parse) is
    ckptd's to judge, so a damaged ckptd manifest is still reported as corrupt.
    """
    if f'"format": "{FORMAT_NAME}"'.encode() in data[:64]:
        return False  # ckptd writes "format" first: no need to parse a large manifest twice
    try:
        body = parse_json(data, MANIFEST_NAME, "manifest", allow_constants=True)  # depth-guarded
    except CkptdError:
        return False
    return isinstance(body, dict) and body.get("format") != FORMAT_NAME and "format_version" not in body


def utc_now() -> str:
    """The current UTC time in ISO 8601 with a ``Z`` suffix."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


REUSE_KINDS = ("link", "copy", "server_copy")
"""How an incremental save made a file it did not write (:attr:`FileRecord.reused`)."""


@dataclass(frozen=True)
class FileRecord:
    """A file of the checkpoint: byte size and CRC32C (8 hex digits).

    ``digest`` (``"sha256:<hex>"``): the file's SHA-256, recorded by ``incremental="hash"``
    saves for the next one to compare with.  ``reused``: how an incremental save made the file
    from the previous checkpoint's instead of writing it (one of :data:`REUSE_KINDS`: a hard
    link, a local copy, a server-side copy); the file is in this checkpoint all the same.

    ``checkpoint`` is read from manifests of older versions only: it names the sibling
    checkpoint (``checkpoint-100``, under the same root) that holds the file, which such an
    incremental save referenced instead of materializing it.  New saves never write it.
    """

    size: int
    crc32c: str
    checkpoint: str | None = None
    digest: str | None = None
    reused: str | None = None


@dataclass(frozen=True)
class ChunkRecord:
    """A stored piece of a tensor: file, absolute byte range, and its box in the global tensor."""

    file: str
    start: int
    end: int
    offset: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TensorRecord:
    """A logical tensor: dtype, global shape, and where its pieces live.

    Most tensors are stored whole (one chunk at offset zero): ``file``, ``start`` and ``end``
    describe it.  Sharded saves that could not write a whole tensor keep one chunk per piece.
    """

    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[ChunkRecord, ...]

    @classmethod
    def whole(cls, dtype: str, shape: tuple[int, ...], file: str, start: int, end: int) -> TensorRecord:
        """The record of a tensor stored whole, equal to ``cls(dtype, shape, (ChunkRecord(file,
        start, end, (0,) * len(shape), shape),))``.

        Every save makes one per tensor (100,000 of them must plan in well under a second), so the
        two records are filled in as their frozen ``__init__`` would, without its per-field lookups.
        """
        chunk = _new_record(ChunkRecord)
        _set(chunk, "file", file)
        _set(chunk, "start", start)
        _set(chunk, "end", end)
        _set(chunk, "offset", zero_offset(len(shape)))
        _set(chunk, "shape", shape)
        record = _new_record(cls)
        _set(record, "dtype", dtype)
        _set(record, "shape", shape)
        _set(record, "chunks", (chunk,))
        return record

    @property
    def is_whole(self) -> bool:
        return len(self.chunks) == 1 and self.chunks[0].shape == self.shape

    @property
    def file(self) -> str:
        return self.chunks[0].file

    @property
    def start(self) -> int:
        return self.chunks[0].start

    @property
    def end(self) -> int:
        return self.chunks[0].end

    @property
    def nbytes(self) -> int:
        return sum(c.end - c.start for c in self.chunks)

    @property
    def files(self) -> set[str]:
        return {c.file for c in self.chunks}

    def to_json(self) -> dict[str, Any]:
        chunks = self.chunks
        if len(chunks) == 1 and chunks[0].shape == self.shape:  # = is_whole (once per tensor of a save)
            chunk = chunks[0]
            offsets = [chunk.start, chunk.end]
            return {"dtype": self.dtype, "shape": list(self.shape), "file": chunk.file, "offsets": offsets}
        return {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "chunks": [
                {"file": c.file, "offsets": [c.start, c.end], "global_offset": list(c.offset), "shape": list(c.shape)}
                for c in self.chunks
            ],
        }

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> TensorRecord:
        """Parse one tensor entry; raises ``TypeError``/``ValueError``/``KeyError`` when malformed
        (:meth:`Manifest.from_json` turns those into :class:`CorruptCheckpointError`)."""
        body = _object(body, "tensor entry")
        if "chunks" not in body:
            # Fast path for the common entry (a whole tensor), the same checks inlined; anything
            # unusual falls through to the step-by-step checks below, which name the problem.
            dtype, shape, file, offsets = body["dtype"], body["shape"], body["file"], body["offsets"]
            if (
                type(dtype) is str
                and type(file) is str
                and type(shape) is list
                and type(offsets) is list
                and len(offsets) == 2
                and len(shape) <= _MAX_RANK
                and all(type(v) is int and -MAX_DIMENSION <= v <= MAX_DIMENSION for v in (*shape, *offsets))
            ):
                dims = tuple(shape)
                return cls(dtype, dims, (ChunkRecord(file, offsets[0], offsets[1], (0,) * len(dims), dims),))
        dtype = _str(body["dtype"], "dtype")
        shape = _dims(body["shape"], "shape")
        if "chunks" not in body:
            start, end = _offsets(body["offsets"])
            return cls.whole(dtype, shape, _str(body["file"], "file"), start, end)
        chunks = []
        for c in _list(body["chunks"], "chunks"):
            c = _object(c, "chunk")
            start, end = _offsets(c["offsets"])
            offset = _dims(c["global_offset"], "global_offset")
            chunks.append(ChunkRecord(_str(c["file"], "file"), start, end, offset, _dims(c["shape"], "shape")))
        return cls(dtype, shape, tuple(chunks))


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"{what} must be an object, not {type(value).__name__}")
    return value


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"{what} must be an array, not {type(value).__name__}")
    return value


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a string, not {type(value).__name__}")
    return value


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an integer, not {type(value).__name__}")
    if not -MAX_DIMENSION <= value <= MAX_DIMENSION:
        raise ValueError(f"{what} {value} is out of range")
    return value


def _dims(value: Any, what: str) -> tuple[int, ...]:
    items = _list(value, what)
    if len(items) > _MAX_RANK:
        raise ValueError(f"{what} has {len(items)} dimensions (at most {_MAX_RANK})")
    return tuple(_int(d, what) for d in items)


def _offsets(value: Any) -> tuple[int, int]:
    items = _list(value, "offsets")
    if len(items) != 2:
        raise ValueError(f"offsets must be [start, end], not {len(items)} numbers")
    return _int(items[0], "offsets"), _int(items[1], "offsets")


def _check_user_json(value: Any, what: str) -> None:
    """Refuse ``metadata``/``metrics`` the manifest could not store or a reader would refuse."""
    try:
        text = json.dumps(value, ensure_ascii=False).encode("utf-8")
    except (TypeError, ValueError, RecursionError, UnicodeError) as e:
        raise UnsupportedValueError(
            f"{what} must be JSON-serializable (strings, numbers, lists, dicts): {type(e).__name__}: {e}"
        ) from e
    if json_depth(text) > MAX_JSON_DEPTH - 2:
        raise UnsupportedValueError(f"{what} is nested deeper than {MAX_JSON_DEPTH - 2} levels; flatten it")


def _timings(value: Any) -> dict[str, float]:
    timings = _object(value, "timings")
    for name, seconds in timings.items():
        if isinstance(seconds, bool) or not isinstance(seconds, int | float):
            raise TypeError(f"timing {name!r} must be a number, not {type(seconds).__name__}")
    return dict(timings)


def _canonical(body: Mapping[str, Any]) -> bytes:
    """The bytes the manifest checksum covers: the body without ``checksum``, keys sorted, no
    whitespace (so re-indenting the file does not matter, any change of meaning does)."""
    rest = {k: v for k, v in body.items() if k != _CHECKSUM_KEY}
    return json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass")


def _check_checksum(body: Any, where: str) -> None:
    if not isinstance(body, dict) or _CHECKSUM_KEY not in body:
        return  # written before manifests carried a checksum (still format version 1)
    stated = body[_CHECKSUM_KEY]
    actual = format_crc(crc32c(_canonical(body)))
    if stated != actual:
        raise CorruptCheckpointError(
            f"{where}: manifest checksum mismatch (stated {stated!r}, content {actual}): the manifest was edited "
            "or is corrupt; restore it or load another step"
        )


@dataclass(frozen=True)
class ComponentRecord:
    """One saved component.  ``kind`` is ``safetensors``, ``torch_bin`` or ``state`` (no tensors)."""

    kind: str
    tensors: dict[str, TensorRecord]
    index: str | None = None
    tied: list[list[str]] = field(default_factory=list)
    sharing: str = "replicated"

    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


@dataclass(frozen=True)
class Manifest:
    """The parsed ``checkpoint_manifest.json``."""

    step: int | None
    created_utc: str
    world_size: int
    library_version: str
    components: dict[str, ComponentRecord]
    files: dict[str, FileRecord]
    state_file: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def to_json(self) -> bytes:
        outline: dict[str, Any] = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "library_version": self.library_version,
            "step": self.step,
            "created_utc": self.created_utc,
            "world_size": self.world_size,
            "state_file": self.state_file,
            "components": {
                name: {"kind": c.kind, "sharing": c.sharing, "index": c.index, "tied": c.tied, "tensors": None}
                for name, c in self.components.items()
            },
            "files": {name: _file_json(f) for name, f in self.files.items()},
            "timings": self.timings,
            "metadata": self.metadata,
            "metrics": self.metrics,
        }
        for what in ("metadata", "metrics"):
            _check_user_json(outline[what], what)
        # The tensor maps are written from the records (manifest_text): a dict per tensor and
        # json's sorted encoding of them cost about 12 µs per tensor of the time to commit.
        tensors = {name: c.tensors for name, c in self.components.items()}
        canonical = canonical_text(outline, tensors).encode("utf-8", "surrogatepass")
        outline[_CHECKSUM_KEY] = format_crc(crc32c(canonical))
        return indented_text(outline, tensors).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        """Parse and validate (checksum included, when the manifest has one); raises
        :class:`CorruptCheckpointError` naming ``where``."""
        body = parse_json(data, where, "manifest", allow_constants=True)
        try:
            _check_checksum(body, where)
            return cls._from_body(body, where)
        except CkptdError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError, UnicodeError) as e:
            raise CorruptCheckpointError(f"{where}: malformed manifest ({type(e).__name__}: {e})") from e

    @classmethod
    def _from_body(cls, body: Any, where: str) -> Manifest:
        if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
            raise CorruptCheckpointError(f"{where}: not a ckptd manifest")
        version = _int(body["format_version"], "format_version")
        if version > FORMAT_VERSION:
            raise CorruptCheckpointError(
                f"{where}: format version {version} is newer than this ckptd supports ({FORMAT_VERSION}); upgrade ckptd"
            )
        files: dict[str, FileRecord] = {}
        for name, f in _object(body["files"], "files").items():
            f = _object(f, f"files[{name!r}]")
            size = _int(f["size"], f"size of {name!r}")
            if size < 0:
                raise ValueError(f"size of {name!r} is negative")
            crc = _str(f["crc32c"], "crc32c")
            reference, digest, reused = _reference(f, where), _digest(f, name, where), _reused(f, name, where)
            files[check_file_name(name, where)] = FileRecord(size, crc, reference, digest, reused)
        components: dict[str, ComponentRecord] = {}
        for name, c in _object(body["components"], "components").items():
            c = _object(c, f"component {name!r}")
            tensors: dict[str, TensorRecord] = {}
            for key, t in _object(c["tensors"], f"tensors of {name!r}").items():
                record = TensorRecord.from_json(t)
                _check_tensor(record, f"{where}: tensor {name}.{key}", files)
                tensors[key] = record
            tied = [
                [_str(k, "tied key") for k in _list(group, "tied group")]
                for group in _list(c.get("tied") or [], "tied")
            ]
            sharing = _str(c.get("sharing", "replicated"), "sharing")
            index = c.get("index")
            if index is not None:
                index = check_file_name(_str(index, f"index of component {name!r}"), where)
            kind = _str(c["kind"], "kind")
            if not (kind == "torch_bin" and index is not None):  # else its keys are in the index: the reader checks
                check_tied_groups(tied, tensors, f"{where}: component {name!r}")
            components[name] = ComponentRecord(kind, tensors, index, tied, sharing)
        _check_byte_ranges(components, where)
        state_file = body.get("state_file")
        if state_file is not None and (not isinstance(state_file, str) or state_file not in files):
            raise CorruptCheckpointError(f"{where}: state file {state_file!r} is not listed in files")
        step = body.get("step")
        return cls(
            step=None if step is None else _int(step, "step"),
            created_utc=_str(body["created_utc"], "created_utc"),
            world_size=_int(body.get("world_size", 1), "world_size"),
            library_version=_str(body.get("library_version", ""), "library_version"),
            components=components,
            files=files,
            state_file=state_file,
            timings=_timings(body.get("timings") or {}),
            metadata=dict(_object(body.get("metadata") or {}, "metadata")),
            metrics=dict(_object(body.get("metrics") or {}, "metrics")),
            format_version=version,
        )


def _file_json(record: FileRecord) -> dict[str, Any]:
    body: dict[str, Any] = {"size": record.size, "crc32c": record.crc32c}
    if record.checkpoint is not None:
        body["checkpoint"] = record.checkpoint
    if record.digest is not None:
        body["digest"] = record.digest
    if record.reused is not None:
        body["reused"] = record.reused
    return body


_HEX = frozenset("0123456789abcdef")


def _digest(body: dict[str, Any], name: str, where: str) -> str | None:
    value = body.get("digest")
    if value is None:
        return None
    hex_part = value[len(DIGEST_PREFIX) :] if isinstance(value, str) and value.startswith(DIGEST_PREFIX) else ""
    if len(hex_part) != 64 or not set(hex_part) <= _HEX:
        raise CorruptCheckpointError(f"{where}: digest of {name!r} is not {DIGEST_PREFIX}<64 hex digits>")
    return str(value)


def _reused(body: dict[str, Any], name: str, where: str) -> str | None:
    value = body.get("reused")
    if value is not None and value not in REUSE_KINDS:
        raise CorruptCheckpointError(f"{where}: file {name!r} was reused by {value!r}, not one of {REUSE_KINDS}")
    return value


def _reference(body: dict[str, Any], where: str) -> str | None:
    name = body.get("checkpoint")
    if name is None:
        return None
    if not isinstance(name, str) or parse_step(name) is None:
        raise CorruptCheckpointError(f"{where}: file reference {name!r} is not a sibling checkpoint name")
    return name


def check_tensor_record(record: TensorRecord, where: str, files: Mapping[str, FileRecord]) -> None:
    """Raise :class:`~ckptd.errors.CorruptCheckpointError` unless ``record`` is consistent with
    ``files`` (their sizes) as a manifest's records must be: a known dtype, every chunk inside
    the tensor and its file, every element covered exactly once.  For records built from other
    tools' files (DCP's HF shards), checked as ckptd's own."""
    _check_tensor(record, where, files)


def _check_tensor(record: TensorRecord, where: str, files: Mapping[str, FileRecord]) -> None:
    itemsize = DTYPE_ITEMSIZE.get(record.dtype)
    if itemsize is None:
        raise CorruptCheckpointError(f"{where}: unknown dtype {record.dtype!r}")
    if any(dim < 0 for dim in record.shape):
        raise CorruptCheckpointError(f"{where}: negative dimension in shape {record.shape}")
    if len(record.chunks) == 1:  # the common case, a whole tensor: the loop below, unrolled
        chunk = record.chunks[0]
        if chunk.shape == record.shape and not any(chunk.offset) and len(chunk.offset) == len(record.shape):
            file = files.get(chunk.file)
            if file is None:
                raise CorruptCheckpointError(f"{where}: file {chunk.file!r} is not listed in the manifest")
            if chunk.start < 0 or chunk.end - chunk.start != itemsize * math.prod(chunk.shape) or chunk.end > file.size:
                raise CorruptCheckpointError(f"{where}: byte range [{chunk.start}, {chunk.end}) is inconsistent")
            if chunk.start == chunk.end and not shape_fits(record.shape, itemsize):  # else bounded by the file
                raise CorruptCheckpointError(f"{where}: shape {list(record.shape)} is beyond any tensor")
            return
    if not shape_fits(record.shape, itemsize):
        raise CorruptCheckpointError(f"{where}: shape {list(record.shape)} is beyond any tensor")
    covered = 0
    for chunk in record.chunks:
        if chunk.file not in files:
            raise CorruptCheckpointError(f"{where}: file {chunk.file!r} is not listed in the manifest")
        if len(chunk.offset) != len(record.shape) or len(chunk.shape) != len(record.shape):
            raise CorruptCheckpointError(f"{where}: a chunk's rank does not match the tensor's")
        if any(o < 0 or o + s > d for o, s, d in zip(chunk.offset, chunk.shape, record.shape, strict=True)):
            raise CorruptCheckpointError(f"{where}: chunk at {list(chunk.offset)} exceeds the tensor")
        expected = itemsize * math.prod(chunk.shape)
        if chunk.start < 0 or chunk.end - chunk.start != expected or chunk.end > files[chunk.file].size:
            raise CorruptCheckpointError(f"{where}: byte range [{chunk.start}, {chunk.end}) is inconsistent")
        covered += math.prod(chunk.shape)
    if covered != math.prod(record.shape):
        raise CorruptCheckpointError(f"{where}: chunks cover {covered} of {math.prod(record.shape)} elements")
    if len(record.chunks) > 1 and not _tiles(record.shape, record.chunks):
        # The counts agree, so some element is in two chunks (and another in none): a load would
        # leave that one unwritten.
        raise CorruptCheckpointError(
            f"{where}: chunks overlap (their {covered} elements do not cover each element of the tensor once)"
        )


_TILING_STEPS = 64
"""Steps per chunk and dimension that :func:`_tiles` takes before :func:`_disjoint` decides."""

_Box = tuple[tuple[int, ...], tuple[int, ...]]  # (lowest corner, highest corner + 1)


class _OverBudget(Exception):
    """:func:`_sums_to_zero` took more steps than it was given."""


def _tiles(shape: tuple[int, ...], chunks: Sequence[ChunkRecord]) -> bool:
    """True if the boxes of ``chunks`` (each inside the tensor) cover ``shape`` exactly once.

    The boxes' indicator functions must sum to the tensor's.  Along the first dimension such a
    sum is piecewise constant, changing only where a box starts or ends; it is right everywhere
    iff it is right before the first box and every change is zero, and each change is the signed
    sum of the cross-sections (in the other dimensions) of the boxes starting and ending there:
    the same question, one dimension down.  Equal cross-sections of opposite sign cancel first,
    so the usual layouts (row or column slabs, grids, flat ranges cut into rows) cost O(chunks),
    and nothing compares chunks pairwise.  Irregular layouts in many dimensions can cost more
    (a box enters at both of its faces in each dimension); past a budget of
    :data:`_TILING_STEPS` per chunk and dimension, :func:`_disjoint` decides instead.
    """
    boxes: dict[_Box, int] = {}
    for chunk in chunks:
        if 0 not in chunk.shape:  # else it holds nothing
            box = (chunk.offset, tuple(map(operator.add, chunk.offset, chunk.shape)))
            boxes[box] = boxes.get(box, 0) + 1
    if 0 in shape:
        return not boxes
    whole = (zero_offset(len(shape)), shape)
    count = boxes.get(whole, 0) - 1
    if count:
        boxes[whole] = count
    else:
        del boxes[whole]
    try:
        return _sums_to_zero(boxes, [_TILING_STEPS * (len(chunks) + 1) * max(len(shape), 1)])
    except _OverBudget:  # the element counts agree: disjoint boxes cover the tensor
        return _disjoint([(c.offset, tuple(map(operator.add, c.offset, c.shape))) for c in chunks if 0 not in c.shape])


def _sums_to_zero(boxes: dict[_Box, int], budget: list[int]) -> bool:
    """True if ``sum(count * indicator(box))`` is zero everywhere (``boxes``: non-empty boxes of
    one rank, with non-zero counts); see :func:`_tiles`."""
    while boxes:
        budget[0] -= len(boxes)
        if budget[0] < 0:
            raise _OverBudget
        first_lo, first_hi = next(iter(boxes))
        if not first_lo:
            return False  # rank 0: the one point, counted a non-zero number of times
        start, end = first_lo[0], first_hi[0]
        if all(lo[0] == start and hi[0] == end for lo, hi in boxes):
            # Every box spans this dimension alike: it factors out (and keys stay distinct).
            boxes = {(lo[1:], hi[1:]): count for (lo, hi), count in boxes.items()}
            continue
        changes: dict[int, dict[_Box, int]] = {}
        for (lo, hi), count in boxes.items():
            section = (lo[1:], hi[1:])
            for position, signed in ((lo[0], count), (hi[0], -count)):
                change = changes.get(position)
                if change is None:
                    change = changes[position] = {}
                total = change.get(section, 0) + signed
                if total:
                    change[section] = total
                else:
                    del change[section]
        return all(_sums_to_zero(change, budget) for change in changes.values() if change)
    return True


def _disjoint(boxes: list[_Box]) -> bool:
    """True if no two of the non-empty ``boxes`` share an element: sort and sweep along the
    dimension where their starts differ most, comparing each box only with those it meets there."""
    rank = len(boxes[0][0]) if boxes else 0
    axis = max(range(rank), key=lambda d: len({lo[d] for lo, _ in boxes}), default=0)
    active: list[_Box] = []
    for lo, hi in sorted(boxes, key=lambda box: box[0][axis] if rank else 0):
        active = [(a, b) for a, b in active if not rank or b[axis] > lo[axis]]
        if any(all(max(a[d], lo[d]) < min(b[d], hi[d]) for d in range(rank)) for a, b in active):
            return False
        active.append((lo, hi))
    return True


_LOW_64 = (1 << 64) - 1  # byte offsets are at most MAX_DIMENSION (2**62): an end fits in 64 bits


def _check_byte_ranges(components: Mapping[str, ComponentRecord], where: str) -> None:
    """Refuse two stored pieces (tensors or chunks) whose bytes overlap in a file.

    ckptd's writers lay a file's entries out back to back, each piece once (the safetensors
    header refuses overlapping entries too), and the local reader requires requests of one file
    not to overlap; pieces claiming the same bytes are a crafted or damaged manifest.  Empty
    pieces hold no bytes and may sit anywhere.
    """
    spans: dict[str, list[int]] = {}  # per file: start << 64 | end (sorting ints is much faster than tuples)
    for component in components.values():
        for t in component.tensors.values():
            for c in t.chunks:
                if c.end > c.start:
                    file_spans = spans.get(c.file)
                    if file_spans is None:
                        file_spans = spans[c.file] = []
                    file_spans.append(c.start << 64 | c.end)
    for file_name, file_spans in spans.items():
        file_spans.sort()
        for previous, span in itertools.pairwise(file_spans):
            start, end = span >> 64, previous & _LOW_64
            if start < end:
                holders = [
                    f"{name}.{key}"
                    for name, component in components.items()
                    for key, t in component.tensors.items()
                    if any(c.file == file_name and c.start < end and start < c.end for c in t.chunks)
                ]
                raise CorruptCheckpointError(
                    f"{where}: bytes [{start}, {end}) of {file_name!r} are claimed twice "
                    f"(by {', '.join(holders[:4])}); ckptd stores every piece in bytes of its own"
                )


def check_tied_groups(groups: Sequence[Sequence[str]], stored: Collection[str], where: str) -> None:
    """Refuse tied groups a load would resolve wrongly (``stored``: the component's stored keys).

    A save stores the first key of each group and leaves the others out; a load gives the others
    the first one's tensor.  So: the first key must be stored here (keys are per component, so
    a group naming another component's key is refused by this too), no other member may be
    stored (its own bytes would be ignored and the first key's tensor returned for it), and no
    key may be in two groups (or twice in one): which tensor it gets would be a guess.
    """
    seen: set[str] = set()
    for group in groups:
        if not group:
            continue  # ties nothing
        for key in group:
            if key in seen:
                raise CorruptCheckpointError(f"{where}: key {key!r} is in more than one tied group")
            seen.add(key)
        first = group[0]
        if first not in stored:
            raise CorruptCheckpointError(
                f"{where}: tied group {list(group)} does not store its first key {first!r} (a save stores it)"
            )
        both = [key for key in group[1:] if key in stored]
        if both:
            raise CorruptCheckpointError(
                f"{where}: tied key {both[0]!r} is stored as well as {first!r}, the key it is tied to "
                "(a save stores a tied group's first key only)"
            )


def sharing_aliases(groups: Sequence[Sequence[str]], stored: Collection[str], where: str) -> dict[str, str]:
    """``{alias: stored key}`` from HF ``param_sharing`` groups: each key of a group that is not
    stored gets the group's first stored key.

    Groups may store more than one key (explicit metadata naming distinct tensors: each stored
    key keeps its own bytes).  A key that two groups give different stored tensors is refused.
    """
    aliases: dict[str, str] = {}
    for group in groups:
        source = next((key for key in group if key in stored), None)
        if source is None:
            continue
        for key in group:
            if key not in stored and aliases.setdefault(key, source) != source:
                raise CorruptCheckpointError(
                    f"{where}: param_sharing ties {key!r} to both {aliases[key]!r} and {source!r}"
                )
    return aliases


def hf_index(weight_map: Mapping[str, str], total_size: int, extra_metadata: Mapping[str, Any] | None = None) -> bytes:
    """An HF index file: ``{"metadata": {"total_size": N}, "weight_map": {key: file}}``."""
    metadata: dict[str, Any] = {"total_size": total_size}
    if extra_metadata:
        metadata.update(extra_metadata)
    # = json.dumps({"metadata": metadata, "weight_map": weight_map}, indent=2, ensure_ascii=False), with
    # the weight map (a line per tensor) written directly: the encoder's indented mode is pure Python.
    head = json.dumps({"metadata": metadata}, indent=2, ensure_ascii=False)[:-2]
    if not weight_map:
        return (head + ',\n  "weight_map": {}\n}').encode()
    lines = ",\n".join([f"    {_json_string(key)}: {_json_string(file)}" for key, file in weight_map.items()])
    return (head + ',\n  "weight_map": {\n' + lines + "\n  }\n}").encode()


def parse_hf_index(index: Any, where: str) -> tuple[dict[str, str], dict[str, str]]:
    """Weight map and tied aliases (``metadata.param_sharing``) of an HF index, given as its JSON
    bytes or as the loaded object; every file name is checked to stay inside the directory."""
    if isinstance(index, bytes | bytearray):
        index = parse_json(bytes(index), where, "index", allow_constants=True)
    try:
        weight_map = {
            _str(k, "weight_map key"): check_file_name(_str(v, "weight_map file"), where)
            for k, v in _object(_object(index, "index")["weight_map"], "weight_map").items()
        }
        metadata = _object(index.get("metadata") or {}, "metadata")
        groups = [
            [_str(k, "param_sharing key") for k in _list(g, "param_sharing group")]
            for g in _list(metadata.get("param_sharing") or [], "param_sharing")
        ]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        if isinstance(e, CkptdError):
            raise
        raise CorruptCheckpointError(f"{where}: malformed index ({type(e).__name__}: {e})") from e
    return weight_map, sharing_aliases(groups, weight_map, where)


def state_file_bytes(trees: Mapping[str, Any]) -> bytes:
    """The ``state.json`` body: each component's encoded object tree."""
    return json.dumps({"format": STATE_FORMAT, "version": 1, "components": dict(trees)}, ensure_ascii=False).encode()


def parse_state_file(data: bytes, where: str) -> dict[str, Any]:
    """Component trees from a ``state.json`` body."""
    body = parse_json(data, where, "state file")
    components = body.get("components") if isinstance(body, dict) else None
    if not isinstance(components, dict):
        raise CorruptCheckpointError(f"{where}: malformed state file (no 'components' object)")
    return components
