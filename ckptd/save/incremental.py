"""Incremental saves: which files of a plan the last committed save already holds.

A file is *reusable* when the last committed save has a file of the same name and size holding
exactly the same tensor records.  Reusable files of frozen tensors are neither staged nor
written: the writer makes them in the new checkpoint from the last one's (a hard link on local
disk, a copy where links fail, a server-side copy on object stores), so every checkpoint holds
all of its files and stands alone.  With ``incremental="hash"`` the other reusable files are
staged, and made the same way instead of written when their SHA-256 equals the one the last
save recorded.  While a save is in flight, the checkpoint it takes files from is in use
(:class:`~ckptd.retention.RunRecord`): retention keeps it until the save is over.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..catalog import list_checkpoints, read_manifest, sibling_checkpoint
from ..errors import ReferencedCheckpointError
from ..formats.manifest import FileRecord, Manifest
from ..retention import RunRecord, legacy_referrers
from ..storage import Storage
from .plan import SavePlan

__all__ = ["IncrementalPolicy", "Reuse", "ReusedFile", "plan_file_frozen"]


@dataclass(frozen=True)
class ReusedFile:
    """A file of the last committed checkpoint that a save may take instead of writing it:
    its size, CRC32C and SHA-256 (when recorded) from that checkpoint's manifest, where it is
    (``source``) and the checkpoint directory holding it (``holder``)."""

    size: int
    crc32c: str
    source: str
    holder: str
    digest: str | None = None

    def record(self, how: str) -> FileRecord:
        """The new checkpoint's record of the file, made ``how`` (a link, a copy...)."""
        return FileRecord(self.size, self.crc32c, digest=self.digest, reused=how)


@dataclass(frozen=True)
class Reuse:
    """What one save takes from the last committed one."""

    reused: Mapping[str, ReusedFile]  # not staged nor written: linked or copied
    hashed: Mapping[str, ReusedFile]  # staged; linked or copied when their SHA-256 is unchanged

    @property
    def holders(self) -> frozenset[str]:
        """Paths of the checkpoints this save takes files from."""
        return frozenset(r.holder for r in [*self.reused.values(), *self.hashed.values()])


def plan_file_frozen(plan: SavePlan, file_name: str) -> bool:
    """True if ``file_name`` of ``plan`` holds only frozen tensors."""
    return any(f.file_name == file_name and f.frozen for f in plan.files)


class IncrementalPolicy:
    """The reuse decisions of one Checkpointer.

    ``mode`` is the Checkpointer's ``incremental`` option (``False``, ``True`` or ``"hash"``).
    :meth:`select` runs on the caller's thread, :meth:`release` and :meth:`committed` on the
    completion thread; ``run`` is the Saver's record of this run (the checkpoints in use).
    """

    def __init__(self, storage: Storage, root: str, mode: bool | str, run: RunRecord) -> None:
        self.storage = storage
        self.root = root
        self.mode = mode
        self.run = run
        self._last_path: str | None = None  # the last committed save
        self._last_manifest: Manifest | None = None

    @property
    def last_path(self) -> str | None:
        """The last committed save of this Checkpointer (every rank must agree on it to reuse)."""
        return self._last_path

    def select(self, plan: SavePlan, final: str, last_committed: Iterable[str | None]) -> Reuse:
        """What the save of ``plan`` to ``final`` reuses, given every rank's last committed save;
        the checkpoint it reuses from stays in use until :meth:`release`."""
        # Reuse only when every rank agrees on the last committed save (a rank whose completion
        # thread has not seen the last commit yet would otherwise plan different writes).
        agreed = set(last_committed)
        with self.run.lock:  # the last save and its use are taken together (see RunRecord)
            candidates = self.reusable(plan) if len(agreed) == 1 and None not in agreed else {}
            if final in {r.holder for r in candidates.values()}:
                candidates = {}  # overwriting the very checkpoint that holds the files
            reused = {name: record for name, record in candidates.items() if plan_file_frozen(plan, name)}
            hashed = {}
            if self.mode == "hash":
                hashed = {n: r for n, r in candidates.items() if n not in reused and r.digest is not None}
            reuse = Reuse(reused, hashed)
            self.run.acquire(reuse.holders)
        return reuse

    def release(self, reuse: Reuse) -> None:
        """The save that took ``reuse`` committed or failed: it no longer uses its sources."""
        self.run.release(reuse.holders)

    def committed(self, path: str, manifest: Manifest | None) -> None:
        """Remember the save just committed at ``path`` (its manifest is read here when this
        rank did not write it, not on the next save's critical path)."""
        if manifest is None and self.mode:
            manifest = read_manifest(self.storage, path)
        with self.run.lock:
            self._last_path, self._last_manifest = path, manifest

    def forget_if_gone(self) -> None:
        """After a failed save: if the last committed checkpoint is gone (deleted by another
        process, say), stop taking files from it; the next save writes everything."""
        with self.run.lock:
            last = self._last_path
        if last is not None and read_manifest(self.storage, last) is None:
            with self.run.lock:
                if self._last_path == last:
                    self._last_path, self._last_manifest = None, None

    def reusable(self, plan: SavePlan) -> dict[str, ReusedFile]:
        """Files of ``plan`` laid out exactly as in the last committed save (same name, size and
        tensor records), with where they are."""
        if not self.mode or self._last_path is None:
            return {}
        if self._last_manifest is None:
            self._last_manifest = read_manifest(self.storage, self._last_path)
        previous = self._last_manifest
        if previous is None:
            return {}
        last = self._last_path
        out: dict[str, ReusedFile] = {}
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
                # An older version's manifest may point at the checkpoint holding the file.
                holder = sibling_checkpoint(self.storage, last, record.checkpoint) if record.checkpoint else last
                source = self.storage.join(holder, file.file_name)
                out[file.file_name] = ReusedFile(record.size, record.crc32c, source, holder, record.digest)
        return out

    def refuse_overwriting_referenced(self, path: str) -> None:
        """Overwriting a checkpoint whose files an older version's incremental saves reference
        would break them (new checkpoints hold their own files and never need this)."""
        users = legacy_referrers(list_checkpoints(self.storage, self.root), path)
        if users:
            raise ReferencedCheckpointError(
                f"checkpoint {path} holds files that {', '.join(users[:3])} reference (incremental saves of an "
                "older ckptd version); consolidate those first, or save under another step"
            )
