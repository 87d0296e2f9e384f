"""Tensors from any source, written as shard files into a destination (the parts the
``consolidate``, ``convert`` and ``export-hf`` commands share).

Sources are described first (keys, dtypes, shapes) and fetched one tensor at a time, except
PyTorch DCP checkpoints and ``.bin`` files, which torch's own readers load whole
(``torch.distributed.checkpoint.FileSystemReader``, as ``dcp_to_torch_save`` does).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointExistsError
from ..storage import Storage, normalize_location, storage_for
from .app import Context
from .output import CliError, Progress

if TYPE_CHECKING:
    from ..formats.manifest import TensorRecord

__all__ = [
    "DCP_METADATA",
    "HF_CONFIG",
    "Destination",
    "Tensors",
    "from_dcp",
    "from_reader",
    "is_dcp_checkpoint",
    "load_dcp",
    "write_shards",
]

DCP_METADATA = ".metadata"
HF_CONFIG = "config.json"


def is_dcp_checkpoint(path: str) -> bool:
    """A local directory holding a PyTorch DCP checkpoint (its ``.metadata`` file)."""
    return "://" not in path and os.path.isfile(os.path.join(path, DCP_METADATA))


# ---- destinations ------------------------------------------------------------------------------


class Destination:
    """Where an output goes: a hidden sibling staging directory (local) or the final prefix."""

    def __init__(self, url: str, context: Context, overwrite: bool) -> None:
        self.final = normalize_location(url)
        self.storage: Storage = storage_for(self.final, context.storage_options)
        self.overwrite = overwrite
        if self.storage.local:
            self.exists = os.path.exists(self.final)
        else:
            self.storage.check_access(self.final)
            self.exists = bool(self.storage.list_names(self.final))
        if self.exists and not overwrite:
            raise CheckpointExistsError(f"{self.final} already exists")
        if self.storage.local:
            parent, base = os.path.split(self.final)
            self.staging = os.path.join(parent, f".{base}.tmp-{secrets.token_hex(4)}")
        else:
            self.staging = self.final

    def begin(self) -> None:
        """Create the staging directory (local), or clear the old output (object stores: not atomic)."""
        if self.storage.local:
            self.storage.makedirs(self.staging)
        elif self.exists:
            from ..catalog import remove_checkpoint

            remove_checkpoint(self.storage, self.final)

    def publish(self) -> None:
        from ..save.commit import publish

        # --overwrite was asked for this path by name: it may replace an HF directory too
        publish(self.storage, self.staging, self.final, overwrite=self.overwrite, replace_any=True)

    def discard(self) -> None:
        if self.storage.local:
            self.storage.remove_tree(self.staging)
        else:
            self.storage.discard(self.staging)

    def written(self) -> int:
        """Bytes written so far (for progress)."""
        return sum(self.storage.sizes(self.staging).values())


# ---- sources -----------------------------------------------------------------------------------


class Tensors:
    """A component's tensors to write: descriptions first, data fetched one tensor at a time."""

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


def from_reader(path: str, component: str | None, context: Context) -> Tensors:
    from ..load.reader import CheckpointReader
    from ..save.layout import WriteItem, describe_tensors

    reader = CheckpointReader.open(path, context.storage_options)
    name = component or reader.default_component()
    if name not in reader.components():
        raise CliError(f"{reader.directory} has no tensor component {name!r} (has {reader.components()})")
    config = None
    if HF_CONFIG in reader.storage.list_names(reader.directory):
        config = reader.storage.read_bytes(reader.storage.join(reader.directory, HF_CONFIG))
    step = reader.manifest.step if reader.manifest is not None else None
    tied = reader.tied_groups(name)
    if reader.kind.startswith("torch_bin"):  # pickled .bin files are read whole (weights_only)
        aliases = {alias for group in tied for alias in group[1:]}
        tensors = {k: v for k, v in reader.read(name).items() if k not in aliases}
        return Tensors(describe_tensors(name, tensors), tensors.__getitem__, tied, step, config)
    records = reader.locate(name)
    items = [WriteItem(name, key, record.dtype, tuple(record.shape)) for key, record in records.items()]
    return Tensors(items, lambda key: reader.read(name, [key])[key], tied, step, config)


def load_dcp(path: str) -> dict[str, Any]:
    """A whole DCP checkpoint, read by torch's own FileSystemReader: tensors, and the other
    entries decoded with ``torch.load(weights_only=True)`` (never arbitrary pickle), in their
    saved structure (a flat save is ``{"model": ...}``)."""
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
    from ..save.layout import describe_tensors

    state = load_dcp(path)
    name = component or ("model" if isinstance(state.get("model"), Mapping) else None)
    tree = state[name] if name is not None else state
    if name is not None and not isinstance(tree, Mapping):
        raise CliError(f"{path}: DCP entry {name!r} is not a state dict (has {sorted(state)})")
    tensors = {k: v.detach().contiguous() for k, v in _flat_tensors(tree).items()}
    if not tensors:
        raise CliError(f"{path}: the DCP checkpoint has no tensors under {name or 'its top level'!r}")
    step = state.get("step") if isinstance(state.get("step"), int) else None
    return Tensors(describe_tensors(name or "model", tensors), tensors.__getitem__, [], step, None)


# ---- writing -----------------------------------------------------------------------------------


def write_shards(
    source: Tensors, destination: Destination, max_shard_size: int, progress: Progress
) -> tuple[dict[str, Any], dict[str, TensorRecord], dict[str, str]]:
    """Stream the tensors into ``model-0000k-of-0000n.safetensors`` files in the staging place."""
    from ..formats.manifest import TensorRecord
    from ..formats.names import shard_file_name
    from ..save.layout import bucket_items, plan_file
    from ..save.tensor_files import write_layout

    storage, staging = destination.storage, destination.staging
    buckets = [b for b in bucket_items(source.items, max_shard_size) if b]
    written: dict[str, Any] = {}
    records: dict[str, TensorRecord] = {}
    weight_map: dict[str, str] = {}

    def fetch(item: Any) -> Any:
        tensor = source.fetch(item.key)
        progress.update(item.nbytes)
        return tensor

    for number, bucket in enumerate(buckets, start=1):
        layout = plan_file("model", shard_file_name("model", number, len(buckets)), bucket)
        written[layout.file_name] = write_layout(storage, storage.join(staging, layout.file_name), layout, fetch)
        for index, item in enumerate(layout.items):
            start = layout.item_file_offset(index)
            records[item.key] = TensorRecord.whole(item.dtype, item.shape, layout.file_name, start, start + item.nbytes)
            weight_map[item.key] = layout.file_name
    return written, records, weight_map
