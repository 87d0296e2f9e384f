"""PyTorch ``.bin`` shards (``pytorch_model-00001-of-00002.bin``): the seed API's default format.

Written only when a caller of the seed-compatible ``save_checkpoint`` passes ``safetensors=False``;
always read with ``torch.load(weights_only=True)``, which refuses arbitrary pickled objects.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Mapping

import torch

from ..errors import CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["load_bin", "load_bin_bytes", "save_bin_bytes"]


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


def _load(source: str | io.BytesIO, path: str, *, mmap: bool) -> dict[str, torch.Tensor]:
    try:
        loaded = torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"{path}: holds objects that weights_only loading refuses; ckptd never unpickles .bin files ({e})"
        ) from e
    except Exception as e:  # truncated zip, bad magic, malformed records...
        raise CorruptCheckpointError(f"{path}: cannot read PyTorch checkpoint ({type(e).__name__}: {e})") from e
    if not isinstance(loaded, Mapping) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise CorruptCheckpointError(f"{path}: expected a mapping of tensor names to tensors")
    return dict(loaded)
