"""Commands on a root of checkpoints: ``ls``, ``gc``, ``rm`` (and the root checks they share).

``ls`` reads manifests only; sizes come from them (bytes each save wrote, and bytes an
incremental save linked or copied from the previous checkpoint instead) and from listing
leftovers.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointNotFoundError, ReferencedCheckpointError
from ..storage import Storage, base_name, normalize_location, storage_for
from .app import Context, Result, non_negative_float, non_negative_int
from .output import EXIT_OK, EXIT_STORAGE, EXIT_USAGE, CliError, Failure, human_size

if TYPE_CHECKING:
    from ..formats.manifest import Manifest

__all__ = ["file_totals", "open_root", "register"]

_CHECKPOINT_MARKERS = (
    "checkpoint_manifest.json",  # formats.manifest.MANIFEST_NAME (not imported: it pulls in torch)
    "model.safetensors.index.json",
    "model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
)


def register(add: Callable[[str, str], argparse.ArgumentParser]) -> None:
    """Add this module's subcommands."""
    ls = add("ls", "list the committed checkpoints under a root, and any leftovers of interrupted saves")
    ls.add_argument("root")
    ls.set_defaults(func=_ls)
    gc = add("gc", "remove what crashed saves left under a root (staging directories, unfinished prefixes)")
    gc.add_argument("root")
    gc.add_argument(
        "--older-than", type=non_negative_float, default=24 * 3600, help="seconds, for other hosts' leftovers"
    )
    gc.set_defaults(func=_gc)
    rm = add("rm", "delete one committed checkpoint (refused while an older version's checkpoint references it)")
    rm.add_argument("root")
    rm.add_argument("step", type=non_negative_int)
    rm.set_defaults(func=_rm)


# ---- roots -------------------------------------------------------------------------------------


def open_root(url: str, context: Context) -> tuple[Storage, str]:
    """The storage and normalised location of an existing checkpoint root; raises when the root
    does not exist, the bucket is missing or unreachable, or ``url`` is a checkpoint itself."""
    root = normalize_location(url)
    storage = storage_for(root, context.storage_options)
    if storage.local:
        if not os.path.exists(root):
            raise CheckpointNotFoundError(f"{root}: no such directory")
        if not os.path.isdir(root):
            raise CliError(f"{root} is a file, not a root of checkpoints", EXIT_USAGE, f"'ckptd info {url}'")
    else:
        storage.check_access(root)
    names = storage.list_names(root)
    if any(marker in names for marker in _CHECKPOINT_MARKERS):
        parent = os.path.dirname(root) if storage.local else root.rsplit("/", 1)[0]
        raise CliError(
            f"{root} is a checkpoint, not a root of checkpoints",
            EXIT_USAGE,
            f"'ckptd info {url}' describes it; 'ckptd ls {parent}' lists it with its siblings",
        )
    if not names and not storage.local:
        raise CheckpointNotFoundError(f"{root}: nothing is stored under this prefix")
    return storage, root


def file_totals(manifest: Manifest) -> dict[str, Any]:
    """A checkpoint's bytes by how its save made them: written, hard-linked or copied (local or
    server-side) from the previous checkpoint by an incremental save; and, for checkpoints of
    older versions only, the bytes referenced in the earlier checkpoints named in ``references``."""
    files = manifest.files.values()
    return {
        "bytes_written": sum(f.size for f in files if f.checkpoint is None and f.reused is None),
        "bytes_linked": sum(f.size for f in files if f.reused == "link"),
        "bytes_copied": sum(f.size for f in files if f.reused in ("copy", "server_copy")),
        "bytes_referenced": sum(f.size for f in files if f.checkpoint is not None),
        "files": len(manifest.files),
        "references": sorted({f.checkpoint for f in files if f.checkpoint}),
    }


# ---- ls ----------------------------------------------------------------------------------------


def _ls(args: argparse.Namespace, context: Context) -> Result:
    from ..catalog import list_checkpoints
    from ..garbage import find_leftovers

    storage, root = open_root(args.root, context)
    checkpoints = [{**_listed(info), "state": "committed"} for info in list_checkpoints(storage, root)]
    leftovers = [
        {
            "name": item.name,
            "path": item.path,
            "kind": item.kind,
            "bytes": item.nbytes,
            "files": item.files,
            "active": item.active,
            "collectable": item.collectable,
        }
        for item in find_leftovers(storage, root)
    ]
    body = {
        "root": root,
        "checkpoints": checkpoints,
        "leftovers": leftovers,
        "tiers": _tier_listings(storage, root, context),
    }
    return body, _render_ls, EXIT_OK


def _listed(info: Any) -> dict[str, Any]:
    """A committed checkpoint as ``ls`` lists it (a root's or a tier's)."""
    return {"step": info.step, "path": info.path, "created_utc": info.created_utc, **file_totals(info.manifest)}


def _tier_listings(storage: Storage, root: str, context: Context) -> list[dict[str, Any]]:
    """The committed checkpoints of each slower tier recorded under ``root`` (by the last
    Checkpointer that saved there with ``tiers``); a tier that cannot be listed says why."""
    from ..catalog import list_checkpoints
    from ..formats.json_files import read_small_json
    from ..formats.names import TIERS_RECORD_NAME

    path = storage.join(root, TIERS_RECORD_NAME)
    if not storage.exists(path):
        return []
    try:
        record = read_small_json(storage, path, what="tiers record")
        tiers = [dict(t) for t in record["tiers"] if isinstance(t.get("root"), str)]
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:
        context.warn(f"{path} is not a readable tiers record ({e}); only {root} is listed")
        return []
    listed = []
    for tier in tiers:
        entry: dict[str, Any] = {
            "tier": tier.get("tier"),
            "root": tier["root"],
            "every": tier.get("every"),
            "keep_last": tier.get("keep_last"),
            "checkpoints": [],
            "error": None,
        }
        try:
            tier_root = normalize_location(tier["root"])
            tier_storage = storage_for(tier_root, context.storage_options)
            entry["checkpoints"] = [_listed(info) for info in list_checkpoints(tier_storage, tier_root)]
        except Exception as e:  # noqa: BLE001 - a tier out of reach is reported, the root's listing stands
            entry["error"] = f"{type(e).__name__}: {e}"
        listed.append(entry)
    return listed


def _render_ls(body: dict[str, Any], context: Context) -> None:
    rows = [("STEP", "CREATED (UTC)", "WRITTEN", "LINKED", "COPIED", "FILES", "STATE", "NAME")]
    for c in body["checkpoints"]:
        created = c["created_utc"].replace("T", " ")[:19]
        rows.append(
            (
                str(c["step"]),
                created,
                human_size(c["bytes_written"]),
                human_size(c["bytes_linked"]) if c["bytes_linked"] else "-",
                human_size(c["bytes_copied"]) if c["bytes_copied"] else "-",
                str(c["files"]),
                "committed" if not c["references"] else f"committed (references {', '.join(c['references'])})",
                base_name(c["path"]),
            )
        )
    for item in body["leftovers"]:
        if item["active"]:
            state = "saving"
        else:
            state = "incomplete" if item["kind"] == "incomplete" else f"incomplete ({item['kind']})"
        rows.append(("-", "-", human_size(item["bytes"]), "-", "-", str(item["files"]), state, item["name"]))
    if len(rows) == 1:
        context.say(f"no committed checkpoints under {body['root']}")
    else:
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        for row in rows:
            context.say(
                "  ".join(
                    cell.ljust(w) if i in (1, 6, 7) else cell.rjust(w)
                    for i, (cell, w) in enumerate(zip(row, widths, strict=True))
                ).rstrip()
            )
    for tier in body.get("tiers", []):
        cadence = f"every {tier['every']} steps" if tier["every"] else "every save"
        kept = f", keeps {tier['keep_last']}" if tier["keep_last"] else ""
        context.say(f"tier {tier['tier']}: {tier['root']} ({cadence}{kept})")
        if tier["error"]:
            context.warn(f"tier {tier['tier']} ({tier['root']}) could not be listed: {tier['error']}")
            continue
        if not tier["checkpoints"]:
            context.say("  no committed checkpoints")
        for c in tier["checkpoints"]:
            created = c["created_utc"].replace("T", " ")[:19]
            size = human_size(c["bytes_written"] + c["bytes_linked"] + c["bytes_copied"])
            context.say(f"  {c['step']:>8}  {created}  {size:>9}  {base_name(c['path'])}")
    stale = [item for item in body["leftovers"] if not item["active"] and item["collectable"]]
    if stale:
        total = sum(item["bytes"] for item in stale)
        context.warn(
            f"{len(stale)} leftover(s) of interrupted saves ({human_size(total)}) under {body['root']}; "
            f"'ckptd gc {body['root']}' removes them"
        )
    for item in body["leftovers"]:
        if not item["collectable"]:
            context.warn(
                f"{item['path']} ({human_size(item['bytes'])}) is not a committed checkpoint and gc leaves it: "
                "delete it by hand if no save is writing it"
            )


# ---- gc, rm ------------------------------------------------------------------------------------


def _gc(args: argparse.Namespace, context: Context) -> Result:
    from ..garbage import collect_garbage, find_leftovers

    storage, root = open_root(args.root, context)
    before = {item.path: item for item in find_leftovers(storage, root)}
    collected = collect_garbage(storage, root, older_than=args.older_than)
    removed = list(collected)  # each really gone
    failed = [
        {"path": f.path, "kind": before[f.path].kind if f.path in before else "leftover", "error": f.error}
        for f in collected.failures
    ]
    done = set(removed) | {f["path"] for f in failed}
    kept = [
        {"path": item.path, "kind": item.kind, "reason": _kept_reason(item, collected.recovered.get(path))}
        for path, item in before.items()
        if path not in done
    ]
    freed = sum(before[path].nbytes for path in removed if path in before)
    body: dict[str, Any] = {"root": root, "removed": removed, "bytes_freed": freed, "kept": kept}
    if not failed:
        return body, _render_gc, EXIT_OK
    first = failed[0]
    if len(failed) == 1:
        message = f"could not remove {first['path']}: {first['error']}"
    else:
        message = f"could not remove {len(failed)} leftovers under {root} (first {first['path']}: {first['error']})"
    failure = Failure(
        EXIT_STORAGE,
        message,
        f"fix the cause (a read-only filesystem, permissions) and run 'ckptd gc {root}' again; --json lists every "
        "failure",
    )
    body.update(ok=False, error=failure.to_json(), failed=failed)
    if context.json:  # the renderer prints it otherwise; with --json too, the error line goes to stderr
        print(failure.line("gc"), file=sys.stderr, flush=True)
    return body, _render_gc, failure.code


def _kept_reason(item: Any, recovered_as: str | None = None) -> str:
    if recovered_as is not None:
        return f"published as {recovered_as} (a complete save a crash left)"
    if item.active:
        return "save in progress"
    if not item.collectable:
        return "not removed by gc: delete it by hand if no save is writing it"
    return "too recent (see --older-than)"


def _render_gc(body: dict[str, Any], context: Context) -> None:
    for path in body["removed"]:
        context.say(f"removed {path}")
    if body["removed"]:
        context.say(f"freed {human_size(body['bytes_freed'])}")
    elif "error" not in body:
        context.say(f"nothing to remove under {body['root']}")
    for item in body["kept"]:
        context.note(f"kept {item['path']}: {item['reason']}")
    if "error" in body:
        for item in body["failed"]:
            context.note(f"could not remove {item['path']}: {item['error']}")
        error = body["error"]
        print(Failure(error["exit_code"], error["message"], error["hint"]).line("gc"), file=sys.stderr, flush=True)


def _rm(args: argparse.Namespace, context: Context) -> Result:
    from ..catalog import checkpoint_dir_name, list_checkpoints, remove_checkpoint
    from ..retention import legacy_referrers

    storage, root = open_root(args.root, context)
    checkpoints = list_checkpoints(storage, root)
    target = next((info for info in checkpoints if info.step == args.step), None)
    if target is None:
        steps = [info.step for info in checkpoints]
        raise CheckpointNotFoundError(
            f"no committed checkpoint of step {args.step} under {root} ({checkpoint_dir_name(args.step)}); "
            f"steps: {steps or 'none'}"
        )
    users = [base_name(path) for path in legacy_referrers(checkpoints, target.path)]
    if users:
        raise ReferencedCheckpointError(
            f"{target.path} holds files that {', '.join(users)} reference (incremental saves of an older ckptd "
            "version); 'ckptd consolidate' those first"
        )
    remove_checkpoint(storage, target.path)
    body = {"root": root, "removed": target.path, "step": target.step}
    return body, lambda b, c: c.say(f"removed {b['removed']}"), EXIT_OK
