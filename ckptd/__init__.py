"""ckptd: asynchronous, crash-safe, HF-compatible checkpoints for PyTorch training.

Public names are imported lazily, so ``import ckptd`` (and the torch-free writer process, which
lives in this package) stays cheap until a name is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

__all__ = [
    "CheckpointInfo",
    "CheckpointMeta",
    "CheckpointReader",
    "Checkpointer",
    "CheckpointerOptions",
    "RNGState",
    "SaveRequest",
    "SaveResult",
    "ShardedTensor",
    "Sharing",
    "TensorInfo",
    "__version__",
    "consolidate",
    "create_sharing_metadata",
    "errors",
    "find_latest_checkpoint",
    "get_param_id_to_sharded_param_map",
    "get_checkpoint_metadata",
    "index_file_name",
    "is_in_safetensors_format",
    "load_checkpoint",
    "load_checkpoint_metrics",
    "load_shard_index",
    "load_sharded_checkpoint",
    "load_sharded_state_dict",
    "load_tensors_metadata",
    "make_shard_index",
    "maybe_delete_oldest_checkpoint",
    "next_checkpoint_path",
    "optim_state_to_sharding_state",
    "retie_parameters",
    "save_checkpoint",
    "save_checkpoint_metrics",
    "save_shard_index",
    "save_sharded_checkpoint",
    "save_sharded_model",
    "validate_checkpoint",
    "validate_sharding",
]

_WHERE = {
    "Checkpointer": "checkpointer",
    "CheckpointerOptions": "options",
    "CheckpointInfo": "catalog",
    "CheckpointMeta": "compat.forgather",
    "CheckpointReader": "load.reader",
    "RNGState": "rng",
    "SaveRequest": "request",
    "SaveResult": "request",
    "ShardedTensor": "dist.sharding",
    "Sharing": "dist.group",
    "TensorInfo": "compat.forgather",
    "consolidate": "tools.consolidate",
    "load_tensors_metadata": "compat.forgather",
    "validate_sharding": "dist.sharding",
    "get_param_id_to_sharded_param_map": "dist.optim",
    "optim_state_to_sharding_state": "dist.optim",
    "create_sharing_metadata": "load.assign",
    "find_latest_checkpoint": "catalog",
    "get_checkpoint_metadata": "compat.forgather",
    "index_file_name": "compat.forgather",
    "is_in_safetensors_format": "compat.forgather",
    "load_checkpoint": "compat.forgather",
    "load_checkpoint_metrics": "catalog",
    "load_shard_index": "compat.forgather",
    "load_sharded_checkpoint": "compat.forgather",
    "load_sharded_state_dict": "compat.forgather",
    "make_shard_index": "compat.forgather",
    "maybe_delete_oldest_checkpoint": "catalog",
    "next_checkpoint_path": "catalog",
    "retie_parameters": "load.assign",
    "save_checkpoint": "compat.forgather",
    "save_checkpoint_metrics": "catalog",
    "save_shard_index": "compat.forgather",
    "save_sharded_checkpoint": "compat.forgather",
    "save_sharded_model": "compat.forgather",
    "validate_checkpoint": "compat.forgather",
}

if TYPE_CHECKING:
    from . import errors
    from .catalog import (
        CheckpointInfo,
        find_latest_checkpoint,
        load_checkpoint_metrics,
        maybe_delete_oldest_checkpoint,
        next_checkpoint_path,
        save_checkpoint_metrics,
    )
    from .checkpointer import Checkpointer
    from .options import CheckpointerOptions
    from .compat.forgather import (
        CheckpointMeta,
        TensorInfo,
        get_checkpoint_metadata,
        index_file_name,
        is_in_safetensors_format,
        load_checkpoint,
        load_shard_index,
        load_sharded_checkpoint,
        load_sharded_state_dict,
        load_tensors_metadata,
        make_shard_index,
        save_checkpoint,
        save_shard_index,
        save_sharded_checkpoint,
        save_sharded_model,
        validate_checkpoint,
    )
    from .dist.group import Sharing
    from .dist.optim import get_param_id_to_sharded_param_map, optim_state_to_sharding_state
    from .dist.sharding import ShardedTensor, validate_sharding
    from .load.assign import create_sharing_metadata, retie_parameters
    from .load.reader import CheckpointReader
    from .request import SaveRequest, SaveResult
    from .rng import RNGState
    from .tools.consolidate import consolidate


def __getattr__(name: str) -> Any:
    if name == "errors":
        return importlib.import_module(".errors", __name__)
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptd' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
