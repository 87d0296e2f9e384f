"""``ckptd memory ls|drop``: this user's held-memory roots (``shm://NAME``) on this host.

``ls`` lists them with the memory their files take, whether a live process uses them (holds a
lease) and how long they are kept once unused; ``drop NAME`` removes one at once, freeing its
memory (refused while a process uses it, unless ``--force``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from .app import Context, Result
from .output import EXIT_OK, EXIT_USAGE, CliError, human_size

__all__ = ["register"]


def register(add: Callable[[str, str], argparse.ArgumentParser]) -> None:
    """Add the ``memory`` subcommand."""
    memory = add("memory", "list (ls) or drop the held-memory roots (shm://NAME) of this user on this host")
    memory.add_argument("action", choices=("ls", "drop"))
    memory.add_argument("name", nargs="?", help="the root to drop: NAME or shm://NAME")
    memory.add_argument("--force", action="store_true", help="drop even while a process uses it")
    memory.set_defaults(func=_memory)


def _memory(args: argparse.Namespace, context: Context) -> Result:
    from ..writer.keeper import drop_held, held_roots

    if args.action == "ls":
        if args.name is not None or args.force:
            raise CliError("'memory ls' takes no NAME and no --force", EXIT_USAGE, "see 'ckptd memory --help'")
        roots = [asdict(root) for root in held_roots()]
        return {"roots": roots}, _render_ls, EXIT_OK
    if args.name is None:
        raise CliError("'memory drop' needs the NAME of a held root", EXIT_USAGE, "'ckptd memory ls' lists them")
    dropped = asdict(drop_held(args.name, force=args.force))
    return {"dropped": dropped}, _render_drop, EXIT_OK


def _render_ls(body: dict[str, Any], context: Context) -> None:
    if not body["roots"]:
        context.say("no held-memory roots")
        return
    rows = [("ROOT", "MEMORY", "STATE", "HOLD", "KEEPER")]
    for root in body["roots"]:
        hold = root["hold_after_exit"]
        rows.append(
            (
                root["url"],
                human_size(root["nbytes"]),
                "in use" if root["in_use"] else "held" if root["keeper_pid"] else "unkept",
                "-" if hold is None else f"{hold:g} s",
                str(root["keeper_pid"] or "-"),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        context.say("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    unkept = [root["url"] for root in body["roots"] if not root["in_use"] and not root["keeper_pid"]]
    if unkept:
        context.warn(f"no keeper releases {', '.join(unkept)}: 'ckptd memory drop NAME' frees the memory")


def _render_drop(body: dict[str, Any], context: Context) -> None:
    dropped = body["dropped"]
    context.say(f"dropped {dropped['url']} ({human_size(dropped['nbytes'])} freed)")
