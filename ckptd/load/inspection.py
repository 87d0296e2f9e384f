"""A checkpoint's metadata without torch: what ``ckptd info``, ``verify`` and ``diff`` read.

:func:`open_view` detects the format as :class:`~ckptd.load.reader.CheckpointReader` does and,
for a ckptd checkpoint (its manifest) or an HF safetensors checkpoint (index and shard headers),
returns a :class:`CheckpointView`: components, keys, tied groups, each tensor's dtype, shape and
byte ranges, file sizes and CRC32C checks, and the raw bytes of byte ranges.  Nothing here imports
torch or numpy (a command that only reads JSON and checksums bytes starts in a tenth of a second,
not in two); the formats only torch reads (PyTorch DCP, pickled ``.bin`` files) get a
``CheckpointReader``, imported then.

One version, as for the reader: a local checkpoint directory is opened once
(:class:`~ckptd.storage.local_read.PinnedDirectory`) and every file is opened relative to it; on
object stores the manifest's version stamp is taken before it is read, and a failure while the
stamp has changed since is :class:`~ckptd.errors.CheckpointReplacedError`.

:mod:`.compare` compares two views' tensors byte by byte (``ckptd diff --exact``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    KeyMismatchError,
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
    sharing_aliases,
)
from ..formats.names import MANIFEST_NAME, SAFETENSORS_INDEX, SAFETENSORS_SINGLE, TORCH_BIN_INDEX, TORCH_BIN_SINGLE
from ..formats.safetensors import SafetensorsHeader, read_header
from ..storage import RangeReader, Storage, check_file_name, normalize_location, storage_for
from .hf_dcp_shards import file_sizes, is_hf_dcp_sharded, shard_files, shard_records
from .pinning import OneVersion, holder
from .torch_checkpointing import is_torch_checkpointing
from .verify import file_crcs

if TYPE_CHECKING:
    from .reader import CheckpointReader

__all__ = ["CheckpointView", "open_view"]

_DCP_METADATA = ".metadata"  # load.dcp.DCP_METADATA (not imported: that module pulls in torch)
_DCP_DATA_SUFFIX = ".distcp"
_OPEN_FILES = 32  # files a view keeps open for read_range


@dataclass(frozen=True)
class _Component:
    """One component's tensors: ``kind`` is ``safetensors`` (``records`` from the manifest, or
    ``None``: from the shards' headers) or ``torch_bin`` (keys only, from its index)."""

    kind: str
    weight_map: dict[str, str]
    records: dict[str, TensorRecord] | None
    aliases: dict[str, str]


def open_view(
    path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, *, require_manifest: bool = False
) -> CheckpointView | CheckpointReader:
    """The checkpoint at ``path`` (a directory, URL or single safetensors file): a
    :class:`CheckpointView` for ckptd and HF safetensors checkpoints, a ``CheckpointReader`` (torch)
    for PyTorch DCP and ``.bin`` checkpoints.  ``require_manifest``: anything but a committed
    ckptd checkpoint is :class:`~ckptd.errors.CheckpointNotFoundError`."""
    location = os.fspath(path)
    storage = storage_for(location, storage_options)
    directory = normalize_location(location)
    single = not require_manifest and _is_single_file(storage, directory)
    if single and directory.endswith((".bin", ".pt")):
        return _torch_reader(location, storage_options, require_manifest)
    parent, _, name = directory.rpartition("/" if not storage.local else os.sep)
    view = CheckpointView(parent if single else directory, storage, pin=not single)
    try:
        with view.guard():
            found = view._add_single_file(name) if single else view._detect(require_manifest)
    except BaseException:
        view.close()
        raise
    if found:
        return view
    view.close()
    return _torch_reader(location, storage_options, require_manifest)


def _torch_reader(location: str, storage_options: dict[str, Any] | None, require_manifest: bool) -> CheckpointReader:
    from .reader import CheckpointReader

    return CheckpointReader.open(location, storage_options, require_manifest=require_manifest)


class CheckpointView:
    """A ckptd or HF safetensors checkpoint, read without torch (see :func:`open_view`).

    ``kind`` is ``"ckptd"``, ``"hf_sharded"``, ``"hf_dcp_sharded"`` or ``"safetensors"``; ``manifest`` is set for
    ckptd checkpoints.  A local view holds the checkpoint directory open until :meth:`close`.
    Thread-safe.
    """

    def __init__(self, directory: str, storage: Storage, *, pin: bool) -> None:
        self.directory = directory
        self.storage = storage
        self.kind = ""
        self.manifest: Manifest | None = None
        self._components: dict[str, _Component] = {}
        self._lock = threading.Lock()
        self._headers: dict[str, SafetensorsHeader] = {}
        self._listings: dict[tuple[str | None, str], dict[str, int]] = {}
        self._open: dict[str, RangeReader] = {}
        self._identities: dict[str, tuple[int, int] | None] = {}
        # Local: the directory held open from here on (a pinned one: a single file's parent).
        self._version = OneVersion.open(storage, directory) if pin else OneVersion(storage, directory)

    def close(self) -> None:
        """Close the files and directories held open."""
        with self._lock:
            for reader in self._open.values():
                reader.close()
            self._open.clear()
        self._version.close()

    # ---- detection (the order of CheckpointReader.open) ---------------------------------------

    def _detect(self, require_manifest: bool) -> bool:
        """Fill this view from what the directory holds; False for the formats only torch reads."""
        storage, directory = self.storage, self.directory
        names = set(self._version.names())
        if not names and not storage.local and not storage.exists(directory):
            raise CheckpointNotFoundError(f"{directory}: no such checkpoint directory")
        if MANIFEST_NAME in names:
            where = storage.join(directory, MANIFEST_NAME)
            self._version.take_stamp()
            data = self._version.read_small(MANIFEST_NAME, follow_symlinks=False)
            if not is_foreign_manifest(data):
                self._add_manifest(Manifest.from_json(data, where), where)
                return True
        if _DCP_METADATA in names and any(n.endswith(_DCP_DATA_SUFFIX) for n in names):
            return False  # (even with require_manifest: torch's reader refuses a crafted .metadata)
        if require_manifest:
            foreign = MANIFEST_NAME in names
            what = f"its {MANIFEST_NAME} is another tool's (Forgather?)" if foreign else f"no {MANIFEST_NAME}"
            raise CheckpointNotFoundError(
                f"{directory} is not a committed ckptd checkpoint ({what}; an interrupted save, or another "
                "format: use ckptd.load_checkpoint for HF and Forgather checkpoints)"
            )
        if SAFETENSORS_INDEX in names:
            self.kind = "hf_sharded"
            weight_map, aliases = parse_hf_index(self._read_index(), storage.join(directory, SAFETENSORS_INDEX))
            self._components["model"] = _Component("safetensors", weight_map, None, aliases)
            return True
        if SAFETENSORS_SINGLE in names:
            return self._add_single_file(SAFETENSORS_SINGLE)
        if TORCH_BIN_INDEX in names or TORCH_BIN_SINGLE in names:
            return False
        if is_hf_dcp_sharded(names):
            self._add_hf_dcp_shards(shard_files(names))
            return True
        if is_torch_checkpointing(names):
            return False  # pickled .pt items: torch reads them
        raise CheckpointNotFoundError(
            f"{directory}: no checkpoint found (looked for {MANIFEST_NAME}, {SAFETENSORS_INDEX}, "
            f"{SAFETENSORS_SINGLE}, {TORCH_BIN_INDEX}, {TORCH_BIN_SINGLE}, DCP's .metadata, DCP's HF "
            "shard-*-model-*.safetensors, torch_checkpointing's metadata.pkl or <item>_<rank>.pt)"
        )

    def _add_hf_dcp_shards(self, files: list[str]) -> None:
        """The per-rank shards of DCP's ``HuggingFaceStorageWriter`` (:mod:`.hf_dcp_shards`)."""
        self.kind = "hf_dcp_sharded"
        sizes = file_sizes(self.open, files)
        records = shard_records({name: self._header(name) for name in files}, sizes, self.directory)
        weight_map = {key: record.file for key, record in records.items()}
        self._components["model"] = _Component("safetensors", weight_map, records, {})

    def _add_manifest(self, manifest: Manifest, where: str) -> None:
        self.kind, self.manifest = "ckptd", manifest
        self._version.pin_siblings(manifest.files)
        for name, component in manifest.components.items():
            aliases = {alias: group[0] for group in component.tied for alias in group[1:]}
            if component.kind == "torch_bin" and component.index:
                index_path = self.storage.join(self.directory, check_file_name(component.index, where))
                data = self._version.read_listed(component.index, manifest.files.get(component.index))
                weight_map, _ = parse_hf_index(data, index_path)
                check_tied_groups(component.tied, weight_map, f"{where}: component {name!r} (index {component.index})")
                self._components[name] = _Component("torch_bin", weight_map, None, aliases)
            elif component.tensors:
                weight_map = {key: record.file for key, record in component.tensors.items()}
                self._components[name] = _Component("safetensors", weight_map, dict(component.tensors), aliases)

    def _add_single_file(self, name: str) -> bool:
        """A lone safetensors file (tied groups in its ``param_sharing`` metadata)."""
        header = self._header(name)
        self.kind = "safetensors"
        where = self.path(name)
        groups = parse_json((header.metadata.get("param_sharing") or "[]").encode(), where, "param_sharing metadata")
        if not isinstance(groups, list) or not all(
            isinstance(g, list) and g and all(isinstance(k, str) for k in g) for g in groups
        ):
            raise CorruptCheckpointError(f"{where}: param_sharing metadata is not a list of key lists")
        aliases = sharing_aliases(groups, header.entries, where)
        self._components["model"] = _Component("safetensors", dict.fromkeys(header.entries, name), None, aliases)
        return True

    # ---- what is in it -------------------------------------------------------------------------

    def components(self) -> list[str]:
        """Names of the components holding tensors (``["model"]`` for HF checkpoints)."""
        return list(self._components)

    def keys(self, component: str = "model") -> list[str]:
        """Every tensor key of a component, tied aliases included."""
        source = self._component(component)
        return [*source.weight_map, *source.aliases]

    def tied_groups(self, component: str = "model") -> list[list[str]]:
        """Groups of tied keys (stored key first)."""
        groups: dict[str, list[str]] = {}
        for alias, stored in self._component(component).aliases.items():
            groups.setdefault(stored, [stored]).append(alias)
        return list(groups.values())

    def locate(self, component: str = "model") -> dict[str, TensorRecord]:
        """Dtype, shape and byte ranges of each stored tensor of a component (aliases left out;
        empty for a ``.bin`` component, whose files are pickles)."""
        source = self._component(component)
        if source.kind != "safetensors":
            return {}
        if source.records is not None:
            return dict(source.records)
        located: dict[str, TensorRecord] = {}
        for key, file_name in source.weight_map.items():
            header = self._header(file_name)
            entry = header.entries.get(key)
            if entry is None:
                raise CorruptCheckpointError(f"{file_name}: index says it holds {key!r} but its header does not")
            start, end = header.data_start + entry.start, header.data_start + entry.end
            located[key] = TensorRecord.whole(entry.dtype, entry.shape, file_name, start, end)
        return located

    def _component(self, component: str) -> _Component:
        try:
            return self._components[component]
        except KeyError:
            raise KeyMismatchError(
                f"{self.directory}: no component {component!r} (has {sorted(self._components)})"
            ) from None

    # ---- files ---------------------------------------------------------------------------------

    def path(self, file_name: str) -> str:
        """Where a file of this checkpoint is: here, or in the sibling checkpoint that holds it
        (checkpoints of ckptd < 0.2 referenced the files of earlier ones)."""
        check_file_name(file_name, self.directory)
        return self.storage.join(holder(self.storage, self.directory, self._checkpoint_of(file_name)), file_name)

    def open(self, file_name: str) -> RangeReader:
        """A new range reader on a file of this checkpoint (the caller closes it)."""
        if self.storage.local:
            check_file_name(file_name, self.directory)
            return self._version.pinned(self._checkpoint_of(file_name)).reader(file_name)
        return self.storage.open_reader(self.path(file_name))

    def identity(self, file_name: str) -> tuple[int, int] | None:
        """``(device, inode)`` of a local file (hard links share it); ``None`` on object stores."""
        if not self.storage.local:
            return None
        if file_name not in self._identities:
            check_file_name(file_name, self.directory)
            fd = self._version.pinned(self._checkpoint_of(file_name)).open(file_name)
            try:
                info = os.fstat(fd)
            finally:
                os.close(fd)
            self._identities[file_name] = (info.st_dev, info.st_ino)
        return self._identities[file_name]

    def read_range(self, file_name: str, offset: int, length: int) -> bytes:
        """``length`` bytes of a file at ``offset`` (the last few files read are kept open)."""
        with self._lock:
            reader = self._open.pop(file_name, None)
        if reader is None:
            reader = self.open(file_name)
        try:
            return reader.read(offset, length)
        finally:
            with self._lock:
                if file_name in self._open:  # another thread put one back meanwhile
                    reader.close()
                else:
                    self._open[file_name] = reader  # most recently used last
                while len(self._open) > _OPEN_FILES:
                    self._open.pop(next(iter(self._open))).close()

    def check_files(self, names: Iterable[str] | None = None) -> None:
        """Raise :class:`~ckptd.errors.CorruptCheckpointError` unless each of ``names`` (every
        file the manifest lists by default) exists with the size the manifest records (one
        listing per directory)."""
        if self.manifest is not None:
            self._version.check_sizes(self.manifest.files, names)

    def verify(self, names: Iterable[str] | None = None) -> None:
        """Check the size and CRC32C of ``names`` (every file by default) against the manifest
        (16 MiB spans of every file checksummed in parallel: :mod:`.verify`)."""
        if self.manifest is None:
            return
        names = list(self.manifest.files if names is None else dict.fromkeys(names))
        records = [self.manifest.files[name] for name in names]
        with self.guard():
            self.check_files(names)
            values = file_crcs([(functools.partial(self.open, n), r.size) for n, r in zip(names, records, strict=True)])
            for name, record, value in zip(names, records, values, strict=True):
                if format_crc(value) != record.crc32c:
                    raise CorruptCheckpointError(
                        f"{self.path(name)}: CRC32C mismatch (manifest {record.crc32c}, file {format_crc(value)}): "
                        "the file is corrupt"
                    )

    def guard(self) -> contextlib.AbstractContextManager[None]:
        """A failure inside (a size or checksum that does not match, a file gone) while the
        checkpoint has since been replaced is that replacement (:class:`CheckpointReplacedError`)."""
        return self._version.guard()

    # ---- internals -----------------------------------------------------------------------------

    def _checkpoint_of(self, file_name: str) -> str | None:
        record = self.manifest.files.get(file_name) if self.manifest is not None else None
        return record.checkpoint if record is not None else None

    def _read_index(self) -> bytes:
        """An HF index; a symlink leading out of the directory (the HF hub cache links snapshots
        to blobs) is read by path."""
        try:
            return self._version.read_small(SAFETENSORS_INDEX, follow_symlinks=True)
        except UnsafeCheckpointError:
            return read_small_file(self.storage, self.storage.join(self.directory, SAFETENSORS_INDEX))

    def _header(self, file_name: str) -> SafetensorsHeader:
        header = self._headers.get(file_name)
        if header is None:
            reader = self.open(file_name)
            try:
                header = read_header(reader.read, reader.size, self.path(file_name))
            finally:
                reader.close()
            self._headers[file_name] = header
        return header


def _is_single_file(storage: Storage, path: str) -> bool:
    if storage.local:
        return os.path.isfile(path)
    return path.endswith((".safetensors", ".bin")) and storage.exists(path)
