"""Consolidation: any ckptd checkpoint → a self-contained one with whole tensors (HF-compatible).

Tensors saved as pieces (sharded saves that could not write whole tensors, e.g. tensor-parallel
splits along dim 1 or saves to object stores) are assembled one at a time and streamed into new
shard files, so memory stays bounded by the largest tensor, whatever the checkpoint's size.
"""

from __future__ import annotations

import os
import time
from typing import Any

from .._version import __version__
from ..errors import CheckpointNotFoundError, ConfigError
from ..formats.manifest import FileRecord, Manifest, TensorRecord
from ..formats.names import shard_file_name
from ..load.reader import CheckpointReader
from ..options import DEFAULT_MAX_SHARD_SIZE, parse_size
from ..save.commit import ComponentInfo, check_destination, check_object_prefix, finalize_checkpoint, staging_directory
from ..save.layout import WriteItem, bucket_items, plan_file
from ..save.tensor_files import write_layout
from ..storage import normalize_location, storage_for

__all__ = ["consolidate"]


def consolidate(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    storage_options: dict[str, Any] | None = None,
    destination_storage_options: dict[str, Any] | None = None,
    verify: bool = False,
    overwrite: bool = False,
) -> Manifest:
    """Write ``source`` (a committed ckptd checkpoint) as a new checkpoint at ``destination``
    where every tensor is stored whole, in HF-style shards with an index per component.

    Tensors are read and written one at a time.  The result keeps the source's components,
    non-tensor state, tied groups, step, metadata and metrics; its manifest is written last.

    An existing checkpoint at ``destination`` raises :class:`~ckptd.errors.CheckpointExistsError`
    before anything is read, unless ``overwrite=True``: then it is replaced once the new one is
    complete (on local disks in one atomic swap, so ``destination`` is the old or the new
    checkpoint at every moment).  A ``destination`` that holds anything but a checkpoint (a local
    directory that is not empty, an object-store prefix with objects that are not ckptd's) is
    never replaced or written into (:class:`~ckptd.errors.ForeignFilesError`, before anything is
    read, whatever ``overwrite`` says: see :func:`ckptd.save.commit.check_destination` and
    :func:`~ckptd.save.commit.check_object_prefix`), and ``destination`` may not be ``source``
    (``ConfigError``).
    """
    reader = CheckpointReader.open(source, storage_options, require_manifest=True)
    manifest = reader.manifest
    if manifest is None:  # pragma: no cover - require_manifest guarantees it
        raise CheckpointNotFoundError(f"{source}: not a committed ckptd checkpoint (no manifest)")
    limit = parse_size(max_shard_size, "max_shard_size")
    target = os.fspath(destination)
    storage = storage_for(target, destination_storage_options)
    final = normalize_location(target)
    if final == reader.directory:
        raise ConfigError(f"{final}: consolidate() needs a destination other than its source")
    if storage.local:
        check_destination(final, overwrite=overwrite)  # before any work, as the commit would
    else:
        check_object_prefix(storage, final)  # someone's objects: refused before the verify pass too
    if verify:
        reader.verify()
    started = time.perf_counter()
    with staging_directory(storage, final, overwrite=overwrite) as staging:
        written: dict[str, FileRecord] = {}
        tensors: dict[str, dict[str, TensorRecord]] = {}
        for name, component in manifest.components.items():
            items = [WriteItem(name, key, record.dtype, record.shape) for key, record in component.tensors.items()]
            if not items:
                continue
            buckets = [b for b in bucket_items(items, limit) if b]
            for number, bucket in enumerate(buckets, start=1):
                layout = plan_file(name, shard_file_name(name, number, len(buckets)), bucket)
                path = storage.join(staging, layout.file_name)
                written[layout.file_name] = write_layout(
                    storage, path, layout, lambda item: reader.read(item.component, [item.key])[item.key]
                )
                for index, item in enumerate(layout.items):
                    start = layout.item_file_offset(index)
                    tensors.setdefault(name, {})[item.key] = TensorRecord.whole(
                        item.dtype, item.shape, layout.file_name, start, start + item.nbytes
                    )
        trees = reader.state_trees()
        return finalize_checkpoint(
            storage,
            staging,
            final,
            step=manifest.step,
            written=written,
            expected_sizes={name: record.size for name, record in written.items()},
            tensors={
                name: {k: tensors[name][k] for k in c.tensors}
                for name, c in manifest.components.items()
                if name in tensors
            },
            components=[
                ComponentInfo(name, "safetensors", c.tied, sharing=c.sharing) for name, c in manifest.components.items()
            ],
            trees=trees if manifest.state_file else None,
            metadata={**manifest.metadata, "consolidated_from": os.fspath(source), "consolidated_by": __version__},
            metrics=manifest.metrics,
            timings={"consolidate": time.perf_counter() - started},
            world_size=1,
            overwrite=overwrite,
        )
