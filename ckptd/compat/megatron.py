"""Megatron-Core ``dist_checkpointing``: its entry points and mapping classes, on ckptd.

``save(sharded_state_dict, checkpoint_dir)`` and ``load(sharded_state_dict, checkpoint_dir)``
take Megatron's sharded state dicts: :class:`ShardedTensor` (``from_rank_offsets``),
:class:`ShardedObject`, :class:`LocalNonpersistentObject` and :class:`ShardedTensorFactory`.
The checkpoint is written by ckptd's Checkpointer (staging arena, torch-free writer process,
whole-or-invisible commit) as three components: ``common`` (everything that is not sharded,
written once, as Megatron's ``common.pt``), ``sharded`` (the tensors, under their
``ShardedTensor.key``, as HF-style safetensors shards) and ``sharded_objects`` (per rank, under
each object's ``unique_key``).  ``async_sharded_save=True`` returns an :class:`AsyncRequest`
that an :class:`AsyncCallsQueue` completes, as in Megatron.

Megatron's own checkpoints are read too (:mod:`.megatron_read`): ``load``,
``load_common_state_dict``, ``load_plain_tensors`` and the metadata readers accept a directory
written by real ``megatron.core.dist_checkpointing.save`` (``torch_dist``: DCP files read by
torch's DCP reader, ``common.pt`` with ``weights_only``), at any world size.  With
``megatron-core`` installed, :class:`SaveStrategy` / :class:`LoadStrategy`
(:mod:`.megatron_strategy`, imported on first use) plug ckptd into the real library.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..checkpointer import Checkpointer
from ..dist.coverage import validate_sharding
from ..dist.optim import get_param_id_to_sharded_param_map, optim_state_to_sharding_state
from ..dist.sharding import ShardedTensor, is_main_replica
from ..errors import CheckpointExistsError, CheckpointNotFoundError, ConfigError, ShardingError
from ..formats.torch_dtypes import dtype_from_name
from ..load.reader import CheckpointReader
from ..storage import is_local, local_path
from .megatron_mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensorFactory,
    apply_factories,
    is_sharded,
    leaves,
    merge,
    prune,
    validate_sharding_integrity,
)
from .megatron_read import (
    CKPTD_BACKEND,
    CKPTD_SUBDIR,
    COMPONENTS,
    MegatronCheckpoint,
    TensorInfo,
    load_sharded_parts,
    megatron_backend,
    tensor_infos,
    verify_integrity,
)

__all__ = [
    "AsyncCallsQueue",
    "AsyncRequest",
    "LoadStrategy",  # noqa: F822 - lazy (module __getattr__): needs megatron-core
    "LocalNonpersistentObject",
    "ShardedObject",
    "ShardedTensor",
    "SaveStrategy",  # noqa: F822 - lazy (module __getattr__): needs megatron-core
    "ShardedTensorFactory",
    "TensorInfo",
    "get_default_load_sharded_strategy",
    "get_default_save_sharded_strategy",
    "get_param_id_to_sharded_param_map",
    "load",
    "load_common_state_dict",
    "load_plain_tensors",
    "load_sharded_metadata",
    "load_tensors_metadata",
    "megatron_backend",
    "register_strategies",  # noqa: F822 - lazy (module __getattr__): needs megatron-core
    "optim_state_to_sharding_state",
    "remove_sharded_tensors",
    "save",
    "validate_sharding",
    "validate_sharding_integrity",
    "verify_integrity",
]

logger = logging.getLogger(__name__)

_COMMON, _SHARDED, _OBJECTS = COMPONENTS


def load_tensors_metadata(
    path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> dict[str, dict[str, TensorInfo]]:
    """Global shapes and dtypes of every tensor, per component, without reading tensor data
    (ckptd: from the manifest; HF checkpoints: from the shard headers; DCP and Megatron
    ``torch_dist`` checkpoints: from torch's ``.metadata``; Megatron checkpoints written with
    :class:`SaveStrategy`: from the manifest of their ``ckptd/`` part)."""
    if is_local(os.fspath(path)) and megatron_backend(path) == CKPTD_BACKEND:
        path = os.path.join(os.fspath(path), CKPTD_SUBDIR)
    reader = CheckpointReader.open(path, storage_options)
    if reader.kind == "dcp":  # Megatron torch_dist / PyTorch DCP: shapes from .metadata (read once, by open)
        layout = reader.dcp_layout()
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


# ---- saving -------------------------------------------------------------------------------------


class _DirCheckpointer(Checkpointer):
    """A Checkpointer that commits its one save into an explicit directory (Megatron's
    ``checkpoint_dir``) instead of ``<root>/checkpoint-<step>``."""

    def __init__(self, directory: str) -> None:
        self._directory = os.path.abspath(directory)
        super().__init__(os.path.dirname(self._directory))

    def path_for(self, step: int) -> str:
        return self._directory


def _check_strategy(*strategies: Any) -> None:
    for strategy in strategies:
        if strategy is not None and not isinstance(strategy, (str, tuple)):
            raise ConfigError(
                f"{type(strategy).__name__}: ckptd writes and reads its own format; pass no strategy "
                "(backend names such as ('torch_dist', 1) are accepted and ignored)"
            )


def _local_dir(checkpoint_dir: str | os.PathLike[str]) -> str:
    path = os.fspath(checkpoint_dir)
    if not is_local(path):
        raise ConfigError(f"{path}: Megatron-style save needs a local directory; use ckptd.Checkpointer for URLs")
    return local_path(path)


def save(
    sharded_state_dict: dict[str, Any],
    checkpoint_dir: str | os.PathLike[str],
    sharded_strategy: Any = None,
    common_strategy: Any = None,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
    preprocess_common_before_consistancy_check: Callable[[Any], Any] | None = None,
    content_metadata: dict[str, Any] | None = None,
    async_strategy: str | None = None,
    verify_integrity: bool = False,
) -> AsyncRequest | None:
    """Save a Megatron sharded state dict into the existing, empty ``checkpoint_dir``.

    Every rank calls it.  Factories are built, local non-persistent objects dropped, sharded
    tensors written by their main replicas (``validate_access_integrity``: ckptd always checks
    that the main replicas tile every tensor exactly once), sharded objects by theirs, and the
    rest once, as the common state.  Returns None after the commit, or with
    ``async_sharded_save=True`` an :class:`AsyncRequest` to hand to an :class:`AsyncCallsQueue`.
    ``preprocess_common_before_consistancy_check`` is accepted for compatibility: rank 0's
    common state is the one written.  Megatron 0.17+'s ``async_strategy`` is accepted and unused
    (ckptd's writer process is the background worker); its ``verify_integrity`` too: ckptd's
    manifest always records a CRC-32C per shard, which every read checks.
    """
    _check_strategy(sharded_strategy, common_strategy)
    directory = _local_dir(checkpoint_dir)
    if not os.path.isdir(directory):
        raise CheckpointNotFoundError(f"checkpoint directory {directory} does not exist; create it first")
    if os.listdir(directory):
        raise CheckpointExistsError(f"checkpoint directory {directory} is not empty; save into an empty one")
    state = prune(apply_factories(sharded_state_dict), lambda v: isinstance(v, LocalNonpersistentObject))
    metadata = {"megatron": True, "content_metadata": copy.deepcopy(content_metadata)}
    pending = start_save(directory, leaves(state), prune(state, is_sharded), metadata, validate_access_integrity)
    if async_sharded_save:
        return pending
    pending.execute_sync()
    return None


def start_save(
    directory: str,
    sharded: Iterable[Any],
    common: dict[str, Any] | None,
    metadata: dict[str, Any],
    validate_access_integrity: bool = True,
) -> AsyncRequest:
    """Hand this rank's sharded tensors and objects (and, unless None, the common state) to a
    Checkpointer that commits them into ``directory``; the writer process persists them."""
    tensors: dict[str, ShardedTensor] = {}
    objects: dict[str, Any] = {}
    for leaf in sharded:
        if isinstance(leaf, ShardedTensor):
            if leaf.key in tensors:
                raise ShardingError(f"sharded tensor key {leaf.key!r} appears twice in this rank's state")
            tensors[leaf.key] = leaf
        elif isinstance(leaf, ShardedObject) and is_main_replica(leaf.replica_id):
            if validate_access_integrity and leaf.unique_key in objects:
                raise ShardingError(f"sharded object {leaf.unique_key!r} has two main replicas on this rank")
            objects[leaf.unique_key] = {"data": leaf.data}
    state: dict[str, Any] = {_SHARDED: tensors, _OBJECTS: objects}
    if common is not None:
        state = {_COMMON: common, **state}
    checkpointer = _DirCheckpointer(directory)
    try:
        request = checkpointer.async_save(0, state, sharing={_OBJECTS: "per_rank"}, overwrite=True, metadata=metadata)
    except BaseException:
        checkpointer.close(wait=False)
        raise
    return AsyncRequest(checkpointer, request)


class AsyncRequest:
    """A save in flight: the writer process persists it; :meth:`execute_sync` waits for the
    commit and runs ``finalize_fns`` (Megatron's finalization), once."""

    def __init__(self, checkpointer: Checkpointer, request: Any) -> None:
        self.checkpointer = checkpointer
        self.request = request
        self.finalize_fns: list[Callable[[], Any]] = []
        self._finalized = False

    def add_finalize_fn(self, fn: Callable[[], Any]) -> None:
        self.finalize_fns.append(fn)

    def done(self) -> bool:
        return bool(self.request.done())

    def execute_sync(self) -> None:
        """Wait for the commit, then finalize (re-raises the save's failure, if any)."""
        if self._finalized:
            return
        try:
            self.request.result()
        finally:
            self.checkpointer.close()
        self._finalized = True
        for fn in self.finalize_fns:
            fn()


class AsyncCallsQueue:
    """Megatron's queue of asynchronous saves: schedule, then finalize those that are done."""

    def __init__(self) -> None:
        self._calls: dict[int, AsyncRequest] = {}
        self._next = 0

    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        """Track a request returned by ``save(..., async_sharded_save=True)``; returns its id."""
        call_id = self._next
        self._calls[call_id] = async_request
        self._next += 1
        return call_id

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> list[int]:
        """Finalize the calls whose commit is done (all of them, in order, with ``blocking``);
        returns their ids.  A failed save raises here."""
        finished = []
        for call_id in sorted(self._calls):
            request = self._calls[call_id]
            if not blocking and not request.done():
                break
            request.execute_sync()
            finished.append(call_id)
            del self._calls[call_id]
        return finished

    def get_num_unfinalized_calls(self) -> int:
        return len(self._calls)

    def close(self) -> None:
        self.maybe_finalize_async_calls(blocking=True)


# ---- loading ------------------------------------------------------------------------------------


def load_common_state_dict(
    checkpoint_dir: str | os.PathLike[str], verify_integrity: bool | None = None
) -> dict[str, Any]:
    """The non-sharded part of the checkpoint (Megatron's ``common.pt``, or Megatron 0.19's
    ``common_state`` object inside the ``torch_dist`` files, read with ``weights_only=True``).
    ``verify_integrity``: see :func:`load`."""
    return MegatronCheckpoint(checkpoint_dir, verify=verify_integrity).common()


def load_plain_tensors(
    checkpoint_dir: str | os.PathLike[str], verify_integrity: bool | None = None
) -> dict[str, torch.Tensor]:
    """Every sharded tensor, whole, by its ``ShardedTensor.key`` (``verify_integrity``: see
    :func:`load`)."""
    opened = MegatronCheckpoint(checkpoint_dir, verify=verify_integrity)
    return opened.reader.read(opened.tensors) if opened.tensor_keys() else {}


def load_sharded_metadata(
    checkpoint_dir: str | os.PathLike[str], sharded_strategy: Any = None, common_strategy: Any = None
) -> dict[str, ShardedTensor | ShardedObject]:
    """What the checkpoint holds, without data: a whole-tensor :class:`ShardedTensor` per key
    (global shape and dtype) and a :class:`ShardedObject` per stored object's unique key."""
    _check_strategy(sharded_strategy, common_strategy)
    opened = MegatronCheckpoint(checkpoint_dir)
    out: dict[str, ShardedTensor | ShardedObject] = {}
    infos = tensor_infos(opened)
    for key, info in infos.items():
        shape = info.shape
        out[key] = ShardedTensor(key, None, shape, (0,) * len(shape), dtype=info.dtype, local_shape=shape)
    for unique_key in opened.object_keys():
        out[unique_key] = ShardedObject.empty_from_unique_key(unique_key)
    return out


def load(
    sharded_state_dict: dict[str, Any],
    checkpoint_dir: str | os.PathLike[str],
    sharded_strategy: Any = None,
    common_strategy: Any = None,
    validate_access_integrity: bool = True,
    strict: Any = None,
    verify_integrity: bool | None = None,
    process_group: Any = None,
) -> dict[str, Any]:
    """Load into the layout ``sharded_state_dict`` describes (any world size): each
    :class:`ShardedTensor` receives exactly its piece in place and is replaced by its tensor,
    sharded objects by their values, factories merged, non-persistent objects unwrapped; the
    result is merged over the common state.  Reads ckptd's own checkpoints and Megatron's
    (``torch_dist``, through torch's DCP reader; or written with :class:`SaveStrategy`).  A key
    the checkpoint lacks raises :class:`~ckptd.errors.KeyMismatchError` (``strict`` is accepted
    for compatibility).

    ``verify_integrity``: a Megatron-written directory with an ``integrity.json`` (Megatron-Core
    0.18+) is checked against it by default (None) before anything is read, a differing file
    raising :class:`~ckptd.errors.CorruptCheckpointError`; True also requires the file, False
    skips the check (ckptd's own checkpoints are always checked by their CRCs).
    ``process_group`` (Megatron 0.19) is accepted: each process reads its own pieces, with no
    collective.
    """
    _check_strategy(sharded_strategy, common_strategy)
    opened = MegatronCheckpoint(checkpoint_dir, verify=verify_integrity)
    loaded = load_sharded_parts(opened, sharded_state_dict)
    return merge(opened.common(), loaded)


def remove_sharded_tensors(checkpoint_dir: str | os.PathLike[str], key_prefix: str) -> None:
    """Rewrite the checkpoint without the sharded tensors whose key starts with ``key_prefix``
    (a new directory is committed, then swapped in; run it in one process)."""
    directory = _local_dir(checkpoint_dir)
    opened = MegatronCheckpoint(directory)
    if opened.backend is not None:
        raise ConfigError(f"{directory}: written by Megatron ({opened.backend}); remove tensors with Megatron's own")
    reader = opened.reader
    keep = [k for k in opened.tensor_keys() if not k.startswith(key_prefix)]
    tensors = reader.read(_SHARDED, keep) if keep else {}
    whole = {k: ShardedTensor(k, t, tuple(t.shape), (0,) * t.dim()) for k, t in tensors.items()}
    objects = {k: {"data": v} for k, v in opened.objects().items()}
    common = opened.common()
    metadata = reader.manifest.metadata if reader.manifest is not None else {}
    fresh = f"{directory}.rewrite-{os.getpid()}"
    os.makedirs(fresh)
    checkpointer = _DirCheckpointer(fresh)
    try:
        checkpointer.save(0, {_COMMON: common, _SHARDED: whole, _OBJECTS: objects}, overwrite=True, metadata=metadata)
    finally:
        checkpointer.close()
    old = f"{directory}.old-{os.getpid()}"
    os.rename(directory, old)
    os.rename(fresh, directory)
    shutil.rmtree(old, ignore_errors=True)


_STRATEGY_NAMES = ("SaveStrategy", "LoadStrategy", "register_strategies")


def get_default_save_sharded_strategy(backend: str = CKPTD_BACKEND) -> Any:
    """Megatron-Core 0.19's factory, here giving ckptd's :class:`SaveStrategy` (needs
    megatron-core).  ``backend`` is the one ``metadata.json`` records: only ckptd's is accepted
    (:class:`~ckptd.errors.ConfigError` otherwise; Megatron's ``torch_dist`` strategy comes from
    ``megatron.core``'s own factory)."""
    return __getattr__("SaveStrategy")(backend)


def get_default_load_sharded_strategy(checkpoint_dir: str | os.PathLike[str] | None = None) -> Any:
    """Megatron-Core 0.19's factory, here giving ckptd's :class:`LoadStrategy` (needs
    megatron-core), which reads checkpoints saved through :class:`SaveStrategy` and Megatron's
    own ``torch_dist`` ones; ``checkpoint_dir`` is accepted (the strategy reads the directory it
    is given at load time)."""
    return __getattr__("LoadStrategy")()


def __getattr__(name: str) -> Any:
    """``SaveStrategy`` / ``LoadStrategy`` / ``register_strategies`` subclass and register with the
    real Megatron-Core: imported on first use, so ckptd imports without ``megatron-core``."""
    if name in _STRATEGY_NAMES:
        try:
            from . import megatron_strategy
        except ImportError as e:
            raise ImportError(f"ckptd.compat.megatron.{name} needs megatron-core: pip install 'ckptd[megatron]'") from e
        return getattr(megatron_strategy, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
