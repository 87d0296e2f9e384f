"""Reading PyTorch Distributed Checkpoint (DCP) directories through torch's reader, without pickle.

A DCP checkpoint is ``.metadata`` (written last by the coordinator: DCP's commit record) and
``__<rank>_<n>.distcp`` data files; Megatron-Core's ``torch_dist`` checkpoints are DCP
checkpoints too.  The layout comes from ``.metadata`` and the bytes from
``torch.distributed.checkpoint.load`` with ``no_dist=True`` (each process reads on its own; no
process group needed).

``.metadata`` is a pickle, and torch's own ``FileSystemReader.read_metadata()`` is a plain
``pickle.load``: a crafted file would run code.  So every read of it, ours and the one
``torch.distributed.checkpoint.load`` makes itself, goes through :mod:`.dcp_metadata`'s
restricted unpickler (DCP's metadata classes, ``torch.Size``, dtypes and a few inert builtins;
nothing else is imported or called): torch is given :func:`~.dcp_metadata.safe_reader`, a
``FileSystemReader``/``FsspecReader`` whose ``read_metadata`` is that one.  A file that asks for
anything else raises :class:`~ckptd.errors.UnsafeCheckpointError` and runs nothing.

Tensors are grouped into components by the first element of their original nested path
(``{"model": ..., "optimizer": ...}`` saves); a flat state dict is the ``model`` component.
Non-tensor entries (an optimizer's ``param_groups``, Megatron's ``ShardedObject`` pieces) are
``torch.save`` pickles in DCP: :func:`read_dcp_objects` fetches their bytes through torch's
reader and decodes them with ``torch.load(weights_only=True)`` only (never arbitrary pickle);
tensor reads use a planner that refuses such entries outright (torch's default planner would
``torch.load(weights_only=False)`` them).  :func:`nest_dcp` puts a component's values back into
their original nested structure.
"""

from __future__ import annotations

import io
import logging
import pickle
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CkptdError, CorruptCheckpointError, KeyMismatchError, UnsafeCheckpointError
from ..formats.manifest import TensorRecord
from ..formats.torch_dtypes import dtype_name
from .dcp_metadata import safe_reader
from .fetch import Destination, empty_tensor

__all__ = [
    "DCP_METADATA",
    "DcpLayout",
    "fetch_dcp",
    "is_dcp",
    "nest_dcp",
    "read_dcp_layout",
    "read_dcp_objects",
    "read_dcp_tensors",
]

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
    ``shapes``/``dtypes`` are its global shape and dtype by that name; ``skipped`` the names of
    the non-tensor entries; ``paths`` every entry's original nested path (list indices as ints)
    and ``flat`` whether the save was a flat state dict (then everything is ``model``)."""

    components: dict[str, dict[str, str]]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    skipped: tuple[str, ...]
    paths: dict[str, tuple[str | int, ...]] = field(default_factory=dict)
    flat: bool = True

    def component_of(self, fqn: str) -> str:
        """The component an entry belongs to."""
        return "model" if self.flat else str(self.paths.get(fqn, (fqn,))[0])


def _reader(directory: str, local: bool, storage_options: Mapping[str, Any] | None) -> Any:
    """torch's reader for ``directory``, its ``.metadata`` read through the allowlist only."""
    return safe_reader(directory, local=local, storage_options=storage_options)


def _torch_load(directory: str, reader: Any, state: dict[str, Any], planner: Any, what: str) -> None:
    """``torch.distributed.checkpoint.load`` in this process alone, its failures as ckptd errors.

    torch wraps every failure in ``CheckpointException`` (a ``BaseException``), and turns a
    failed ``read_metadata`` into a bare ``AssertionError`` naming it: the reader keeps its own
    refusal (``ckptd_error``), which is raised as it was; a ckptd error from the planner too;
    an interrupt stays an interrupt; anything else is a :class:`CorruptCheckpointError`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        try:
            dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
        except (Exception, CheckpointException) as e:
            cause = getattr(reader, "ckptd_error", None) or _wrapped(e)
            if cause is not None:
                raise cause from e
            raise CorruptCheckpointError(f"{directory}: torch could not read {what} ({e})") from e


def _wrapped(error: BaseException) -> BaseException | None:
    """A ckptd error or an interrupt that torch's ``CheckpointException`` wraps, if any."""
    failures = getattr(error, "failures", None)
    for failure in failures.values() if isinstance(failures, dict) else ():
        cause = failure[0] if isinstance(failure, tuple) and failure else None  # (exception, stack summary)
        if isinstance(cause, CkptdError) or (isinstance(cause, BaseException) and not isinstance(cause, Exception)):
            return cause
    return None


def _path(paths: Any, fqn: str) -> tuple[Any, ...]:
    """An entry's original nested path from DCP's planner data (the name itself if none)."""
    path = paths.get(fqn) if isinstance(paths, dict) else None
    return tuple(path) if isinstance(path, (tuple, list)) and path else (fqn,)


def read_dcp_layout(
    directory: str, *, local: bool = True, storage_options: Mapping[str, Any] | None = None
) -> DcpLayout:
    """The tensors of the DCP checkpoint in ``directory``, grouped into components."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = _reader(directory, local, storage_options).read_metadata()
    except CkptdError:
        raise  # refused by the allowlist, or not DCP metadata: the message names the file
    except Exception as e:  # the file cannot be opened or read: assorted types
        raise CorruptCheckpointError(f"{directory}/{DCP_METADATA}: cannot read this DCP metadata ({e})") from e
    paths = metadata.planner_data
    entries = metadata.state_dict_metadata
    tensors = {fqn: md for fqn, md in entries.items() if isinstance(md, TensorStorageMetadata)}
    skipped = tuple(sorted(fqn for fqn in entries if fqn not in tensors))
    nested = {fqn: tuple(str(p) for p in _path(paths, fqn)) for fqn in tensors}
    flat = all(len(path) == 1 for path in nested.values())
    original = {fqn: tuple(p if isinstance(p, int) else str(p) for p in _path(paths, fqn)) for fqn in entries}
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
        original,
        flat,
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
    wanted = list(dict.fromkeys(fqns))
    unknown = [fqn for fqn in wanted if fqn not in layout.shapes]
    if unknown:
        raise KeyMismatchError(f"{directory}: the DCP checkpoint has no tensor(s) {unknown[:5]}")
    state = {
        fqn: empty_tensor(layout.shapes[fqn], layout.dtypes[fqn], f"{directory}: DCP tensor {fqn!r}") for fqn in wanted
    }
    if not state:
        return {}
    reader = _reader(directory, local, storage_options)
    _torch_load(directory, reader, state, _tensor_planner(directory), "the DCP data files")
    return state


def _tensor_planner(directory: str) -> Any:
    """torch's default load planner, except that an entry stored as pickled bytes is refused
    (the default would ``torch.load(weights_only=False)`` it): only tensors are asked for, so
    bytes mean the ``.metadata`` changed since the layout was read."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class _TensorsOnlyPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            raise UnsafeCheckpointError(
                f"{directory}: DCP entry {read_item.dest_index.fqn!r} is stored as pickled bytes, not a tensor "
                "(its .metadata changed while it was read?); ckptd does not unpickle it"
            )

    return _TensorsOnlyPlanner()


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


def _bytes_planner() -> Any:
    """A torch load planner that keeps each non-tensor entry's raw bytes (torch's own planner
    would unpickle them with ``weights_only=False``)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class _RawBytesPlanner(DefaultLoadPlanner):
        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.raw: dict[str, bytes] = {}

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            self.raw[read_item.dest_index.fqn] = value.read()

    return _RawBytesPlanner()


def read_dcp_objects(
    directory: str,
    fqns: Iterable[str],
    *,
    local: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The non-tensor entries ``fqns`` of a DCP checkpoint, read by torch's reader and decoded
    with ``torch.load(weights_only=True)``; a value that would need arbitrary pickle raises
    :class:`~ckptd.errors.UnsafeCheckpointError` naming the entry."""
    wanted = list(dict.fromkeys(fqns))
    if not wanted:
        return {}
    planner = _bytes_planner()
    reader = _reader(directory, local, storage_options)
    _torch_load(directory, reader, dict.fromkeys(wanted), planner, f"the DCP entries {wanted[:5]}")
    out: dict[str, Any] = {}
    for fqn in wanted:
        try:
            out[fqn] = torch.load(io.BytesIO(planner.raw[fqn]), map_location="cpu", weights_only=True)
        except KeyError as e:
            raise KeyMismatchError(f"{directory}: the DCP checkpoint has no entry {fqn!r}") from e
        except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError, EOFError) as e:
            raise UnsafeCheckpointError(
                f"{directory}: DCP entry {fqn!r} is not readable with torch.load(weights_only=True) ({e}); "
                "only plain values (numbers, strings, lists, dicts, tensors) are loaded from DCP entries"
            ) from e
    return out


def nest_dcp(layout: DcpLayout, component: str | None, values: Mapping[str, Any]) -> Any:
    """Entries (``values`` by DCP name) put back into their nested structure: one component's
    (``component``), or the whole saved state (None; a flat save is then ``{"model": ...}``).
    Dict keys are strings (DCP stores them so); integer path elements are list indices."""
    root: dict[Any, Any] = {}
    for fqn, value in values.items():
        if layout.flat:
            if component is None:
                root.setdefault("model", {})[fqn] = value
            elif component == "model":
                root[fqn] = value
            continue
        path = layout.paths.get(fqn, (fqn,))
        if component is not None:
            if not path or str(path[0]) != component:
                continue
            path = path[1:] or path
        node = root
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return _lists(root)


def _lists(node: Any) -> Any:
    """Dicts keyed 0..n-1 by ints (list indices in DCP paths) become lists."""
    if not isinstance(node, dict):
        return node
    items = {k: _lists(v) for k, v in node.items()}
    if items and all(isinstance(k, int) for k in items) and sorted(items) == list(range(len(items))):
        return [items[i] for i in range(len(items))]
    return items
