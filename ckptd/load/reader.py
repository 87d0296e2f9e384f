"""Loading: detect the checkpoint format and locate tensors (the bytes are read by
:mod:`ckptd.load.fetch`, only those needed).

Formats, in detection order: a ckptd checkpoint (``checkpoint_manifest.json`` in ckptd's
schema; another tool's manifest of that name, e.g. Forgather's, is looked past), a PyTorch DCP
checkpoint (``.metadata`` + ``*.distcp``, read by torch: see :mod:`.dcp`), an HF sharded
safetensors checkpoint (``model.safetensors.index.json``), a single ``model.safetensors``,
PyTorch ``pytorch_model.bin.index.json`` / ``pytorch_model.bin`` (read with
``weights_only=True``), the per-rank shards of DCP's ``HuggingFaceStorageWriter`` (see
:mod:`.hf_dcp_shards`) and a torch_checkpointing checkpoint (``<item>_<rank>.pt``, see
:mod:`.torch_checkpointing`).  File names come from indexes and manifests, so every name is checked to
stay inside the checkpoint directory.  Sizes are checked on every load; CRC32C when asked.

One version: a load never combines files of two versions of a checkpoint that is overwritten
while it is read.  A local checkpoint directory is opened once (:class:`~ckptd.storage.local_read.
PinnedDirectory`) and every file is opened relative to it; on object stores the manifest's
version stamp is taken before it is read and compared after the reads (before any value is
returned).  A replacement noticed either way is :class:`~ckptd.errors.CheckpointReplacedError`.

This module is longer than 450 lines on purpose: detecting eight formats, the one read path they
share and the pinning of that path to one version belong to one class; fetching bytes
(:mod:`.fetch`), DCP (:mod:`.dcp`), assigning (:mod:`.assign`) and the pinned directory
(:mod:`ckptd.storage.local_read`) already live apart.
"""

from __future__ import annotations

import functools
import logging
import os
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    KeyMismatchError,
    MissingFileError,
    UnsafeCheckpointError,
)
from ..formats.checksum import format_crc
from ..formats.json_files import parse_json, read_small_file
from ..formats.manifest import (
    Manifest,
    TensorRecord,
    check_tied_groups,
    is_foreign_manifest,
    parse_hf_index,
    parse_state_file,
    sharing_aliases,
)
from ..formats.names import MANIFEST_NAME, SAFETENSORS_INDEX, SAFETENSORS_SINGLE, TORCH_BIN_INDEX, TORCH_BIN_SINGLE
from ..formats.safetensors import SafetensorsHeader, read_header
from ..formats.torch_bin import load_bin_bytes, load_tree, load_tree_bytes
from ..storage import (
    RangeReader,
    Storage,
    StorageTuning,
    check_file_name,
    normalize_location,
    storage_for,
)
from .cache import FileCache
from .dcp import DcpLayout, fetch_dcp, is_dcp, nest_dcp, read_dcp_layout, read_dcp_objects
from .fetch import (
    DEFAULT_REMOTE_CONCURRENCY,
    Destination,
    fetch_bin,
    make_destinations,
    new_device_tensor,
    plan_requests,
    preview,
    read_requests,
)
from .hf_dcp_shards import file_sizes, is_hf_dcp_sharded, shard_files, shard_records
from .inline_verify import VerifyMode, cover, verify_mode
from .pinning import OneVersion, holder
from .to_device import DeviceRequest
from .torch_checkpointing import METADATA_FILE, is_torch_checkpointing, item_files
from .verify import file_crcs

__all__ = [
    "CheckpointReader",
    "PendingRead",
    "preview",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Source:
    """One component's tensors: ``kind`` is ``safetensors``, ``torch_bin`` or ``dcp`` (then
    ``weight_map`` maps each key to its DCP fully qualified name)."""

    kind: str
    weight_map: dict[str, str]
    records: dict[str, TensorRecord] | None
    aliases: dict[str, str]


@dataclass
class PendingRead:
    """The tensors one :meth:`CheckpointReader.plan` placed: their memory is allocated (or is
    the caller's), their bytes arrive in :meth:`CheckpointReader.run`; ``result()`` then gives
    what :meth:`CheckpointReader.read` returns.  (Mutable: ``done`` records that run read it.)"""

    requested: list[str]
    aliases: dict[str, str]
    records: dict[str, TensorRecord]
    destinations: dict[str, Destination]
    targeted: frozenset[str]
    device: torch.device
    verify: bool
    inline: bool = False  # verify while reading (fresh destinations, or verify="inline")
    done: bool = False

    def result(self) -> dict[str, Any]:
        """``{key: tensor or target}`` for every requested key (aliases too), once read."""
        if self.records and not self.done:
            raise ConfigError("PendingRead.result() called before CheckpointReader.run() read its bytes")
        loaded: dict[str, Any] = {}
        for key, destination in self.destinations.items():
            value = destination.finish()
            if key not in self.targeted and isinstance(value, torch.Tensor) and value.device != self.device:
                value = value.to(self.device)
            loaded[key] = value
        return {key: loaded[self.aliases.get(key, key)] for key in self.requested}


class CheckpointReader:
    """A checkpoint opened for reading, in any supported format.

    ``kind`` is ``"ckptd"``, ``"dcp"``, ``"hf_sharded"``, ``"hf_dcp_sharded"`` (the per-rank
    shards of DCP's ``HuggingFaceStorageWriter``), ``"safetensors"``, ``"torch_bin_sharded"``,
    ``"torch_bin"`` or ``"torch_checkpointing"`` (each item a component).  ``manifest`` is set for ckptd checkpoints.

    Everything read through one reader comes from one version of the checkpoint.  If it is
    overwritten or deleted meanwhile, a read raises
    :class:`~ckptd.errors.CheckpointReplacedError` (having combined nothing of two versions);
    open a new reader to read the version now committed.  (A local reader holds the checkpoint
    directory open: :meth:`close` it, or use it as a context manager; an unreferenced reader
    closes itself.  PyTorch DCP checkpoints are read by torch itself, by path.)
    """

    def __init__(
        self,
        directory: str,
        storage: Storage,
        kind: str,
        sources: dict[str, _Source],
        manifest: Manifest | None,
        cache: FileCache | None = None,
        *,
        version: OneVersion | None = None,
    ) -> None:
        self.directory = directory
        self.storage = storage
        self.kind = kind
        self.manifest = manifest
        self.cache = cache
        self._sources = sources
        self._headers: dict[str, SafetensorsHeader] = {}
        self._verified: set[str] = set()
        self._state_trees: dict[str, Any] | None = None
        self._dcp_layout: tuple[DcpLayout, dict[str, Any] | None] | None = None
        self._trees: dict[str, str] = {}  # torch.save files of any structure -> item (torch_checkpointing)
        self._version = version if version is not None else OneVersion(storage, directory)
        weakref.finalize(self, self._version.close)

    def close(self) -> None:
        """Release the directories held open (local checkpoints); reading after this is a
        :class:`~ckptd.errors.ConfigError`."""
        self._version.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        version = OneVersion.open(storage, directory)  # locally: the directory, held from here on
        try:
            with version.guard():
                return cls._detect(directory, storage, cache, version, require_manifest, storage_options)
        except BaseException:
            version.close()
            raise

    @classmethod
    def _detect(
        cls,
        directory: str,
        storage: Storage,
        cache: FileCache | None,
        version: OneVersion,
        require_manifest: bool,
        storage_options: dict[str, Any] | None,
    ) -> CheckpointReader:
        names = set(version.names())
        if not names and not storage.local and not storage.exists(directory):
            raise CheckpointNotFoundError(f"{directory}: no such checkpoint directory")
        if MANIFEST_NAME in names:
            version.take_stamp()
            data = version.read_small(MANIFEST_NAME, follow_symlinks=False)
            if not is_foreign_manifest(data):
                return cls._ckptd(directory, storage, cache, data, version)
            logger.debug("%s: %s was written by another tool; reading the weights it holds", directory, MANIFEST_NAME)
        if is_dcp(names):  # DCP's .metadata is its commit record, written last
            return cls._dcp(directory, storage, cache, storage_options, version)
        if require_manifest:
            foreign = MANIFEST_NAME in names
            what = f"its {MANIFEST_NAME} is another tool's (Forgather?)" if foreign else f"no {MANIFEST_NAME}"
            raise CheckpointNotFoundError(
                f"{directory} is not a committed ckptd checkpoint ({what}; an interrupted save, or another "
                "format: use ckptd.load_checkpoint for HF and Forgather checkpoints)"
            )
        if SAFETENSORS_INDEX in names:
            return cls._indexed(directory, storage, SAFETENSORS_INDEX, "safetensors", "hf_sharded", cache, version)
        if SAFETENSORS_SINGLE in names:
            return cls._single_file(storage, directory, SAFETENSORS_SINGLE, cache, version)
        if TORCH_BIN_INDEX in names:
            return cls._indexed(directory, storage, TORCH_BIN_INDEX, "torch_bin", "torch_bin_sharded", cache, version)
        if TORCH_BIN_SINGLE in names:
            return cls._single_file(storage, directory, TORCH_BIN_SINGLE, cache, version)
        if is_hf_dcp_sharded(names):
            return cls._hf_dcp_shards(directory, storage, cache, version, names)
        if is_torch_checkpointing(names):
            return cls._torch_checkpointing(directory, storage, cache, version, names)
        raise CheckpointNotFoundError(
            f"{directory}: no checkpoint found (looked for {MANIFEST_NAME}, {SAFETENSORS_INDEX}, "
            f"{SAFETENSORS_SINGLE}, {TORCH_BIN_INDEX}, {TORCH_BIN_SINGLE}, DCP's .metadata, DCP's HF "
            f"shard-*-model-*.safetensors, torch_checkpointing's {METADATA_FILE} or <item>_<rank>.pt)"
        )

    @classmethod
    def _ckptd(
        cls,
        directory: str,
        storage: Storage,
        cache: FileCache | None,
        data: bytes,
        version: OneVersion,
    ) -> CheckpointReader:
        where = storage.join(directory, MANIFEST_NAME)
        manifest = Manifest.from_json(data, where)
        reader = cls(directory, storage, "ckptd", {}, manifest, cache, version=version)
        with version.guard():
            version.pin_siblings(manifest.files)
            for name, component in manifest.components.items():
                aliases = {alias: group[0] for group in component.tied for alias in group[1:]}
                if component.kind == "torch_bin" and component.index:
                    index_path = _safe_path(storage, directory, component.index, where)
                    data = version.read_listed(component.index, manifest.files.get(component.index))
                    index = parse_hf_index(data, index_path)
                    check_tied_groups(
                        component.tied, index[0], f"{where}: component {name!r} (index {component.index})"
                    )
                    reader._sources[name] = _Source("torch_bin", index[0], None, aliases)
                elif component.tensors:
                    weight_map = {key: record.file for key, record in component.tensors.items()}
                    reader._sources[name] = _Source("safetensors", weight_map, dict(component.tensors), aliases)
        return reader

    def check_files(self, names: Iterable[str] | None = None) -> None:
        """Raise :class:`~ckptd.errors.CorruptCheckpointError` unless each of ``names`` (every
        file the manifest lists by default) exists with the size the manifest records.

        A load checks only the files it reads, just before it reads them: a ``components=`` or
        ``keys=`` load needs nothing else, while a full load and :meth:`verify` check them all
        (:meth:`~ckptd.load.pinning.OneVersion.check_sizes`)."""
        if self.manifest is not None:
            with self._version.guard():
                self._version.check_sizes(self.manifest.files, names)

    @classmethod
    def _dcp(
        cls,
        directory: str,
        storage: Storage,
        cache: FileCache | None,
        storage_options: dict[str, Any] | None,
        version: OneVersion | None = None,
    ) -> CheckpointReader:
        """A PyTorch DCP checkpoint (Megatron ``torch_dist`` too), read by torch's own reader."""
        layout = read_dcp_layout(directory, local=storage.local, storage_options=storage_options)
        sources = {name: _Source("dcp", dict(fqns), None, {}) for name, fqns in layout.components.items()}
        reader = cls(directory, storage, "dcp", sources, None, cache, version=version)
        reader._dcp_layout = (layout, storage_options)
        return reader

    @classmethod
    def _hf_dcp_shards(
        cls, directory: str, storage: Storage, cache: FileCache | None, version: OneVersion, names: set[str]
    ) -> CheckpointReader:
        """The per-rank shards of DCP's ``HuggingFaceStorageWriter(save_distributed=True)``: one
        record per tensor, a chunk per rank's piece (:mod:`.hf_dcp_shards`)."""
        reader = cls(directory, storage, "hf_dcp_sharded", {}, None, cache, version=version)
        files = shard_files(names)
        sizes = file_sizes(reader._open, files)
        records = shard_records({name: reader._header(name) for name in files}, sizes, directory)
        weight_map = {key: record.file for key, record in records.items()}
        reader._sources["model"] = _Source("safetensors", weight_map, records, {})
        return reader

    @classmethod
    def _torch_checkpointing(
        cls, directory: str, storage: Storage, cache: FileCache | None, version: OneVersion, names: set[str]
    ) -> CheckpointReader:
        """A torch_checkpointing checkpoint: each item a component (:mod:`.torch_checkpointing`);
        ``.pt`` items are loaded whole by torch (``weights_only``) to list their tensors."""
        metadata = version.read_small(METADATA_FILE, follow_symlinks=False) if METADATA_FILE in names else None
        reader = cls(directory, storage, "torch_checkpointing", {}, None, cache, version=version)
        for item, found in item_files(names, metadata, directory).items():
            if found.format == "safetensors":
                entries = reader._header(found.file).entries
                reader._sources[item] = _Source("safetensors", dict.fromkeys(entries, found.file), None, {})
            else:
                reader._trees[found.file] = item
                keys = reader._load_bin(found.file)
                if not keys:  # a number, a string, param-less state: no tensors to read
                    logger.debug("%s: item %r holds no tensors", directory, item)
                    continue
                reader._sources[item] = _Source("torch_bin", dict.fromkeys(keys, found.file), None, {})
        return reader

    @classmethod
    def _indexed(
        cls,
        directory: str,
        storage: Storage,
        index_name: str,
        kind: str,
        label: str,
        cache: FileCache | None,
        version: OneVersion,
    ) -> CheckpointReader:
        weight_map, aliases = _read_index(version, index_name)
        sources = {"model": _Source(kind, weight_map, None, aliases)}
        return cls(directory, storage, label, sources, None, cache, version=version)

    @classmethod
    def from_index(
        cls, directory: str, index: Mapping[str, Any], kind: str, storage_options: dict[str, Any] | None = None
    ) -> CheckpointReader:
        """A reader over a directory (or URL) driven by an already loaded HF index."""
        weight_map, aliases = parse_hf_index(index, directory)
        storage = storage_for(directory, storage_options)
        directory = normalize_location(directory)
        label = "hf_sharded" if kind == "safetensors" else "torch_bin_sharded"
        return cls(directory, storage, label, {"model": _Source(kind, weight_map, None, aliases)}, None)

    @classmethod
    def _single_file(
        cls, storage: Storage, directory: str, name: str, cache: FileCache | None, version: OneVersion | None = None
    ) -> CheckpointReader:
        reader = cls(directory, storage, "", {}, None, cache, version=version)
        if name.endswith((".bin", ".pt")):
            reader.kind = "torch_bin"
            keys = reader._load_bin(name).keys()
            reader._sources["model"] = _Source("torch_bin", dict.fromkeys(keys, name), None, {})
        else:
            header = reader._header(name)
            reader.kind = "safetensors"
            where = reader._path(name)
            groups = parse_json(
                (header.metadata.get("param_sharing") or "[]").encode(), where, "param_sharing metadata"
            )
            if not isinstance(groups, list) or not all(
                isinstance(g, list) and g and all(isinstance(k, str) for k in g) for g in groups
            ):
                raise CorruptCheckpointError(f"{where}: param_sharing metadata is not a list of key lists")
            aliases = sharing_aliases(groups, header.entries, where)
            reader._sources["model"] = _Source("safetensors", dict.fromkeys(header.entries, name), None, aliases)
        return reader

    def check_unchanged(self) -> None:
        """Raise :class:`~ckptd.errors.CheckpointReplacedError` if this checkpoint was replaced
        since it was opened, as far as reads could be affected: on object stores, its manifest's
        version stamp changed or the manifest is gone (one ``HEAD``).  :meth:`run` calls it after
        its reads; local readers read pinned directories, with nothing to check."""
        self._version.check_unchanged()

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

    def state_trees(self, verify: VerifyMode = False) -> dict[str, Any]:
        """The encoded non-tensor trees of every component (ckptd checkpoints only)."""
        if self.manifest is None or self.manifest.state_file is None:
            return {}
        if verify:
            self.verify([self.manifest.state_file])
        if self._state_trees is None:  # read once: every component's lookup asks for it
            where = _safe_path(self.storage, self.directory, self.manifest.state_file, MANIFEST_NAME)
            record = self.manifest.files.get(self.manifest.state_file)
            with self._version.guard():
                self._state_trees = parse_state_file(self._version.read_listed(self.manifest.state_file, record), where)
        return self._state_trees

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
        place = holder(self.storage, self.directory, record.checkpoint if record else None)
        return _safe_path(self.storage, place, file_name, self.directory)

    def _open(self, file_name: str) -> RangeReader:
        """A range reader on a file of this checkpoint (through the local cache if configured;
        locally, opened in the pinned directory that holds it)."""
        path = self._path(file_name)
        record = self.manifest.files.get(file_name) if self.manifest is not None else None
        if self.cache is not None:
            return self.cache.open(self.storage, path, file_name, record)
        if self.storage.local:
            return self._version.reader(file_name, record.checkpoint if record else None)
        return self.storage.open_reader(path)

    def _header(self, file_name: str) -> SafetensorsHeader:
        header = self._headers.get(file_name)
        if header is None:
            reader = self._open(file_name)
            try:
                header = read_header(reader.read, reader.size, self._path(file_name))
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
        """Raise unless every file of every component exists and every safetensors header parses
        (ckptd checkpoints: every file the manifest lists, with its recorded size)."""
        self.check_files()
        for name, source in self._sources.items():
            if source.kind == "dcp":
                continue  # torch read its .metadata; the data files are DCP's to check
            if source.kind == "safetensors":
                self.locate(name)
                continue
            for file_name in set(source.weight_map.values()):
                path = self._path(file_name)
                if not self.storage.local:
                    if not self.storage.exists(path):
                        raise CorruptCheckpointError(f"{path}: listed in the index but missing")
                    continue
                try:
                    self._version.reader(file_name).close()
                except MissingFileError as e:
                    raise CorruptCheckpointError(f"{path}: listed in the index but missing") from e

    # ---- reading ---------------------------------------------------------------------------

    def verify(self, files: Iterable[str] | None = None) -> None:
        """Check CRC32C of ``files`` (all by default) against the manifest, before anything is
        read from them (16 MiB spans of every file checksummed in parallel: :mod:`.verify`)."""
        if self.manifest is None:
            return
        names = [n for n in (self.manifest.files if files is None else dict.fromkeys(files)) if n not in self._verified]
        self.check_files(names)
        records = [self.manifest.files[name] for name in names]
        pairs = zip(names, records, strict=True)
        with self._version.guard():
            values = file_crcs([(functools.partial(self._open, name), record.size) for name, record in pairs])
            for name, record, value in zip(names, records, values, strict=True):
                if format_crc(value) != record.crc32c:
                    raise CorruptCheckpointError(
                        f"{self._path(name)}: CRC32C mismatch (manifest {record.crc32c}, file {format_crc(value)}): "
                        "the file is corrupt"
                    )
        self._verified.update(names)

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
        verify: VerifyMode = False,
    ) -> dict[str, Any]:
        """Read tensors of ``component`` (all, or ``keys``); tied aliases map to the same tensor.

        ``targets[key]`` receives the data in place: a tensor (the whole tensor), a DTensor or a
        :class:`~ckptd.ShardedTensor` (only its piece of the global tensor: exactly the byte
        ranges overlapping it are read, whatever layout the checkpoint was saved in).  Bytes go
        straight into target memory when it is a contiguous CPU tensor of the stored dtype;
        otherwise they are read into a buffer and copied.  Keys without a target come back as
        whole tensors on ``device`` (assembled from their pieces if they were saved sharded).
        """
        pending = self.plan(component, keys, device=device, targets=targets, verify=verify)
        self.run([pending])
        return pending.result()

    def plan(
        self,
        component: str = "model",
        keys: Iterable[str] | None = None,
        *,
        device: str | torch.device = "cpu",
        targets: Mapping[str, Any] | None = None,
        verify: VerifyMode = False,
    ) -> PendingRead:
        """The first half of :meth:`read`: check keys and targets and place every tensor, reading
        nothing yet from safetensors files (``.bin`` and DCP checkpoints are read here).

        Call order: 1. :meth:`plan` for each component; 2. :meth:`run` once with every plan (one
        pass over the files, all components' ranges at once); 3. ``result()`` of each plan.
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
        records: dict[str, TensorRecord] = {}
        place = torch.device(device)
        if source.kind == "torch_bin":
            files = sorted({source.weight_map[k] for k in stored})
            destinations = fetch_bin(files, stored, stored_targets, self._load_bin, where=self.directory)
        elif source.kind == "dcp":
            destinations = self._read_dcp(source, stored, stored_targets)
        else:
            records = self.locate(component, stored)
            device_reads = self.storage.local  # CUDA targets filled from page-locked memory (.to_device)
            if device_reads and place.type == "cuda":
                for key in stored:  # fresh tensors on the device: filled there, never in pageable memory
                    if stored_targets.get(key) is None:
                        stored_targets[key] = new_device_tensor(key, records[key], place, self.directory)
            destinations = make_destinations(stored, records, stored_targets, self.directory, device_reads)
        # Checked while read when nothing the caller holds is written (or the caller asked).
        inline = verify_mode(verify) == "inline" or (verify is True and not targets)
        held = frozenset(stored_targets)
        return PendingRead(requested, source.aliases, records, destinations, held, place, bool(verify), inline)

    def run(self, plans: Iterable[PendingRead]) -> None:
        """Read the bytes of every plan (of this reader) in one pass: one set of reads over the
        files, all components' ranges together, on the shared read pool.

        Raises :class:`~ckptd.errors.CheckpointReplacedError`, before any ``result()`` is
        handed out, if the checkpoint was replaced while it was read.  Targets read in place (a
        module's own tensors) may then hold part of the bytes: locally and on S3, only bytes of
        the version this reader opened (local files are pinned; S3 reads are ``If-Match`` the
        ETags seen before the manifest was found unchanged once more, after every file was
        opened); on stores without conditional reads (GCS, ``memory://``), possibly of both."""
        plans = [p for p in plans if p.records and not p.done]
        if not plans:
            return
        requests: dict[str, list[tuple[int, memoryview]]] = {}
        device_requests: dict[str, list[DeviceRequest]] = {}
        for p in plans:
            host, device = plan_requests(p.records, p.destinations, self.directory)
            for file_name, wanted in host.items():
                requests.setdefault(file_name, []).extend(wanted)
            for file_name, spans in device.items():
                device_requests.setdefault(file_name, []).extend(spans)
        inline = self._inline_checks(plans, requests, device_requests)
        to_verify = sorted({f for p in plans if p.verify for r in p.records.values() for f in r.files} - set(inline))
        if to_verify:
            self.verify(to_verify)
        self.check_files([*requests, *device_requests])  # before the first byte lands in a target
        tuning = getattr(self.storage, "tuning", None)
        concurrency = tuning.part_concurrency if tuning is not None else DEFAULT_REMOTE_CONCURRENCY
        with self._version.guard():
            read_requests(
                requests,
                self._open,
                self._path,
                local=self.storage.local,
                concurrency=concurrency,
                opened=self._version.check_unchanged,
                device_requests=device_requests,
                inline=inline,
            )
        self._version.check_unchanged()
        self._verified.update(inline)
        for p in plans:
            p.done = True

    def _inline_checks(
        self,
        plans: Sequence[PendingRead],
        requests: Mapping[str, list[tuple[int, memoryview]]],
        device_requests: Mapping[str, list[DeviceRequest]],
    ) -> dict[str, tuple[int, str]]:
        """``{file: (size, CRC32C)}`` of the files ``run`` checks while reading them
        (:mod:`.inline_verify`): local files with a manifest record, read into host memory only,
        by no plan that must check them first (``verify=True`` into caller's targets)."""
        if self.manifest is None or not self.storage.local:
            return {}
        first = {f for p in plans if p.verify and not p.inline for r in p.records.values() for f in r.files}
        wanted = {f for p in plans if p.inline for r in p.records.values() for f in r.files}
        out: dict[str, tuple[int, str]] = {}
        for name in sorted(wanted - first - self._verified):
            record = self.manifest.files.get(name)
            if record is None or name not in requests or name in device_requests:
                continue
            if cover(requests[name], record.size) is not None:
                out[name] = (record.size, record.crc32c)
        return out

    def _load_bin(self, file_name: str) -> dict[str, torch.Tensor]:
        """A ``.bin`` file's tensors; for a torch_checkpointing item's file (in ``_trees``) those
        of any structure, flattened (a bare tensor is keyed by its item's name)."""
        path = self._path(file_name)
        tree = file_name in self._trees
        name = self._trees.get(file_name, "")
        if self.storage.local:
            record = self.manifest.files.get(file_name) if self.manifest is not None else None
            load = functools.partial(load_tree, name=name) if tree else None
            return self._version.load_bin(file_name, path, record.checkpoint if record else None, load)
        with self._version.guard():
            data = self.storage.read_bytes(path)
            tensors = load_tree_bytes(data, path, name) if tree else load_bin_bytes(data, path)
        self._version.check_unchanged()
        return tensors

    def dcp_layout(self) -> DcpLayout:
        """What torch's ``.metadata`` lists (DCP and Megatron ``torch_dist`` checkpoints only)."""
        if self._dcp_layout is None:
            raise CorruptCheckpointError(f"{self.directory}: not a DCP checkpoint (kind {self.kind!r})")
        return self._dcp_layout[0]

    def read_dcp_objects(self, fqns: Iterable[str]) -> dict[str, Any]:
        """Non-tensor DCP entries by name, decoded with ``torch.load(weights_only=True)``."""
        self.dcp_layout()
        options = self._dcp_layout[1] if self._dcp_layout is not None else None
        return read_dcp_objects(self.directory, fqns, local=self.storage.local, storage_options=options)

    def read_dcp_nested(self, component: str, tensors: Mapping[str, Any]) -> Any:
        """A DCP component rebuilt in its saved structure: ``tensors`` (by key, as :meth:`read`
        returns them) plus the component's non-tensor entries (an optimizer's ``param_groups``)."""
        layout = self.dcp_layout()
        fqns = self._source(component).weight_map
        objects = [fqn for fqn in layout.skipped if layout.component_of(fqn) == component]
        values = {fqns[key]: value for key, value in tensors.items() if key in fqns}
        values.update(self.read_dcp_objects(objects))
        return nest_dcp(layout, component, values)

    def _read_dcp(self, source: _Source, keys: list[str], targets: Mapping[str, Any]) -> dict[str, Destination]:
        if self._dcp_layout is None:  # pragma: no cover - set by _dcp()
            raise CorruptCheckpointError(f"{self.directory}: not opened as a DCP checkpoint")
        layout, options = self._dcp_layout
        fqns = {key: source.weight_map[key] for key in keys}
        return fetch_dcp(self.directory, layout, fqns, targets, local=self.storage.local, storage_options=options)


def _read_index(version: OneVersion, name: str) -> tuple[dict[str, str], dict[str, str]]:
    """An HF index.  A symlink inside the directory is followed; one leading out (the HF hub
    cache links snapshots to blobs) is read by path, as before pinning (its shards must still be
    inside)."""
    where = version.storage.join(version.directory, name)
    try:
        data = version.read_small(name, follow_symlinks=True)
    except UnsafeCheckpointError:
        data = read_small_file(version.storage, where)
    return parse_hf_index(data, where)


def _is_single_file(storage: Storage, path: str) -> bool:
    if storage.local:
        return os.path.isfile(path)
    return path.endswith((".safetensors", ".bin")) and storage.exists(path)


def _safe_path(storage: Storage, directory: str, name: str, where: str) -> str:
    """``directory/name`` once ``name`` is checked to be a plain name inside the checkpoint
    (locally, symlinks leading out are refused when the file is opened in its pinned directory)."""
    check_file_name(name, where)
    return storage.join(directory, name)
