"""The tensors of another checkpoint, described first and fetched one at a time (for conversions).

A source is a ckptd checkpoint, an HF model directory (safetensors or ``.bin`` shards, or single
files) or a PyTorch DCP checkpoint.  ckptd and safetensors sources are read one tensor at a time,
so memory stays bounded by the largest tensor; PyTorch DCP checkpoints and ``.bin`` files are
loaded whole by torch's own readers (``torch.distributed.checkpoint.FileSystemReader``, as
``dcp_to_torch_save`` does; ``torch.load(weights_only=True)``), never by arbitrary unpickling:
a DCP ``.metadata`` is read through :mod:`ckptd.load.dcp_metadata`'s allowlist (torch's own
``read_metadata`` is a plain ``pickle.load``).  A directory with a ckptd manifest is a ckptd
source even if a ``.metadata`` lies beside it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import ConfigError
from ..formats.manifest import is_foreign_manifest
from ..formats.names import MANIFEST_NAME

__all__ = [
    "DCP_METADATA",
    "HF_CONFIG",
    "Tensors",
    "from_dcp",
    "from_reader",
    "is_dcp_checkpoint",
    "load_dcp",
]

DCP_METADATA = ".metadata"
HF_CONFIG = "config.json"


def is_dcp_checkpoint(path: str) -> bool:
    """A local directory holding a PyTorch DCP checkpoint (its ``.metadata`` file) and no ckptd
    manifest: ckptd's own manifest is looked at first, as :meth:`CheckpointReader.open` does, so a
    ckptd checkpoint never has its ``.metadata`` (anyone's file) read."""
    if "://" in path or not os.path.isfile(os.path.join(path, DCP_METADATA)):
        return False
    manifest = os.path.join(path, MANIFEST_NAME)
    if not os.path.isfile(manifest):
        return True
    with open(manifest, "rb") as f:
        return is_foreign_manifest(f.read())


class Tensors:
    """A component's tensors to write: descriptions first, data fetched one tensor at a time.

    ``items`` are :class:`~ckptd.save.layout.WriteItem` descriptions, ``fetch(key)`` returns one
    tensor, ``tied`` lists groups of keys sharing one tensor (the first key is stored), ``step``
    is the source's step when it records one, ``config`` the bytes of its ``config.json``.
    """

    def __init__(
        self,
        items: list[Any],
        fetch: Callable[[str], Any],
        tied: list[list[str]],
        step: int | None,
        config: bytes | None,
    ) -> None:
        self.items = items
        self.fetch = fetch
        self.tied = tied
        self.step = step
        self.config = config

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data to write."""
        return sum(item.nbytes for item in self.items)


def from_reader(path: str, component: str | None, storage_options: dict[str, Any] | None = None) -> Tensors:
    """The tensors of ``component`` (default: the model's) of a checkpoint that
    :class:`~ckptd.load.reader.CheckpointReader` opens (ckptd, HF safetensors or ``.bin``, DCP's
    HF shards, a torch_checkpointing item), with
    the source's ``config.json`` when ``component`` is the model (``model``, or the only one)."""
    from ..load.reader import CheckpointReader
    from ..save.layout import WriteItem, describe_tensors

    reader = CheckpointReader.open(path, storage_options)
    name = component or reader.default_component()
    if name not in reader.components():
        raise ConfigError(f"{reader.directory} has no tensor component {name!r} (has {reader.components()})")
    config = None  # the model's configuration: never copied beside another component's tensors
    is_model = name == "model" or reader.components() == [name]
    if is_model and HF_CONFIG in reader.storage.list_names(reader.directory):
        config = reader.storage.read_bytes(reader.storage.join(reader.directory, HF_CONFIG))
    step = reader.manifest.step if reader.manifest is not None else None
    tied = reader.tied_groups(name)
    if reader.kind.startswith("torch_bin") or reader.kind == "torch_checkpointing":  # pickles: whole, weights_only
        aliases = {alias for group in tied for alias in group[1:]}
        tensors = {k: v for k, v in reader.read(name).items() if k not in aliases}
        return Tensors(describe_tensors(name, tensors), tensors.__getitem__, tied, step, config)
    records = reader.locate(name)
    items = [WriteItem(name, key, record.dtype, tuple(record.shape)) for key, record in records.items()]
    return Tensors(items, lambda key: reader.read(name, [key])[key], tied, step, config)


def load_dcp(path: str) -> dict[str, Any]:
    """A whole DCP checkpoint, read by torch's own FileSystemReader (its ``.metadata`` through
    ckptd's allowlist): tensors, and the other entries decoded with
    ``torch.load(weights_only=True)`` (never arbitrary pickle), in their saved structure (a flat
    save is ``{"model": ...}``)."""
    from ..load.dcp import nest_dcp, read_dcp_layout, read_dcp_objects, read_dcp_tensors

    layout = read_dcp_layout(path)
    values: dict[str, Any] = read_dcp_tensors(path, layout, layout.shapes)
    values.update(read_dcp_objects(path, layout.skipped))
    return dict(nest_dcp(layout, None, values))


def _flat_tensors(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            out[name] = value
        elif isinstance(value, Mapping):
            out.update(_flat_tensors(value, f"{name}."))
    return out


def from_dcp(path: str, component: str | None) -> Tensors:
    """The tensors of one entry of a DCP checkpoint (default: ``model`` when it holds a state
    dict, else the top level), flattened to dotted keys."""
    from ..save.layout import describe_tensors

    state = load_dcp(path)
    name = component or ("model" if isinstance(state.get("model"), Mapping) else None)
    if name is not None and name not in state:
        raise ConfigError(f"{path}: the DCP checkpoint has no entry {name!r} (has {sorted(state)})")
    tree = state[name] if name is not None else state
    if name is not None and not isinstance(tree, Mapping):
        raise ConfigError(f"{path}: DCP entry {name!r} is not a state dict (has {sorted(state)})")
    tensors = {k: v.detach().contiguous() for k, v in _flat_tensors(tree).items()}
    if not tensors:
        raise ConfigError(f"{path}: the DCP checkpoint has no tensors under {name or 'its top level'!r}")
    step = state.get("step") if isinstance(state.get("step"), int) else None
    return Tensors(describe_tensors(name or "model", tensors), tensors.__getitem__, [], step, None)
