"""ckptd as a strategy of the real Megatron-Core ``dist_checkpointing`` (needs ``megatron-core``).

``megatron.core.dist_checkpointing.save(sd, dir, sharded_strategy=SaveStrategy())`` keeps
Megatron's own steps (factories, integrity check, ``metadata.json`` written last) and hands the
sharded part to ckptd: every rank's ShardedTensors and ShardedObjects go through ckptd's
Checkpointer (staging arena, torch-free writer process, whole-or-invisible commit) into
``dir/ckptd/``.  ``metadata.json`` then says ``{"sharded_backend": "ckptd",
"sharded_backend_version": 1}``.  The common state is ``dir/common.pt`` with every Megatron:
written by Megatron up to 0.18, by this strategy from 0.19 on (there Megatron hands it over as
a ``"common_state"`` ShardedObject; 0.19 still reads ``common.pt`` first).

``megatron.core.dist_checkpointing.load(sd, dir, sharded_strategy=LoadStrategy())`` reads that
part at any world size, and also Megatron's own ``torch_dist`` checkpoints (through torch's DCP
reader).  Up to Megatron-Core 0.16 Megatron finds a strategy for the ``ckptd`` backend by itself
once :func:`register_strategies` has run (constructing either strategy runs it); from 0.17 on
Megatron has no strategy registry and its ``load`` uses ``torch_dist`` unless
``sharded_strategy=LoadStrategy()`` is passed.

Which Megatron-Core this is, is decided by what it has, never by its version string:

- ``strategies/base.py`` with ``register_default_strategy`` (0.16): the registry is used;
- Megatron's torch_dist save strategy still an ``AsyncSaveShardedStrategy`` (0.16):
  :class:`SaveStrategy` subclasses ``AsyncSaveShardedStrategy`` and :class:`LoadStrategy`
  ``LoadShardedStrategy``; otherwise (0.17+, where ``save`` replaces any strategy that is not a
  ``TorchDistSaveShardedStrategy`` with a fresh one, and 0.19, where ``base.py`` is gone) they
  subclass ``TorchDistSaveShardedStrategy`` / ``TorchDistLoadShardedStrategy`` and override
  every method Megatron calls;
- a ``"common_state"`` ShardedObject among the values to save (0.19+): written as
  ``common.pt``.

The order Megatron calls them in, on every rank:

1. save: ``SaveStrategy.async_save`` (or ``save``) with this rank's sharded values (up to 0.18
   after rank 0 wrote ``common.pt``); the returned request's finalize step waits for ckptd's
   commit, then Megatron writes ``metadata.json`` (and, with ``verify_integrity=True`` on
   0.18+, ``integrity.json``).
2. load: up to 0.16 ``check_backend_compatibility`` / ``check_version_compatibility`` with what
   ``metadata.json`` says; then ``load`` (and ``load_tensors_metadata`` /
   ``load_sharded_metadata`` for ``load_plain_tensors`` and strict checks).

Importing this module imports Megatron-Core; ``ckptd.compat.megatron`` does so only when one of
these names is first used.
"""

from __future__ import annotations

import importlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from megatron.core.dist_checkpointing import ShardedObject as MegatronShardedObject
from megatron.core.dist_checkpointing import ShardedTensor as MegatronShardedTensor
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest as MegatronAsyncRequest
from megatron.core.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)

from ..dist.sharding import ShardedTensor, is_main_replica
from ..errors import ConfigError, ShardingError
from .megatron import start_save
from .megatron_mapping import ShardedObject, map_leaves, prune
from .megatron_read import (
    CKPTD_BACKEND,
    CKPTD_SUBDIR,
    COMMON_FILE,
    COMMON_STATE_KEY,
    load_sharded_parts,
    open_megatron_checkpoint,
    tensor_infos,
)

__all__ = ["FORMAT_VERSION", "HAS_STRATEGY_REGISTRY", "LoadStrategy", "SaveStrategy", "register_strategies"]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_READABLE_BACKENDS = (CKPTD_BACKEND, "torch_dist")


def _strategies_base() -> Any:
    """Megatron's ``strategies/base.py`` (up to 0.18), or None (0.19 deleted it)."""
    try:
        return importlib.import_module("megatron.core.dist_checkpointing.strategies.base")
    except ImportError:
        return None


_BASE = _strategies_base()
HAS_STRATEGY_REGISTRY = _BASE is not None and hasattr(_BASE, "register_default_strategy")
"""Whether Megatron picks a strategy by the backend ``metadata.json`` names (0.16)."""


def _base_class(generic_name: str, torch_dist: type) -> type:
    """Megatron's generic strategy base when its own torch_dist strategy still derives from it
    (0.16: ``save`` / ``load`` accept any such strategy), else the torch_dist strategy itself
    (0.17+: ``save`` swaps anything else for a fresh ``TorchDistSaveShardedStrategy``)."""
    generic = getattr(_BASE, generic_name, None) if _BASE is not None else None
    if isinstance(generic, type) and issubclass(torch_dist, generic):
        return generic
    return torch_dist


_SaveBase: Any = _base_class("AsyncSaveShardedStrategy", TorchDistSaveShardedStrategy)
_LoadBase: Any = _base_class("LoadShardedStrategy", TorchDistLoadShardedStrategy)


def register_strategies() -> None:
    """Make ckptd Megatron's default strategy for the ``ckptd`` backend (save and load), so
    ``dist_checkpointing.load(sd, dir)`` of a directory written with :class:`SaveStrategy`
    needs no ``sharded_strategy`` argument.  A no-op where Megatron has no strategy registry
    (0.17+): pass ``sharded_strategy=LoadStrategy()`` there."""
    if not HAS_STRATEGY_REGISTRY:
        logger.debug("Megatron-Core has no strategy registry: nothing to register")
        return
    action = _BASE.StrategyAction
    _BASE.register_default_strategy(action.SAVE_SHARDED, CKPTD_BACKEND, FORMAT_VERSION, SaveStrategy())
    _BASE.register_default_strategy(action.LOAD_SHARDED, CKPTD_BACKEND, FORMAT_VERSION, LoadStrategy())


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


class SaveStrategy(_SaveBase):
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

    def save(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | Path) -> None:
        """Synchronous save: :meth:`async_save`, then wait for ckptd's commit."""
        self.async_save(sharded_state_dict, checkpoint_dir).execute_sync()

    def async_save(
        self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | Path, async_strategy: str | None = None
    ) -> MegatronAsyncRequest:
        """Stage this rank's pieces and start ckptd's writer; the returned request has no
        ``async_fn`` (ckptd's writer process is already the background worker): its finalize
        step waits for the commit, on every rank, before Megatron writes ``metadata.json``.
        ``async_strategy`` (Megatron 0.17+: ``"nvrx"`` or ``"mcore"``) is accepted and unused.
        A ``"common_state"`` object (Megatron 0.19+) is written by its main replica as
        ``common.pt`` before this returns."""
        _ensure_registered()
        root = os.path.abspath(os.fspath(checkpoint_dir))
        directory = os.path.join(root, CKPTD_SUBDIR)
        rest = prune(sharded_state_dict, _is_common_state)
        common = [leaf for leaf in _leaves(sharded_state_dict) if _is_common_state(leaf)]
        for leaf in common:
            if is_main_replica(leaf.replica_id):
                _write_common_file(root, leaf.data)
        converted = map_leaves(rest, lambda leaf: _to_ckptd(leaf, loading=False))
        leaves = _leaves(converted)
        pending = start_save(directory, leaves, None, {"megatron": True, "megatron_strategy": True})
        logger.debug("rank save of %d sharded values into %s started", len(leaves), directory)
        return MegatronAsyncRequest(None, (), [pending.execute_sync])


def _leaves(tree: Any) -> list[Any]:
    out: list[Any] = []
    map_leaves(tree, out.append)
    return out


def _is_common_state(leaf: Any) -> bool:
    return isinstance(leaf, MegatronShardedObject) and leaf.key == COMMON_STATE_KEY


def _write_common_file(root: str, common: Any) -> None:
    """Megatron 0.19's common state as ``common.pt`` (what Megatron itself wrote up to 0.18, and
    0.19's ``load_common_state_dict`` reads first); written whole or not at all."""
    fd, tmp = tempfile.mkstemp(prefix=f".{COMMON_FILE}.", dir=root)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(common, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(root, COMMON_FILE))
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class LoadStrategy(_LoadBase):
    """Megatron sharded load strategy reading with ckptd: checkpoints written through
    :class:`SaveStrategy` and Megatron's own ``torch_dist`` ones, at any world size."""

    def __init__(self) -> None:
        super().__init__()
        _ensure_registered()

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

    def load(
        self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | Path, async_strategy: str | None = None
    ) -> dict[str, Any]:
        """Each ShardedTensor's piece read in place into its data (allocated when None), each
        ShardedObject's data; returns the same structure holding the loaded values.
        ``async_strategy`` (passed by Megatron 0.17+) is unused."""
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
