"""The seed-compatible functional API (Forgather ``sharded_checkpoint``, ModelOpt helpers).

These functions save and load synchronously in the calling process; use
:class:`ckptd.Checkpointer` for asynchronous saves of whole training state.  What they write is
an HF-compatible sharded checkpoint (index + shards) plus a ckptd manifest, written last, so
:func:`validate_checkpoint` and ``verify=True`` loads can check every byte.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .._version import __version__
from ..errors import ConfigError, CorruptCheckpointError, KeyMismatchError
from ..formats.checksum import crc32c, format_crc
from ..formats.manifest import ComponentRecord, FileRecord, Manifest, TensorRecord, utc_now
from ..formats.names import (
    MANIFEST_NAME,
    SAFETENSORS_INDEX,
    SAFETENSORS_SINGLE,
    TORCH_BIN_INDEX,
    TORCH_BIN_SINGLE,
    index_file_name,
    is_seed_shard_name,
    seed_shard_name,
)
from ..formats.torch_bin import save_bin_bytes
from ..formats.torch_dtypes import dtype_from_name
from ..load.assign import create_sharing_metadata, load_into_module, retie_parameters
from ..load.fetch import tensor_memoryview
from ..load.reader import CheckpointReader
from ..options import parse_size
from ..save.flatten import find_tied_groups
from ..save.layout import FileLayout, WriteItem, bucket_items, describe_tensors, plan_file
from ..storage import Storage, check_file_name, local_path, normalize_location, storage_for

__all__ = [
    "CheckpointMeta",
    "TensorInfo",
    "ShardIndex",
    "SharingMetadataT",
    "StateDictLike",
    "create_sharing_metadata",
    "get_checkpoint_metadata",
    "index_file_name",
    "is_in_safetensors_format",
    "load_checkpoint",
    "load_shard_index",
    "load_sharded_checkpoint",
    "load_sharded_state_dict",
    "load_tensors_metadata",
    "make_shard_index",
    "retie_parameters",
    "save_checkpoint",
    "save_shard_index",
    "save_sharded_checkpoint",
    "save_sharded_model",
    "validate_checkpoint",
]

StateDictLike = torch.nn.Module | dict[str, torch.Tensor]
ShardIndex = dict[str, dict[str, Any]]
SharingMetadataT = list[list[str]]


@dataclass(frozen=True)
class TensorInfo:
    """A stored tensor's dtype and global shape (what :func:`load_tensors_metadata` returns)."""

    dtype: torch.dtype
    shape: tuple[int, ...]


def load_tensors_metadata(
    path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> dict[str, dict[str, TensorInfo]]:
    """Global shapes and dtypes of every tensor, per component, without reading tensor data
    (ckptd: from the manifest; HF checkpoints: from the shard headers)."""
    reader = CheckpointReader.open(path, storage_options)
    out: dict[str, dict[str, TensorInfo]] = {}
    for component in reader.components():
        records = reader.locate(component) if reader.kind != "torch_bin_sharded" else {}
        aliases = {k: a for group in reader.tied_groups(component) for k in group[1:] for a in group[:1]}
        infos = {key: TensorInfo(dtype_from_name(r.dtype), tuple(r.shape)) for key, r in records.items()}
        infos.update({alias: infos[stored] for alias, stored in aliases.items() if stored in infos})
        out[component] = infos
    return out


@dataclass(frozen=True)
class CheckpointMeta:
    """What :func:`get_checkpoint_metadata` found: the file to open, and its kind."""

    file_name: str
    is_index: bool
    safetensors: bool


def _location(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> tuple[Storage, str]:
    """The storage backend and normalised directory (or object prefix) for a path or URL."""
    text = os.fspath(path)
    storage = storage_for(text, storage_options)
    return storage, normalize_location(text)


def _state_of(module: StateDictLike) -> dict[str, torch.Tensor]:
    state = module.state_dict() if isinstance(module, torch.nn.Module) else module
    if not isinstance(state, Mapping):
        raise ConfigError(f"expected an nn.Module or a dict of tensors, got {type(module).__name__}")
    tensors = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise ConfigError(f"state dict entry {key!r} is a {type(value).__name__}, not a tensor")
        tensors[key] = value.detach()
    return tensors


def _drop_aliases(state: Mapping[str, torch.Tensor], sharing: Iterable[Iterable[str]]) -> dict[str, torch.Tensor]:
    aliases = {k for group in sharing for k in list(group)[1:]}
    return {k: v for k, v in state.items() if k not in aliases}


def make_shard_index(
    state_dictionaries: list[dict[str, torch.Tensor]],
    metadata: dict[str, Any] | None = None,
    safetensors: bool = False,
    max_shard_size: int = 2**32,
    param_sharing_metadata: list[list[str]] | None = None,
) -> ShardIndex:
    """An HF shard index for one or more state dicts; each gets its own shard files.

    Tied aliases named in ``param_sharing_metadata`` are left out of the weight map (stored
    once) and recorded as ``metadata["param_sharing"]``.
    """
    limit = parse_size(max_shard_size, "max_shard_size")
    sharing = [list(g) for g in param_sharing_metadata or []]
    buckets: list[list[WriteItem]] = []
    total = 0
    for state in state_dictionaries:
        items = describe_tensors("model", _drop_aliases(_state_of(state), sharing))
        total += sum(item.nbytes for item in items)
        buckets.extend(b for b in bucket_items(items, limit) if b)
    weight_map: dict[str, str] = {}
    for number, bucket in enumerate(buckets, start=1):
        for item in bucket:
            weight_map[item.key] = seed_shard_name(safetensors, number, len(buckets))
    index_metadata: dict[str, Any] = {"total_size": total}
    if metadata:
        index_metadata.update(metadata)
    if sharing:
        index_metadata["param_sharing"] = sharing
    return {"metadata": index_metadata, "weight_map": weight_map}


def save_shard_index(shard_index: ShardIndex, output_dir: str, index_name: str) -> None:
    """Write a shard index into ``output_dir`` (atomically on local disk)."""
    storage, directory = _location(output_dir)
    storage.makedirs(directory)
    path = storage.join(directory, check_file_name(index_name, directory))
    storage.write_stream(path, [memoryview(json.dumps(shard_index, indent=2).encode())])


def load_shard_index(output_dir: str, index_name: str) -> ShardIndex:
    """Read a shard index from ``output_dir``."""
    storage, directory = _location(output_dir)
    path = storage.join(directory, check_file_name(index_name, directory))
    try:
        index = json.loads(storage.read_bytes(path))
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(f"{path}: cannot read shard index ({e})") from e
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise CorruptCheckpointError(f"{path}: not a shard index (no weight_map)")
    return index


def save_sharded_checkpoint(
    output_dir: str,
    shard_index: ShardIndex,
    module: StateDictLike,
    safetensors: bool = False,
    *,
    debug: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, FileRecord]:
    """Write the shard files of ``shard_index`` that hold keys of ``module``.

    Every file written must be complete: a file whose keys are only partly in ``module`` is an
    error.  Returns the size and CRC32C of each file written.
    """
    storage, directory = _location(output_dir, storage_options)
    storage.makedirs(directory)
    state = _state_of(module)
    records: dict[str, FileRecord] = {}
    for file_name, keys in _group(shard_index["weight_map"]).items():
        check_file_name(file_name, "shard index")
        present = [k for k in keys if k in state]
        if not present:
            continue
        if len(present) != len(keys):
            absent = [k for k in keys if k not in state]
            raise KeyMismatchError(f"cannot write {file_name}: the state lacks {absent[:5]} of its keys")
        tensors = {k: state[k] for k in keys}
        path = storage.join(directory, file_name)
        if safetensors:
            records[file_name] = _write_safetensors(storage, path, tensors)
        else:
            records[file_name] = _write_bytes(storage, path, save_bin_bytes(tensors))
    return records


def save_checkpoint(
    output_dir: str,
    module: StateDictLike,
    metadata: dict[str, Any] | None = None,
    safetensors: bool = False,
    max_shard_size: int = 2**31,
    include_param_sharing: bool = True,
    param_sharing_metadata: SharingMetadataT | None = None,
    *,
    debug: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """Save a module or a dict of tensors as an HF-compatible sharded checkpoint in ``output_dir``.

    ``output_dir`` may be a local path or an fsspec URL (``storage_options`` go to fsspec).
    Writes the shards, the index (``metadata`` goes into the index's metadata), then
    ``checkpoint_manifest.json`` last.  Tied parameters are stored once and recorded
    (auto-detected for modules unless ``include_param_sharing=False``, in which case every key
    is stored as its own copy).  ``safetensors=False`` (the seed default) writes ``.bin`` shards.
    """
    storage, directory = _location(output_dir, storage_options)
    storage.makedirs(directory)
    state = _state_of(module)
    if param_sharing_metadata is not None:
        sharing = [list(g) for g in param_sharing_metadata]
    elif include_param_sharing:
        sharing = create_sharing_metadata(module) if isinstance(module, torch.nn.Module) else find_tied_groups(state)
    else:
        sharing = []  # every key written in full: shards stream each tensor's own bytes
    storage.remove(storage.join(directory, MANIFEST_NAME))  # the old checkpoint stops being one
    index = make_shard_index([state], metadata, safetensors, max_shard_size, sharing)
    written = save_sharded_checkpoint(directory, index, state, safetensors, storage_options=storage_options)
    index_name = index_file_name(safetensors)
    written[index_name] = _write_bytes(
        storage, storage.join(directory, index_name), json.dumps(index, indent=2).encode()
    )
    _remove_stale_shards(storage, directory, set(written))
    tensors: dict[str, TensorRecord] = {}
    if safetensors:
        for file_name, keys in _group(index["weight_map"]).items():
            shard = plan_file("model", file_name, describe_tensors("model", {k: state[k] for k in keys}))
            for i, item in enumerate(shard.items):
                start = shard.item_file_offset(i)
                tensors[item.key] = TensorRecord.whole(item.dtype, item.shape, file_name, start, start + item.nbytes)
    manifest = Manifest(
        step=None,
        created_utc=utc_now(),
        world_size=1,
        library_version=__version__,
        components={
            "model": ComponentRecord("safetensors" if safetensors else "torch_bin", tensors, index_name, sharing)
        },
        files=written,
        metadata=dict(metadata or {}),
    )
    _write_bytes(storage, storage.join(directory, MANIFEST_NAME), manifest.to_json())


def _group(weight_map: Mapping[str, str]) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = {}
    for key, file_name in weight_map.items():
        grouped.setdefault(file_name, []).append(key)
    return grouped


def _remove_stale_shards(storage: Storage, directory: str, keep: set[str]) -> None:
    for name in storage.list_names(directory):
        if is_seed_shard_name(name) and name not in keep:
            storage.remove(storage.join(directory, name))


def _write_bytes(storage: Storage, path: str, data: bytes) -> FileRecord:
    """Write a whole file (atomically on local disk) and return its record."""
    storage.write_stream(path, [memoryview(data)])
    return FileRecord(len(data), format_crc(crc32c(data)))


def _write_safetensors(storage: Storage, path: str, tensors: Mapping[str, torch.Tensor]) -> FileRecord:
    """Write one safetensors file holding ``tensors`` and return its record."""
    layout = plan_file("model", path.rsplit("/", 1)[-1], describe_tensors("model", dict(tensors)))
    return write_layout(storage, path, layout, lambda item: tensors[item.key])


def write_layout(
    storage: Storage, path: str, layout: FileLayout, tensor_for: Callable[[WriteItem], torch.Tensor]
) -> FileRecord:
    """Stream a planned safetensors file: its header, then each item's bytes, fetched one tensor
    at a time with ``tensor_for`` (so memory holds one tensor); returns its size and CRC32C."""
    checksum = [crc32c(layout.header)]

    def pieces() -> Iterator[memoryview]:
        yield memoryview(layout.header)
        for item in layout.items:
            tensor = tensor_for(item).detach().to("cpu").contiguous()
            view = tensor_memoryview(tensor)
            checksum[0] = crc32c(view, checksum[0])
            yield view
            del tensor, view

    storage.write_stream(path, pieces())
    return FileRecord(layout.size, format_crc(checksum[0]))


def save_sharded_model(model_shard: StateDictLike, out_path: str) -> None:
    """ModelOpt: write one safetensors file (e.g. ``<dir>/model.safetensors``) with every tensor."""
    storage, path = _location(out_path)
    parent = path.rsplit("/", 1)[0] if not storage.local else os.path.dirname(path)
    storage.makedirs(parent)
    state = _state_of(model_shard)
    _write_safetensors(storage, path, _drop_aliases(state, find_tied_groups(state)))


# ---- loading --------------------------------------------------------------------------------


def load_checkpoint(
    model_dir: str,
    module: torch.nn.Module | None = None,
    device: str = "cpu",
    strict: bool = True,
    assign: bool = False,
    keys: set[str] | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    cache_dir: str | None = None,
) -> dict[str, torch.Tensor] | None:
    """Load model weights from any supported format (auto-detected), from a path or URL.

    With ``module``, loads into it in place (``strict``/``assign`` as in ``load_state_dict``) and
    re-ties tied parameters; returns None.  Without, returns ``{key: tensor}`` on ``device``,
    restricted to ``keys`` if given (only the shards holding them are opened).
    """
    reader = CheckpointReader.open(model_dir, storage_options, cache_dir=cache_dir)
    component = reader.default_component()
    if module is None:
        return reader.read(component, keys, device=device)
    load_into_module(reader, component, module, strict=strict, assign=assign, device=device)
    return None


def load_sharded_checkpoint(
    model_dir: str,
    shard_index: ShardIndex,
    module: torch.nn.Module | None = None,
    device: str = "cpu",
    safetensors: bool = False,
    strict: bool = True,
    assign: bool = False,
    debug: bool = False,
    keys: set[str] | None = None,
) -> set[str] | dict[str, torch.Tensor]:
    """Load using an already loaded ``shard_index``.

    Module mode returns the module keys that were not loaded; dict mode returns the tensors.
    """
    reader = CheckpointReader.from_index(
        local_path(model_dir), shard_index, "safetensors" if safetensors else "torch_bin"
    )
    if module is None:
        return reader.read("model", keys, device=device)
    return load_into_module(reader, "model", module, strict=strict, assign=assign, device=device)


def load_sharded_state_dict(
    model_name_or_path: str | os.PathLike[str],
    keys_to_load: Iterable[str] | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """ModelOpt: the state dict (or only ``keys_to_load``) of a checkpoint, reading only needed shards."""
    reader = CheckpointReader.open(os.fspath(model_name_or_path))
    return reader.read(reader.default_component(), keys_to_load, device=device)


def is_in_safetensors_format(checkpoint_dir: str | os.PathLike[str]) -> bool:
    """ModelOpt: True if the directory holds safetensors weights (single file, index or ckptd)."""
    try:
        reader = CheckpointReader.open(os.fspath(checkpoint_dir))
    except (FileNotFoundError, CorruptCheckpointError):
        return False
    if reader.kind in ("hf_sharded", "safetensors"):
        return True
    if reader.kind == "ckptd" and reader.manifest is not None:
        component = reader.manifest.components.get(reader.default_component())
        return component is not None and component.kind == "safetensors"
    return False


def get_checkpoint_metadata(path: str) -> CheckpointMeta | None:
    """Which file to load from ``path`` (index or single file) and whether it is safetensors."""
    storage, directory = _location(path)
    names = set(storage.list_names(directory))
    for name, is_index, is_safetensors in (
        (SAFETENSORS_INDEX, True, True),
        (SAFETENSORS_SINGLE, False, True),
        (TORCH_BIN_INDEX, True, False),
        (TORCH_BIN_SINGLE, False, False),
    ):
        if name in names:
            return CheckpointMeta(name, is_index, is_safetensors)
    return None


def validate_checkpoint(path: str) -> bool:
    """True if ``path`` holds a complete checkpoint: a valid manifest whose files all have the
    recorded sizes, or an HF index whose shards all exist with intact headers."""
    try:
        CheckpointReader.open(path).check_complete()
    except (OSError, ValueError, KeyError):
        return False
    return True
