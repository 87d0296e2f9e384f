"""Forgather ``sharded_checkpoint``: its functional API, same names and signatures.

These functions save and load synchronously in the calling process; use
:class:`ckptd.Checkpointer` for asynchronous saves of whole training state.  What they write is
an HF-compatible sharded checkpoint (index + shards) plus a ckptd manifest, written last, so
:func:`validate_checkpoint` and ``verify=True`` loads can check every byte.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .._version import __version__
from ..catalog import apply_retention, checkpoint_dir_name, latest_checkpoint, read_manifest
from ..errors import ConfigError, CorruptCheckpointError, KeyMismatchError
from ..formats.manifest import ComponentRecord, FileRecord, Manifest, TensorRecord, utc_now
from ..formats.names import (
    MANIFEST_NAME,
    METRICS_NAME,
    SAFETENSORS_INDEX,
    SAFETENSORS_SINGLE,
    TORCH_BIN_INDEX,
    TORCH_BIN_SINGLE,
    index_file_name,
    is_seed_shard_name,
    seed_shard_name,
)
from ..formats.torch_bin import save_bin_bytes
from ..load.assign import create_sharing_metadata, load_into_module, retie_parameters
from ..load.reader import CheckpointReader
from ..options import parse_size
from ..save.flatten import find_tied_groups
from ..save.layout import WriteItem, bucket_items, describe_tensors, plan_file
from ..save.tensor_files import write_safetensors_file, write_whole_file
from ..storage import Storage, check_file_name, is_local, local_path, normalize_location, storage_for

__all__ = [
    "METRICS_NAME",
    "CheckpointMeta",
    "ShardIndex",
    "SharingMetadataT",
    "StateDictLike",
    "create_sharing_metadata",
    "find_latest_checkpoint",
    "get_checkpoint_metadata",
    "index_file_name",
    "load_checkpoint",
    "load_checkpoint_metrics",
    "load_shard_index",
    "load_sharded_checkpoint",
    "make_shard_index",
    "maybe_delete_oldest_checkpoint",
    "next_checkpoint_path",
    "retie_parameters",
    "save_checkpoint",
    "save_checkpoint_metrics",
    "save_shard_index",
    "save_sharded_checkpoint",
    "validate_checkpoint",
]

StateDictLike = torch.nn.Module | dict[str, torch.Tensor]
ShardIndex = dict[str, dict[str, Any]]
SharingMetadataT = list[list[str]]


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
            records[file_name] = write_safetensors_file(storage, path, tensors)
        else:
            records[file_name] = write_whole_file(storage, path, save_bin_bytes(tensors))
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
    written[index_name] = write_whole_file(
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
    write_whole_file(storage, storage.join(directory, MANIFEST_NAME), manifest.to_json())


def _group(weight_map: Mapping[str, str]) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = {}
    for key, file_name in weight_map.items():
        grouped.setdefault(file_name, []).append(key)
    return grouped


def _remove_stale_shards(storage: Storage, directory: str, keep: set[str]) -> None:
    for name in storage.list_names(directory):
        if is_seed_shard_name(name) and name not in keep:
            storage.remove(storage.join(directory, name))


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


# ---- checkpoint management (a model directory with a ``checkpoints/`` folder) ------------------


def _checkpoints_root(model_dir: str) -> tuple[Storage, str]:
    root = normalize_location(model_dir)
    storage = storage_for(root)
    sub = storage.join(root, "checkpoints")
    return storage, (sub if "checkpoints" in storage.list_names(root) else root)


def find_latest_checkpoint(model_dir: str) -> str | None:
    """Path of the newest committed checkpoint in ``model_dir/checkpoints`` (or ``model_dir``)."""
    storage, root = _checkpoints_root(model_dir)
    info = latest_checkpoint(storage, root)
    return info.path if info else None


def next_checkpoint_path(model_dir: str, checkpoint_id: int | str) -> str:
    """``model_dir/checkpoints/checkpoint-<id>``: where the next checkpoint goes."""
    name = checkpoint_dir_name(checkpoint_id) if isinstance(checkpoint_id, int) else f"checkpoint-{checkpoint_id}"
    if is_local(model_dir):
        return os.path.join(model_dir, "checkpoints", name)
    return f"{model_dir.rstrip('/')}/checkpoints/{name}"


def maybe_delete_oldest_checkpoint(
    model_dir: str,
    max_checkpoints: int,
    best_checkpoint: str | None = None,
    preserved_checkpoints: list[str] | None = None,
) -> None:
    """Delete the oldest checkpoints beyond ``max_checkpoints``, keeping the best and preserved ones."""
    storage, root = _checkpoints_root(model_dir)
    keep = [p for p in [best_checkpoint, *(preserved_checkpoints or [])] if p]
    protect = {normalize_location(p) for p in keep}
    apply_retention(storage, root, max_checkpoints, protect)


def save_checkpoint_metrics(checkpoint_path: str, metrics: dict[str, float]) -> None:
    """Write ``metrics.json`` beside a checkpoint (atomically on local disk)."""
    path = normalize_location(checkpoint_path)
    storage = storage_for(path)
    storage.write_stream(storage.join(path, METRICS_NAME), [memoryview(json.dumps(metrics).encode())])


def load_checkpoint_metrics(checkpoint_path: str) -> dict[str, Any] | None:
    """Metrics saved with :func:`save_checkpoint_metrics`, else those recorded in the manifest."""
    path = normalize_location(checkpoint_path)
    storage = storage_for(path)
    try:
        return dict(json.loads(storage.read_bytes(storage.join(path, METRICS_NAME))))
    except FileNotFoundError:
        pass
    manifest = read_manifest(storage, path)
    return dict(manifest.metrics) if manifest is not None and manifest.metrics else None
