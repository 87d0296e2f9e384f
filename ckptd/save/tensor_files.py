"""Synchronous file writes straight from tensors, with no staging arena.

The functional API (``save_checkpoint``...) and ``consolidate`` write through here: a planned
safetensors file is streamed header first, then one tensor at a time (so memory holds one tensor),
with its CRC32C computed on the way.  Asynchronous saves go through the writer process instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch

from ..formats.checksum import crc32c, format_crc
from ..formats.manifest import FileRecord
from ..load.fetch import tensor_memoryview
from ..storage import Storage
from .layout import FileLayout, WriteItem, describe_tensors, plan_file

__all__ = ["write_layout", "write_safetensors_file", "write_whole_file"]


def write_whole_file(storage: Storage, path: str, data: bytes) -> FileRecord:
    """Write a whole file (atomically on local disk) and return its record."""
    storage.write_stream(path, [memoryview(data)])
    return FileRecord(len(data), format_crc(crc32c(data)))


def write_safetensors_file(storage: Storage, path: str, tensors: Mapping[str, torch.Tensor]) -> FileRecord:
    """Write one safetensors file holding ``tensors`` and return its record."""
    layout = plan_file("model", path.rsplit("/", 1)[-1], describe_tensors("model", dict(tensors)))
    return write_layout(storage, path, layout, lambda item: tensors[item.key])


def write_layout(
    storage: Storage, path: str, layout: FileLayout, tensor_for: Callable[[WriteItem], torch.Tensor]
) -> FileRecord:
    """Stream a planned safetensors file: its header, then each item's bytes, fetched one tensor
    at a time with ``tensor_for`` (so memory holds one tensor); returns its size and CRC32C."""
    checksum = [crc32c(layout.header)]

    def pieces() -> Iterator[memoryview]:
        yield memoryview(layout.header)
        for item in layout.items:
            tensor = tensor_for(item).detach().to("cpu").contiguous()
            view = tensor_memoryview(tensor)
            checksum[0] = crc32c(view, checksum[0])
            yield view
            del tensor, view

    storage.write_stream(path, pieces())
    return FileRecord(layout.size, format_crc(checksum[0]))
