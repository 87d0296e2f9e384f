"""ModelOpt ``sharded_checkpoint_utils``: the generic helpers, same names and signatures.

``load_sharded_state_dict`` reads only the shards holding the keys asked for;
``save_sharded_model`` writes one safetensors file of a model (shard); ``is_in_safetensors_format``
tells whether a directory holds safetensors weights; ``load_state_dict_to_shards`` hands each
rank's model shard its part of a state dict loaded on rank 0; ``set_submodule`` replaces a
submodule by dotted path.  (ModelOpt's descriptor-bound functions are not provided.)
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

from ..errors import ConfigError, CorruptCheckpointError
from ..load.reader import CheckpointReader
from ..save.flatten import find_tied_groups
from ..save.tensor_files import write_safetensors_file
from .forgather import StateDictLike, _drop_aliases, _location, _state_of

__all__ = [
    "is_in_safetensors_format",
    "load_sharded_state_dict",
    "load_state_dict_to_shards",
    "save_sharded_model",
    "set_submodule",
]


def save_sharded_model(model_shard: StateDictLike, out_path: str) -> None:
    """ModelOpt: write one safetensors file (e.g. ``<dir>/model.safetensors``) with every tensor."""
    storage, path = _location(out_path)
    parent = path.rsplit("/", 1)[0] if not storage.local else os.path.dirname(path)
    storage.makedirs(parent)
    state = _state_of(model_shard)
    write_safetensors_file(storage, path, _drop_aliases(state, find_tied_groups(state)))


def load_sharded_state_dict(
    model_name_or_path: str | os.PathLike[str],
    keys_to_load: Iterable[str] | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """ModelOpt: the state dict (or only ``keys_to_load``) of a checkpoint, reading only needed shards."""
    reader = CheckpointReader.open(os.fspath(model_name_or_path))
    return reader.read(reader.default_component(), keys_to_load, device=device)


def is_in_safetensors_format(checkpoint_dir: str | os.PathLike[str]) -> bool:
    """ModelOpt: True if the directory holds safetensors weights (single file, index or ckptd)."""
    try:
        reader = CheckpointReader.open(os.fspath(checkpoint_dir))
    except (FileNotFoundError, CorruptCheckpointError):
        return False
    if reader.kind in ("hf_sharded", "safetensors"):
        return True
    if reader.kind == "ckptd" and reader.manifest is not None:
        component = reader.manifest.components.get(reader.default_component())
        return component is not None and component.kind == "safetensors"
    return False


def set_submodule(model: torch.nn.Module, module_name: str, new_submodule: torch.nn.Module) -> None:
    """ModelOpt: put ``new_submodule`` at the dotted path ``module_name`` of ``model``."""
    parent_name, _, attr = module_name.rpartition(".")
    if not attr:
        raise ConfigError("set_submodule needs a non-empty module name")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, new_submodule)


def load_state_dict_to_shards(model_shard: torch.nn.Module, loaded_state_dict: dict | None = None) -> None:
    """ModelOpt: every rank calls it; rank 0 passes the whole ``loaded_state_dict`` and each rank's
    ``model_shard`` gets its own keys (``load_state_dict(..., assign=True)``, strict).

    Under torch.distributed rank 0 gathers each rank's key list and sends each its tensors
    (objects over the default group, as ModelOpt does).  Reading from storage on every rank is
    cheaper: ``load_sharded_state_dict(path, keys_to_load=model_shard.state_dict())``.
    """
    import torch.distributed as dist

    keys = list(model_shard.state_dict())
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank = dist.get_rank() if distributed else 0
    loaded: dict[str, Any] = {}
    if rank == 0:
        if loaded_state_dict is None:
            raise ConfigError("load_state_dict_to_shards: rank 0 must pass loaded_state_dict")
        loaded = {k.replace("_orig_mod.", ""): v for k, v in loaded_state_dict.items()}
    if distributed:
        gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(keys, gathered, dst=0)
        parts = [{k: loaded[k] for k in wanted if k in loaded} for wanted in gathered] if gathered else None
        received: list[Any] = [None]
        dist.scatter_object_list(received, parts, src=0)
        shard = received[0]
    else:
        shard = {k: loaded[k] for k in keys if k in loaded}
    model_shard.load_state_dict(shard, assign=True)
