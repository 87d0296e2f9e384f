"""Commands that write a new checkpoint from another: ``consolidate``, ``convert``, ``export-hf``.

The work is the library's (:func:`ckptd.consolidate`, :func:`ckptd.tools.convert.convert`); this
module checks the options (before anything is written), shows progress and reports what was
written.  An HF output is a model directory: another component (an optimizer's state) is refused
unless ``--allow-non-model`` says it is meant, and an output without ``config.json`` comes with
the hint that ``from_pretrained`` needs one.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

from ..errors import CheckpointNotFoundError
from ..formats.names import match_leftover_name
from ..options import parse_size
from ..storage import base_name, normalize_location
from ..tools.convert import ConvertResult, ShardOutput, source_format
from .app import Context, Result
from .output import EXIT_OK, EXIT_USAGE, CliError, Progress, polled

__all__ = ["register"]


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
    export = add(
        "export-hf",
        "write a checkpoint's model as an HF directory (shards + index [+ config.json]) for from_pretrained",
    )
    export.add_argument("source")
    export.add_argument("destination")
    _hf_options(export)
    export.set_defaults(func=_export_hf)


def _hf_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="a config.json to copy into an HF output (from_pretrained needs one)")
    parser.add_argument("--component", help="component holding the model's tensors (default: model)")
    parser.add_argument(
        "--allow-non-model",
        action="store_true",
        help="write an HF output of a --component that is not the model (an optimizer's state: no "
        "config.json is copied and from_pretrained cannot load it)",
    )
    parser.add_argument("--max-shard-size", default="2GB")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing destination")


# ---- consolidate -------------------------------------------------------------------------------


def _consolidate(args: argparse.Namespace, context: Context) -> Result:
    from ..load.reader import CheckpointReader
    from ..tools.consolidate import consolidate

    parse_size(args.max_shard_size, "--max-shard-size")
    source = CheckpointReader.open(args.source, context.storage_options, require_manifest=True)
    if source.manifest is None:  # pragma: no cover - require_manifest guarantees it
        raise CheckpointNotFoundError(f"{args.source}: not a ckptd checkpoint")
    if normalize_location(args.destination) == source.directory:
        raise CliError("source and destination are the same checkpoint", EXIT_USAGE, "pick another destination")
    destination = ShardOutput(args.destination, context.storage_options, args.overwrite)
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
        # consolidate() writes the shards under their final names (it claims the prefix itself;
        # a prefix of someone else's objects is refused, whatever --overwrite says).
        def measure() -> int:
            return sum(destination.storage.sizes(destination.final).values())

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
        for warning in body.get("warnings", ()):
            context.warn(warning)

    return render


# ---- convert, export-hf -----------------------------------------------------------------------


def _converted(args: argparse.Namespace, context: Context, label: str, to: str | None) -> Result:
    from ..tools.convert import convert

    parse_size(args.max_shard_size, "--max-shard-size")  # named as the user typed it
    hf = (to or ("hf" if source_format(args.source, context.storage_options) == "ckptd" else "ckptd")) == "hf"
    model = _check_component(args, context) if hf else True
    bar: Progress | None = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = Progress(label, total, enabled=context.progress)
        bar.set(done)

    try:
        result = convert(
            args.source,
            args.destination,
            to=to,
            component=args.component,
            config=args.config,
            step=getattr(args, "step", None),
            max_shard_size=args.max_shard_size,
            overwrite=args.overwrite,
            storage_options=context.storage_options,
            progress=progress,
        )
    finally:
        if bar is not None:
            bar.close()
    body = _body(result)
    if result.format == "hf" and not model:
        body["warnings"].append(
            f"{result.destination} holds the tensors of component {args.component!r}, not a model: "
            "from_pretrained cannot load it"
        )
    elif result.format == "hf" and not result.config:
        body["warnings"].append(
            f"{result.destination} has no config.json: from_pretrained will need one; pass --config "
            "path/to/config.json (the model's configuration), or copy it there"
        )
    if result.format == "ckptd":
        verb = "converted"
    else:
        verb = "wrote HF model of" if model else f"wrote the tensors of component {args.component!r} (not a model) of"
    return body, _render_written(verb), EXIT_OK


def _check_component(args: argparse.Namespace, context: Context) -> bool:
    """Whether ``--component`` (if given) is the source's model: ``model``, or its only tensor
    component.  Another one is refused (usage) unless ``--allow-non-model``."""
    if args.component is None:
        return True
    from ..load.inspection import open_view

    with contextlib.closing(open_view(args.source, context.storage_options)) as source:
        components = source.components()
    if args.component == "model" or components == [args.component] or args.component not in components:
        return True  # (an unknown component is convert()'s to refuse, naming the ones there are)
    if not args.allow_non_model:
        raise CliError(
            f"component {args.component!r} is not the model of {args.source} (its components: "
            f"{', '.join(components)}): an HF model directory of it would not load with from_pretrained",
            EXIT_USAGE,
            "export the model (the default), or pass --allow-non-model to write these tensors anyway",
        )
    return False


def _body(result: ConvertResult) -> dict[str, Any]:
    return {
        "source": result.source,
        "destination": result.destination,
        "format": result.format,
        "files": result.files,
        "tensors": result.tensors,
        "bytes": result.bytes,
        "config": result.config,
        "seconds": result.seconds,
        "warnings": [],
    }


def _convert(args: argparse.Namespace, context: Context) -> Result:
    to = args.to or None
    plain = to == "ckptd" and args.config is None and args.component is None and args.step is None
    if plain and source_format(args.source, context.storage_options) == "ckptd":  # else convert() looks
        args.verify = False
        return _consolidate(args, context)  # with its own progress (the staged bytes, polled)
    return _converted(args, context, f"convert {base_name(args.source)}", to)


def _export_hf(args: argparse.Namespace, context: Context) -> Result:
    return _converted(args, context, f"export {base_name(args.source)}", "hf")
