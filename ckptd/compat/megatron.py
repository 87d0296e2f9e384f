"""Megatron-Core ``dist_checkpointing``: the names ckptd shares with it.

``load_tensors_metadata`` gives every tensor's global shape and dtype without reading data;
``ShardedTensor`` (with ``from_rank_offsets``), ``validate_sharding`` and the optimizer-state
helpers live in :mod:`ckptd.dist` and are re-exported here under Megatron's module.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from ..dist.optim import get_param_id_to_sharded_param_map, optim_state_to_sharding_state
from ..dist.sharding import ShardedTensor, validate_sharding
from ..formats.safetensors import dtype_from_name
from ..load.dcp import read_dcp_layout
from ..load.reader import CheckpointReader

__all__ = [
    "ShardedTensor",
    "TensorInfo",
    "get_param_id_to_sharded_param_map",
    "load_tensors_metadata",
    "optim_state_to_sharding_state",
    "validate_sharding",
]


@dataclass(frozen=True)
class TensorInfo:
    """A stored tensor's dtype and global shape (what :func:`load_tensors_metadata` returns)."""

    dtype: torch.dtype
    shape: tuple[int, ...]


def load_tensors_metadata(
    path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> dict[str, dict[str, TensorInfo]]:
    """Global shapes and dtypes of every tensor, per component, without reading tensor data
    (ckptd: from the manifest; HF checkpoints: from the shard headers; DCP and Megatron
    ``torch_dist`` checkpoints: from torch's ``.metadata``)."""
    reader = CheckpointReader.open(path, storage_options)
    if reader.kind == "dcp":  # Megatron torch_dist / PyTorch DCP: shapes from torch's metadata
        layout = read_dcp_layout(reader.directory, local=reader.storage.local, storage_options=storage_options)
        return {
            component: {key: TensorInfo(layout.dtypes[fqn], layout.shapes[fqn]) for key, fqn in fqns.items()}
            for component, fqns in layout.components.items()
        }
    out: dict[str, dict[str, TensorInfo]] = {}
    for component in reader.components():
        records = reader.locate(component) if reader.kind != "torch_bin_sharded" else {}
        aliases = {k: a for group in reader.tied_groups(component) for k in group[1:] for a in group[:1]}
        infos = {key: TensorInfo(dtype_from_name(r.dtype), tuple(r.shape)) for key, r in records.items()}
        infos.update({alias: infos[stored] for alias, stored in aliases.items() if stored in infos})
        out[component] = infos
    return out
