"""The per-rank shards that DCP's ``HuggingFaceStorageWriter`` writes, described without torch.

``torch.distributed.checkpoint.HuggingFaceStorageWriter(path, save_distributed=True)`` has each
rank write ``shard-<rank>-model-<i>-of-<n>.safetensors`` (ranks counted from 1) and no index:
every file is plain safetensors holding that rank's pieces, and its ``__metadata__`` entry
``DCP_SHARDING_INFO`` (JSON) gives each piece's ``saved_offsets`` in the global tensor.  With
``enable_consolidation=True`` these shards go to ``path/sharded`` and whole tensors to ``path``
(``model-<i>-of-<n>.safetensors`` and ``model.safetensors.index.json``, an HF sharded
checkpoint that ckptd reads as one); without ``save_distributed`` the writer makes that HF
layout directly.

:func:`shard_records` turns the shards' headers into one :class:`~ckptd.formats.manifest.
TensorRecord` per tensor (a chunk per piece, global shape from the pieces), checked as a ckptd
manifest's records are: every piece inside the tensor and its file, every element covered once.
Reading them is then the same byte-range reading as for ckptd's own sharded saves.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping

from ..errors import CorruptCheckpointError
from ..formats.manifest import ChunkRecord, FileRecord, TensorRecord, check_tensor_record
from ..formats.safetensors import SafetensorsHeader
from ..storage import RangeReader

__all__ = ["SHARDING_INFO_KEY", "file_sizes", "is_hf_dcp_sharded", "shard_files", "shard_records"]

SHARDING_INFO_KEY = "DCP_SHARDING_INFO"
_OFFSETS_KEY = "saved_offsets"
_SHARD_FILE = re.compile(r"^shard-\d+-model-\d+-of-\d+\.safetensors$")


def shard_files(names: Iterable[str]) -> list[str]:
    """The names of a directory listing that are ``HuggingFaceStorageWriter`` rank shards."""
    return sorted(n for n in names if _SHARD_FILE.match(n))


def file_sizes(open_file: Callable[[str], RangeReader], names: Iterable[str]) -> dict[str, int]:
    """The size of each file, from a reader ``open_file(name)`` opened and closed for it."""
    sizes: dict[str, int] = {}
    for name in names:
        opened = open_file(name)
        try:
            sizes[name] = opened.size
        finally:
            opened.close()
    return sizes


def is_hf_dcp_sharded(names: Iterable[str]) -> bool:
    """True if a listing holds ``HuggingFaceStorageWriter(save_distributed=True)`` rank shards."""
    return bool(shard_files(names))


def _offsets(header: SafetensorsHeader, where: str) -> dict[str, tuple[int, ...]]:
    """``saved_offsets`` of each tensor of one shard, from its ``DCP_SHARDING_INFO`` metadata."""
    raw = header.metadata.get(SHARDING_INFO_KEY)
    if raw is None:
        raise CorruptCheckpointError(
            f"{where}: no {SHARDING_INFO_KEY} in the safetensors metadata (not written by DCP's "
            "HuggingFaceStorageWriter with save_distributed=True?)"
        )
    try:
        info = json.loads(raw)
    except ValueError as e:
        raise CorruptCheckpointError(f"{where}: {SHARDING_INFO_KEY} is not JSON ({e})") from e
    if not isinstance(info, dict):
        raise CorruptCheckpointError(f"{where}: {SHARDING_INFO_KEY} is not a JSON object")
    out: dict[str, tuple[int, ...]] = {}
    for key, entry in header.entries.items():
        offsets = info.get(key, {}).get(_OFFSETS_KEY) if isinstance(info.get(key), dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != len(entry.shape)
            or not all(type(o) is int and o >= 0 for o in offsets)
        ):
            raise CorruptCheckpointError(
                f"{where}: {SHARDING_INFO_KEY} has no valid {_OFFSETS_KEY} for tensor {key!r} "
                f"(one non-negative integer per dimension of {list(entry.shape)})"
            )
        out[key] = tuple(offsets)
    return out


def shard_records(
    headers: Mapping[str, SafetensorsHeader], sizes: Mapping[str, int], directory: str
) -> dict[str, TensorRecord]:
    """One record per tensor of the shards (``headers`` and ``sizes`` by file name), its chunks
    the pieces the ranks wrote, its shape the smallest that holds them all."""
    pieces: dict[str, list[tuple[str, ChunkRecord]]] = {}
    for name in sorted(headers):
        header = headers[name]
        where = f"{directory}/{name}"
        for key, offsets in _offsets(header, where).items():
            entry = header.entries[key]
            chunk = ChunkRecord(
                name, header.data_start + entry.start, header.data_start + entry.end, offsets, entry.shape
            )
            pieces.setdefault(key, []).append((entry.dtype, chunk))
    files = {name: FileRecord(size, "") for name, size in sizes.items()}
    records: dict[str, TensorRecord] = {}
    for key, found in pieces.items():
        dtypes = sorted({dtype for dtype, _ in found})
        if len(dtypes) != 1:
            raise CorruptCheckpointError(f"{directory}: tensor {key!r} is stored with several dtypes {dtypes}")
        chunks = tuple(chunk for _, chunk in found)
        shape = tuple(
            max(o + s for o, s in zip(*dims, strict=True)) for dims in _dims(chunks, f"{directory}: tensor {key!r}")
        )
        record = TensorRecord(dtypes[0], shape, chunks)
        check_tensor_record(record, f"{directory}: tensor {key!r}", files)
        records[key] = record
    return records


def _dims(chunks: tuple[ChunkRecord, ...], where: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Per dimension, the chunks' offsets and sizes (chunks of different ranks are refused)."""
    ranks = {len(c.shape) for c in chunks}
    if len(ranks) != 1:
        raise CorruptCheckpointError(f"{where}: its pieces have different numbers of dimensions ({sorted(ranks)})")
    return [
        (tuple(c.offset[d] for c in chunks), tuple(c.shape[d] for c in chunks)) for d in range(len(chunks[0].shape))
    ]
