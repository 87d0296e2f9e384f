"""Commands that write a new checkpoint from another: ``consolidate``, ``convert``, ``export-hf``.

Tensors are streamed one at a time (memory stays bounded by the largest tensor), except for
PyTorch DCP sources and ``.bin`` files, which are loaded whole by torch's own readers
(``torch.distributed.checkpoint.FileSystemReader``, as ``dcp_to_torch_save`` does).  Local
destinations are written into a hidden sibling directory and renamed into place, so a failed
conversion leaves nothing behind and ``--overwrite`` replaces the old copy only at the end.
"""

from __future__ import annotations

import argparse
import os
import secrets
import time
from collections.abc import Callable
from typing import Any

from ..errors import CheckpointNotFoundError
from ..formats.names import match_leftover_name
from ..options import DEFAULT_MAX_SHARD_SIZE, parse_size
from ..storage import base_name, normalize_location, storage_for
from .app import Context, Result
from .output import EXIT_OK, EXIT_USAGE, CliError, Progress, polled
from .shards import HF_CONFIG, Destination, Tensors, from_dcp, from_reader, is_dcp_checkpoint, load_dcp, write_shards

__all__ = ["register"]

_MANIFEST_NAME = "checkpoint_manifest.json"  # formats.manifest.MANIFEST_NAME (importing it pulls in torch)


def register(add: Callable[[str, str], argparse.ArgumentParser]) -> None:
    """Add this module's subcommands."""
    consolidate = add(
        "consolidate", "rewrite a checkpoint with whole tensors in HF-style shards, self-contained (bounded memory)"
    )
    consolidate.add_argument("source")
    consolidate.add_argument("destination")
    consolidate.add_argument("--max-shard-size", default="2GB")
    consolidate.add_argument("--verify", action="store_true", help="check the source's CRC32C first")
    consolidate.add_argument("--overwrite", action="store_true", help="replace an existing destination")
    consolidate.set_defaults(func=_consolidate)
    convert = add(
        "convert",
        "convert between a ckptd checkpoint, an HF model directory and a PyTorch DCP checkpoint "
        "(default: ckptd -> hf, anything else -> ckptd)",
    )
    convert.add_argument("source", help="ckptd checkpoint, HF directory (safetensors or .bin) or DCP directory")
    convert.add_argument("destination")
    convert.add_argument("--to", choices=("hf", "ckptd"), help="output format")
    _hf_options(convert)
    convert.add_argument("--step", type=int, help="step recorded in a ckptd output (default: the source's, or 0)")
    convert.set_defaults(func=_convert)
    export = add("export-hf", "write a checkpoint's model as an HF directory (shards + index [+ config.json])")
    export.add_argument("source")
    export.add_argument("destination")
    _hf_options(export)
    export.set_defaults(func=_export_hf)


def _hf_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="a config.json to copy into an HF output (from_pretrained needs one)")
    parser.add_argument("--component", help="component holding the model's tensors (default: model)")
    parser.add_argument("--max-shard-size", default="2GB")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing destination")


# ---- consolidate -------------------------------------------------------------------------------


def _consolidate(args: argparse.Namespace, context: Context) -> Result:
    from ..load.reader import CheckpointReader
    from ..tools.consolidate import consolidate

    source = CheckpointReader.open(args.source, context.storage_options, require_manifest=True)
    if source.manifest is None:  # pragma: no cover - require_manifest guarantees it
        raise CheckpointNotFoundError(f"{args.source}: not a ckptd checkpoint")
    if normalize_location(args.destination) == source.directory:
        raise CliError("source and destination are the same checkpoint", EXIT_USAGE, "pick another destination")
    parse_size(args.max_shard_size, "--max-shard-size")
    destination = Destination(args.destination, context, args.overwrite)
    total = sum(c.tensor_bytes() for c in source.manifest.components.values())
    progress = Progress(f"consolidate {base_name(source.directory)}", total, enabled=context.progress)
    started = time.perf_counter()
    if destination.storage.local:
        # consolidate() stages in a hidden sibling of the destination (a leftover_name of kind
        # "tmp") and swaps it in at the end: the old copy stays committed until then.
        parent, base = os.path.split(destination.final)

        def staging(name: str) -> bool:
            match = match_leftover_name(name)
            return match is not None and match.group("base") == base and match.group("kind") == "tmp"

        def measure() -> int:
            staged = [os.path.join(parent, n) for n in os.listdir(parent) if staging(n)]
            return sum(sum(destination.storage.sizes(path).values()) for path in staged)

    else:
        destination.begin()

        def measure() -> int:
            return destination.written()

    with polled(progress, measure):
        manifest = consolidate(
            source.directory,
            destination.final,
            max_shard_size=args.max_shard_size,
            storage_options=context.storage_options,
            destination_storage_options=context.storage_options,
            verify=args.verify,
            overwrite=args.overwrite,
        )
    body = {
        "source": source.directory,
        "destination": destination.final,
        "files": len(manifest.files),
        "bytes": sum(f.size for f in manifest.files.values()),
        "seconds": round(time.perf_counter() - started, 3),
        "overwritten": destination.exists,
    }
    return body, _render_written("consolidated"), EXIT_OK


def _render_written(verb: str) -> Callable[[dict[str, Any], Context], None]:
    def render(body: dict[str, Any], context: Context) -> None:
        context.say(
            f"{verb} {body['source']} into {body['destination']}: {body['files']} files, {body['bytes']} bytes "
            f"in {body['seconds']:.2f} s"
        )

    return render


# ---- writing -----------------------------------------------------------------------------------


def _config_bytes(args: argparse.Namespace, source: Tensors) -> bytes | None:
    if args.config:
        try:
            with open(args.config, "rb") as f:
                return f.read()
        except FileNotFoundError as e:
            raise CheckpointNotFoundError(f"{args.config}: no such config file") from e
    return source.config


def _write_hf(args: argparse.Namespace, source: Tensors, context: Context, label: str) -> Result:
    from ..formats.manifest import hf_index

    limit = parse_size(args.max_shard_size or DEFAULT_MAX_SHARD_SIZE, "--max-shard-size")
    config = _config_bytes(args, source)
    destination = Destination(args.destination, context, args.overwrite)
    total = sum(item.nbytes for item in source.items)
    progress = Progress(label, total, enabled=context.progress)
    started = time.perf_counter()
    destination.begin()
    try:
        written, _records, weight_map = write_shards(source, destination, limit, progress)
        extra = {"param_sharing": source.tied} if source.tied else None
        storage = destination.storage
        index = hf_index(weight_map, total, extra)
        storage.write_stream(storage.join(destination.staging, "model.safetensors.index.json"), [memoryview(index)])
        if config is not None:
            storage.write_stream(storage.join(destination.staging, HF_CONFIG), [memoryview(config)])
        destination.publish()
    except BaseException:
        destination.discard()
        raise
    finally:
        progress.close()
    body = {
        "source": normalize_location(args.source),
        "destination": destination.final,
        "format": "hf",
        "files": len(written) + 1 + (config is not None),
        "tensors": len(source.items),
        "bytes": sum(record.size for record in written.values()),
        "config": config is not None,
        "seconds": round(time.perf_counter() - started, 3),
    }
    return body, _render_written("wrote HF model of"), EXIT_OK


def _write_ckptd(args: argparse.Namespace, source: Tensors, context: Context) -> Result:
    from ..save.commit import ComponentInfo, claim_step, finalize_checkpoint

    limit = parse_size(args.max_shard_size or DEFAULT_MAX_SHARD_SIZE, "--max-shard-size")
    destination = Destination(args.destination, context, args.overwrite)
    total = sum(item.nbytes for item in source.items)
    progress = Progress(f"convert {base_name(args.source)}", total, enabled=context.progress)
    started = time.perf_counter()
    destination.begin()
    try:
        if not destination.storage.local:
            claim_step(destination.storage, destination.final, overwrite=args.overwrite, replace_any=True)
        written, records, _ = write_shards(source, destination, limit, progress)
        manifest = finalize_checkpoint(
            destination.storage,
            destination.staging,
            destination.final,
            step=args.step if args.step is not None else source.step if source.step is not None else 0,
            written=written,
            expected_sizes={name: record.size for name, record in written.items()},
            tensors={"model": records},
            components=[ComponentInfo("model", "safetensors", source.tied)],
            trees=None,
            metadata={"converted_from": normalize_location(args.source)},
            timings={"convert": time.perf_counter() - started},
            overwrite=args.overwrite,
        )
    except BaseException:
        destination.discard()
        raise
    finally:
        progress.close()
    body = {
        "source": normalize_location(args.source),
        "destination": destination.final,
        "format": "ckptd",
        "files": len(manifest.files),
        "tensors": len(source.items),
        "bytes": sum(f.size for f in manifest.files.values()),
        "config": False,
        "seconds": round(time.perf_counter() - started, 3),
    }
    return body, _render_written("converted"), EXIT_OK


def _dcp_to_ckptd(args: argparse.Namespace, context: Context) -> Result:
    """A DCP checkpoint with all its components (model, optimizer, extra state) as a ckptd checkpoint."""
    from ..catalog import checkpoint_dir_name, read_manifest
    from ..checkpointer import Checkpointer
    from ..save.commit import publish

    destination = Destination(args.destination, context, args.overwrite)
    if not destination.storage.local:
        raise CliError(
            "converting a DCP checkpoint writes to a local directory",
            EXIT_USAGE,
            "convert locally, then upload the directory (or save it with ckptd.Checkpointer)",
        )
    started = time.perf_counter()
    state = load_dcp(args.source)
    stored_step = state.get("step")
    step: int = args.step if args.step is not None else stored_step if isinstance(stored_step, int) else 0
    parent, base = os.path.split(destination.final)
    scratch = os.path.join(parent, f".{base}.convert-{secrets.token_hex(4)}")
    try:
        with Checkpointer(scratch, max_shard_size=args.max_shard_size) as checkpointer:
            result = checkpointer.save(step, state, metadata={"converted_from": normalize_location(args.source)})
        publish(
            destination.storage,
            os.path.join(scratch, checkpoint_dir_name(step)),
            destination.final,
            overwrite=args.overwrite,
        )
    finally:
        destination.storage.remove_tree(scratch)
    manifest = read_manifest(destination.storage, destination.final)
    body = {
        "source": normalize_location(args.source),
        "destination": destination.final,
        "format": "ckptd",
        "files": len(manifest.files) if manifest else 0,
        "tensors": sum(len(c.tensors) for c in manifest.components.values()) if manifest else 0,
        "bytes": result.bytes_written,
        "config": False,
        "seconds": round(time.perf_counter() - started, 3),
    }
    return body, _render_written("converted"), EXIT_OK


# ---- commands ----------------------------------------------------------------------------------


def _source_kind(path: str, context: Context) -> str:
    if is_dcp_checkpoint(path):
        return "dcp"
    location = normalize_location(path)
    storage = storage_for(location, context.storage_options)
    if _MANIFEST_NAME in storage.list_names(location):
        return "ckptd"
    return "hf"


def _convert(args: argparse.Namespace, context: Context) -> Result:
    kind = _source_kind(args.source, context)
    target = args.to or ("hf" if kind == "ckptd" else "ckptd")
    if target == "hf":
        source = (
            from_dcp(args.source, args.component)
            if kind == "dcp"
            else from_reader(args.source, args.component, context)
        )
        return _write_hf(args, source, context, f"convert {base_name(args.source)}")
    if kind == "ckptd":
        args.verify = False
        return _consolidate(args, context)
    if kind == "dcp":
        return _dcp_to_ckptd(args, context)
    return _write_ckptd(args, from_reader(args.source, args.component, context), context)


def _export_hf(args: argparse.Namespace, context: Context) -> Result:
    kind = _source_kind(args.source, context)
    source = (
        from_dcp(args.source, args.component) if kind == "dcp" else from_reader(args.source, args.component, context)
    )
    return _write_hf(args, source, context, f"export {base_name(args.source)}")
