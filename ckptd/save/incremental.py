"""Incremental saves: which files of a plan the last committed save already holds.

A file is *reusable* when the last committed save has a file of the same name and size holding
exactly the same tensor records.  Reusable files of frozen tensors are not written at all (the
new manifest references the holder); with ``incremental="hash"`` the other reusable files are
written unless their CRC32C matches the holder's.  While a save that references a holder is
queued, retention must keep the holder; and a holder that committed saves reference must not be
overwritten.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..catalog import list_checkpoints, read_manifest
from ..errors import ReferencedCheckpointError
from ..formats.manifest import FileRecord, Manifest
from ..storage import Storage, base_name
from .plan import SavePlan

__all__ = ["IncrementalPolicy", "Reuse", "plan_file_frozen"]


@dataclass(frozen=True)
class Reuse:
    """What one save takes from the last committed one."""

    reused: Mapping[str, FileRecord]  # not written: the holder's, referenced
    hashed: Mapping[str, FileRecord]  # written unless their CRC32C matches the holder's

    @property
    def holders(self) -> frozenset[str]:
        """Names of the checkpoints this save references."""
        return frozenset(r.checkpoint for r in [*self.reused.values(), *self.hashed.values()] if r.checkpoint)


def plan_file_frozen(plan: SavePlan, file_name: str) -> bool:
    """True if ``file_name`` of ``plan`` holds only frozen tensors."""
    return any(f.file_name == file_name and f.frozen for f in plan.files)


class IncrementalPolicy:
    """The reuse decisions of one Checkpointer, and the references its queued saves hold.

    ``mode`` is the Checkpointer's ``incremental`` option (``False``, ``True`` or ``"hash"``).
    :meth:`select` runs on the caller's thread, :meth:`release`, :meth:`committed` and
    :meth:`protected` on the completion thread.
    """

    def __init__(self, storage: Storage, root: str, mode: bool | str) -> None:
        self.storage = storage
        self.root = root
        self.mode = mode
        self._last_path: str | None = None  # the last committed save
        self._last_manifest: Manifest | None = None
        self._references: collections.Counter[str] = collections.Counter()  # holders queued saves reuse
        self._lock = threading.Lock()

    @property
    def last_path(self) -> str | None:
        """The last committed save of this Checkpointer (every rank must agree on it to reuse)."""
        return self._last_path

    def select(self, plan: SavePlan, final: str, last_committed: Iterable[str | None]) -> Reuse:
        """What the save of ``plan`` to ``final`` reuses, given every rank's last committed save;
        the holders stay referenced until :meth:`release`."""
        # Reuse only when every rank agrees on the last committed save (a rank whose completion
        # thread has not seen the last commit yet would otherwise plan different writes).
        agreed = set(last_committed)
        candidates = self.reusable(plan) if len(agreed) == 1 and None not in agreed else {}
        if base_name(final) in {r.checkpoint for r in candidates.values()}:
            candidates = {}  # overwriting the very checkpoint that holds the files
        reused = {name: record for name, record in candidates.items() if plan_file_frozen(plan, name)}
        hashed = {} if self.mode != "hash" else {n: r for n, r in candidates.items() if n not in reused}
        reuse = Reuse(reused, hashed)
        with self._lock:
            self._references.update(reuse.holders)
        return reuse

    def release(self, reuse: Reuse) -> None:
        """The save that took ``reuse`` committed or failed: its holders are no longer queued."""
        with self._lock:
            self._references.subtract(reuse.holders)
            self._references += collections.Counter()  # drop the zero counts

    def protected(self) -> set[str]:
        """Paths of the checkpoints queued saves reference (retention must keep them)."""
        with self._lock:
            names = list(self._references)
        return {self.storage.join(self.root, name) for name in names}

    def committed(self, path: str, manifest: Manifest | None) -> None:
        """Remember the save just committed at ``path`` (its manifest is read here when this
        rank did not write it, not on the next save's critical path)."""
        if manifest is None and self.mode:
            manifest = read_manifest(self.storage, path)
        self._last_path, self._last_manifest = path, manifest

    def reusable(self, plan: SavePlan) -> dict[str, FileRecord]:
        """Files of ``plan`` laid out exactly as in the last committed save (same name, size and
        tensor records), referenced to the checkpoint that holds them."""
        if not self.mode or self._last_path is None:
            return {}
        if self._last_manifest is None:
            self._last_manifest = read_manifest(self.storage, self._last_path)
        previous = self._last_manifest
        if previous is None:
            return {}
        holder = base_name(self._last_path)
        out: dict[str, FileRecord] = {}
        for file in plan.files:
            record = previous.files.get(file.file_name)
            if record is None or record.size != file.size:
                continue
            mine = {
                (c, k): t
                for c, tensors in plan.tensors.items()
                for k, t in tensors.items()
                if file.file_name in t.files
            }
            theirs = {
                (c, k): t
                for c, component in previous.components.items()
                for k, t in component.tensors.items()
                if file.file_name in t.files
            }
            if mine == theirs:
                out[file.file_name] = FileRecord(record.size, record.crc32c, record.checkpoint or holder)
        return out

    def refuse_overwriting_referenced(self, path: str) -> None:
        """Overwriting a checkpoint whose files incremental saves reference would break them."""
        name = base_name(path)
        users = [
            info.path
            for info in list_checkpoints(self.storage, self.root)
            if info.path != path and any(f.checkpoint == name for f in info.manifest.files.values())
        ]
        if users:
            raise ReferencedCheckpointError(
                f"checkpoint {path} holds files that {', '.join(users[:3])} reference (incremental saves); "
                "consolidate those first, or save under another step"
            )
