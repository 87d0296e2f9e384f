"""ModelOpt ``sharded_checkpoint_utils``: the generic helpers, same names and signatures.

``load_sharded_state_dict`` reads only the shards holding the keys asked for;
``save_sharded_model`` writes one safetensors file of a model (shard); ``is_in_safetensors_format``
tells whether a directory holds safetensors weights.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

from ..errors import CorruptCheckpointError
from ..load.reader import CheckpointReader
from ..save.flatten import find_tied_groups
from ..save.tensor_files import write_safetensors_file
from .forgather import StateDictLike, _drop_aliases, _location, _state_of

__all__ = ["is_in_safetensors_format", "load_sharded_state_dict", "save_sharded_model"]


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
