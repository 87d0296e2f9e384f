"""Optimizer state that follows its parameters' sharding (Megatron's idea, same names).

For frameworks without DTensor, a model's sharded state dict holds :class:`ShardedTensor` pieces;
:func:`optim_state_to_sharding_state` wraps each per-parameter optimizer tensor (Adam's moments)
in a :class:`ShardedTensor` with the same global shape, offset and replica id as its parameter,
keyed by the parameter's key, so the optimizer state saved at N ranks loads at M ranks.
(DTensor optimizers — FSDP2 — need none of this: their state tensors are DTensors already.)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .sharding import ShardedTensor

__all__ = ["get_param_id_to_sharded_param_map", "optim_state_to_sharding_state"]


def get_param_id_to_sharded_param_map(
    model_sharded_state_dict: Mapping[str, Any], optim_params_iter: Iterable[torch.Tensor]
) -> dict[int, ShardedTensor]:
    """Map the optimizer's parameter ids (0, 1, ... in ``param_groups`` order) to the model's
    :class:`ShardedTensor` wrapping each parameter (matched by identity of the local data)."""
    by_storage: dict[tuple[int, int, tuple[int, ...]], ShardedTensor] = {}

    def walk(value: Any) -> None:
        if isinstance(value, ShardedTensor) and value.data is not None:
            identity = (
                value.data.untyped_storage().data_ptr(),
                int(value.data.storage_offset()),
                tuple(value.data.shape),
            )
            by_storage[identity] = value
        elif isinstance(value, Mapping):
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk(model_sharded_state_dict)
    mapping: dict[int, ShardedTensor] = {}
    for index, param in enumerate(optim_params_iter):
        identity = (param.untyped_storage().data_ptr(), int(param.storage_offset()), tuple(param.shape))
        if identity in by_storage:
            mapping[index] = by_storage[identity]
    return mapping


def optim_state_to_sharding_state(
    optim_state_dict: dict[str, Any],
    id_to_sharded_param_map: Mapping[int, ShardedTensor],
    exclude_keys: Iterable[str] = (),
    prefix: str = "optimizer.state",
) -> None:
    """Wrap, in place, every tensor of ``optim_state_dict["state"][param_id]`` that has its
    parameter's local shape in a :class:`ShardedTensor` keyed ``{prefix}.{param key}.{name}``,
    sharded like the parameter.  Other values (scalar steps) are left as they are; keys in
    ``exclude_keys`` are dropped."""
    excluded = set(exclude_keys)
    for param_id, state in optim_state_dict.get("state", {}).items():
        sharded_param = id_to_sharded_param_map.get(int(param_id))
        for name in list(state):
            if name in excluded:
                del state[name]
                continue
            value = state[name]
            if (
                sharded_param is not None
                and isinstance(value, torch.Tensor)
                and sharded_param.data is not None
                and tuple(value.shape) == tuple(sharded_param.data.shape)
            ):
                state[name] = sharded_param.like(f"{prefix}.{sharded_param.key}.{name}", value)
