"""Commands on one checkpoint: ``info``, ``verify``, ``diff``.

``info`` and ``diff`` read manifests (or safetensors headers for HF checkpoints), never tensor
data, except ``diff --exact`` (only the tensors whose files differ).  ``verify`` reads every byte.
"""

from __future__ import annotations

import argparse
import os
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import CheckpointNotFoundError, CorruptCheckpointError
from ..storage import base_name, normalize_location, storage_for
from .app import Context, Result
from .output import EXIT_OK, EXIT_USAGE, CliError, Progress, human_size
from .roots import file_totals

__all__ = ["register"]


def register(add: Callable[[str, str], argparse.ArgumentParser]) -> None:
    """Add this module's subcommands."""
    info = add("info", "describe a checkpoint: components, tensors, dtypes, files, sizes, CRCs, references")
    info.add_argument("path")
    info.add_argument("--top", type=int, default=5, help="how many of the largest tensors to show (default 5)")
    info.set_defaults(func=_info)
    verify = add("verify", "check the size and CRC32C of every file of a checkpoint")
    verify.add_argument("path")
    verify.set_defaults(func=_verify)
    diff = add("diff", "compare two checkpoints' tensors (keys added, removed, changed) from their manifests")
    diff.add_argument("a")
    diff.add_argument("b")
    diff.add_argument("--component", help="compare only this component")
    diff.add_argument("--exact", action="store_true", help="read the tensors whose files differ and compare bytes")
    diff.set_defaults(func=_diff)


# ---- info --------------------------------------------------------------------------------------


def _info(args: argparse.Namespace, context: Context) -> Result:
    from ..catalog import read_manifest
    from ..load.reader import CheckpointReader

    try:
        reader = CheckpointReader.open(args.path, context.storage_options)
    except CheckpointNotFoundError:
        _maybe_root(args.path, context)
        raise
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
            try:
                records = reader.locate(name)
            except (CorruptCheckpointError, KeyError):
                records = {}
            dtypes = Counter(record.dtype for record in records.values())
            count = len(records) or len(reader.keys(name))
            body["components"].append(
                {
                    "name": name,
                    "kind": "torch_bin" if reader.kind.startswith("torch_bin") else "safetensors",
                    "sharing": "replicated",
                    "tensors": count,
                    "bytes": sum(r.nbytes for r in records.values()),
                    "dtypes": dict(dtypes),
                    "tied_groups": len(reader.tied_groups(name)),
                }
            )
            for key, record in records.items():
                tensors.append(_tensor_json(name, key, record.dtype, record.shape, record.nbytes, len(record.chunks)))
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
    body["largest_tensors"] = tensors[: max(0, args.top)]
    return body, _render_info, EXIT_OK


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
    from ..load.reader import CheckpointReader

    reader = CheckpointReader.open(args.path, context.storage_options, require_manifest=True)
    manifest = reader.manifest
    if manifest is None:  # pragma: no cover - require_manifest guarantees it
        raise CheckpointNotFoundError(f"{args.path}: not a ckptd checkpoint")
    total = sum(f.size for f in manifest.files.values())
    progress = Progress(f"verify {base_name(reader.directory)}", total, enabled=context.progress)
    failures: dict[str, str] = {}

    def check(name: str) -> None:
        try:
            reader.verify([name])
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
    body = {"path": reader.directory, "files": len(manifest.files), "bytes": total, "verified": True}
    return body, _render_verify, EXIT_OK


def _render_verify(body: dict[str, Any], context: Context) -> None:
    context.say(f"OK: {body['files']} files, {body['bytes']} bytes, sizes and CRC32C match")


# ---- diff --------------------------------------------------------------------------------------


def _describe(path: str, context: Context) -> tuple[Any, dict[str, dict[str, tuple[str, tuple[int, ...], tuple]]]]:
    """A reader and, per component, each tensor's dtype, shape and a fingerprint of its bytes
    (the files holding it with their CRC32C and byte ranges; ``None`` when no CRC is known)."""
    from ..load.reader import CheckpointReader

    reader = CheckpointReader.open(path, context.storage_options)
    manifest = reader.manifest
    out: dict[str, dict[str, tuple[str, tuple[int, ...], tuple]]] = {}
    for component in reader.components():
        records = reader.locate(component) if not reader.kind.startswith("torch_bin") else {}
        described = {}
        for key, record in records.items():
            fingerprint: tuple = ()
            if manifest is not None:
                fingerprint = tuple((manifest.files[c.file].crc32c, c.start, c.end, c.offset) for c in record.chunks)
            described[key] = (record.dtype, tuple(record.shape), fingerprint)
        for alias, stored in ((a, g[0]) for g in reader.tied_groups(component) for a in g[1:]):
            if stored in described:
                described[alias] = described[stored]
        out[component] = described
    return reader, out


def _diff(args: argparse.Namespace, context: Context) -> Result:
    reader_a, a = _describe(args.a, context)
    reader_b, b = _describe(args.b, context)
    components = sorted(set(a) | set(b))
    if args.component:
        if args.component not in components:
            raise CliError(f"neither checkpoint has a component {args.component!r} (found {components})")
        components = [args.component]
    added: list[dict[str, Any]] = []
    removed: list[dict[str, Any]] = []
    changed: list[dict[str, Any]] = []
    unchanged = 0
    for component in components:
        left, right = a.get(component, {}), b.get(component, {})
        for key in sorted(set(right) - set(left)):
            added.append({"component": component, "key": key, "dtype": right[key][0], "shape": list(right[key][1])})
        for key in sorted(set(left) - set(right)):
            removed.append({"component": component, "key": key, "dtype": left[key][0], "shape": list(left[key][1])})
        for key in sorted(set(left) & set(right)):
            (dtype_a, shape_a, print_a), (dtype_b, shape_b, print_b) = left[key], right[key]
            reason = None
            if dtype_a != dtype_b:
                reason = "dtype"
            elif shape_a != shape_b:
                reason = "shape"
            elif not print_a or not print_b or print_a != print_b:
                reason = "file_crc" if print_a and print_b else "unknown"
                if args.exact:
                    same = _same_bytes(reader_a, reader_b, component, key)
                    reason = None if same else "data"
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
    return body, _render_diff, EXIT_OK


def _same_bytes(reader_a: Any, reader_b: Any, component: str, key: str) -> bool:
    import torch

    left = reader_a.read(component, [key])[key]
    right = reader_b.read(component, [key])[key]
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
    context.say(
        f"{len(body['added'])} added, {len(body['removed'])} removed, {len(body['changed'])} changed, "
        f"{body['unchanged']} unchanged"
    )
