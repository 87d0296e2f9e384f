"""The exception hierarchy of ckptd.

Every error raised on purpose by ckptd derives from :class:`CkptdError` and from the builtin
exception it most resembles, so that generic ``except OSError`` / ``except ValueError`` handlers
keep working.  This module imports nothing heavy: the writer process uses it too.
"""

from __future__ import annotations

__all__ = [
    "AllocationError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CheckpointReplacedError",
    "CkptdError",
    "ConfigError",
    "CorruptCheckpointError",
    "DistributedSaveError",
    "ForeignFilesError",
    "HeldRootInUseError",
    "KeyMismatchError",
    "MissingFileError",
    "ReferencedCheckpointError",
    "ReplicationError",
    "ShardingError",
    "StorageError",
    "UnsafeCheckpointError",
    "UnsupportedValueError",
    "WriterError",
]


class CkptdError(Exception):
    """Root of every exception raised by ckptd on purpose."""


class ConfigError(CkptdError, ValueError):
    """An argument or setting is invalid (bad size string, bad component name, bad URL...)."""


class UnsupportedValueError(CkptdError, TypeError):
    """The state holds a value ckptd cannot store without opting in (e.g. an arbitrary object)."""


class CheckpointNotFoundError(CkptdError, FileNotFoundError):
    """No committed checkpoint (or no known checkpoint format) exists where one was asked for."""


class CheckpointReplacedError(CkptdError, RuntimeError):
    """A checkpoint was replaced (overwritten or deleted) while it was being read: a file of the
    version being read is gone, or (object stores) its manifest changed.  Nothing of two versions
    was combined; open it again to read the version now committed (``Checkpointer.load`` does, a
    few times, before it raises this)."""


class CheckpointExistsError(CkptdError, FileExistsError):
    """A committed checkpoint already exists at the destination and overwriting was not asked."""


class ForeignFilesError(CheckpointExistsError):
    """The destination holds files that are not a ckptd checkpoint: never replaced, even with
    ``overwrite=True`` (a commit would have to delete them)."""


class ReferencedCheckpointError(CkptdError, PermissionError):
    """A checkpoint cannot be overwritten or deleted: checkpoints of an older ckptd version
    reference its files (their incremental saves pointed into it; new ones link their files)."""


class HeldRootInUseError(CkptdError, PermissionError):
    """A held-memory root (``shm://NAME``) cannot be dropped: a live process holds a lease on it."""


class CorruptCheckpointError(CkptdError, ValueError):
    """A checkpoint file is truncated, malformed or fails its checksum."""


class AllocationError(CkptdError, MemoryError):
    """Memory for a tensor being loaded cannot be had: more bytes than this machine holds (RAM
    and swap), or the allocator refused them.  The checkpoint may be valid; this machine cannot
    load it into fresh memory (or the sizes it states were crafted)."""


class UnsafeCheckpointError(CkptdError, PermissionError):
    """Loading would need pickle (without opt-in) or a path outside the checkpoint directory."""


class KeyMismatchError(CkptdError, KeyError):
    """Requested or expected tensor keys are missing from (or unexpected in) a checkpoint."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep messages readable.
        return str(self.args[0]) if self.args else ""


class ShardingError(CkptdError, ValueError):
    """Sharded tensors do not describe a valid sharding (gap, overlap, mismatched shapes)."""


class DistributedSaveError(CkptdError, RuntimeError):
    """A multi-rank save failed on some rank(s); ``ranks`` lists them, the message says why."""

    def __init__(self, message: str, ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.ranks = list(ranks or [])


class ReplicationError(CkptdError, RuntimeError):
    """Copying a snapshot to a peer rank (or back from it) failed: the peer died, the group broke,
    or the copy arrived damaged.  The snapshot in this rank's own memory is unaffected."""


class StorageError(CkptdError, OSError):
    """Reading or writing the storage backend failed (full disk, permission, network...)."""


class MissingFileError(StorageError, FileNotFoundError):
    """A file or object that storage was asked to read does not exist (``errno`` is ENOENT)."""


class WriterError(CkptdError, RuntimeError):
    """The background writer process failed, died or could not be started.

    ``writer_traceback`` holds the writer-side traceback text when the writer reported one.
    """

    def __init__(self, message: str, writer_traceback: str | None = None) -> None:
        super().__init__(message)
        self.writer_traceback = writer_traceback

    def __str__(self) -> str:
        base = super().__str__()
        if self.writer_traceback:
            return f"{base}\n--- writer traceback ---\n{self.writer_traceback.rstrip()}"
        return base
