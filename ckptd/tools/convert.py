"""Conversions between checkpoint formats: :func:`convert` and :func:`export_hf` (the library side
of ``ckptd convert`` and ``ckptd export-hf``).

Sources: a ckptd checkpoint, an HF model directory (safetensors or ``.bin``) or a PyTorch DCP
checkpoint (:mod:`ckptd.tools.tensor_sources`).  Outputs: an HF model directory (shards
``model-0000k-of-0000n.safetensors``, ``model.safetensors.index.json``, the ``config.json`` when
there is one) or a ckptd checkpoint (shards, indexes and the manifest, committed last).

Tensors are streamed one at a time except from DCP and ``.bin`` sources (loaded whole by torch's
readers).  A local output is written into a hidden sibling directory and renamed into place, so
a failed conversion leaves nothing behind and ``overwrite=True`` replaces the old copy only at
the end; on object stores the old output is removed first (an object store has no rename).
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointExistsError, ConfigError
from ..options import DEFAULT_MAX_SHARD_SIZE, parse_size
from ..storage import Storage, normalize_location, storage_for
from ..storage.liveness import Hold, hold_new_directory
from .tensor_sources import HF_CONFIG, Tensors, from_dcp, from_reader, is_dcp_checkpoint, load_dcp

if TYPE_CHECKING:
    from ..formats.manifest import TensorRecord

__all__ = ["ConvertResult", "ProgressCallback", "ShardOutput", "convert", "export_hf", "source_format", "write_shards"]

ProgressCallback = Callable[[int, int], None]
"""Called as ``progress(bytes_done, bytes_total)`` after each tensor a conversion has read."""

_MANIFEST_NAME = "checkpoint_manifest.json"  # formats.manifest.MANIFEST_NAME (importing it pulls in torch)
_HF_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class ConvertResult:
    """What a conversion wrote: ``format`` is ``"hf"`` or ``"ckptd"``, ``files`` counts every
    file of the output (shards, indexes, manifest, ``config.json``), ``bytes`` the shards' bytes,
    ``config`` whether a ``config.json`` was written, ``replaced`` whether an existing output at
    ``destination`` was replaced (``overwrite=True``)."""

    source: str
    destination: str
    format: str
    files: int
    tensors: int
    bytes: int
    config: bool
    seconds: float
    replaced: bool


def source_format(source: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> str:
    """``"dcp"`` (a local PyTorch DCP directory), ``"ckptd"`` (a committed ckptd checkpoint) or
    ``"hf"`` (anything else: an HF model directory or file, checked when it is read)."""
    location = normalize_location(os.fspath(source))
    if is_dcp_checkpoint(location):
        return "dcp"
    if _MANIFEST_NAME in storage_for(location, storage_options).list_names(location):
        return "ckptd"
    return "hf"


def convert(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    to: str | None = None,
    component: str | None = None,
    config: str | os.PathLike[str] | bytes | None = None,
    step: int | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
    progress: ProgressCallback | None = None,
) -> ConvertResult:
    """Write ``source`` as a new checkpoint at ``destination`` in the format ``to``.

    ``to`` is ``"hf"`` or ``"ckptd"`` (default: a ckptd source becomes an HF directory, anything
    else a ckptd checkpoint).  ``component`` picks the tensors of an HF output or of a ckptd
    output from an HF source (default: the model's); a DCP source becomes a ckptd checkpoint
    with all its entries, and a ckptd source converted to ckptd is consolidated
    (:func:`~ckptd.consolidate`: every component, whole tensors).  ``config`` is a
    ``config.json`` (path or bytes) for an HF output (``from_pretrained`` needs one; default:
    the source's own, if it has one and ``component`` is its model: ``model`` or its only one).
    ``step`` is recorded in a ckptd output converted from HF or DCP (default: the source's step,
    else 0).  ``progress(bytes_done, bytes_total)`` is called after each tensor read where
    tensors are streamed (not for DCP -> ckptd or a consolidation).

    An existing ``destination`` raises :class:`~ckptd.errors.CheckpointExistsError` unless
    ``overwrite=True``, which replaces whatever is there (an earlier HF export too) once the new
    output is complete (on object stores the old objects are removed first); a consolidation
    replaces only a checkpoint (see :func:`~ckptd.consolidate`).  ``destination`` may not be
    ``source`` (:class:`~ckptd.errors.ConfigError`), nor may options be given that the conversion
    would not use.
    """
    started = time.perf_counter()
    location = normalize_location(os.fspath(source))
    target = normalize_location(os.fspath(destination))
    kind = source_format(location, storage_options)
    output = to or ("hf" if kind == "ckptd" else "ckptd")
    if output not in ("hf", "ckptd"):
        raise ConfigError(f"convert: to={to!r} is not a format ckptd writes (use 'hf' or 'ckptd')")
    if target.rstrip("/") == location.rstrip("/"):
        raise ConfigError(f"convert: source and destination are the same ({location}); pick another destination")
    limit = parse_size(max_shard_size, "max_shard_size")
    if output == "ckptd" and config is not None:
        raise ConfigError("convert: config= is written into HF outputs only (to='hf')")
    if output == "hf" and step is not None:
        raise ConfigError("convert: step= is recorded in ckptd outputs only (to='ckptd')")
    if output == "hf":
        hf = ShardOutput(target, storage_options, overwrite)  # checked before the source is read
        tensors = from_dcp(location, component) if kind == "dcp" else from_reader(location, component, storage_options)
        return _write_hf(location, tensors, hf, limit, _config_bytes(config, tensors), progress, started)
    if kind == "ckptd":
        if component is not None or step is not None:
            raise ConfigError("convert: a ckptd checkpoint converted to ckptd keeps all its components and its step")
        return _consolidate(location, target, limit, overwrite, storage_options, started)
    if kind == "dcp" and component is not None:
        raise ConfigError("convert: a DCP checkpoint converted to ckptd keeps all its entries (no component=)")
    checkpoint = ShardOutput(target, storage_options, overwrite)
    if kind == "dcp":
        return _dcp_to_ckptd(location, checkpoint, limit, step, started)
    tensors = from_reader(location, component, storage_options)
    return _write_ckptd(location, tensors, checkpoint, limit, step, progress, started)


def export_hf(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    component: str | None = None,
    config: str | os.PathLike[str] | bytes | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
    progress: ProgressCallback | None = None,
) -> ConvertResult:
    """Write the model of ``source`` (any format :func:`convert` reads) as an HF model directory
    at ``destination``: ``convert(..., to="hf")``."""
    return convert(
        source,
        destination,
        to="hf",
        component=component,
        config=config,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        storage_options=storage_options,
        progress=progress,
    )


# ---- outputs -----------------------------------------------------------------------------------


class ShardOutput:
    """Where an output goes: a hidden sibling staging directory (local) or the final prefix."""

    def __init__(self, location: str, storage_options: dict[str, Any] | None, overwrite: bool) -> None:
        self.final = normalize_location(location)
        self.storage: Storage = storage_for(self.final, storage_options)
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

    @contextmanager
    def staged(self) -> Iterator[str]:
        """The staging place to write into: a new hidden directory (local), or the final prefix
        with the old output removed first (object stores: not atomic).  If the block fails,
        what it wrote is removed."""
        held: Hold | None = None
        if self.storage.local:  # locked until published or removed: a garbage collection leaves it
            held = hold_new_directory(self.staging, self.storage.makedirs)
        elif self.exists:
            from ..catalog import remove_checkpoint

            remove_checkpoint(self.storage, self.final)
        try:
            yield self.staging
        except BaseException:
            if self.storage.local:
                self.storage.remove_tree(self.staging)
            else:
                self.storage.discard(self.staging)
            raise
        finally:
            if held is not None:
                held.release()

    def publish(self) -> None:
        """Swap the staged output in (local); object stores wrote in place."""
        from ..save.commit import publish

        # overwrite was asked for this path by name: it may replace an HF directory too
        publish(self.storage, self.staging, self.final, overwrite=self.overwrite, replace_any=True)


def write_shards(
    source: Tensors, output: ShardOutput, max_shard_size: int, progress: ProgressCallback | None = None
) -> tuple[dict[str, Any], dict[str, TensorRecord], dict[str, str]]:
    """Stream the tensors into ``model-0000k-of-0000n.safetensors`` files in the staging place;
    returns the files written, the tensors' records and the HF weight map."""
    from ..formats.manifest import TensorRecord
    from ..formats.names import shard_file_name
    from ..save.layout import bucket_items, plan_file
    from ..save.tensor_files import write_layout

    storage, staging = output.storage, output.staging
    buckets = [b for b in bucket_items(source.items, max_shard_size) if b]
    written: dict[str, Any] = {}
    records: dict[str, TensorRecord] = {}
    weight_map: dict[str, str] = {}
    total = source.nbytes
    done = 0

    def fetch(item: Any) -> Any:
        nonlocal done
        tensor = source.fetch(item.key)
        done += item.nbytes
        if progress is not None:
            progress(done, total)
        return tensor

    for number, bucket in enumerate(buckets, start=1):
        layout = plan_file("model", shard_file_name("model", number, len(buckets)), bucket)
        written[layout.file_name] = write_layout(storage, storage.join(staging, layout.file_name), layout, fetch)
        for index, item in enumerate(layout.items):
            start = layout.item_file_offset(index)
            records[item.key] = TensorRecord.whole(item.dtype, item.shape, layout.file_name, start, start + item.nbytes)
            weight_map[item.key] = layout.file_name
    return written, records, weight_map


# ---- the conversions ---------------------------------------------------------------------------


def _config_bytes(config: str | os.PathLike[str] | bytes | None, source: Tensors) -> bytes | None:
    if config is None:
        return source.config
    if isinstance(config, bytes):
        return config
    try:
        with open(config, "rb") as f:
            return f.read()
    except FileNotFoundError as e:
        from ..errors import CheckpointNotFoundError

        raise CheckpointNotFoundError(f"{os.fspath(config)}: no such config file") from e


def _write_hf(
    location: str,
    source: Tensors,
    output: ShardOutput,
    limit: int,
    config: bytes | None,
    progress: ProgressCallback | None,
    started: float,
) -> ConvertResult:
    from ..formats.manifest import hf_index

    storage = output.storage
    with output.staged() as staging:
        written, _records, weight_map = write_shards(source, output, limit, progress)
        index = hf_index(weight_map, source.nbytes, {"param_sharing": source.tied} if source.tied else None)
        storage.write_stream(storage.join(staging, _HF_INDEX), [memoryview(index)])
        if config is not None:
            storage.write_stream(storage.join(staging, HF_CONFIG), [memoryview(config)])
        output.publish()
    return ConvertResult(
        source=location,
        destination=output.final,
        format="hf",
        files=len(written) + 1 + (config is not None),
        tensors=len(source.items),
        bytes=sum(record.size for record in written.values()),
        config=config is not None,
        seconds=round(time.perf_counter() - started, 3),
        replaced=output.exists,
    )


def _write_ckptd(
    location: str,
    source: Tensors,
    output: ShardOutput,
    limit: int,
    step: int | None,
    progress: ProgressCallback | None,
    started: float,
) -> ConvertResult:
    from ..save.commit import ComponentInfo, claim_step, finalize_checkpoint

    with output.staged() as staging:
        if not output.storage.local:
            claim_step(output.storage, output.final, overwrite=output.overwrite, replace_any=True)
        written, records, _ = write_shards(source, output, limit, progress)
        manifest = finalize_checkpoint(
            output.storage,
            staging,
            output.final,
            step=step if step is not None else source.step if source.step is not None else 0,
            written=written,
            expected_sizes={name: record.size for name, record in written.items()},
            tensors={"model": records},
            components=[ComponentInfo("model", "safetensors", source.tied)],
            trees=None,
            metadata={"converted_from": location},
            timings={"convert": time.perf_counter() - started},
            overwrite=output.overwrite,
        )
    return ConvertResult(
        source=location,
        destination=output.final,
        format="ckptd",
        files=len(manifest.files),
        tensors=len(source.items),
        bytes=sum(f.size for f in manifest.files.values()),
        config=False,
        seconds=round(time.perf_counter() - started, 3),
        replaced=output.exists,
    )


def _consolidate(
    location: str, target: str, limit: int, overwrite: bool, storage_options: dict[str, Any] | None, started: float
) -> ConvertResult:
    from .consolidate import consolidate

    storage = storage_for(target, storage_options)
    existed = os.path.exists(target) if storage.local else bool(storage.list_names(target))
    manifest = consolidate(
        location,
        target,
        max_shard_size=limit,
        storage_options=storage_options,
        destination_storage_options=storage_options,
        overwrite=overwrite,
    )
    return ConvertResult(
        source=location,
        destination=target,
        format="ckptd",
        files=len(manifest.files),
        tensors=sum(len(c.tensors) for c in manifest.components.values()),
        bytes=sum(f.size for f in manifest.files.values()),
        config=False,
        seconds=round(time.perf_counter() - started, 3),
        replaced=existed,
    )


def _dcp_to_ckptd(location: str, output: ShardOutput, limit: int, step: int | None, started: float) -> ConvertResult:
    """A DCP checkpoint with all its entries (model, optimizer, extra state) as a ckptd checkpoint."""
    from ..catalog import checkpoint_dir_name, read_manifest
    from ..checkpointer import Checkpointer
    from ..save.commit import publish

    if not output.storage.local:
        raise ConfigError(
            f"convert: a DCP checkpoint is converted into a local directory, not {output.final}: convert locally, "
            "then upload the directory (or save the state with ckptd.Checkpointer)"
        )
    state = load_dcp(location)
    stored_step = state.get("step")
    chosen: int = step if step is not None else stored_step if isinstance(stored_step, int) else 0
    parent, base = os.path.split(output.final)
    scratch = os.path.join(parent, f".{base}.convert-{secrets.token_hex(4)}")
    try:
        with Checkpointer(scratch, max_shard_size=limit) as checkpointer:
            result = checkpointer.save(chosen, state, metadata={"converted_from": location})
        staged = os.path.join(scratch, checkpoint_dir_name(chosen))
        publish(output.storage, staged, output.final, overwrite=output.overwrite)
    finally:
        output.storage.remove_tree(scratch)
    manifest = read_manifest(output.storage, output.final)
    return ConvertResult(
        source=location,
        destination=output.final,
        format="ckptd",
        files=len(manifest.files) if manifest else 0,
        tensors=sum(len(c.tensors) for c in manifest.components.values()) if manifest else 0,
        bytes=result.bytes_written,
        config=False,
        seconds=round(time.perf_counter() - started, 3),
        replaced=output.exists,
    )
