"""Torch dtypes and their safetensors names (``torch.bfloat16`` ↔ ``"BF16"``).

Kept apart from :mod:`ckptd.formats.safetensors` so that the header code, the manifest and
everything that only reads them (the commit, the catalog, the writer process) import no torch.
"""

from __future__ import annotations

import torch

from ..errors import CorruptCheckpointError, UnsupportedValueError

__all__ = ["TORCH_DTYPES", "dtype_from_name", "dtype_name"]

TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
}
_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in TORCH_DTYPES.items()}


def dtype_name(dtype: torch.dtype, key: str = "") -> str:
    """The safetensors name of a torch dtype (``torch.bfloat16`` → ``"BF16"``)."""
    try:
        return _NAMES[dtype]
    except KeyError:
        where = f" (tensor {key!r})" if key else ""
        supported = ", ".join(str(d) for d in _NAMES)
        raise UnsupportedValueError(
            f"dtype {dtype}{where} cannot be stored in safetensors; supported: {supported}"
        ) from None


def dtype_from_name(name: str, where: str = "") -> torch.dtype:
    """The torch dtype of a safetensors dtype name (``"BF16"`` → ``torch.bfloat16``)."""
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise CorruptCheckpointError(f"unknown safetensors dtype {name!r}{where}") from None
