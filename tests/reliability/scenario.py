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
            "w": torch.full((32, 32), base),
            "b": torch.arange(48, dtype=torch.float32) + base,
            "h": torch.full((16,), int(base), dtype=torch.int64),
        },
        "trainer": {"step": step, "variant": variant},
    }


def main(action: str, args: dict[str, Any]) -> None:
    import ckptd
    from ckptd.catalog import apply_retention, collect_garbage
    from ckptd.storage.local import LocalStorage

    if args.get("no_exchange"):
        import ckptd.storage.local as local

        local.exchange_paths = lambda a, b: False  # a filesystem without RENAME_EXCHANGE
    if action == "save":
        with ckptd.Checkpointer(
            args["root"],
            keep_last=args.get("keep_last"),
            max_shard_size="4KB",
            storage_options=args.get("storage_options") or {},
        ) as ckpt:
            for step in args["steps"]:
                ckpt.save(step, state_for(step, args.get("variant", 0)), overwrite=args.get("overwrite", False))
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
