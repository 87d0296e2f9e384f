"""ckptd: asynchronous, crash-safe, HF-compatible checkpoints for PyTorch training.

Public names are imported lazily, so ``import ckptd`` (and the torch-free writer process, which
lives in this package) stays cheap until a name is used.

``__all__`` lists ckptd's own API.  The seed-compatible names (Forgather ``sharded_checkpoint``,
ModelOpt ``sharded_checkpoint_utils``, Megatron ``dist_checkpointing``) live in
:mod:`ckptd.compat` and stay importable from here for existing users (``ckptd.save_checkpoint``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

__all__ = [
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointPolicy",
    "CheckpointReader",
    "Checkpointer",
    "CheckpointerOptions",
    "HeldRoot",
    "LoadSource",
    "PeerRestore",
    "PeerSnapshots",
    "PromotionResult",
    "RNGState",
    "SaveRequest",
    "SaveResult",
    "ShardedTensor",
    "Sharing",
    "Tier",
    "__version__",
    "consolidate",
    "convert",
    "create_sharing_metadata",
    "drop_held",
    "errors",
    "export_hf",
    "get_param_id_to_sharded_param_map",
    "held_roots",
    "load_tensors_metadata",
    "optim_state_to_sharding_state",
    "retie_parameters",
    "save_stats",
    "validate_sharding",
]

# ckptd's own names: where each lives.
_CORE = {
    "Checkpointer": "checkpointer",
    "CheckpointerOptions": "options",
    "CheckpointInfo": "catalog",
    "CheckpointManager": "manager",
    "CheckpointPolicy": "manager",
    "CheckpointReader": "load.reader",
    "HeldRoot": "writer.keeper",
    "drop_held": "writer.keeper",
    "held_roots": "writer.keeper",
    "LoadSource": "tiers",
    "PromotionResult": "tiers",
    "PeerRestore": "replicas",
    "PeerSnapshots": "replicas",
    "RNGState": "rng",
    "SaveRequest": "request",
    "SaveResult": "request",
    "ShardedTensor": "dist.sharding",
    "Sharing": "dist.group",
    "Tier": "tiers",
    "consolidate": "tools.consolidate",
    "convert": "tools.convert",
    "export_hf": "tools.convert",
    "create_sharing_metadata": "load.assign",
    "get_param_id_to_sharded_param_map": "dist.optim",
    "load_tensors_metadata": "compat.megatron",
    "optim_state_to_sharding_state": "dist.optim",
    "retie_parameters": "load.assign",
    "save_stats": "stats",
    "validate_sharding": "dist.coverage",
}

# Seed-compatible names, kept importable from the top level (not in ``__all__``).
_COMPAT = {
    "CHECKPOINT_MANIFEST_FILENAME": "compat.forgather",
    "CheckpointMeta": "compat.forgather",
    "LocalNonpersistentObject": "compat.megatron",
    "MODEL_EXCLUDED_MARKER": "compat.forgather",
    "SAFE_WEIGHTS_INDEX_NAME": "compat.forgather",
    "SAFE_WEIGHTS_NAME": "compat.forgather",
    "ShardedObject": "compat.megatron",
    "ShardedTensorFactory": "compat.megatron",
    "TensorInfo": "compat.megatron",
    "WEIGHTS_INDEX_NAME": "compat.forgather",
    "WEIGHTS_NAME": "compat.forgather",
    "create_pretrained_symlinks": "compat.forgather",
    "find_latest_checkpoint": "compat.forgather",
    "get_all_fqns": "compat.forgather",
    "get_checkpoint_metadata": "compat.forgather",
    "id_to_fqn": "compat.forgather",
    "index_file_name": "compat.forgather",
    "is_in_safetensors_format": "compat.modelopt",
    "load_checkpoint": "compat.forgather",
    "load_checkpoint_metrics": "compat.forgather",
    "load_common_state_dict": "compat.megatron",
    "load_plain_tensors": "compat.megatron",
    "load_shard_index": "compat.forgather",
    "load_sharded_checkpoint": "compat.forgather",
    "load_sharded_metadata": "compat.megatron",
    "load_sharded_state_dict": "compat.modelopt",
    "load_state_dict_to_shards": "compat.modelopt",
    "make_cannonical_names": "compat.forgather",
    "make_shard_index": "compat.forgather",
    "map_cannonical_names": "compat.forgather",
    "maybe_delete_oldest_checkpoint": "compat.forgather",
    "next_checkpoint_path": "compat.forgather",
    "save_checkpoint": "compat.forgather",
    "save_checkpoint_metrics": "compat.forgather",
    "save_shard_index": "compat.forgather",
    "save_sharded_checkpoint": "compat.forgather",
    "save_sharded_model": "compat.modelopt",
    "set_submodule": "compat.modelopt",
    "validate_checkpoint": "compat.forgather",
    "validate_output_dir": "compat.forgather",
    "validate_sharding_integrity": "compat.megatron",
}

_WHERE = {**_CORE, **_COMPAT}

if TYPE_CHECKING:
    from . import errors
    from .catalog import CheckpointInfo
    from .checkpointer import Checkpointer
    from .compat.forgather import (
        CHECKPOINT_MANIFEST_FILENAME,
        MODEL_EXCLUDED_MARKER,
        SAFE_WEIGHTS_INDEX_NAME,
        SAFE_WEIGHTS_NAME,
        WEIGHTS_INDEX_NAME,
        WEIGHTS_NAME,
        CheckpointMeta,
        create_pretrained_symlinks,
        find_latest_checkpoint,
        get_all_fqns,
        get_checkpoint_metadata,
        id_to_fqn,
        index_file_name,
        load_checkpoint,
        load_checkpoint_metrics,
        load_shard_index,
        load_sharded_checkpoint,
        make_cannonical_names,
        make_shard_index,
        map_cannonical_names,
        maybe_delete_oldest_checkpoint,
        next_checkpoint_path,
        save_checkpoint,
        save_checkpoint_metrics,
        save_shard_index,
        save_sharded_checkpoint,
        validate_checkpoint,
        validate_output_dir,
    )
    from .compat.megatron import (
        LocalNonpersistentObject,
        ShardedObject,
        ShardedTensorFactory,
        TensorInfo,
        load_common_state_dict,
        load_plain_tensors,
        load_sharded_metadata,
        load_tensors_metadata,
        validate_sharding_integrity,
    )
    from .compat.modelopt import (
        is_in_safetensors_format,
        load_sharded_state_dict,
        load_state_dict_to_shards,
        save_sharded_model,
        set_submodule,
    )
    from .dist.coverage import validate_sharding
    from .dist.group import Sharing
    from .dist.optim import get_param_id_to_sharded_param_map, optim_state_to_sharding_state
    from .dist.sharding import ShardedTensor
    from .load.assign import create_sharing_metadata, retie_parameters
    from .load.reader import CheckpointReader
    from .manager import CheckpointManager, CheckpointPolicy
    from .options import CheckpointerOptions
    from .replicas import PeerRestore, PeerSnapshots
    from .request import SaveRequest, SaveResult
    from .rng import RNGState
    from .stats import save_stats
    from .tiers import LoadSource, PromotionResult, Tier
    from .tools.consolidate import consolidate
    from .tools.convert import convert, export_hf
    from .writer.keeper import HeldRoot, drop_held, held_roots


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
    return sorted({*__all__, *_COMPAT})
