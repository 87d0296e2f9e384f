"""Megatron-Core ``dist_checkpointing.mapping``: the classes of a sharded state dict, the tree
walks over it (factories applied and merged back, non-persistent values dropped) and the
cross-rank integrity check.  Pure data: nothing here reads or writes files.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from ..dist.coverage import ChunkInfo, validate_sharding
from ..dist.sharding import ShardedTensor, is_main_replica
from ..errors import ConfigError, ShardingError
from ..formats.torch_dtypes import dtype_name

__all__ = [
    "LocalNonpersistentObject",
    "ShardedObject",
    "ShardedTensorFactory",
    "apply_factories",
    "apply_factory_merges",
    "is_sharded",
    "leaves",
    "map_leaves",
    "merge",
    "prune",
    "validate_sharding_integrity",
]


class ShardedObject:
    """A non-tensor value that is one piece of a sharded whole (Megatron: e.g. per-rank optimizer
    extras): ``global_shape`` counts the pieces, ``global_offset`` says which one this is."""

    def __init__(
        self,
        key: str,
        data: Any,
        global_shape: Sequence[int],
        global_offset: Sequence[int],
        replica_id: int | tuple[int, ...] = 0,
    ) -> None:
        self.key = key
        self.data = data
        self.global_shape = tuple(int(d) for d in global_shape)
        self.global_offset = tuple(int(o) for o in global_offset)
        self.replica_id = replica_id
        if len(self.global_shape) != len(self.global_offset):
            raise ShardingError(f"sharded object {key!r}: global shape and offset differ in length")

    @property
    def unique_key(self) -> str:
        """``key/shard_<offset>_<shape>`` (dot-joined), Megatron's name for this piece."""
        offset = ".".join(map(str, self.global_offset))
        shape = ".".join(map(str, self.global_shape))
        return f"{self.key}/shard_{offset}_{shape}"

    @classmethod
    def empty_from_unique_key(cls, unique_key: str, replica_id: int | tuple[int, ...] = 0) -> ShardedObject:
        """The object (without data) a :attr:`unique_key` names."""
        key, _, shard = unique_key.rpartition("/shard_")
        offset, _, shape = shard.partition("_")
        if not key or not shape:
            raise ConfigError(f"{unique_key!r} is not a sharded object's unique key (key/shard_<offset>_<shape>)")
        return cls(key, None, [int(x) for x in shape.split(".")], [int(x) for x in offset.split(".")], replica_id)

    def __repr__(self) -> str:
        return f"ShardedObject({self.unique_key!r}, replica_id={self.replica_id})"


class LocalNonpersistentObject:
    """A value kept out of the checkpoint: ``save`` drops it, ``load`` puts ``obj`` back."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def unwrap(self) -> Any:
        return self.obj


class ShardedTensorFactory:
    """A tensor saved as what ``build_fn(key, data, replica_id)`` returns (a sharded sub-state)
    and loaded back through ``merge_fn(loaded sub-state)`` (Megatron's apply/merge)."""

    def __init__(
        self,
        key: str,
        data: torch.Tensor,
        build_fn: Callable[[str, torch.Tensor, Any], Any],
        merge_fn: Callable[[Any], torch.Tensor],
        replica_id: int | tuple[int, ...] = 0,
    ) -> None:
        self.key = key
        self.data = data
        self.build_fn = build_fn
        self.merge_fn = merge_fn
        self.replica_id = replica_id

    def build(self) -> Any:
        return self.build_fn(self.key, self.data, self.replica_id)


def map_leaves(tree: Any, fn: Callable[[Any], Any]) -> Any:
    """A copy of the dict/list structure of ``tree`` with ``fn`` applied to every leaf."""
    if isinstance(tree, dict):
        return {k: map_leaves(v, fn) for k, v in tree.items()}
    if isinstance(tree, list):
        return [map_leaves(v, fn) for v in tree]
    return fn(tree)


def leaves(tree: Any) -> Iterator[Any]:
    if isinstance(tree, dict):
        for value in tree.values():
            yield from leaves(value)
    elif isinstance(tree, list):
        for value in tree:
            yield from leaves(value)
    else:
        yield tree


def prune(tree: Any, drop: Callable[[Any], bool]) -> Any:
    """``tree`` without the leaves ``drop`` selects (and without dicts that become empty)."""
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            if isinstance(value, (dict, list)):
                pruned = prune(value, drop)
                if pruned or not value:
                    out[key] = pruned
            elif not drop(value):
                out[key] = value
        return out
    if isinstance(tree, list):
        return [prune(v, drop) if isinstance(v, (dict, list)) else v for v in tree if not drop(v)]
    return tree


def apply_factories(tree: Any) -> Any:
    return map_leaves(tree, lambda v: apply_factories(v.build()) if isinstance(v, ShardedTensorFactory) else v)


def apply_factory_merges(loaded: Any, original: Any) -> Any:
    """Where ``original`` held a factory, replace the loaded sub-state by ``merge_fn`` of it."""
    if isinstance(original, ShardedTensorFactory):
        return original.merge_fn(loaded)
    if isinstance(original, dict) and isinstance(loaded, dict):
        return {k: apply_factory_merges(v, original[k]) if k in original else v for k, v in loaded.items()}
    if isinstance(original, list) and isinstance(loaded, list):
        return [apply_factory_merges(a, b) for a, b in zip(loaded, original, strict=False)]
    return loaded


def merge(base: Any, update: Any) -> Any:
    """Megatron's ``merge``: nested dicts combined, ``update`` winning for other values."""
    if isinstance(base, dict) and isinstance(update, dict):
        out = dict(base)
        for key, value in update.items():
            out[key] = merge(out[key], value) if key in out else value
        return out
    return update


def is_sharded(value: Any) -> bool:
    return isinstance(value, (ShardedTensor, ShardedObject, LocalNonpersistentObject, ShardedTensorFactory))


def validate_sharding_integrity(global_metadata: Iterable[Iterable[Any]], common_state_dict: Any = None) -> None:
    """Raise :class:`~ckptd.errors.ShardingError` unless, over all ranks (``global_metadata[r]``
    is rank ``r``'s sharded tensors and objects), every tensor's main replicas tile it exactly
    once with one shape and dtype, and every sharded object piece has exactly one main replica."""
    chunks: list[ChunkInfo] = []
    objects: dict[str, list[tuple[int, ShardedObject]]] = {}
    for rank, items in enumerate(global_metadata):
        for item in items:
            if isinstance(item, ShardedTensor):
                dtype = dtype_name(item.dtype, item.key) if item.dtype is not None else "?"
                box = item.box
                main = is_main_replica(item.replica_id)
                chunks.append(ChunkInfo(rank, item.key, dtype, item.global_shape, box, main))
            elif isinstance(item, ShardedObject):
                objects.setdefault(item.key, []).append((rank, item))
    validate_sharding(chunks)
    for key, pieces in objects.items():
        shapes = {o.global_shape for _, o in pieces}
        if len(shapes) > 1:
            raise ShardingError(f"sharded object {key!r}: ranks disagree on its global shape ({sorted(shapes)})")
        (shape,) = shapes
        mains: dict[tuple[int, ...], list[int]] = {}
        for rank, o in pieces:
            if is_main_replica(o.replica_id):
                mains.setdefault(o.global_offset, []).append(rank)
        expected = 1
        for size in shape:
            expected *= size
        doubled = {off: ranks for off, ranks in mains.items() if len(ranks) > 1}
        if doubled:
            offset, ranks = next(iter(doubled.items()))
            raise ShardingError(f"sharded object {key!r} piece {list(offset)}: main replicas on ranks {ranks}")
        if len(mains) != expected:
            raise ShardingError(f"sharded object {key!r}: {len(mains)} of {expected} pieces have a main replica")
