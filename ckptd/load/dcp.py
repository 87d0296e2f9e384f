"""Reading PyTorch Distributed Checkpoint (DCP) directories with torch's own reader.

A DCP checkpoint is ``.metadata`` (written last by the coordinator: DCP's commit record) and
``__<rank>_<n>.distcp`` data files; Megatron-Core's ``torch_dist`` checkpoints are DCP
checkpoints too.  Nothing here parses those files: the layout comes from
``FileSystemReader.read_metadata()`` and the bytes from ``torch.distributed.checkpoint.load``
with ``no_dist=True`` (each process reads on its own; no process group needed).

Tensors are grouped into components by the first element of their original nested path
(``{"model": ..., "optimizer": ...}`` saves); a flat state dict is the ``model`` component.
Non-tensor entries are pickles in DCP and are not read.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CorruptCheckpointError, KeyMismatchError
from ..formats.manifest import TensorRecord
from ..formats.torch_dtypes import dtype_name
from .fetch import Destination

__all__ = ["DCP_METADATA", "DcpLayout", "fetch_dcp", "is_dcp", "read_dcp_layout", "read_dcp_tensors"]

logger = logging.getLogger(__name__)

DCP_METADATA = ".metadata"
_DATA_SUFFIX = ".distcp"


def is_dcp(names: Iterable[str]) -> bool:
    """True if a directory listing is a committed DCP checkpoint (``.metadata`` + data files)."""
    listed = set(names)
    return DCP_METADATA in listed and any(n.endswith(_DATA_SUFFIX) for n in listed)


@dataclass(frozen=True)
class DcpLayout:
    """``components[name][key]`` is the DCP fully qualified name of a stored tensor;
    ``shapes``/``dtypes`` are its global shape and dtype by that name."""

    components: dict[str, dict[str, str]]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    skipped: tuple[str, ...]


def _reader(directory: str, local: bool, storage_options: Mapping[str, Any] | None) -> Any:
    if local:
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(directory)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(directory, **dict(storage_options or {}))


def read_dcp_layout(
    directory: str, *, local: bool = True, storage_options: Mapping[str, Any] | None = None
) -> DcpLayout:
    """The tensors of the DCP checkpoint in ``directory``, grouped into components."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = _reader(directory, local, storage_options).read_metadata()
    except Exception as e:  # torch raises assorted types for a damaged .metadata
        raise CorruptCheckpointError(f"{directory}/{DCP_METADATA}: torch cannot read this DCP metadata ({e})") from e
    paths = metadata.planner_data or {}
    entries = metadata.state_dict_metadata
    tensors = {fqn: md for fqn, md in entries.items() if isinstance(md, TensorStorageMetadata)}
    skipped = tuple(sorted(fqn for fqn in entries if fqn not in tensors))
    nested = {fqn: tuple(str(p) for p in paths.get(fqn, (fqn,))) for fqn in tensors}
    flat = all(len(path) == 1 for path in nested.values())
    components: dict[str, dict[str, str]] = {}
    for fqn, path in nested.items():
        if flat:
            component, key = "model", fqn
        else:
            component, key = path[0], ".".join(path[1:]) or path[0]
        components.setdefault(component, {})[key] = fqn
    if skipped:
        logger.debug("%s: %d non-tensor DCP entries are not read (pickled values)", directory, len(skipped))
    return DcpLayout(
        components,
        {fqn: tuple(md.size) for fqn, md in tensors.items()},
        {fqn: md.properties.dtype for fqn, md in tensors.items()},
        skipped,
    )


def read_dcp_tensors(
    directory: str,
    layout: DcpLayout,
    fqns: Iterable[str],
    *,
    local: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """Whole CPU tensors for ``fqns``, read by ``torch.distributed.checkpoint.load``."""
    import torch.distributed.checkpoint as dcp

    wanted = list(dict.fromkeys(fqns))
    unknown = [fqn for fqn in wanted if fqn not in layout.shapes]
    if unknown:
        raise KeyMismatchError(f"{directory}: the DCP checkpoint has no tensor(s) {unknown[:5]}")
    state = {fqn: torch.empty(layout.shapes[fqn], dtype=layout.dtypes[fqn]) for fqn in wanted}
    if not state:
        return {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        try:
            dcp.load(state, storage_reader=_reader(directory, local, storage_options), no_dist=True)
        except Exception as e:  # torch wraps per-rank failures in CheckpointException
            raise CorruptCheckpointError(f"{directory}: torch could not read the DCP data files ({e})") from e
    return state


def fetch_dcp(
    directory: str,
    layout: DcpLayout,
    fqns: Mapping[str, str],
    targets: Mapping[str, Any],
    *,
    local: bool,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Destination]:
    """Destinations for ``fqns`` (key -> DCP fully qualified name) filled from a DCP checkpoint
    through torch's reader, each narrowed to its target's piece."""
    tensors = read_dcp_tensors(directory, layout, fqns.values(), local=local, storage_options=storage_options)
    out: dict[str, Destination] = {}
    for key, fqn in fqns.items():
        tensor = tensors[fqn]
        record = TensorRecord.whole(dtype_name(tensor.dtype, key), tuple(tensor.shape), fqn, 0, 0)
        destination = Destination.make(key, record, targets.get(key), directory)
        with torch.no_grad():
            destination.buffer.copy_(tensor[destination.box.slices()])
        out[key] = destination
    return out
