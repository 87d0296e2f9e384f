"""What a reliability test runs in a subprocess (under ``oshook``): one ckptd operation.

``python scenario.py <action> <json arguments>``; see :func:`main`.  The state saved for a step
is :func:`state_for` (values derived from the step and a variant), so a survivor can be checked
bit for bit.
"""

from __future__ import annotations

import json
import sys
from typing import Any

__all__ = ["main", "state_for"]


def state_for(step: int, variant: int = 0) -> dict[str, Any]:
    """The state saved for ``step`` (``variant`` tells an overwrite's new values from the old)."""
    import torch

    base = float(step * 10 + variant)
    return {
        "model": {
            "frozen": torch.arange(1024, dtype=torch.float32),  # the same at every step (incremental)
            "w": torch.full((32, 32), base),
            "b": torch.arange(48, dtype=torch.float32) + base,
            "h": torch.full((16,), int(base), dtype=torch.int64),
        },
        "trainer": {"step": step, "variant": variant},
    }


def main(action: str, args: dict[str, Any]) -> None:
    import ckptd
    from ckptd.garbage import collect_garbage
    from ckptd.retention import apply_retention
    from ckptd.storage.local import LocalStorage

    if args.get("no_exchange"):
        import ckptd.storage.local as local

        local.exchange_paths = lambda a, b: False  # a filesystem without RENAME_EXCHANGE
    if action == "save":
        with ckptd.Checkpointer(
            args["root"],
            keep_last=args.get("keep_last"),
            incremental=bool(args.get("incremental")),
            max_shard_size="4KB",
            storage_options=args.get("storage_options") or {},
        ) as ckpt:
            for step in args["steps"]:
                state = state_for(step, args.get("variant", 0))
                frozen = {"model": ["frozen"]} if args.get("incremental") else None
                ckpt.save(step, state, overwrite=args.get("overwrite", False), frozen=frozen)
    elif action == "retention":
        apply_retention(LocalStorage(), args["root"], args["keep_last"])
    elif action == "gc":
        collect_garbage(LocalStorage(), args["root"])
    elif action == "consolidate":
        ckptd.consolidate(args["source"], args["destination"], max_shard_size="4KB")
    elif action == "metrics":
        from ckptd.compat.forgather import save_checkpoint_metrics

        save_checkpoint_metrics(args["path"], {"loss": 0.5})
    else:
        raise SystemExit(f"unknown action {action}")


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
