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

__all__ = ["load_bin", "save_bin_bytes"]


def save_bin_bytes(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """The bytes of a ``.bin`` shard holding ``tensors`` (contiguous CPU copies)."""
    buffer = io.BytesIO()
    torch.save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, buffer)
    return buffer.getvalue()


def load_bin(path: str) -> dict[str, torch.Tensor]:
    """Load a local ``.bin`` shard with ``weights_only=True`` (memory-mapped when possible)."""
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=os.path.getsize(path) > 0)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"{path}: holds objects that weights_only loading refuses; ckptd never unpickles .bin files ({e})"
        ) from e
    except Exception as e:  # truncated zip, bad magic, malformed records...
        raise CorruptCheckpointError(f"{path}: cannot read PyTorch checkpoint ({type(e).__name__}: {e})") from e
    if not isinstance(loaded, Mapping) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise CorruptCheckpointError(f"{path}: expected a mapping of tensor names to tensors")
    return dict(loaded)
