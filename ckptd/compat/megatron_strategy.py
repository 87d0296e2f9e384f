"""ckptd as a strategy of the real Megatron-Core ``dist_checkpointing`` (needs ``megatron-core``).

``megatron.core.dist_checkpointing.save(sd, dir, sharded_strategy=SaveStrategy())`` keeps
Megatron's own steps (factories, integrity check, ``common.pt`` from rank 0, ``metadata.json``
written last) and hands the sharded part to ckptd: every rank's ShardedTensors and
ShardedObjects go through ckptd's Checkpointer (staging arena, torch-free writer process,
whole-or-invisible commit) into ``dir/ckptd/``.  ``metadata.json`` then says
``{"sharded_backend": "ckptd", "sharded_backend_version": 1}``.

``megatron.core.dist_checkpointing.load(sd, dir, sharded_strategy=LoadStrategy())`` reads that
part at any world size, and also Megatron's own ``torch_dist`` checkpoints (through torch's DCP
reader).  Megatron finds a strategy for the ``ckptd`` backend by itself once
:func:`register_strategies` has run (constructing either strategy runs it).

The order Megatron calls them in, on every rank:

1. save: ``SaveStrategy.async_save`` (or ``save``) after ``common.pt`` is written; the returned
   request's finalize step waits for ckptd's commit, then Megatron writes ``metadata.json``.
2. load: ``check_backend_compatibility`` / ``check_version_compatibility`` with what
   ``metadata.json`` says, then ``load`` (and ``load_tensors_metadata`` /
   ``load_sharded_metadata`` for ``load_plain_tensors`` and strict checks).

Importing this module imports Megatron-Core; ``ckptd.compat.megatron`` does so only when one of
these names is first used.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from megatron.core.dist_checkpointing import ShardedObject as MegatronShardedObject
from megatron.core.dist_checkpointing import ShardedTensor as MegatronShardedTensor
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest as MegatronAsyncRequest
from megatron.core.dist_checkpointing.strategies.base import (
    AsyncSaveShardedStrategy,
    LoadShardedStrategy,
    StrategyAction,
    register_default_strategy,
)

from ..dist.sharding import ShardedTensor
from ..errors import ConfigError, ShardingError
from .megatron import start_save
from .megatron_mapping import ShardedObject, map_leaves
from .megatron_read import CKPTD_BACKEND, CKPTD_SUBDIR, load_sharded_parts, open_megatron_checkpoint, tensor_infos

__all__ = ["FORMAT_VERSION", "LoadStrategy", "SaveStrategy", "register_strategies"]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_READABLE_BACKENDS = (CKPTD_BACKEND, "torch_dist")


def register_strategies() -> None:
    """Make ckptd Megatron's default strategy for the ``ckptd`` backend (save and load), so
    ``dist_checkpointing.load(sd, dir)`` of a directory written with :class:`SaveStrategy`
    needs no ``sharded_strategy`` argument."""
    register_default_strategy(StrategyAction.SAVE_SHARDED, CKPTD_BACKEND, FORMAT_VERSION, SaveStrategy())
    register_default_strategy(StrategyAction.LOAD_SHARDED, CKPTD_BACKEND, FORMAT_VERSION, LoadStrategy())


def _to_ckptd(leaf: Any, loading: bool) -> Any:
    """Megatron's ShardedTensor / ShardedObject as ckptd's (same data object, same placement)."""
    if isinstance(leaf, MegatronShardedTensor):
        if loading and leaf.allow_shape_mismatch:
            raise ShardingError(
                f"sharded tensor {leaf.key!r}: allow_shape_mismatch is not supported by ckptd's LoadStrategy "
                "(it loads exact global shapes); load it with Megatron's torch_dist strategy"
            )
        if leaf.data is None and loading:
            leaf.init_data("cpu")
        return ShardedTensor(
            leaf.key,
            leaf.data,
            leaf.global_shape,
            leaf.global_offset,
            leaf.replica_id,
            dtype=leaf.dtype,
            local_shape=leaf.local_shape,
            axis_fragmentations=leaf.axis_fragmentations,
            prepend_axis_num=leaf.prepend_axis_num,
            flattened_range=leaf.flattened_range,
        )
    if isinstance(leaf, MegatronShardedObject):
        return ShardedObject(leaf.key, leaf.data, leaf.global_shape, leaf.global_offset, leaf.replica_id)
    return leaf


class SaveStrategy(AsyncSaveShardedStrategy):
    """Megatron sharded save strategy writing through ckptd's Checkpointer (see the module
    docstring); ``backend``/``version`` are what ``metadata.json`` records."""

    def __init__(self, backend: str = CKPTD_BACKEND, version: int = FORMAT_VERSION) -> None:
        super().__init__(backend, version)
        if (backend, version) != (CKPTD_BACKEND, FORMAT_VERSION):
            raise ConfigError(
                f"SaveStrategy writes backend ({CKPTD_BACKEND!r}, {FORMAT_VERSION}), not {(backend, version)}"
            )

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def async_save(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | Path) -> MegatronAsyncRequest:
        """Stage this rank's pieces and start ckptd's writer; the returned request has no
        ``async_fn`` (ckptd's writer process is already the background worker): its finalize
        step waits for the commit, on every rank, before Megatron writes ``metadata.json``."""
        _ensure_registered()
        directory = os.path.join(os.path.abspath(os.fspath(checkpoint_dir)), CKPTD_SUBDIR)
        converted = map_leaves(sharded_state_dict, lambda leaf: _to_ckptd(leaf, loading=False))
        leaves: list[Any] = []
        map_leaves(converted, leaves.append)
        pending = start_save(directory, leaves, None, {"megatron": True, "megatron_strategy": True})
        logger.debug("rank save of %d sharded values into %s started", len(leaves), directory)
        return MegatronAsyncRequest(None, (), [pending.execute_sync])


class LoadStrategy(LoadShardedStrategy):
    """Megatron sharded load strategy reading with ckptd: checkpoints written through
    :class:`SaveStrategy` and Megatron's own ``torch_dist`` ones, at any world size."""

    def __init__(self) -> None:
        super().__init__()
        _ensure_registered()

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend not in _READABLE_BACKENDS:
            raise ConfigError(
                f"ckptd's LoadStrategy reads sharded backends {list(_READABLE_BACKENDS)}, not {loaded_backend!r}; "
                "load this checkpoint with Megatron's default strategy"
            )

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != FORMAT_VERSION:
            raise ConfigError(f"ckptd's LoadStrategy reads format version {FORMAT_VERSION}, not {loaded_version!r}")

    def load(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | Path) -> dict[str, Any]:
        """Each ShardedTensor's piece read in place into its data (allocated when None), each
        ShardedObject's data; returns the same structure holding the loaded values."""
        converted = map_leaves(sharded_state_dict, lambda leaf: _to_ckptd(leaf, loading=True))
        return load_sharded_parts(open_megatron_checkpoint(os.fspath(checkpoint_dir)), converted)

    def load_tensors_metadata(self, checkpoint_dir: str | Path, metadata: Any = None) -> dict[str, Any]:
        """Megatron ShardedTensors without data and without sharding (global shape and dtype)."""
        infos = tensor_infos(open_megatron_checkpoint(os.fspath(checkpoint_dir)))
        return {
            key: MegatronShardedTensor.from_rank_offsets(
                key, torch.empty(info.shape, dtype=info.dtype, device="meta")
            ).without_data()
            for key, info in infos.items()
        }

    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> dict[str, Any]:
        """:meth:`load_tensors_metadata` plus a ShardedObject per stored piece."""
        opened = open_megatron_checkpoint(os.fspath(checkpoint_dir))
        out: dict[str, Any] = {key: MegatronShardedObject.empty_from_unique_key(key) for key in opened.object_keys()}
        out.update(self.load_tensors_metadata(checkpoint_dir))
        return out

    def remove_sharded_tensors(self, checkpoint_dir: str | Path, key_prefix: str) -> None:
        raise ConfigError(
            f"{checkpoint_dir}: removing tensors from a Megatron checkpoint is Megatron's job "
            "(ckptd.compat.megatron.remove_sharded_tensors rewrites ckptd-format checkpoints)"
        )


_registered = False


def _ensure_registered() -> None:
    global _registered
    if not _registered:
        _registered = True
        register_strategies()
