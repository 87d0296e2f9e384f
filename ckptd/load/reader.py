"""Loading: detect the checkpoint format, locate tensors, fetch only the bytes needed.

Formats, in detection order: a ckptd checkpoint (``checkpoint_manifest.json`` in ckptd's
schema; another tool's manifest of that name, e.g. Forgather's, is looked past), a PyTorch DCP
checkpoint (``.metadata`` + ``*.distcp``, read by torch: see :mod:`.dcp`), an HF sharded
safetensors checkpoint (``model.safetensors.index.json``), a single ``model.safetensors``, and
PyTorch ``pytorch_model.bin.index.json`` / ``pytorch_model.bin`` (read with
``weights_only=True``).  File names come from indexes and manifests, so every name is checked to
stay inside the checkpoint directory.  Sizes are checked on every load; CRC32C when asked.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ..dist.sharding import Box, ShardedTensor, describe_dtensor, intersect, is_dtensor, paired_runs
from ..errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    KeyMismatchError,
    StorageError,
    UnsafeCheckpointError,
)
from ..formats.checksum import crc32c, format_crc
from ..formats.manifest import MANIFEST_NAME, Manifest, TensorRecord, is_foreign_manifest, parse_state_file
from ..formats.safetensors import DTYPE_ITEMSIZE, SafetensorsHeader, dtype_from_name, dtype_name, parse_header
from ..formats.torch_bin import load_bin, load_bin_bytes
from ..storage import (
    RangeReader,
    Storage,
    StorageTuning,
    check_file_name,
    normalize_location,
    read_chunks,
    storage_for,
)
from .cache import FileCache
from .dcp import DcpLayout, is_dcp, read_dcp_layout, read_dcp_tensors

__all__ = [
    "CheckpointReader",
    "SAFETENSORS_INDEX",
    "SAFETENSORS_SINGLE",
    "TORCH_BIN_INDEX",
    "TORCH_BIN_SINGLE",
    "preview",
    "tensor_memoryview",
]

logger = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"
TORCH_BIN_SINGLE = "pytorch_model.bin"
_READ_THREADS = 4
_READ_SLICE = 32 * 1024 * 1024
_HEADER_PREFETCH = 64 * 1024
_VERIFY_CHUNK = 16 * 1024 * 1024


def tensor_memoryview(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (the tensor must stay alive)."""
    if tensor.numel() == 0:
        return memoryview(bytearray(0))
    buffer = (ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr())
    return memoryview(buffer).cast("B")


@dataclass(frozen=True)
class _Source:
    """One component's tensors: ``kind`` is ``safetensors``, ``torch_bin`` or ``dcp`` (then
    ``weight_map`` maps each key to its DCP fully qualified name)."""

    kind: str
    weight_map: dict[str, str]
    records: dict[str, TensorRecord] | None
    aliases: dict[str, str]


class CheckpointReader:
    """A checkpoint opened for reading, in any supported format.

    ``kind`` is ``"ckptd"``, ``"dcp"``, ``"hf_sharded"``, ``"safetensors"``,
    ``"torch_bin_sharded"`` or ``"torch_bin"``.  ``manifest`` is set for ckptd checkpoints.
    """

    def __init__(
        self,
        directory: str,
        storage: Storage,
        kind: str,
        sources: dict[str, _Source],
        manifest: Manifest | None,
        cache: FileCache | None = None,
    ) -> None:
        self.directory = directory
        self.storage = storage
        self.kind = kind
        self.manifest = manifest
        self.cache = cache
        self._sources = sources
        self._headers: dict[str, SafetensorsHeader] = {}
        self._verified: set[str] = set()
        self._dcp_layout: tuple[DcpLayout, dict[str, Any] | None] | None = None

    # ---- opening ---------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        storage_options: dict[str, Any] | None = None,
        *,
        require_manifest: bool = False,
        cache_dir: str | os.PathLike[str] | None = None,
        tuning: StorageTuning | None = None,
    ) -> CheckpointReader:
        """Detect the format at ``path`` (a directory, URL, or a single shard file).

        ``cache_dir`` (remote checkpoints): files read are downloaded whole into this local
        directory once, checked against the manifest, and read from there afterwards.
        """
        path = os.fspath(path)
        storage = storage_for(path, storage_options, tuning)
        directory = normalize_location(path)
        cache = FileCache(os.fspath(cache_dir), directory) if cache_dir is not None and not storage.local else None
        if not require_manifest and _is_single_file(storage, directory):
            parent, _, name = directory.rpartition("/" if not storage.local else os.sep)
            return cls._single_file(storage, parent, name, cache)
        names = set(storage.list_names(directory))
        if not names and not storage.exists(directory):
            raise CheckpointNotFoundError(f"{directory}: no such checkpoint directory")
        if MANIFEST_NAME in names:
            data = storage.read_bytes(storage.join(directory, MANIFEST_NAME))
            if not is_foreign_manifest(data):
                return cls._ckptd(directory, storage, cache, data)
            logger.debug("%s: %s was written by another tool; reading the weights it holds", directory, MANIFEST_NAME)
        if is_dcp(names):  # DCP's .metadata is its commit record, written last
            return cls._dcp(directory, storage, cache, storage_options)
        if require_manifest:
            foreign = MANIFEST_NAME in names
            what = f"its {MANIFEST_NAME} is another tool's (Forgather?)" if foreign else f"no {MANIFEST_NAME}"
            raise CheckpointNotFoundError(
                f"{directory} is not a committed ckptd checkpoint ({what}; an interrupted save, or another "
                "format: use ckptd.load_checkpoint for HF and Forgather checkpoints)"
            )
        if SAFETENSORS_INDEX in names:
            return cls._indexed(directory, storage, SAFETENSORS_INDEX, "safetensors", "hf_sharded", cache)
        if SAFETENSORS_SINGLE in names:
            return cls._single_file(storage, directory, SAFETENSORS_SINGLE, cache)
        if TORCH_BIN_INDEX in names:
            return cls._indexed(directory, storage, TORCH_BIN_INDEX, "torch_bin", "torch_bin_sharded", cache)
        if TORCH_BIN_SINGLE in names:
            return cls._single_file(storage, directory, TORCH_BIN_SINGLE, cache)
        raise CheckpointNotFoundError(
            f"{directory}: no checkpoint found (looked for {MANIFEST_NAME}, {SAFETENSORS_INDEX}, "
            f"{SAFETENSORS_SINGLE}, {TORCH_BIN_INDEX}, {TORCH_BIN_SINGLE})"
        )

    @classmethod
    def _ckptd(
        cls, directory: str, storage: Storage, cache: FileCache | None = None, data: bytes | None = None
    ) -> CheckpointReader:
        where = storage.join(directory, MANIFEST_NAME)
        manifest = Manifest.from_json(storage.read_bytes(where) if data is None else data, where)
        listings: dict[str, dict[str, int]] = {}
        for name, record in manifest.files.items():
            holder = _holder(storage, directory, record.checkpoint)
            path = _safe_path(storage, holder, name, where)
            if holder not in listings:
                listings[holder] = storage.sizes(holder)
            actual = listings[holder].get(name)
            if actual is None:
                raise CorruptCheckpointError(f"{path}: listed in the manifest but missing")
            if actual != record.size:
                raise CorruptCheckpointError(
                    f"{path}: file is {actual} bytes but the manifest says {record.size} (truncated or replaced)"
                )
        sources: dict[str, _Source] = {}
        for name, component in manifest.components.items():
            aliases = {alias: group[0] for group in component.tied for alias in group[1:]}
            if component.kind == "torch_bin" and component.index:
                index = _read_index(storage, _safe_path(storage, directory, component.index, where))
                sources[name] = _Source("torch_bin", index[0], None, aliases)
            elif component.tensors:
                weight_map = {key: record.file for key, record in component.tensors.items()}
                sources[name] = _Source("safetensors", weight_map, dict(component.tensors), aliases)
        return cls(directory, storage, "ckptd", sources, manifest, cache)

    @classmethod
    def _dcp(
        cls, directory: str, storage: Storage, cache: FileCache | None, storage_options: dict[str, Any] | None
    ) -> CheckpointReader:
        """A PyTorch DCP checkpoint (Megatron ``torch_dist`` too), read by torch's own reader."""
        layout = read_dcp_layout(directory, local=storage.local, storage_options=storage_options)
        sources = {name: _Source("dcp", dict(fqns), None, {}) for name, fqns in layout.components.items()}
        reader = cls(directory, storage, "dcp", sources, None, cache)
        reader._dcp_layout = (layout, storage_options)
        return reader

    @classmethod
    def _indexed(
        cls, directory: str, storage: Storage, index_name: str, kind: str, label: str, cache: FileCache | None
    ) -> CheckpointReader:
        weight_map, aliases = _read_index(storage, storage.join(directory, index_name))
        return cls(directory, storage, label, {"model": _Source(kind, weight_map, None, aliases)}, None, cache)

    @classmethod
    def from_index(
        cls, directory: str, index: Mapping[str, Any], kind: str, storage_options: dict[str, Any] | None = None
    ) -> CheckpointReader:
        """A reader over a directory (or URL) driven by an already loaded HF index."""
        weight_map, aliases = _parse_index(index, directory)
        storage = storage_for(directory, storage_options)
        directory = normalize_location(directory)
        label = "hf_sharded" if kind == "safetensors" else "torch_bin_sharded"
        return cls(directory, storage, label, {"model": _Source(kind, weight_map, None, aliases)}, None)

    @classmethod
    def _single_file(cls, storage: Storage, directory: str, name: str, cache: FileCache | None) -> CheckpointReader:
        reader = cls(directory, storage, "", {}, None, cache)
        if name.endswith((".bin", ".pt")):
            reader.kind = "torch_bin"
            keys = reader._load_bin(name).keys()
            reader._sources["model"] = _Source("torch_bin", dict.fromkeys(keys, name), None, {})
        else:
            header = reader._header(name)
            reader.kind = "safetensors"
            aliases = {}
            for group in json.loads(header.metadata.get("param_sharing", "[]") or "[]"):
                aliases.update({k: group[0] for k in group[1:] if k not in header.entries})
            reader._sources["model"] = _Source("safetensors", dict.fromkeys(header.entries, name), None, aliases)
        return reader

    # ---- what is in it ---------------------------------------------------------------------

    def components(self) -> list[str]:
        """Names of the components holding tensors (``["model"]`` for HF checkpoints)."""
        return list(self._sources)

    def default_component(self) -> str:
        """``model`` if present, else the only component; raises if that is ambiguous."""
        if "model" in self._sources:
            return "model"
        if len(self._sources) == 1:
            return next(iter(self._sources))
        raise KeyMismatchError(f"{self.directory}: no 'model' component; choose one of {sorted(self._sources)}")

    def keys(self, component: str = "model") -> list[str]:
        """Every tensor key of a component, tied aliases included."""
        source = self._source(component)
        return [*source.weight_map, *source.aliases]

    def tied_groups(self, component: str = "model") -> list[list[str]]:
        """Groups of tied keys (stored key first)."""
        groups: dict[str, list[str]] = {}
        for alias, stored in self._source(component).aliases.items():
            groups.setdefault(stored, [stored]).append(alias)
        return list(groups.values())

    def state_trees(self, verify: bool = False) -> dict[str, Any]:
        """The encoded non-tensor trees of every component (ckptd checkpoints only)."""
        if self.manifest is None or self.manifest.state_file is None:
            return {}
        if verify:
            self.verify([self.manifest.state_file])
        where = _safe_path(self.storage, self.directory, self.manifest.state_file, MANIFEST_NAME)
        return parse_state_file(self.storage.read_bytes(where), where)

    def _source(self, component: str) -> _Source:
        try:
            return self._sources[component]
        except KeyError:
            raise KeyMismatchError(
                f"{self.directory}: no component {component!r} (has {sorted(self._sources)})"
            ) from None

    def _path(self, file_name: str) -> str:
        """Where a file of this checkpoint is: here, or in the sibling checkpoint that holds it
        (files an incremental save reused)."""
        record = self.manifest.files.get(file_name) if self.manifest is not None else None
        holder = _holder(self.storage, self.directory, record.checkpoint if record else None)
        return _safe_path(self.storage, holder, file_name, self.directory)

    def _open(self, file_name: str) -> RangeReader:
        """A range reader on a file of this checkpoint (through the local cache if configured)."""
        path = self._path(file_name)
        if self.cache is not None:
            record = self.manifest.files.get(file_name) if self.manifest is not None else None
            return self.cache.open(self.storage, path, file_name, record)
        return self.storage.open_reader(path)

    def _header(self, file_name: str) -> SafetensorsHeader:
        header = self._headers.get(file_name)
        if header is None:
            path = self._path(file_name)
            reader = self._open(file_name)
            try:
                head = reader.read(0, min(reader.size, _HEADER_PREFETCH))
                if len(head) < 8:
                    raise CorruptCheckpointError(f"{path}: file is too short to be safetensors ({reader.size} bytes)")
                length = int.from_bytes(head[:8], "little")
                if 8 + length > reader.size:
                    raise CorruptCheckpointError(f"{path}: safetensors header length {length} exceeds the file")
                body = head[8 : 8 + length] if 8 + length <= len(head) else reader.read(8, length)
                header = parse_header(head[:8], body, reader.size, path)
            finally:
                reader.close()
            self._headers[file_name] = header
        return header

    def locate(self, component: str, keys: Iterable[str] | None = None) -> dict[str, TensorRecord]:
        """Byte ranges of safetensors tensors (aliases resolved to their stored key)."""
        source = self._source(component)
        wanted = list(source.weight_map) if keys is None else [source.aliases.get(k, k) for k in keys]
        missing = [k for k in wanted if k not in source.weight_map]
        if missing:
            raise KeyMismatchError(f"{self.directory}: component {component!r} has no tensor(s) {preview(missing)}")
        if source.records is not None:
            return {k: source.records[k] for k in wanted}
        located: dict[str, TensorRecord] = {}
        for key in wanted:
            file_name = source.weight_map[key]
            header = self._header(file_name)
            entry = header.entries.get(key)
            if entry is None:
                raise CorruptCheckpointError(f"{file_name}: index says it holds {key!r} but its header does not")
            located[key] = TensorRecord.whole(
                entry.dtype, entry.shape, file_name, header.data_start + entry.start, header.data_start + entry.end
            )
        return located

    def check_complete(self) -> None:
        """Raise unless every file of every component exists and every safetensors header parses."""
        for name, source in self._sources.items():
            if source.kind == "dcp":
                continue  # torch read its .metadata; the data files are DCP's to check
            if source.kind == "safetensors":
                self.locate(name)
                continue
            for file_name in set(source.weight_map.values()):
                path = self._path(file_name)
                if not self.storage.exists(path):
                    raise CorruptCheckpointError(f"{path}: listed in the index but missing")

    # ---- reading ---------------------------------------------------------------------------

    def verify(self, files: Iterable[str] | None = None) -> None:
        """Check CRC32C of ``files`` (all by default) against the manifest."""
        if self.manifest is None:
            return
        names = [n for n in (self.manifest.files if files is None else dict.fromkeys(files)) if n not in self._verified]
        with ThreadPoolExecutor(min(_READ_THREADS, max(1, len(names)))) as pool:
            list(pool.map(self._verify_file, names))
        self._verified.update(names)

    def _verify_file(self, name: str) -> None:
        if self.manifest is None:
            return
        expected = self.manifest.files[name]
        path = self._path(name)
        reader = self._open(name)
        try:
            value = 0
            for chunk in read_chunks(reader, expected.size, _VERIFY_CHUNK):
                value = crc32c(chunk, value)
        finally:
            reader.close()
        if format_crc(value) != expected.crc32c:
            raise CorruptCheckpointError(
                f"{path}: CRC32C mismatch (manifest {expected.crc32c}, file {format_crc(value)}): the file is corrupt"
            )

    def record(self, component: str, key: str) -> TensorRecord | None:
        """Dtype, global shape and location of one stored tensor (``None`` for ``.bin`` files)."""
        source = self._source(component)
        if source.kind in ("torch_bin", "dcp"):
            return None
        return self.locate(component, [key])[source.aliases.get(key, key)]

    def read(
        self,
        component: str = "model",
        keys: Iterable[str] | None = None,
        *,
        device: str | torch.device = "cpu",
        targets: Mapping[str, Any] | None = None,
        verify: bool = False,
    ) -> dict[str, Any]:
        """Read tensors of ``component`` (all, or ``keys``); tied aliases map to the same tensor.

        ``targets[key]`` receives the data in place: a tensor (the whole tensor), a DTensor or a
        :class:`~ckptd.ShardedTensor` (only its piece of the global tensor: exactly the byte
        ranges overlapping it are read, whatever layout the checkpoint was saved in).  Bytes go
        straight into target memory when it is a contiguous CPU tensor of the stored dtype;
        otherwise they are read into a buffer and copied.  Keys without a target come back as
        whole tensors on ``device`` (assembled from their pieces if they were saved sharded).
        """
        source = self._source(component)
        requested = list(source.weight_map) + list(source.aliases) if keys is None else list(dict.fromkeys(keys))
        stored = list(dict.fromkeys(source.aliases.get(k, k) for k in requested))
        missing = [k for k in stored if k not in source.weight_map]
        if missing:
            raise KeyMismatchError(f"{self.directory}: component {component!r} has no tensor(s) {preview(missing)}")
        targets = dict(targets or {})
        stored_targets = {k: targets[k] for k in stored if k in targets}
        for alias, key in source.aliases.items():
            if alias in targets and key not in stored_targets:
                stored_targets[key] = targets[alias]
        if source.kind == "torch_bin":
            files = sorted({source.weight_map[k] for k in stored})
            destinations = self._read_bin(files, stored, stored_targets)
        elif source.kind == "dcp":
            destinations = self._read_dcp(source, stored, stored_targets)
        else:
            records = self.locate(component, stored)
            if verify:
                self.verify(sorted({f for record in records.values() for f in record.files}))
            destinations = {
                key: _Destination.make(key, records[key], stored_targets.get(key), self.directory) for key in stored
            }
            self._fetch(records, destinations)
        device = torch.device(device)
        loaded: dict[str, Any] = {}
        for key, destination in destinations.items():
            value = destination.finish()
            if key not in stored_targets and isinstance(value, torch.Tensor) and value.device != device:
                value = value.to(device)
            loaded[key] = value
        return {key: loaded[source.aliases.get(key, key)] for key in requested}

    def _fetch(self, records: Mapping[str, TensorRecord], destinations: Mapping[str, _Destination]) -> None:
        """Read, for every destination, the byte runs of each stored chunk overlapping it."""
        requests: dict[str, list[tuple[int, memoryview]]] = {}
        for key, destination in destinations.items():
            record = records[key]
            itemsize = DTYPE_ITEMSIZE[record.dtype]
            view = tensor_memoryview(destination.buffer)
            covered = 0
            for chunk in record.chunks:
                chunk_box = Box(chunk.offset, chunk.shape)
                overlap = intersect(chunk_box, destination.box)
                if overlap is None or overlap.numel == 0:
                    continue
                covered += overlap.numel
                for src, dst, length in paired_runs(chunk_box, destination.box, overlap):
                    requests.setdefault(chunk.file, []).append(
                        (chunk.start + src * itemsize, view[dst * itemsize : (dst + length) * itemsize])
                    )
            if covered != destination.box.numel:
                raise CorruptCheckpointError(
                    f"{self.directory}: the stored pieces of {key!r} cover {covered} of the "
                    f"{destination.box.numel} elements asked for"
                )

        readers: dict[str, RangeReader] = {}
        try:
            for file_name, wanted in sorted(requests.items()):
                reader = readers[file_name] = self._open(file_name)
                end = max(offset + len(buffer) for offset, buffer in wanted)
                if end > reader.size:
                    raise CorruptCheckpointError(
                        f"{self._path(file_name)}: file is truncated: {end} bytes needed, the file has {reader.size}"
                    )
            # Local files: positional reads from several threads (preadv drops the GIL), large
            # tensors cut into slices, so one big shard is read in parallel too.  Remote
            # readers batch, coalesce and parallelise one file's ranges themselves.
            tasks: list[tuple[str, list[tuple[int, memoryview]]]] = []
            for file_name, wanted in sorted(requests.items()):
                if self.storage.local:
                    tasks.extend((file_name, [piece]) for piece in _slices(wanted, _READ_SLICE))
                else:
                    tasks.append((file_name, wanted))

            def run(task: tuple[str, list[tuple[int, memoryview]]]) -> None:
                file_name, wanted = task
                try:
                    readers[file_name].read_many(wanted)
                except StorageError as e:
                    raise CorruptCheckpointError(f"{self._path(file_name)}: cannot read tensors: {e}") from e

            if len(tasks) > 1:
                with ThreadPoolExecutor(min(_READ_THREADS, len(tasks)), thread_name_prefix="ckptd-read") as pool:
                    list(pool.map(run, tasks))
            else:
                for task in tasks:
                    run(task)
        finally:
            for reader in readers.values():
                reader.close()

    def _load_bin(self, file_name: str) -> dict[str, torch.Tensor]:
        path = self._path(file_name)
        if self.storage.local:
            return load_bin(path)
        return load_bin_bytes(self.storage.read_bytes(path), path)

    def _read_dcp(self, source: _Source, keys: list[str], targets: Mapping[str, Any]) -> dict[str, _Destination]:
        if self._dcp_layout is None:  # pragma: no cover - set by _dcp()
            raise CorruptCheckpointError(f"{self.directory}: not opened as a DCP checkpoint")
        layout, options = self._dcp_layout
        fqns = {key: source.weight_map[key] for key in keys}
        tensors = read_dcp_tensors(
            self.directory, layout, fqns.values(), local=self.storage.local, storage_options=options
        )
        out: dict[str, _Destination] = {}
        for key, fqn in fqns.items():
            tensor = tensors[fqn]
            record = TensorRecord.whole(dtype_name(tensor.dtype, key), tuple(tensor.shape), fqn, 0, 0)
            destination = _Destination.make(key, record, targets.get(key), self.directory)
            with torch.no_grad():
                destination.buffer.copy_(tensor[destination.box.slices()])
            out[key] = destination
        return out

    def _read_bin(self, files: list[str], keys: list[str], targets: Mapping[str, Any]) -> dict[str, _Destination]:
        out: dict[str, _Destination] = {}
        wanted = set(keys)
        for file_name in files:
            for key, tensor in self._load_bin(file_name).items():
                if key not in wanted:
                    continue
                record = TensorRecord.whole(dtype_name(tensor.dtype, key), tuple(tensor.shape), file_name, 0, 0)
                destination = _Destination.make(key, record, targets.get(key), self.directory)
                with torch.no_grad():
                    destination.buffer.copy_(tensor[destination.box.slices()])
                out[key] = destination
        absent = wanted - set(out)
        if absent:
            raise CorruptCheckpointError(
                f"{self.directory}: index lists {preview(sorted(absent))} but the shards lack them"
            )
        return out


def _read_index(storage: Storage, where: str) -> tuple[dict[str, str], dict[str, str]]:
    try:
        index = json.loads(storage.read_bytes(where))
    except ValueError as e:
        raise CorruptCheckpointError(f"{where}: index is not valid JSON ({e})") from e
    return _parse_index(index, where)


def _parse_index(index: Any, where: str) -> tuple[dict[str, str], dict[str, str]]:
    """Weight map and tied aliases (``metadata.param_sharing``) of an HF index."""
    try:
        weight_map = {str(k): check_file_name(str(v), where) for k, v in index["weight_map"].items()}
        metadata = index.get("metadata") or {}
        groups = metadata.get("param_sharing") or []
    except (KeyError, TypeError, AttributeError) as e:
        raise CorruptCheckpointError(f"{where}: malformed index ({e})") from e
    aliases: dict[str, str] = {}
    for group in groups:
        stored = [k for k in group if k in weight_map]
        if stored:
            aliases.update({k: stored[0] for k in group if k not in weight_map})
    return weight_map, aliases


@dataclass
class _Destination:
    """Where one tensor's bytes land: ``buffer`` (contiguous, CPU, stored dtype, ``box`` shape),
    then copied into ``target`` when that is not the buffer itself; ``result`` is what the read
    returns for the key."""

    key: str
    box: Box
    buffer: torch.Tensor
    target: torch.Tensor | None
    result: Any

    @classmethod
    def make(cls, key: str, record: TensorRecord, target: Any, where: str) -> _Destination:
        dtype = dtype_from_name(record.dtype, f" for tensor {key!r} in {where}")
        if target is None:
            buffer = torch.empty(record.shape, dtype=dtype)
            return cls(key, Box((0,) * len(record.shape), record.shape), buffer, None, buffer)
        local, box, result = _target_region(target, record, key, where)
        direct = local.device.type == "cpu" and local.dtype == dtype and local.is_contiguous()
        buffer = local if direct else torch.empty(box.shape, dtype=dtype)
        return cls(key, box, buffer, None if direct else local, result)

    def finish(self) -> Any:
        if self.target is not None:
            with torch.no_grad():
                self.target.copy_(self.buffer)
        return self.result


def _target_region(target: Any, record: TensorRecord, key: str, where: str) -> tuple[torch.Tensor, Box, Any]:
    """``(local tensor, its box in the global tensor, value to return)`` of a load target."""
    result: Any = target
    if isinstance(target, ShardedTensor):
        if target.data is None:
            raise KeyMismatchError(f"sharded target {key!r} has no data to load into")
        local, global_shape, offset = target.data, target.global_shape, target.global_offset
    elif is_dtensor(target):
        local, global_shape, offset, _ = describe_dtensor(target)
    elif isinstance(target, torch.Tensor):
        local, global_shape, offset = target, tuple(target.shape), (0,) * target.dim()
    else:
        raise KeyMismatchError(f"cannot load {key!r} into a {type(target).__name__}")
    if tuple(global_shape) != tuple(record.shape):
        raise KeyMismatchError(
            f"size mismatch for {key!r}: checkpoint {where} has shape {tuple(record.shape)}, "
            f"the target has {tuple(global_shape)}"
        )
    return local, Box(tuple(offset), tuple(local.shape)), result


def _is_single_file(storage: Storage, path: str) -> bool:
    if storage.local:
        return os.path.isfile(path)
    return path.endswith((".safetensors", ".bin")) and storage.exists(path)


def _slices(requests: list[tuple[int, memoryview]], size: int) -> list[tuple[int, memoryview]]:
    """The same byte ranges, with every range longer than ``size`` cut into ``size`` slices."""
    out = []
    for offset, buffer in requests:
        view = buffer.cast("B") if buffer.format != "B" else buffer
        for start in range(0, len(view), size):
            out.append((offset + start, view[start : start + size]))
    return out


def _holder(storage: Storage, directory: str, checkpoint: str | None) -> str:
    """The directory holding a file: ``directory``, or its sibling ``checkpoint`` (which must be
    a real directory inside the same root, not a symlink leading elsewhere)."""
    if checkpoint is None:
        return directory
    parent = os.path.dirname(directory) if storage.local else directory.rstrip("/").rsplit("/", 1)[0]
    holder = storage.join(parent, checkpoint)
    if storage.local:
        real_parent = os.path.realpath(parent)
        if os.path.islink(holder) or os.path.dirname(os.path.realpath(holder)) != real_parent:
            raise UnsafeCheckpointError(f"{holder}: a referenced checkpoint must be a directory beside {directory}")
    return holder


def _safe_path(storage: Storage, directory: str, name: str, where: str) -> str:
    check_file_name(name, where)
    path = storage.join(directory, name)
    if storage.local:
        real_dir = os.path.realpath(directory)
        real = os.path.realpath(path)
        if os.path.commonpath([real_dir, real]) != real_dir:
            raise UnsafeCheckpointError(f"{path} resolves to {real}, outside the checkpoint directory {real_dir}")
    return path


def preview(keys: list[str], limit: int = 5) -> str:
    """``'a', 'b' and 3 more`` for error messages (``none`` for no keys)."""
    if not keys:
        return "none"
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")
