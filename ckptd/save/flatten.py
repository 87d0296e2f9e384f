"""Nested training state ⇄ flat tensor keys plus a JSON object tree.

A save receives a mapping of *components* (``{"model": model, "optimizer": opt, ...}``).  Each
component is turned into its state (``state_dict()`` for stateful objects) and then split into

* ``tensors``: flat ``{key: Tensor}``; keys are the nested path joined with ``"."``, so a module's
  state dict keeps its own keys (``"layers.0.weight"``), which is what HF tools expect;
* ``tree``: a JSON-compatible copy of the structure where every tensor is replaced by a reference
  to its key and non-JSON values (tuples, int dict keys, dtypes, non-finite floats...) are tagged.

Encoding happens at snapshot time, so mutating the caller's objects afterwards cannot change what
is saved, and an unsupported object is reported before anything is written.  Arbitrary objects
are refused unless the caller opts into pickle, both when saving and when loading.
"""

from __future__ import annotations

import base64
import math
import pickle
import re
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..dist.grid import Grid, grid_of
from ..dist.sharding import ShardedTensor, describe_dtensor, is_dtensor, is_main_replica
from ..errors import CkptdError, ConfigError, CorruptCheckpointError, UnsafeCheckpointError, UnsupportedValueError

__all__ = [
    "COMPONENT_NAME_RE",
    "MAX_TREE_DEPTH",
    "FlatComponent",
    "Placement",
    "component_state",
    "find_tied_groups",
    "flatten_component",
    "restore_tree",
    "tensor_leaves",
    "tree_tensor_keys",
]

TAG = "__ckptd__"
MAX_TREE_DEPTH = 100
"""Deepest nesting of containers a component's state may have (its JSON tree then stays within
the depth every reader accepts, :data:`ckptd.formats.json_files.MAX_JSON_DEPTH`)."""
COMPONENT_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


@dataclass(frozen=True)
class Placement:
    """Where a local tensor sits in its global tensor (sharded tensors only); for a DTensor
    placed by plain ``Shard``/``Replicate`` placements, also its mesh, its
    :class:`~ckptd.dist.grid.Grid` and this rank's coordinate in the mesh."""

    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    main: bool
    mesh: Any = None
    grid: Grid | None = None
    coordinate: tuple[int, ...] = ()


@dataclass(frozen=True)
class FlatComponent:
    """One component of a save, flattened.

    ``tensors`` holds each distinct local tensor once; ``placements`` says, for the pieces of
    sharded tensors (DTensor, :class:`~ckptd.ShardedTensor`), where they sit in their global
    tensor; ``tied`` lists groups of keys that alias the same storage (first key is the one
    stored); ``frozen`` the keys of parameters with ``requires_grad=False``; ``tree`` is the
    JSON-compatible structure.
    """

    name: str
    tensors: dict[str, torch.Tensor]
    tree: Any
    tied: list[list[str]] = field(default_factory=list)
    placements: dict[str, Placement] = field(default_factory=dict)
    frozen: frozenset[str] = frozenset()


def component_state(value: Any) -> Any:
    """The state of one component: ``value.state_dict()`` for stateful objects, else ``value``."""
    if isinstance(value, torch.Tensor) or isinstance(value, Mapping):
        return value
    if isinstance(value, torch.nn.Module):
        return value.state_dict(keep_vars=True)  # Parameters keep requires_grad (frozen detection)
    state_dict = getattr(value, "state_dict", None)
    if callable(state_dict):
        return state_dict()
    return value


def flatten_component(name: str, value: Any, *, allow_pickle: bool = False) -> FlatComponent:
    """Flatten one component; raises :class:`UnsupportedValueError` on values it cannot store."""
    if not COMPONENT_NAME_RE.match(name):
        raise ConfigError(
            f"component name {name!r} must be letters, digits, '_', '-' or '.', not starting with '.' or '-'"
        )
    state = component_state(value)
    encoder = _Encoder(name, allow_pickle)
    try:
        tree = encoder.encode(state, (), top=True)
    except RecursionError as e:  # e.g. a state_dict() that returns an object with a state_dict()
        raise UnsupportedValueError(
            f"the state of component {name!r} recurses without end (or too deeply) and cannot be stored"
        ) from e
    tied = find_tied_groups(encoder.tensors)
    tensors = dict(encoder.tensors)
    for group in tied:
        for alias in group[1:]:
            del tensors[alias]
    placements = {k: p for k, p in encoder.placements.items() if k in tensors}
    frozen = frozenset(k for k in encoder.frozen if k in tensors)
    return FlatComponent(name=name, tensors=tensors, tree=tree, tied=tied, placements=placements, frozen=frozen)


def find_tied_groups(tensors: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """Groups of keys whose tensors are the same view of the same storage (tied parameters).

    Tensors that are the same view start at the same address, so only tensors sharing a
    ``data_ptr`` with another are compared in full (asking a tensor for its storage costs more
    than everything else here, and most tensors share nothing).
    """
    pointers: dict[str, int] = {}  # str -> int only: the garbage collector does not track it
    counts: dict[int, int] = {}
    for key, value in tensors.items():
        tensor = value.to_local() if is_dtensor(value) else value  # type: ignore[attr-defined]
        if tensor.is_meta or tensor.numel() == 0:
            continue
        pointer = pointers[key] = tensor.data_ptr()
        counts[pointer] = counts.get(pointer, 0) + 1
    by_view: dict[tuple[Any, ...], list[str]] = {}
    for key, pointer in pointers.items():
        if counts[pointer] == 1:
            continue
        value = tensors[key]
        tensor = value.to_local() if is_dtensor(value) else value  # type: ignore[attr-defined]
        identity = (
            tensor.device,
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tensor.dtype,
            tuple(tensor.shape),
            tensor.stride(),
        )
        by_view.setdefault(identity, []).append(key)
    return [keys for keys in by_view.values() if len(keys) > 1]


def tensor_leaves(name: str, value: Any) -> dict[str, Any]:
    """The tensors of a component's current state under the keys a save would give them (DTensor
    and :class:`~ckptd.ShardedTensor` leaves as they are): the in-place targets of a load.
    Values that could not be saved are skipped, not refused."""
    encoder = _Encoder(name, allow_pickle=False, lenient=True)
    try:
        encoder.encode(component_state(value), (), top=True)
    except RecursionError as e:
        raise UnsupportedValueError(f"the state of component {name!r} recurses without end (or too deeply)") from e
    return encoder.leaves


class _Encoder:
    def __init__(self, component: str, allow_pickle: bool, lenient: bool = False) -> None:
        self.component = component
        self.allow_pickle = allow_pickle
        self.lenient = lenient
        self.tensors: dict[str, torch.Tensor] = {}
        self.placements: dict[str, Placement] = {}
        self.leaves: dict[str, Any] = {}
        self.frozen: set[str] = set()

    def _where(self, path: tuple[str, ...]) -> str:
        return ".".join((self.component, *path)) if path else self.component

    def _tensor_key(self, path: tuple[str, ...]) -> str:
        key = ".".join(path) if path else self.component
        if key in self.tensors:
            raise ConfigError(
                f"two tensors in component {self.component!r} flatten to the same key {key!r}; "
                "rename one of the nested keys"
            )
        return key

    def encode(self, value: Any, path: tuple[str, ...], top: bool = False) -> Any:
        if len(path) > MAX_TREE_DEPTH:
            if self.lenient:
                return None
            raise UnsupportedValueError(
                f"the state of component {self.component!r} is nested more than {MAX_TREE_DEPTH} levels deep "
                f"(at {'.'.join(path[:6])}...); flatten it (or store it as bytes) before saving"
            )
        if isinstance(value, ShardedTensor):
            if value.data is None:
                raise UnsupportedValueError(f"sharded tensor {value.key!r} at {self._where(path)!r} has no data")
            key = self._add_tensor(value.local_view(), path, key=value.key)
            self.placements[key] = Placement(value.global_shape, value.box.offset, is_main_replica(value.replica_id))
            self.leaves[key] = value
            return {TAG: "tensor", "key": key, "sharded": "sharded_tensor"}
        if is_dtensor(value):
            local, global_shape, offset, replica = describe_dtensor(value)
            key = self._add_tensor(local, path)
            if isinstance(value, torch.nn.Parameter) and not value.requires_grad:
                self.frozen.add(key)
            self.placements[key] = Placement(global_shape, offset, is_main_replica(replica), *(grid_of(value) or ()))
            self.leaves[key] = value
            return {TAG: "tensor", "key": key, "sharded": "dtensor"}
        if isinstance(value, torch.Tensor):
            key = self._add_tensor(value, path)
            self.leaves[key] = value
            return {TAG: "tensor", "key": key}
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            if math.isfinite(value):
                return float(value)
            return {TAG: "float", "value": repr(value)}
        if isinstance(value, Mapping):
            return self._encode_mapping(value, path)
        if isinstance(value, torch.Size):
            return {TAG: "size", "items": list(value)}
        if isinstance(value, tuple):
            return {TAG: "tuple", "items": [self.encode(v, (*path, str(i))) for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self.encode(v, (*path, str(i))) for i, v in enumerate(value)]
        if isinstance(value, (set, frozenset)):
            items = sorted((self.encode(v, (*path, "?")) for v in value), key=repr)
            return {TAG: "frozenset" if isinstance(value, frozenset) else "set", "items": items}
        if isinstance(value, torch.dtype):
            return {TAG: "dtype", "value": str(value).removeprefix("torch.")}
        if isinstance(value, torch.device):
            return {TAG: "device", "value": str(value)}
        if isinstance(value, (bytes, bytearray)):
            return {TAG: "bytes", "b64": base64.b64encode(bytes(value)).decode("ascii")}
        encoded = self._encode_numpy(value, path)
        if encoded is not None:
            return encoded
        if not top and hasattr(value, "state_dict") and callable(value.state_dict):
            return self.encode(value.state_dict(), path)
        if self.lenient:
            return None
        if self.allow_pickle:
            return {TAG: "pickle", "b64": base64.b64encode(pickle.dumps(value)).decode("ascii")}
        raise UnsupportedValueError(
            f"cannot store {type(value).__module__}.{type(value).__qualname__} at {self._where(path)!r}: "
            "only tensors, numbers, strings, None, lists, tuples, dicts, sets, bytes, dtypes and numpy "
            "values are stored without pickle; convert it, or pass allow_pickle=True on save and load"
        )

    def _add_tensor(self, tensor: torch.Tensor, path: tuple[str, ...], key: str | None = None) -> str:
        if tensor.layout != torch.strided:  # sparse (COO, CSR...) tensors
            raise UnsupportedValueError(f"sparse tensor at {self._where(path)!r}: only dense tensors can be saved")
        if tensor.is_quantized:
            raise UnsupportedValueError(f"quantized tensor at {self._where(path)!r} cannot be saved as safetensors")
        if tensor.is_meta:
            raise UnsupportedValueError(f"tensor at {self._where(path)!r} is on the meta device and holds no data")
        if key is None:
            key = self._tensor_key(path)
        elif key in self.tensors:
            raise ConfigError(f"two sharded tensors in component {self.component!r} use the key {key!r}")
        # A frozen parameter.  isinstance(x, Parameter) runs Python code (Parameter's metaclass):
        # a plain tensor, the common case by far, is told apart by its exact type first.
        if not tensor.requires_grad and type(tensor) is not torch.Tensor and isinstance(tensor, torch.nn.Parameter):
            self.frozen.add(key)
        # Detached only where autograd tracks it (a new tensor object costs ~0.8 µs per tensor).
        self.tensors[key] = tensor.detach() if tensor.requires_grad else tensor
        return key

    def _encode_mapping(self, value: Mapping[Any, Any], path: tuple[str, ...]) -> Any:
        if all(isinstance(k, str) for k in value) and TAG not in value:
            return {k: self.encode(v, (*path, k)) for k, v in value.items()}
        items = [[self.encode(k, (*path, "<key>")), self.encode(v, (*path, str(k)))] for k, v in value.items()]
        return {TAG: "dict", "items": items}

    def _encode_numpy(self, value: Any, path: tuple[str, ...]) -> Any:
        module = type(value).__module__
        if not module.startswith("numpy"):
            return None
        import numpy as np

        if isinstance(value, np.ndarray):
            try:
                tensor = torch.from_numpy(np.ascontiguousarray(value).copy())
            except TypeError:  # object, string and other dtypes torch cannot hold
                return None
            return {TAG: "ndarray", "key": self._add_tensor(tensor, path)}
        if isinstance(value, np.generic):
            return {TAG: "npscalar", "dtype": str(value.dtype), "value": self.encode(value.item(), path)}
        return None


def tree_tensor_keys(tree: Any, where: str = "") -> list[str]:
    """The tensor keys an encoded tree refers to, in order; raises
    :class:`CorruptCheckpointError` when a tensor reference is malformed."""
    keys: list[str] = []
    stack = [tree]  # iterative: a hostile tree may be deep
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get(TAG) in ("tensor", "ndarray"):
                key = node.get("key")
                if not isinstance(key, str):
                    raise CorruptCheckpointError(
                        f"{where or 'the checkpoint state'}: tensor reference {_preview(node)} has no string 'key'"
                    )
                keys.append(key)
                continue
            stack.extend(reversed(list(node.values())))
        elif isinstance(node, list):
            stack.extend(reversed(node))
    return keys


def _preview(node: Any) -> str:
    return reprlib.repr(node)  # bounded in length and depth: the node may be hostile


def restore_tree(tree: Any, tensors: Mapping[str, torch.Tensor], *, allow_pickle: bool = False, where: str = "") -> Any:
    """Rebuild the original structure of an encoded tree, taking tensors from ``tensors``.

    A malformed tree (a tag with the wrong fields, a reference to a tensor not given, nesting
    deeper than Python can rebuild) raises :class:`CorruptCheckpointError` naming ``where``.
    """
    try:
        return _decode_tree(tree, tensors, allow_pickle, where)
    except CkptdError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError, RuntimeError) as e:
        # RuntimeError covers RecursionError (deep trees) and torch.device/torch.Size refusals.
        raise CorruptCheckpointError(
            f"{where or 'the checkpoint state'}: malformed state tree ({type(e).__name__}: {e}); "
            "the state file is corrupt"
        ) from e


def _decode_tree(tree: Any, tensors: Mapping[str, torch.Tensor], allow_pickle: bool, where: str) -> Any:
    def decode(node: Any) -> Any:
        if isinstance(node, list):
            return [decode(v) for v in node]
        if not isinstance(node, dict):
            return node
        tag = node.get(TAG)
        if tag is None:
            return {k: decode(v) for k, v in node.items()}
        if tag == "tensor":
            return tensors[node["key"]]
        if tag == "tuple":
            return tuple(decode(v) for v in node["items"])
        if tag == "dict":
            return {_hashable(decode(k)): decode(v) for k, v in node["items"]}
        if tag == "float":
            return float(node["value"])
        if tag == "size":
            return torch.Size(node["items"])
        if tag == "set":
            return {_hashable(decode(v)) for v in node["items"]}
        if tag == "frozenset":
            return frozenset(_hashable(decode(v)) for v in node["items"])
        if tag == "dtype":
            dtype = getattr(torch, node["value"], None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"{node['value']!r} is not a torch dtype")
            return dtype
        if tag == "device":
            return torch.device(node["value"])
        if tag == "bytes":
            return base64.b64decode(node["b64"], validate=True)
        if tag == "ndarray":
            return tensors[node["key"]].cpu().numpy()
        if tag == "npscalar":
            import numpy as np

            return np.dtype(node["dtype"]).type(decode(node["value"]))
        if tag == "pickle":
            if not allow_pickle:
                raise UnsafeCheckpointError(
                    f"{where or 'the checkpoint'} holds a pickled object; pass allow_pickle=True "
                    "only if you trust the checkpoint"
                )
            try:
                return pickle.loads(base64.b64decode(node["b64"]))
            except Exception as e:  # anything unpickling raises: truncated data, a class that is gone, ...
                raise CorruptCheckpointError(
                    f"{where or 'the checkpoint state'}: a pickled object cannot be rebuilt ({type(e).__name__}: {e})"
                ) from e
        raise CorruptCheckpointError(
            f"unknown tag {tag!r} in {where or 'the checkpoint state'} (written by a newer ckptd, or corrupt)"
        )

    return decode(tree)


def _hashable(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    return value
