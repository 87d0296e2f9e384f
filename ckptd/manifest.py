"""The commit record (``checkpoint_manifest.json``), the non-tensor state file and HF indexes.

The manifest is written last; a directory (or prefix) without a manifest that parses and
validates is not a checkpoint.  It describes everything needed to load without listing the
store: every file with size and CRC32C, every tensor with dtype, shape, file and byte range.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from .errors import CorruptCheckpointError
from .formats.safetensors import DTYPE_ITEMSIZE
from .storage import check_file_name

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "STATE_NAME",
    "ComponentRecord",
    "FileRecord",
    "Manifest",
    "TensorRecord",
    "hf_index",
    "hf_index_name",
    "parse_state_file",
    "state_file_bytes",
    "tensor_records_from_plan",
    "utc_now",
]

FORMAT_NAME = "ckptd"
FORMAT_VERSION = 1
MANIFEST_NAME = "checkpoint_manifest.json"
STATE_NAME = "state.json"


def utc_now() -> str:
    """The current UTC time in ISO 8601 with a ``Z`` suffix."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def hf_index_name(component: str, kind: str = "safetensors") -> str:
    """``model.safetensors.index.json`` (or ``pytorch_model.bin.index.json`` for ``.bin``)."""
    if kind == "torch_bin":
        return "pytorch_model.bin.index.json" if component == "model" else f"{component}.bin.index.json"
    return f"{component}.safetensors.index.json"


@dataclass(frozen=True)
class FileRecord:
    """A file of the checkpoint: byte size and CRC32C (8 hex digits)."""

    size: int
    crc32c: str


@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor lives: file name and absolute byte range ``[start, end)``."""

    dtype: str
    shape: tuple[int, ...]
    file: str
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ComponentRecord:
    """One saved component.  ``kind`` is ``safetensors``, ``torch_bin`` or ``state`` (no tensors)."""

    kind: str
    tensors: dict[str, TensorRecord]
    index: str | None = None
    tied: list[list[str]] = field(default_factory=list)

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
        body: dict[str, Any] = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "library_version": self.library_version,
            "step": self.step,
            "created_utc": self.created_utc,
            "world_size": self.world_size,
            "state_file": self.state_file,
            "components": {
                name: {
                    "kind": c.kind,
                    "index": c.index,
                    "tied": c.tied,
                    "tensors": {
                        key: {"dtype": t.dtype, "shape": list(t.shape), "file": t.file, "offsets": [t.start, t.end]}
                        for key, t in c.tensors.items()
                    },
                }
                for name, c in self.components.items()
            },
            "files": {name: {"size": f.size, "crc32c": f.crc32c} for name, f in self.files.items()},
            "timings": self.timings,
            "metadata": self.metadata,
            "metrics": self.metrics,
        }
        return json.dumps(body, indent=1, ensure_ascii=False).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        """Parse and validate; raises :class:`CorruptCheckpointError` naming ``where``."""
        try:
            body = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CorruptCheckpointError(f"{where}: manifest is not valid JSON ({e})") from e
        try:
            return cls._from_body(body, where)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, CorruptCheckpointError):
                raise
            raise CorruptCheckpointError(f"{where}: malformed manifest ({type(e).__name__}: {e})") from e

    @classmethod
    def _from_body(cls, body: Any, where: str) -> Manifest:
        if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
            raise CorruptCheckpointError(f"{where}: not a ckptd manifest")
        version = int(body["format_version"])
        if version > FORMAT_VERSION:
            raise CorruptCheckpointError(
                f"{where}: format version {version} is newer than this ckptd supports ({FORMAT_VERSION}); upgrade ckptd"
            )
        files = {
            check_file_name(name, where): FileRecord(int(f["size"]), str(f["crc32c"]))
            for name, f in body["files"].items()
        }
        components: dict[str, ComponentRecord] = {}
        for name, c in body["components"].items():
            tensors: dict[str, TensorRecord] = {}
            for key, t in c["tensors"].items():
                start, end = (int(o) for o in t["offsets"])
                record = TensorRecord(str(t["dtype"]), tuple(int(d) for d in t["shape"]), str(t["file"]), start, end)
                _check_tensor(record, f"{where}: tensor {name}.{key}", files)
                tensors[key] = record
            tied = [[str(k) for k in group] for group in c.get("tied") or []]
            components[name] = ComponentRecord(str(c["kind"]), tensors, c.get("index"), tied)
        state_file = body.get("state_file")
        if state_file is not None and state_file not in files:
            raise CorruptCheckpointError(f"{where}: state file {state_file!r} is not listed in files")
        return cls(
            step=body.get("step"),
            created_utc=str(body["created_utc"]),
            world_size=int(body.get("world_size", 1)),
            library_version=str(body.get("library_version", "")),
            components=components,
            files=files,
            state_file=state_file,
            timings=dict(body.get("timings") or {}),
            metadata=dict(body.get("metadata") or {}),
            metrics=dict(body.get("metrics") or {}),
            format_version=version,
        )


def _check_tensor(record: TensorRecord, where: str, files: Mapping[str, FileRecord]) -> None:
    if record.file not in files:
        raise CorruptCheckpointError(f"{where}: file {record.file!r} is not listed in the manifest")
    itemsize = DTYPE_ITEMSIZE.get(record.dtype)
    if itemsize is None:
        raise CorruptCheckpointError(f"{where}: unknown dtype {record.dtype!r}")
    expected = itemsize
    for dim in record.shape:
        if dim < 0:
            raise CorruptCheckpointError(f"{where}: negative dimension in shape {record.shape}")
        expected *= dim
    if record.start < 0 or record.end - record.start != expected or record.end > files[record.file].size:
        raise CorruptCheckpointError(f"{where}: byte range [{record.start}, {record.end}) is inconsistent")


def hf_index(weight_map: Mapping[str, str], total_size: int, extra_metadata: Mapping[str, Any] | None = None) -> bytes:
    """An HF index file: ``{"metadata": {"total_size": N}, "weight_map": {key: file}}``."""
    metadata: dict[str, Any] = {"total_size": total_size}
    if extra_metadata:
        metadata.update(extra_metadata)
    return json.dumps({"metadata": metadata, "weight_map": dict(weight_map)}, indent=2, ensure_ascii=False).encode()


def state_file_bytes(trees: Mapping[str, Any]) -> bytes:
    """The ``state.json`` body: each component's encoded object tree."""
    return json.dumps({"format": "ckptd-state", "version": 1, "components": dict(trees)}, ensure_ascii=False).encode()


def parse_state_file(data: bytes, where: str) -> dict[str, Any]:
    """Component trees from a ``state.json`` body."""
    try:
        body = json.loads(data.decode("utf-8"))
        components = body["components"]
        if not isinstance(components, dict):
            raise TypeError("components is not an object")
        return components
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"{where}: malformed state file ({e})") from e


def tensor_records_from_plan(shards: Iterable[Any]) -> dict[str, dict[str, TensorRecord]]:
    """Tensor records per component from planned shards (see :mod:`ckptd.planner`)."""
    records: dict[str, dict[str, TensorRecord]] = {}
    for shard in shards:
        for i, item in enumerate(shard.items):
            start = shard.item_file_offset(i)
            records.setdefault(shard.component, {})[item.key] = TensorRecord(
                item.dtype, item.shape, shard.file_name, start, start + item.nbytes
            )
    return records
