"""PyTorch ``.bin`` shards (``pytorch_model-00001-of-00002.bin``): the seed API's default format.

Written only when a caller of the seed-compatible ``save_checkpoint`` passes ``safetensors=False``;
always read with ``torch.load(weights_only=True)``, which refuses arbitrary pickled objects.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["flat_tensors", "load_bin", "load_bin_bytes", "load_tree", "load_tree_bytes", "save_bin_bytes"]


def save_bin_bytes(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """The bytes of a ``.bin`` shard holding ``tensors`` (contiguous CPU copies)."""
    buffer = io.BytesIO()
    torch.save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, buffer)
    return buffer.getvalue()


def load_bin(path: str) -> dict[str, torch.Tensor]:
    """Load a local ``.bin`` shard with ``weights_only=True`` (memory-mapped when possible)."""
    return _load(path, path, mmap=os.path.getsize(path) > 0)


def load_bin_bytes(data: bytes, where: str) -> dict[str, torch.Tensor]:
    """Load a ``.bin`` shard fetched into memory, with ``weights_only=True``."""
    return _load(io.BytesIO(data), where, mmap=False)


def load_tree(path: str, name: str) -> dict[str, torch.Tensor]:
    """The tensors of any ``torch.save`` file (a nested state dict, an optimizer's, a bare tensor;
    ``weights_only=True``), flattened by :func:`flat_tensors` (``name``: a bare tensor's key)."""
    return flat_tensors(_weights_only(path, path, mmap=os.path.getsize(path) > 0), name)


def load_tree_bytes(data: bytes, where: str, name: str) -> dict[str, torch.Tensor]:
    """:func:`load_tree` of a file fetched into memory."""
    return flat_tensors(_weights_only(io.BytesIO(data), where, mmap=False), name)


def flat_tensors(value: Any, name: str) -> dict[str, torch.Tensor]:
    """The tensor leaves of ``value`` under dotted paths (dict keys and list indices joined by
    ``.``, as torch_checkpointing and ``state_dict()`` name them); a bare tensor is ``name``.
    Other leaves (numbers, strings, ``param_groups``' options) are left out."""
    out: dict[str, torch.Tensor] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, torch.Tensor):
            out[prefix or name] = node
        elif isinstance(node, Mapping):
            for key, child in node.items():
                walk(child, f"{prefix}.{key}" if prefix else str(key))
        elif isinstance(node, (list, tuple)):
            for index, child in enumerate(node):
                walk(child, f"{prefix}.{index}" if prefix else str(index))

    walk(value, "")
    return out


def _load(source: str | io.BytesIO, path: str, *, mmap: bool) -> dict[str, torch.Tensor]:
    loaded = _weights_only(source, path, mmap=mmap)
    if not isinstance(loaded, Mapping) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise CorruptCheckpointError(f"{path}: expected a mapping of tensor names to tensors")
    return dict(loaded)


def _weights_only(source: str | io.BytesIO, path: str, *, mmap: bool) -> Any:
    try:
        loaded = torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"{path}: holds objects that weights_only loading refuses; ckptd never unpickles PyTorch files ({e})"
        ) from e
    except Exception as e:  # truncated zip, bad magic, malformed records...
        raise CorruptCheckpointError(f"{path}: cannot read PyTorch checkpoint ({type(e).__name__}: {e})") from e
    return loaded
