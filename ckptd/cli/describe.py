"""Commands on one checkpoint: ``info``, ``verify`` (``diff`` compares two: :mod:`.diff`).

``info`` reads the manifest (or safetensors headers for HF checkpoints), never tensor data;
``verify`` reads every byte.  Neither imports torch for ckptd and HF safetensors checkpoints
(:mod:`ckptd.load.inspection`); PyTorch DCP and ``.bin`` checkpoints are read by torch.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import CheckpointNotFoundError, CorruptCheckpointError
from ..storage import base_name, normalize_location, storage_for
from .app import Context, Result, non_negative_int
from .output import EXIT_OK, EXIT_USAGE, CliError, Progress, human_size
from .roots import file_totals

__all__ = ["register", "tensor_shapes"]


def register(add: Callable[[str, str], argparse.ArgumentParser]) -> None:
    """Add this module's subcommands."""
    info = add("info", "describe a checkpoint: components, tensors, dtypes, files, sizes, CRCs, references")
    info.add_argument("path")
    info.add_argument(
        "--top", type=non_negative_int, default=5, help="how many of the largest tensors to show (default 5)"
    )
    info.set_defaults(func=_info)
    verify = add("verify", "check the size and CRC32C of every file of a checkpoint")
    verify.add_argument("path")
    verify.set_defaults(func=_verify)


# ---- info --------------------------------------------------------------------------------------


def _info(args: argparse.Namespace, context: Context) -> Result:
    from ..load.inspection import open_view

    try:
        reader = open_view(args.path, context.storage_options)
    except CheckpointNotFoundError:
        _maybe_root(args.path, context)
        raise
    with contextlib.closing(reader):
        return _describe_checkpoint(reader, args.top), _render_info, EXIT_OK


def _describe_checkpoint(reader: Any, top: int) -> dict[str, Any]:
    """The ``info`` document of an open checkpoint (a CheckpointView, or a CheckpointReader)."""
    from ..catalog import read_manifest

    storage = reader.storage
    manifest = reader.manifest
    body: dict[str, Any] = {
        "path": reader.directory,
        "format": reader.kind,
        "step": None,
        "created_utc": None,
        "world_size": None,
        "library_version": None,
        "components": [],
        "tensor_count": 0,
        "tensor_bytes": 0,
        "dtypes": {},
        "largest_tensors": [],
        "files": [],
        "bytes_written": 0,
        "bytes_linked": 0,
        "bytes_copied": 0,
        "bytes_referenced": 0,
        "references": [],
        "non_tensor_components": [],
        "metadata": {},
        "metrics": {},
        "timings": {},
    }
    tensors: list[dict[str, Any]] = []
    if manifest is not None:
        reader.check_files()  # every file there, of its size (one listing): a truncated file is corrupt
        body.update(
            step=manifest.step,
            created_utc=manifest.created_utc,
            world_size=manifest.world_size,
            library_version=manifest.library_version,
            metadata=manifest.metadata,
            metrics=manifest.metrics,
            timings=manifest.timings,
        )
        for name, component in manifest.components.items():
            dtypes = Counter(record.dtype for record in component.tensors.values())
            body["components"].append(
                {
                    "name": name,
                    "kind": component.kind,
                    "sharing": component.sharing,
                    "tensors": len(component.tensors),
                    "bytes": component.tensor_bytes(),
                    "dtypes": dict(dtypes),
                    "tied_groups": len(component.tied),
                }
            )
            if not component.tensors:
                body["non_tensor_components"].append(name)
            for key, record in component.tensors.items():
                tensors.append(_tensor_json(name, key, record.dtype, record.shape, record.nbytes, len(record.chunks)))
        body["files"] = [
            {"name": name, "size": f.size, "crc32c": f.crc32c, "reused": f.reused, "checkpoint": f.checkpoint}
            for name, f in sorted(manifest.files.items())
        ]
        totals = file_totals(manifest)
        body.update({k: totals[k] for k in ("bytes_written", "bytes_linked", "bytes_copied", "bytes_referenced")})
        parent = os.path.dirname(reader.directory) if storage.local else reader.directory.rsplit("/", 1)[0]
        for name in totals["references"]:
            holder = storage.join(parent, name)
            files = [f for f in manifest.files.values() if f.checkpoint == name]
            body["references"].append(
                {
                    "checkpoint": name,
                    "path": holder,
                    "files": len(files),
                    "bytes": sum(f.size for f in files),
                    "committed": read_manifest(storage, holder) is not None,
                }
            )
    else:
        for name in reader.components():
            found = tensor_shapes(reader, name)
            dtypes = Counter(dtype for dtype, _, _, _ in found.values())
            count = len(found) or len(reader.keys(name))
            kind = reader.kind if reader.kind == "dcp" else "safetensors"
            kind = "torch_bin" if reader.kind.startswith("torch_bin") or reader.kind == "torch_checkpointing" else kind
            body["components"].append(
                {
                    "name": name,
                    "kind": kind,
                    "sharing": "replicated",
                    "tensors": count,
                    "bytes": sum(nbytes for _, _, nbytes, _ in found.values()),
                    "dtypes": dict(dtypes),
                    "tied_groups": len(reader.tied_groups(name)),
                }
            )
            for key, (dtype, shape, nbytes, chunks) in found.items():
                tensors.append(_tensor_json(name, key, dtype, shape, nbytes, chunks))
        sizes = storage.sizes(reader.directory)
        body["files"] = [{"name": n, "size": s, "crc32c": None, "checkpoint": None} for n, s in sorted(sizes.items())]
        body["bytes_written"] = sum(sizes.values())
    body["tensor_count"] = sum(c["tensors"] for c in body["components"])
    body["tensor_bytes"] = sum(c["bytes"] for c in body["components"])
    all_dtypes: Counter[str] = Counter()
    for component in body["components"]:
        all_dtypes.update(component["dtypes"])
    body["dtypes"] = dict(all_dtypes)
    tensors.sort(key=lambda t: (-t["bytes"], t["component"], t["key"]))
    body["largest_tensors"] = tensors[:top]
    return body


def tensor_shapes(reader: Any, component: str) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    """Dtype, shape, bytes and pieces of each stored tensor of a component of a checkpoint with no
    ckptd manifest (none for ``.bin`` files, which only torch can open: their keys are listed;
    torch_checkpointing's ``.pt`` items are loaded by torch, ``weights_only``)."""
    if reader.kind == "dcp":  # torch read its .metadata
        from ..formats.safetensors import DTYPE_ITEMSIZE
        from ..formats.torch_dtypes import dtype_name

        layout = reader.dcp_layout()
        out = {}
        for key, fqn in layout.components[component].items():
            dtype, shape = dtype_name(layout.dtypes[fqn], key), tuple(layout.shapes[fqn])
            out[key] = (dtype, shape, math.prod(shape) * DTYPE_ITEMSIZE[dtype], 1)
        return out
    if reader.kind == "torch_checkpointing":  # torch.save items: torch loads them (memory-mapped) to tell
        from ..formats.torch_dtypes import dtype_name

        loaded = reader.read(component)
        return {key: (dtype_name(t.dtype, key), tuple(t.shape), t.nbytes, 1) for key, t in loaded.items()}
    try:
        records = reader.locate(component)
    except (CorruptCheckpointError, KeyError):
        return {}
    return {key: (r.dtype, tuple(r.shape), r.nbytes, len(r.chunks)) for key, r in records.items()}


def _tensor_json(
    component: str, key: str, dtype: str, shape: tuple[int, ...], nbytes: int, chunks: int
) -> dict[str, Any]:
    return {"component": component, "key": key, "dtype": dtype, "shape": list(shape), "bytes": nbytes, "chunks": chunks}


def _maybe_root(path: str, context: Context) -> None:
    """Raise a clearer error when ``path`` is a root of checkpoints rather than a checkpoint."""
    from ..catalog import list_checkpoints

    root = normalize_location(path)
    storage = storage_for(root, context.storage_options)
    if not storage.local:
        return
    found = list_checkpoints(storage, root) if os.path.isdir(root) else []
    if found:
        raise CliError(
            f"{root} is a root of {len(found)} checkpoint(s), not a checkpoint",
            EXIT_USAGE,
            f"pass one of them, e.g. 'ckptd info {found[-1].path}'; 'ckptd ls {root}' lists them",
        )


def _render_info(body: dict[str, Any], context: Context) -> None:
    say = context.say
    say(f"path: {body['path']}")
    say(f"format: {body['format']}")
    if body["step"] is not None or body["created_utc"]:
        say(
            f"step: {body['step']}  created: {body['created_utc']}  world size: {body['world_size']}  "
            f"ckptd {body['library_version']}"
        )
    dtypes = ", ".join(f"{d} x{n}" for d, n in sorted(body["dtypes"].items()))
    say(f"tensors: {body['tensor_count']} ({human_size(body['tensor_bytes'])}); dtypes: {dtypes or '-'}")
    say("components:")
    for c in body["components"]:
        kinds = ", ".join(f"{d} x{n}" for d, n in sorted(c["dtypes"].items()))
        tied = f", {c['tied_groups']} tied group(s)" if c["tied_groups"] else ""
        if c["tensors"]:
            say(
                f"  {c['name']}: {c['tensors']} tensors, {human_size(c['bytes'])} ({kinds or c['kind']}), "
                f"{c['sharing']}{tied}"
            )
        else:
            say(f"  {c['name']}: non-tensor state ({c['sharing']})")
    if body["largest_tensors"]:
        say("largest tensors:")
        for t in body["largest_tensors"]:
            shape = "x".join(str(d) for d in t["shape"]) or "scalar"
            pieces = f", {t['chunks']} pieces" if t["chunks"] > 1 else ""
            say(f"  {t['component']}/{t['key']}  {t['dtype']}  [{shape}]  {human_size(t['bytes'])}{pieces}")
    say(
        f"files: {len(body['files'])}, {human_size(body['bytes_written'])} written here"
        + (f", {human_size(body['bytes_linked'])} linked" if body["bytes_linked"] else "")
        + (f", {human_size(body['bytes_copied'])} copied" if body["bytes_copied"] else "")
        + (f", {human_size(body['bytes_referenced'])} referenced" if body["bytes_referenced"] else "")
    )
    for f in body["files"]:
        where = f"  (in {f['checkpoint']})" if f["checkpoint"] else ""
        where += f"  ({f['reused'].replace('_', ' ')} of the previous checkpoint's)" if f.get("reused") else ""
        crc = f"crc32c {f['crc32c']}" if f["crc32c"] else "no crc"
        say(f"  {f['name']}  {human_size(f['size'])}  {crc}{where}")
    for ref in body["references"]:
        state = "committed" if ref["committed"] else "MISSING"
        say(f"references {ref['checkpoint']}: {ref['files']} file(s), {human_size(ref['bytes'])} ({state})")
    if body["metadata"]:
        say(f"metadata: {body['metadata']}")
    if body["metrics"]:
        say(f"metrics: {body['metrics']}")
    if body["timings"]:
        say("timings: " + ", ".join(f"{k} {v:.3f} s" for k, v in body["timings"].items()))


# ---- verify ------------------------------------------------------------------------------------


def _verify(args: argparse.Namespace, context: Context) -> Result:
    from ..load.inspection import CheckpointView, open_view

    view = open_view(args.path, context.storage_options, require_manifest=True)
    with contextlib.closing(view):
        manifest = view.manifest
        if manifest is None or not isinstance(view, CheckpointView):  # a DCP checkpoint, opened by torch
            raise CheckpointNotFoundError(f"{args.path}: not a ckptd checkpoint")
        total = sum(f.size for f in manifest.files.values())
        progress = Progress(f"verify {base_name(view.directory)}", total, enabled=context.progress)
        failures: dict[str, str] = {}

        def check(name: str) -> None:
            try:
                view.verify([name])
            except CorruptCheckpointError as e:  # storage errors propagate: they say nothing of the file
                failures[name] = str(e)
            progress.update(manifest.files[name].size)

        try:
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(check, sorted(manifest.files)))
        finally:
            progress.close()
    if failures:
        first = sorted(failures)[0]
        raise CorruptCheckpointError(
            f"{len(failures)} of {len(manifest.files)} files failed: {failures[first]}"
            + (f" (and {', '.join(sorted(failures)[1:4])})" if len(failures) > 1 else "")
        )
    body = {"path": view.directory, "files": len(manifest.files), "bytes": total, "verified": True}
    return body, _render_verify, EXIT_OK


def _render_verify(body: dict[str, Any], context: Context) -> None:
    context.say(f"OK: {body['files']} files, {body['bytes']} bytes, sizes and CRC32C match")
