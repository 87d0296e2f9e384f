"""Forgather ``sharded_checkpoint``: its functional API, same names and signatures.

These functions save and load synchronously in the calling process; use
:class:`ckptd.Checkpointer` for asynchronous saves of whole training state.  What they write is
an HF-compatible sharded checkpoint (index + shards, Forgather's file names) plus a ckptd
manifest, written last, so :func:`validate_checkpoint` and ``verify=True`` loads can check every
byte.  Directories written by Forgather itself (its trainer's ``checkpoint_manifest.json`` has
another schema under the same name) are found, validated, rotated and loaded as Forgather does.

This module is longer than 450 lines on purpose: it mirrors ``forgather.ml.sharded_checkpoint``
name for name (and the private helpers Forgather's own tests import), so users change one import.
"""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import torch

from .._version import __version__
from ..catalog import is_linked_checkpoint, read_manifest, remove_checkpoint
from ..errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    KeyMismatchError,
)
from ..formats.json_files import read_small_json
from ..formats.manifest import ComponentRecord, FileRecord, Manifest, TensorRecord, utc_now
from ..formats.names import (
    LEGACY_METRICS_NAME,
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
from ..retention import legacy_references
from ..save.flatten import find_tied_groups
from ..save.layout import WriteItem, bucket_items, describe_tensors, plan_file
from ..save.tensor_files import write_safetensors_file, write_whole_file
from ..storage import (
    Storage,
    base_name,
    check_file_name,
    is_local,
    local_path,
    normalize_location,
    storage_for,
)

__all__ = [
    "CHECKPOINT_MANIFEST_FILENAME",
    "METRICS_NAME",
    "MODEL_EXCLUDED_MARKER",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "CheckpointMeta",
    "ShardIndex",
    "SharingMetadataT",
    "StateDictLike",
    "create_pretrained_symlinks",
    "create_sharing_metadata",
    "find_latest_checkpoint",
    "get_all_fqns",
    "get_checkpoint_metadata",
    "id_to_fqn",
    "index_file_name",
    "load_checkpoint",
    "load_checkpoint_metrics",
    "load_shard_index",
    "load_sharded_checkpoint",
    "make_cannonical_names",
    "make_shard_index",
    "map_cannonical_names",
    "maybe_delete_oldest_checkpoint",
    "next_checkpoint_path",
    "retie_parameters",
    "save_checkpoint",
    "save_checkpoint_metrics",
    "save_shard_index",
    "save_sharded_checkpoint",
    "validate_checkpoint",
    "validate_output_dir",
]

logger = logging.getLogger(__name__)

# HF / Forgather file names.
WEIGHTS_NAME = TORCH_BIN_SINGLE
WEIGHTS_INDEX_NAME = TORCH_BIN_INDEX
SAFE_WEIGHTS_NAME = SAFETENSORS_SINGLE
SAFE_WEIGHTS_INDEX_NAME = SAFETENSORS_INDEX
CHECKPOINT_MANIFEST_FILENAME = MANIFEST_NAME
#: Forgather's marker of a checkpoint that holds no model weights on purpose (they live elsewhere).
MODEL_EXCLUDED_MARKER = ".forgather_no_model_weights"

StateDictLike = torch.nn.Module | dict[str, torch.Tensor]
ShardIndex = dict[str, dict[str, Any]]
SharingMetadataT = list[list[str]]


@dataclass(frozen=True)
class CheckpointMeta:
    """What :func:`get_checkpoint_metadata` found: the file to open, and its kind."""

    file_name: str
    is_index: bool
    safetensors: bool


def id_to_fqn(module: torch.nn.Module) -> dict[int, set[str]]:
    """``{id(tensor): {names}}`` over the module's state and all its buffers; tied parameters
    share one entry."""
    mapping: dict[int, set[str]] = defaultdict(set)
    for name, value in module.state_dict(keep_vars=True).items():
        mapping[id(value)].add(name)
    for name, buffer in module.named_buffers(remove_duplicate=False):
        mapping[id(buffer)].add(name)
    return mapping


def get_all_fqns(module: torch.nn.Module) -> set[str]:
    """Every parameter and buffer name of ``module``, tied aliases and non-persistent buffers included."""
    names = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    return names | {name for name, _ in module.named_buffers(remove_duplicate=False)}


def make_cannonical_names(fqns: set[str], sharing_metadata: list[list[str]]) -> dict[str, list[str]]:
    """For each sharing group, one of its names present in ``fqns`` mapped to the others present.

    (Forgather's spelling of "canonical", kept so existing imports work.)
    """
    cnames: dict[str, list[str]] = {}
    for group in sharing_metadata:
        present = [name for name in dict.fromkeys(group) if name in fqns]
        if present:
            cnames[present[0]] = present[1:]
    return cnames


def map_cannonical_names(cnames: dict[str, list[str]]) -> dict[str, str]:
    """Invert :func:`make_cannonical_names`: ``{alias: canonical name}``."""
    return {alias: cname for cname, aliases in cnames.items() for alias in aliases}


def _resolve_state_dict(source: StateDictLike) -> dict[str, torch.Tensor]:
    """A module's ``state_dict()``, or the dict itself."""
    return source.state_dict() if isinstance(source, torch.nn.Module) else source


def _intersect_weight_map(weight_map: Mapping[str, str], state_dict: Mapping[str, Any]) -> set[str]:
    """Keys both in the weight map and in the state dict."""
    return set(weight_map) & set(state_dict)


def _make_shard_dictionaries(
    weight_map: Mapping[str, str], state_dict: Mapping[str, torch.Tensor]
) -> dict[str, dict[str, torch.Tensor]]:
    """``{file name: {key: tensor}}`` for the keys of ``state_dict`` the weight map places."""
    files: dict[str, dict[str, torch.Tensor]] = {}
    for key in _intersect_weight_map(weight_map, state_dict):
        files.setdefault(weight_map[key], {})[key] = state_dict[key]
    return files


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
    sharing = [list(g) for g in param_sharing_metadata or []]
    return _shard_index(state_dictionaries, metadata, safetensors, max_shard_size, sharing, sharing)


def _shard_index(
    state_dictionaries: list[dict[str, torch.Tensor]],
    metadata: dict[str, Any] | None,
    safetensors: bool,
    max_shard_size: int,
    sharing: list[list[str]],
    stored_once: list[list[str]],
) -> ShardIndex:
    """The index; ``sharing`` is recorded, the aliases of ``stored_once`` are left out."""
    limit = parse_size(max_shard_size, "max_shard_size")
    buckets: list[list[WriteItem]] = []
    total = 0
    for state in state_dictionaries:
        items = describe_tensors("model", _drop_aliases(_state_of(state), stored_once))
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
        index = read_small_json(storage, path, what="shard index")
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
    debug: bool = False,
    *,
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
    debug: bool = False,
    include_param_sharing: bool = True,
    param_sharing_metadata: SharingMetadataT | None = None,
    *,
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
    stored_once = _really_tied(state, sharing)
    index = _shard_index([state], metadata, safetensors, max_shard_size, sharing, stored_once)
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
            "model": ComponentRecord("safetensors" if safetensors else "torch_bin", tensors, index_name, stored_once)
        },
        files=written,
        metadata=dict(metadata or {}),
    )
    write_whole_file(storage, storage.join(directory, MANIFEST_NAME), manifest.to_json())


def _really_tied(state: Mapping[str, torch.Tensor], sharing: list[list[str]]) -> list[list[str]]:
    """The parts of the sharing groups whose tensors are one tensor: only those are stored once
    (explicit metadata naming two distinct tensors must not lose the second one's values)."""
    tied: list[list[str]] = []
    for group in sharing:
        present = {k: state[k] for k in dict.fromkeys(group) if k in state}
        tied.extend(find_tied_groups(present))
    return tied


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


def validate_checkpoint(checkpoint_path: str) -> bool:
    """True if ``checkpoint_path`` holds a complete checkpoint: a valid ckptd manifest whose files all have
    the recorded sizes, or HF weights (an index whose shards all exist with intact headers, or a
    single weights file), whatever other manifest sits beside them; or Forgather's marker of a
    checkpoint saved without model weights."""
    try:
        CheckpointReader.open(checkpoint_path).check_complete()
    except (OSError, ValueError, KeyError):
        storage, directory = _location(checkpoint_path)
        try:
            names = storage.list_names(directory)
        except OSError:
            return False
        weights = {SAFETENSORS_INDEX, SAFETENSORS_SINGLE, TORCH_BIN_INDEX, TORCH_BIN_SINGLE}
        return MODEL_EXCLUDED_MARKER in names and not weights.intersection(names)  # Forgather: no weights on purpose
    return True


# ---- checkpoint management (Forgather's rules, over a model directory with ``checkpoints/``) ---


def _is_dir(path: str) -> bool:
    """A local directory, or a remote prefix holding at least one object."""
    if is_local(path):
        return os.path.isdir(local_path(path))
    storage = storage_for(path)
    return bool(storage.list_names(normalize_location(path)))


def _join(directory: str, name: str) -> str:
    """``directory/name`` in the caller's spelling (Forgather returns ``os.path.join`` paths)."""
    return os.path.join(directory, name) if is_local(directory) else f"{directory.rstrip('/')}/{name}"


def _candidates(checkpoints_dir: str) -> list[str]:
    """``checkpoints_dir/checkpoint-*``: Forgather's glob (hidden staging names never match),
    without the entries that are symlinks (unlike Forgather: a link is not one of the directory's
    checkpoints, so it is never the latest, never counted by rotation, never deleted through)."""
    storage = storage_for(checkpoints_dir)
    location = normalize_location(checkpoints_dir)
    try:
        names = storage.list_names(location)
    except FileNotFoundError:
        return []
    return [
        _join(checkpoints_dir, n)
        for n in sorted(names)
        if n.startswith("checkpoint-") and not is_linked_checkpoint(storage, storage.join(location, n))
    ]


def _get_checkpoint_timestamp(checkpoint_path: str) -> float:
    """When a checkpoint was made, in epoch seconds: the manifest's time (Forgather's
    ``timestamp`` or ckptd's ``created_utc``; stable across copies), else the directory mtime."""
    storage = storage_for(checkpoint_path)
    path = normalize_location(checkpoint_path)
    try:
        body = read_small_json(storage, storage.join(path, MANIFEST_NAME), what="manifest", allow_constants=True)
        stamp = body["timestamp"] if "timestamp" in body else body["created_utc"]  # Forgather's, else ckptd's
        return datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        logger.warning("%s: cannot read a timestamp from %s (%s); using the directory mtime", path, MANIFEST_NAME, e)
    if is_local(path):
        return os.path.getmtime(local_path(path))
    return 0.0


def _checkpoint_sort_key(checkpoint_path: str) -> tuple[float, int]:
    """Oldest first: by timestamp, ties broken by the number after ``checkpoint-``."""
    name = base_name(normalize_location(checkpoint_path))
    try:
        number = int(name.split("checkpoint-", 1)[-1])
    except ValueError:
        number = 0
    return (_get_checkpoint_timestamp(checkpoint_path), number)


def find_latest_checkpoint(model_dir: str) -> str | None:
    """The newest valid checkpoint of ``model_dir`` (Forgather's rule), or None.

    With a ``checkpoints/`` folder: the valid ``checkpoints/checkpoint-*`` with the latest
    manifest timestamp (else mtime), ties broken by step.  Without one: ``model_dir`` itself if
    it holds weights; else (a :class:`ckptd.Checkpointer` root) its newest ``checkpoint-*``.
    """
    checkpoints_dir = _join(model_dir, "checkpoints")
    if not _is_dir(checkpoints_dir):
        if validate_checkpoint(model_dir):
            return model_dir
        checkpoints_dir = model_dir
    valid = [p for p in _candidates(checkpoints_dir) if validate_checkpoint(p)]
    if not valid:
        return None
    return max(valid, key=_checkpoint_sort_key)


def next_checkpoint_path(model_dir: str, checkpoint_id: int | str) -> str:
    """``model_dir/checkpoints/checkpoint-<id>`` (``checkpoint-1000`` for step 1000)."""
    name = f"checkpoint-{checkpoint_id}"
    if is_local(model_dir):
        return os.path.join(model_dir, "checkpoints", name)
    return f"{model_dir.rstrip('/')}/checkpoints/{name}"


def maybe_delete_oldest_checkpoint(
    model_dir: str,
    max_checkpoints: int,
    best_checkpoint: str | None = None,
    preserved_checkpoints: list[str] | None = None,
) -> None:
    """Keep at most ``max_checkpoints`` under ``model_dir/checkpoints`` (Forgather's rule).

    Counts every ``checkpoint-*`` entry; deletes ``count - max_checkpoints`` of the oldest
    (manifest timestamp, else mtime; ties by step), never ``best_checkpoint`` nor
    ``preserved_checkpoints``, so fewer go when preserved ones are among the oldest.  Without a
    ``checkpoints/`` folder it does nothing.  A ckptd checkpoint is deleted manifest first, and
    one whose files a kept incremental ckptd checkpoint of an older version references is kept
    (with a warning).
    """
    checkpoints = _candidates(_join(model_dir, "checkpoints"))
    if len(checkpoints) <= max_checkpoints:
        return
    preserved = {normalize_location(p) for p in [*(preserved_checkpoints or []), best_checkpoint] if p}
    candidates = [p for p in checkpoints if normalize_location(p) not in preserved]
    count = min(len(checkpoints) - max_checkpoints, len(candidates))
    if count <= 0:
        return
    candidates.sort(key=_checkpoint_sort_key)
    doomed = candidates[:count]
    referenced = _referenced_by(set(checkpoints) - set(doomed))
    for path in doomed:
        if base_name(path) in referenced:  # a kept incremental ckptd save reads files from it
            logger.warning("keeping checkpoint %s: newer incremental checkpoints reference its files", path)
            continue
        logger.info("deleting checkpoint %s (keeping %d; preserved: %s)", path, max_checkpoints, sorted(preserved))
        remove_checkpoint(storage_for(path), normalize_location(path))


def _referenced_by(paths: set[str]) -> set[str]:
    """Names of sibling checkpoints whose files the ckptd manifests of ``paths`` reference
    (manifests of older ckptd versions' incremental saves only)."""
    manifests = (read_manifest(storage_for(path), normalize_location(path)) for path in paths)
    return legacy_references(m for m in manifests if m is not None)


def save_checkpoint_metrics(checkpoint_path: str, metrics: dict[str, float]) -> None:
    """Write ``eval_metrics.json`` into ``checkpoint_path`` (created if missing; atomic locally)."""
    path = normalize_location(checkpoint_path)
    storage = storage_for(path)
    storage.makedirs(path)
    body = json.dumps(metrics, indent=2).encode()
    storage.write_stream(storage.join(path, METRICS_NAME), [memoryview(body)])


def load_checkpoint_metrics(checkpoint_path: str) -> dict[str, Any] | None:
    """Metrics saved with :func:`save_checkpoint_metrics` (``eval_metrics.json``; the
    ``metrics.json`` of older ckptd versions), else those a ckptd manifest records, else None."""
    path = normalize_location(checkpoint_path)
    storage = storage_for(path)
    for name in (METRICS_NAME, LEGACY_METRICS_NAME):
        try:
            return dict(read_small_json(storage, storage.join(path, name), what="metrics", allow_constants=True))
        except (FileNotFoundError, NotADirectoryError):
            continue
    manifest = read_manifest(storage, path)
    return dict(manifest.metrics) if manifest is not None and manifest.metrics else None


def validate_output_dir(output_dir: str, overwrite: bool = False) -> None:
    """Refuse to write a model where one exists: raises unless ``overwrite`` (then warns)."""
    if is_local(output_dir) and os.path.exists(local_path(output_dir)) and not os.path.isdir(local_path(output_dir)):
        raise ConfigError(f"{output_dir} exists and is not a directory; choose another output directory")
    if get_checkpoint_metadata(output_dir) is None:
        return
    if not overwrite:
        raise CheckpointExistsError(
            f"a checkpoint already exists in {output_dir}; pass overwrite=True to replace it or write elsewhere"
        )
    logger.warning("a checkpoint exists in %s and may be overwritten", output_dir)


def create_pretrained_symlinks(model_dir: str, force_overwrite: bool = False, dry_run: bool = False) -> list[str]:
    """Link the latest checkpoint's weight files (index and shards, or the single file) into
    ``model_dir`` with relative symlinks, so ``from_pretrained(model_dir)`` loads them.

    Existing symlinks are replaced; a real file is replaced only with ``force_overwrite``
    (else :class:`CheckpointExistsError`).  ``dry_run`` only logs.  Returns the link paths.
    Local directories only.
    """
    if not is_local(model_dir):
        raise ConfigError(f"{model_dir}: symlinks need a local model directory")
    model_dir = local_path(model_dir)
    latest = find_latest_checkpoint(model_dir)
    if not latest:
        raise CheckpointNotFoundError(f"no valid checkpoint in {model_dir}")
    meta = get_checkpoint_metadata(latest)
    if meta is None:
        raise CheckpointNotFoundError(f"{latest}: no weights file or index to link")
    files = [meta.file_name]
    if meta.is_index:
        for shard in sorted(set(load_shard_index(latest, meta.file_name)["weight_map"].values())):
            if os.path.exists(os.path.join(latest, shard)):
                files.append(shard)
            else:
                logger.warning("%s: the index names %s but it is missing", latest, shard)
    links = []
    for name in files:
        link = os.path.join(model_dir, name)
        target = os.path.relpath(os.path.join(latest, name), model_dir)
        if os.path.lexists(link):
            if not os.path.islink(link) and not force_overwrite:
                raise CheckpointExistsError(
                    f"{link} exists and is not a symlink; pass force_overwrite=True to replace it"
                )
            if dry_run:
                logger.info("dry run: would replace %s with a symlink to %s", link, target)
            else:
                os.unlink(link)
        if dry_run:
            logger.info("dry run: would link %s -> %s", link, target)
        else:
            os.symlink(target, link)
            logger.info("linked %s -> %s", link, target)
        links.append(link)
    return links
