"""``diff``: the tensors two checkpoints hold, added, removed or changed.

By default it compares what the manifests record (dtype, shape, and the CRC32C of the file and
byte range holding each tensor), reading no tensor data; ``--exact`` reads the bytes of every
tensor whose dtype and shape match on both sides (:func:`ckptd.load.compare.same_bytes`, a few
MiB at a time).  Exit code :data:`~ckptd.cli.output.EXIT_DIFFERS` when anything differs.  No
torch for ckptd and HF safetensors checkpoints; PyTorch DCP and ``.bin`` checkpoints are read by
torch.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable
from typing import Any

from ..errors import CorruptCheckpointError
from ..formats.manifest import TensorRecord
from .app import Context, Result
from .describe import tensor_shapes
from .output import EXIT_DIFFERS, EXIT_OK, CliError

__all__ = ["register"]


def register(add: Callable[[str, str], argparse.ArgumentParser]) -> None:
    """Add the ``diff`` subcommand."""
    diff = add(
        "diff",
        "compare two checkpoints' tensors (keys added, removed, changed): by the CRC32C their manifests "
        "record, or byte by byte with --exact (exit code 7 when they differ)",
    )
    diff.add_argument("a")
    diff.add_argument("b")
    diff.add_argument("--component", help="compare only this component")
    diff.add_argument(
        "--exact", action="store_true", help="read every tensor whose dtype and shape match and compare its bytes"
    )
    diff.set_defaults(func=_diff)


_Described = dict[str, dict[str, tuple[str, tuple[int, ...], tuple, TensorRecord | None]]]
"""Per component, each tensor's dtype, shape, fingerprint and record (tied aliases too)."""


def _describe(path: str, context: Context) -> tuple[Any, _Described]:
    """An open checkpoint and, per component, each tensor's dtype, shape, a fingerprint of its
    bytes (the files holding it with their CRC32C and byte ranges; empty when no CRC is known) and
    its record (``None`` where its bytes are torch's to read)."""
    from ..load.inspection import CheckpointView, open_view

    reader = open_view(path, context.storage_options)
    try:
        manifest = reader.manifest
        out: _Described = {}
        for component in reader.components():
            described: dict[str, tuple[str, tuple[int, ...], tuple, TensorRecord | None]] = {}
            if isinstance(reader, CheckpointView):
                for key, record in reader.locate(component).items():
                    fingerprint: tuple = ()
                    if manifest is not None:
                        fingerprint = tuple(
                            (manifest.files[c.file].crc32c, c.start, c.end, c.offset) for c in record.chunks
                        )
                    described[key] = (record.dtype, tuple(record.shape), fingerprint, record)
            elif reader.kind == "dcp":  # torch read its .metadata: no byte ranges, no CRCs
                for key, (dtype, shape, _, _) in tensor_shapes(reader, component).items():
                    described[key] = (dtype, shape, (), None)
            else:  # .bin pickles, read whole by torch (weights_only)
                from ..formats.torch_dtypes import dtype_name

                for key, tensor in reader.read(component).items():
                    described[key] = (dtype_name(tensor.dtype, key), tuple(tensor.shape), (), None)
            for alias, stored in ((a, g[0]) for g in reader.tied_groups(component) for a in g[1:]):
                if stored in described:
                    described[alias] = described[stored]
            out[component] = described
    except BaseException:
        reader.close()
        raise
    return reader, out


def _diff(args: argparse.Namespace, context: Context) -> Result:
    with contextlib.ExitStack() as stack:
        reader_a, a = _describe(args.a, context)
        stack.callback(reader_a.close)
        reader_b, b = _describe(args.b, context)
        stack.callback(reader_b.close)
        return _compare(args, context, reader_a, a, reader_b, b)


def _compare(
    args: argparse.Namespace, context: Context, reader_a: Any, a: _Described, reader_b: Any, b: _Described
) -> Result:
    components = sorted(set(a) | set(b))
    if args.component:
        if args.component not in components:
            raise CliError(f"neither checkpoint has a component {args.component!r} (found {components})")
        components = [args.component]
    added: list[dict[str, Any]] = []
    removed: list[dict[str, Any]] = []
    changed: list[dict[str, Any]] = []
    unchanged = 0
    common = [(c, k) for c in components for k in sorted(set(a.get(c, {})) & set(b.get(c, {})))]
    same = _read_and_compare(reader_a, a, reader_b, b, common, context.storage_options) if args.exact else {}
    for component in components:
        left, right = a.get(component, {}), b.get(component, {})
        for key in sorted(set(right) - set(left)):
            added.append({"component": component, "key": key, "dtype": right[key][0], "shape": list(right[key][1])})
        for key in sorted(set(left) - set(right)):
            removed.append({"component": component, "key": key, "dtype": left[key][0], "shape": list(left[key][1])})
        for key in sorted(set(left) & set(right)):
            (dtype_a, shape_a, print_a, _), (dtype_b, shape_b, print_b, _) = left[key], right[key]
            reason = None
            if dtype_a != dtype_b:
                reason = "dtype"
            elif shape_a != shape_b:
                reason = "shape"
            elif args.exact:
                reason = None if same[component, key] else "data"
            elif not print_a or not print_b or print_a != print_b:
                reason = "file_crc" if print_a and print_b else "unknown"
            if reason is None:
                unchanged += 1
                continue
            changed.append(
                {
                    "component": component,
                    "key": key,
                    "reason": reason,
                    "a": {"dtype": dtype_a, "shape": list(shape_a)},
                    "b": {"dtype": dtype_b, "shape": list(shape_b)},
                }
            )
    body = {
        "a": reader_a.directory,
        "b": reader_b.directory,
        "exact": bool(args.exact),
        "added": added,
        "removed": removed,
        "changed": changed,
        "unchanged": unchanged,
    }
    return body, _render_diff, EXIT_DIFFERS if added or removed or changed else EXIT_OK


def _read_and_compare(
    reader_a: Any,
    a: _Described,
    reader_b: Any,
    b: _Described,
    pairs: list[tuple[str, str]],
    storage_options: dict[str, Any],
) -> dict[tuple[str, str], bool]:
    """Whether each ``(component, key)`` of one dtype and shape on both sides holds the same
    bytes, read in the order of A's files (a few MiB at a time: :func:`~ckptd.load.compare.
    same_bytes`); through torch where a side is a DCP or ``.bin`` checkpoint."""
    from ..load.compare import same_bytes
    from ..load.inspection import CheckpointView

    def where(pair: tuple[str, str]) -> tuple[str, int]:
        record = a[pair[0]][pair[1]][3]
        return (record.chunks[0].file, record.chunks[0].start) if record is not None else ("", 0)

    out: dict[tuple[str, str], bool] = {}
    for component, key in sorted(pairs, key=where):
        dtype_a, shape_a, _, record_a = a[component][key]
        dtype_b, shape_b, _, record_b = b[component][key]
        if (dtype_a, shape_a) != (dtype_b, shape_b):
            continue  # reported by dtype or shape
        if isinstance(reader_a, CheckpointView) and isinstance(reader_b, CheckpointView):
            if record_a is None or record_b is None:  # pragma: no cover - views locate every tensor
                raise CorruptCheckpointError(f"{component}/{key}: no byte range to compare")
            out[component, key] = same_bytes(reader_a, record_a, reader_b, record_b)
        else:
            out[component, key] = _same_tensor(reader_a, reader_b, component, key, storage_options)
    return out


def _same_tensor(reader_a: Any, reader_b: Any, component: str, key: str, storage_options: dict[str, Any]) -> bool:
    """Compare one tensor read whole by torch (a side is a DCP or ``.bin`` checkpoint)."""
    import torch

    from ..load.reader import CheckpointReader

    def read(reader: Any) -> Any:
        if not isinstance(reader, CheckpointReader):  # the other side's view
            with CheckpointReader.open(reader.directory, storage_options) as opened:
                return opened.read(component, [key])[key]
        return reader.read(component, [key])[key]

    left, right = read(reader_a), read(reader_b)
    return bool(
        left.dtype == right.dtype
        and left.shape == right.shape
        and torch.equal(left.reshape(-1).view(torch.uint8), right.reshape(-1).view(torch.uint8))
    )


def _render_diff(body: dict[str, Any], context: Context) -> None:
    for t in body["added"]:
        context.say(f"+ {t['component']}/{t['key']}  {t['dtype']} {t['shape']}")
    for t in body["removed"]:
        context.say(f"- {t['component']}/{t['key']}  {t['dtype']} {t['shape']}")
    for t in body["changed"]:
        a, b = t["a"], t["b"]
        what = {
            "dtype": f"dtype {a['dtype']} -> {b['dtype']}",
            "shape": f"shape {a['shape']} -> {b['shape']}",
            "data": "data differs",
            "file_crc": "its file's CRC32C differs (--exact reads the tensor to tell)",
            "unknown": "no CRC recorded (--exact reads the tensor to tell)",
        }[t["reason"]]
        context.say(f"~ {t['component']}/{t['key']}  {what}")
    how = (
        "compared byte by byte"
        if body["exact"]
        else "compared by the CRC32C the manifests record, not the bytes: --exact reads them"
    )
    context.say(
        f"{len(body['added'])} added, {len(body['removed'])} removed, {len(body['changed'])} changed, "
        f"{body['unchanged']} unchanged ({how})"
    )
