"""Reading the checkpoints :func:`ckptd.compat.megatron.load` accepts, and which one a
directory is: ckptd's own Megatron-style save (a ckptd checkpoint with ``common``, ``sharded``
and ``sharded_objects`` components), Megatron's ``torch_dist`` (``metadata.json``,
``common.pt``, torch DCP files: read by torch's own DCP reader, its ``.metadata`` through
:mod:`ckptd.load.dcp_metadata`'s allowlist) and Megatron with ckptd's
``SaveStrategy`` (``metadata.json``, ``common.pt`` and ckptd's sharded part in ``ckptd/``).
``common.pt`` and DCP's pickled entries are decoded with ``torch.load(weights_only=True)`` only.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import pickle
import types
from dataclasses import dataclass
from typing import Any

import torch

from ..dist.sharding import ShardedTensor
from ..errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError, UnsafeCheckpointError
from ..formats.json_files import parse_json
from ..formats.torch_dtypes import dtype_from_name
from ..load.assign import read_components
from ..load.reader import CheckpointReader
from ..storage import is_local
from .megatron_mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    apply_factories,
    apply_factory_merges,
    is_sharded,
    leaves,
    map_leaves,
    prune,
)

__all__ = [
    "CKPTD_BACKEND",
    "CKPTD_SUBDIR",
    "COMMON_FILE",
    "MEGATRON_CONFIG",
    "MegatronCheckpoint",
    "TensorInfo",
    "load_sharded_parts",
    "megatron_backend",
    "open_megatron_checkpoint",
    "tensor_infos",
]

COMPONENTS = ("common", "sharded", "sharded_objects")
_COMMON, _SHARDED, _OBJECTS = COMPONENTS


@dataclass(frozen=True)
class TensorInfo:
    """A stored tensor's dtype and global shape (what :func:`load_tensors_metadata` returns)."""

    dtype: torch.dtype
    shape: tuple[int, ...]


MEGATRON_CONFIG = "metadata.json"  # Megatron's record of the backends, written last
COMMON_FILE = "common.pt"  # Megatron's non-sharded state (torch.save)
CKPTD_BACKEND = "ckptd"  # sharded_backend of checkpoints written through SaveStrategy
CKPTD_SUBDIR = "ckptd"  # where SaveStrategy commits the sharded part inside checkpoint_dir


def megatron_backend(checkpoint_dir: str | os.PathLike[str]) -> str | None:
    """``sharded_backend`` of a directory written by Megatron's ``dist_checkpointing.save``
    (``torch_dist``; ``ckptd`` through :class:`SaveStrategy`), None for other directories."""
    path = os.path.join(os.fspath(checkpoint_dir), MEGATRON_CONFIG)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        config = parse_json(f.read(), path, "Megatron checkpoint config")
    backend = config.get("sharded_backend") if isinstance(config, dict) else None
    if not isinstance(backend, str):
        raise CorruptCheckpointError(f"{path}: no 'sharded_backend' string; not a Megatron checkpoint config")
    return backend


class MegatronCheckpoint:
    """A checkpoint ``load`` can read: ckptd's own (``save`` above), Megatron ``torch_dist`` (DCP
    files + ``common.pt``, read by torch's DCP reader) or Megatron with ckptd's strategy
    (``common.pt`` + ckptd's sharded part in ``ckptd/``)."""

    def __init__(self, checkpoint_dir: str | os.PathLike[str]) -> None:
        directory = os.fspath(checkpoint_dir)
        self.backend = megatron_backend(directory) if is_local(directory) else None
        if self.backend is None:
            self.reader = CheckpointReader.open(directory, require_manifest=True)
            if _COMMON not in self.reader.state_trees() and _SHARDED not in self.reader.components():
                raise CheckpointNotFoundError(
                    f"{self.reader.directory}: not written by ckptd.compat.megatron.save (no {_COMMON!r} component) "
                    f"nor by Megatron (no {MEGATRON_CONFIG}); load it with ckptd.Checkpointer.load"
                )
            self.tensors = _SHARDED
        elif self.backend == CKPTD_BACKEND:
            self.reader = CheckpointReader.open(os.path.join(directory, CKPTD_SUBDIR), require_manifest=True)
            self.tensors = _SHARDED
        elif self.backend == "torch_dist":
            self.reader = CheckpointReader.open(directory)
            if self.reader.kind != "dcp":
                raise CorruptCheckpointError(f"{directory}: metadata.json says torch_dist but there is no .metadata")
            self.tensors = "model"
        else:
            raise ConfigError(
                f"{directory}: Megatron sharded backend {self.backend!r} is not readable by ckptd "
                "(torch_dist and ckptd are); convert it with Megatron first"
            )
        self.directory = directory
        self._objects: dict[str, Any] | None = None

    def tensor_keys(self) -> list[str]:
        return self.reader.keys(self.tensors) if self.tensors in self.reader.components() else []

    def common(self) -> dict[str, Any]:
        if self.backend is None:
            trees = self.reader.state_trees()
            return dict(read_components(self.reader, [_COMMON])[_COMMON]) if _COMMON in trees else {}
        return _load_common_file(os.path.join(self.directory, COMMON_FILE))

    def object_keys(self) -> list[str]:
        if self.backend == "torch_dist":
            return [fqn for fqn in self.reader.dcp_layout().skipped if "/shard_" in fqn]
        return list(self.objects())

    def objects(self, wanted: list[str] | None = None) -> dict[str, Any]:
        """Stored sharded objects' data by unique key."""
        if self.backend == "torch_dist":  # Megatron: torch.save([data]) per piece, as DCP bytes
            keys = self.object_keys() if wanted is None else [k for k in wanted if k in set(self.object_keys())]
            read = self.reader.read_dcp_objects(keys)
            return {k: v[0] if isinstance(v, list) and v else v for k, v in read.items()}
        if self._objects is None:
            names = [n for n in self.reader.state_trees() if n == _OBJECTS or n.startswith(f"{_OBJECTS}@")]
            found: dict[str, Any] = {}
            for name in names:
                found.update(read_components(self.reader, [name])[name] or {})
            self._objects = {k: v["data"] for k, v in found.items()}
        return self._objects


_COMMON_SAFE_CLASSES = [argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath]


def _load_common_file(path: str) -> dict[str, Any]:
    """Megatron's ``common.pt`` with ``torch.load(weights_only=True)`` (never arbitrary pickle);
    ``argparse.Namespace``, ``types.SimpleNamespace`` and ``pathlib.PosixPath`` are allowed too:
    Megatron-LM keeps its ``args`` there (Megatron registers the same classes)."""
    if not os.path.isfile(path):
        return {}
    try:
        # only the classes not allowed yet: the context manager removes what it was given on exit,
        # and must not take away what Megatron registered for the whole process
        allowed = set(map(id, torch.serialization.get_safe_globals()))
        with torch.serialization.safe_globals([c for c in _COMMON_SAFE_CLASSES if id(c) not in allowed]):
            loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"{path}: holds objects that torch.load(weights_only=True) refuses ({e}); ckptd does not unpickle "
            "arbitrary objects: keep the common state to plain values, or load it with Megatron"
        ) from e
    except Exception as e:  # truncated zip, bad magic...
        raise CorruptCheckpointError(f"{path}: cannot read Megatron's common state ({type(e).__name__}: {e})") from e
    if not isinstance(loaded, dict):
        raise CorruptCheckpointError(f"{path}: expected a dict, found a {type(loaded).__name__}")
    return loaded


def tensor_infos(opened: MegatronCheckpoint) -> dict[str, TensorInfo]:
    if opened.reader.kind == "dcp":
        layout = opened.reader.dcp_layout()
        fqns = layout.components.get(opened.tensors, {})
        return {key: TensorInfo(layout.dtypes[fqn], layout.shapes[fqn]) for key, fqn in fqns.items()}
    records = opened.reader.locate(opened.tensors) if opened.tensor_keys() else {}
    return {key: TensorInfo(dtype_from_name(r.dtype), tuple(r.shape)) for key, r in records.items()}


def load_sharded_parts(opened: MegatronCheckpoint, sharded_state_dict: dict[str, Any]) -> Any:
    """The sharded part of ``load``: the tree of ``sharded_state_dict`` with every sharded leaf
    replaced by its loaded value (plain leaves dropped)."""
    built = apply_factories(sharded_state_dict)
    pieces = [leaf for leaf in leaves(built) if isinstance(leaf, ShardedTensor)]
    for piece in pieces:
        piece.init_data()
    rounds: list[dict[str, ShardedTensor]] = []  # a key asked for twice (two pieces) is read once per piece
    for piece in pieces:
        free = next((r for r in rounds if piece.key not in r), None)
        if free is None:
            rounds.append(free := {})
        free[piece.key] = piece
    for targets in rounds:
        opened.reader.read(opened.tensors, list(targets), targets=targets)
    wanted = [leaf.unique_key for leaf in leaves(built) if isinstance(leaf, ShardedObject)]
    objects = opened.objects(wanted) if wanted else {}

    def value(leaf: Any) -> Any:
        if isinstance(leaf, ShardedTensor):
            return leaf.data
        if isinstance(leaf, LocalNonpersistentObject):
            return leaf.unwrap()
        if isinstance(leaf, ShardedObject):
            if leaf.unique_key not in objects:
                raise CheckpointNotFoundError(f"{opened.directory}: no sharded object {leaf.unique_key!r}")
            return objects[leaf.unique_key]
        return leaf

    only_sharded = prune(built, lambda leaf: not is_sharded(leaf))  # plain values come from the checkpoint
    return apply_factory_merges(map_leaves(only_sharded, value), sharded_state_dict)


def open_megatron_checkpoint(checkpoint_dir: str | os.PathLike[str]) -> MegatronCheckpoint:
    """The checkpoint in ``checkpoint_dir``, whichever of the three kinds it is."""
    return MegatronCheckpoint(checkpoint_dir)
