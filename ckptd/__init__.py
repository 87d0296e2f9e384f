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
    "CheckpointInfo": "manager",
    "CheckpointMeta": "api",
    "CheckpointReader": "loader",
    "RNGState": "rng",
    "SaveRequest": "request",
    "SaveResult": "request",
    "ShardedTensor": "sharding",
    "Sharing": "dist",
    "TensorInfo": "api",
    "consolidate": "consolidation",
    "load_tensors_metadata": "api",
    "validate_sharding": "sharding",
    "get_param_id_to_sharded_param_map": "optim",
    "optim_state_to_sharding_state": "optim",
    "create_sharing_metadata": "restore",
    "find_latest_checkpoint": "manager",
    "get_checkpoint_metadata": "api",
    "index_file_name": "api",
    "is_in_safetensors_format": "api",
    "load_checkpoint": "api",
    "load_checkpoint_metrics": "manager",
    "load_shard_index": "api",
    "load_sharded_checkpoint": "api",
    "load_sharded_state_dict": "api",
    "make_shard_index": "api",
    "maybe_delete_oldest_checkpoint": "manager",
    "next_checkpoint_path": "manager",
    "retie_parameters": "restore",
    "save_checkpoint": "api",
    "save_checkpoint_metrics": "manager",
    "save_shard_index": "api",
    "save_sharded_checkpoint": "api",
    "save_sharded_model": "api",
    "validate_checkpoint": "api",
}

if TYPE_CHECKING:
    from . import errors
    from .api import (
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
    from .checkpointer import Checkpointer
    from .consolidation import consolidate
    from .dist import Sharing
    from .loader import CheckpointReader
    from .manager import (
        CheckpointInfo,
        find_latest_checkpoint,
        load_checkpoint_metrics,
        maybe_delete_oldest_checkpoint,
        next_checkpoint_path,
        save_checkpoint_metrics,
    )
    from .optim import get_param_id_to_sharded_param_map, optim_state_to_sharding_state
    from .request import SaveRequest, SaveResult
    from .restore import create_sharing_metadata, retie_parameters
    from .rng import RNGState
    from .sharding import ShardedTensor, validate_sharding


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
