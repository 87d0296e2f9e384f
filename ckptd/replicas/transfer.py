"""One committed checkpoint sent from a rank to another over a torch.distributed (gloo) group.

The sender sends a header (the step, the manifest's bytes, each file's name and size), then every
file listed in the manifest in pieces of at most :data:`PIECE` bytes, read from descriptors opened
before the first byte is sent (the sender's retention may delete the directory meanwhile; open
files stay readable).  The receiver writes them into a locked staging directory of its root,
folds each file's CRC32C as the pieces arrive and compares it (and the size) with the manifest's,
and only then publishes the directory as ``checkpoint-<step>`` (a rename): a replica is whole or
invisible, and a damaged or torn copy is never published.  Both sides move the same number of
pieces whatever happens, so one bad file never leaves the stream out of step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch
import torch.distributed as dist

from ..catalog import spare_files
from ..errors import CkptdError, CorruptCheckpointError, ReplicationError, UnsafeCheckpointError
from ..formats.checksum import crc32c, format_crc
from ..formats.manifest import MANIFEST_NAME, Manifest
from ..formats.names import checkpoint_dir_name
from ..save.commit import publish, staging_directory
from ..storage import Storage
from ..storage.held import in_held_memory
from ..storage.local import open_recycled
from ..storage.local_read import PinnedDirectory

__all__ = ["PIECE", "BackgroundSend", "Received", "receive_checkpoint", "send_checkpoint"]

logger = logging.getLogger(__name__)

PIECE = 8 * 1024 * 1024
"""Bytes sent at a time: the memory a transfer holds on each side."""


@dataclass(frozen=True)
class Received:
    """What :func:`receive_checkpoint` got: the step, and the published checkpoint's path (``None``
    when the sender had no such checkpoint or the copy was refused, ``error`` saying why)."""

    step: int
    path: str | None
    nbytes: int = 0
    error: str | None = None


def send_checkpoint(path: str | None, step: int, dst: int, group: Any) -> int:
    """Send the committed checkpoint at ``path`` (``None``: none, the receiver is told so) to rank
    ``dst``; returns the bytes sent."""
    opened = _open_checkpoint(path) if path is not None else None
    if opened is None:
        _send_bytes(json.dumps({"step": step, "files": None}).encode(), dst, group)
        return 0
    manifest_bytes, files = opened
    try:
        header = {"step": step, "files": [[name, size] for name, size, _ in files]}
        _send_bytes(json.dumps(header).encode(), dst, group)
        _send_bytes(manifest_bytes, dst, group)
        buffer = torch.empty(PIECE, dtype=torch.uint8)
        view = buffer.numpy().data
        sent = 0
        for _, size, fd in files:
            offset = 0
            while offset < size:
                count = min(PIECE, size - offset)
                got = _read_at(fd, view[:count], offset)
                if got < count:  # truncated meanwhile: zeros keep the stream in step; the CRC refuses them
                    buffer[got:count].zero_()
                dist.send(buffer[:count], dst, group=group)
                offset += count
                sent += count
        return sent
    finally:
        for _, _, fd in files:
            os.close(fd)


def receive_checkpoint(storage: Storage, root: str, src: int, group: Any) -> Received:
    """Receive a checkpoint from rank ``src`` and publish it under ``root`` (replacing a checkpoint
    of the same step); returns what happened.  Only a stream that breaks raises."""
    header = json.loads(_receive_bytes(src, group))
    step, files = int(header["step"]), header["files"]
    if files is None:
        return Received(step, None, error=f"rank {src} holds no committed checkpoint of step {step}")
    manifest_bytes = _receive_bytes(src, group)
    final = storage.join(root, checkpoint_dir_name(step))
    problem: str | None = None
    try:
        manifest = Manifest.from_json(manifest_bytes, f"rank {src}'s {final}/{MANIFEST_NAME}")
        problem = _check_listing(manifest, files)
    except (CorruptCheckpointError, ValueError) as e:
        problem = str(e)
    storage.makedirs(root)
    spares = spare_files(root) if storage.local and in_held_memory(root) else {}
    with staging_directory(storage, final, overwrite=True) as staging:
        received = 0
        buffer = torch.empty(PIECE, dtype=torch.uint8)
        for name, size in files:
            value, target = 0, None
            if problem is None:
                target = storage.join(staging, name)
                os.makedirs(os.path.dirname(target), exist_ok=True)
            spare = spares.get(name) if target is not None else None
            with _create(target, spare, size) if target is not None else contextlib.nullcontext() as out:
                offset = 0
                while offset < size:
                    count = min(PIECE, size - offset)
                    dist.recv(buffer[:count], src, group=group)
                    if out is not None:
                        piece = buffer.numpy().data[:count]
                        value = crc32c(piece, value)
                        out.write(piece)
                    offset += count
            received += size
            if problem is None and format_crc(value) != manifest.files[name].crc32c:
                problem = (
                    f"{name}: CRC32C {format_crc(value)} received, the manifest lists {manifest.files[name].crc32c}"
                )
        if problem is not None:
            storage.discard(staging)
            return Received(step, None, received, f"the copy of step {step} from rank {src} was refused: {problem}")
        storage.write_bytes(storage.join(staging, MANIFEST_NAME), manifest_bytes)
        publish(storage, staging, final, overwrite=True, replace_any=True)
        return Received(step, final, received)


def _create(target: str, spare: str | None, size: int) -> BinaryIO:
    """``target`` created for writing: the ``spare`` file renamed there and reused when it can be
    (:func:`~ckptd.storage.local.open_recycled`), else a new file."""
    fd = open_recycled(spare, target, size) if spare is not None else None
    if fd is None:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    return os.fdopen(fd, "wb")


def _check_listing(manifest: Manifest, files: list[list[Any]]) -> str | None:
    """Why the header's file list does not match the manifest (``None`` when it does)."""
    listed = {name: record.size for name, record in manifest.files.items()}
    sent = {str(name): int(size) for name, size in files}
    if listed != sent:
        return f"the files sent {sorted(sent)} are not the manifest's {sorted(listed)}"
    for name, record in manifest.files.items():
        if record.checkpoint:
            return f"{name} belongs to another checkpoint ({record.checkpoint}): not self-contained"
        parts = name.split("/")
        if name.startswith("/") or any(part in ("", ".", "..") for part in parts):
            return f"{name!r} is not a path inside the checkpoint"
    return None


def _open_checkpoint(path: str) -> tuple[bytes, list[tuple[str, int, int]]] | None:
    """The manifest's bytes and ``(name, size, fd)`` of every file it lists, all opened now,
    relative to the directory opened once and never through a symlink; ``None`` when the
    checkpoint is gone, unreadable or holds a link (what is sent is the checkpoint's own bytes)."""
    files: list[tuple[str, int, int]] = []
    try:
        directory = PinnedDirectory(path)
    except CkptdError:
        return None
    try:
        fd = directory.open(MANIFEST_NAME, follow_symlinks=False)
        with open(fd, "rb") as handle:
            manifest_bytes = handle.read()
        manifest = Manifest.from_json(manifest_bytes, os.path.join(path, MANIFEST_NAME))
        for name, record in sorted(manifest.files.items()):
            files.append((name, record.size, directory.open(name, follow_symlinks=False)))
    except (OSError, ValueError, CkptdError) as e:
        if isinstance(e, UnsafeCheckpointError):
            logger.warning("ckptd: not sending %s: %s", path, e)
        for _, _, fd in files:
            os.close(fd)
        return None
    finally:
        directory.close()
    return manifest_bytes, files


def _read_at(fd: int, view: memoryview, offset: int) -> int:
    done = 0
    while done < len(view):
        count = os.preadv(fd, [view[done:]], offset + done)
        if count == 0:
            break
        done += count
    return done


def _send_bytes(data: bytes, dst: int, group: Any) -> None:
    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst, group=group)
    if data:
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst, group=group)


def _receive_bytes(src: int, group: Any) -> bytes:
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    if data.numel():
        dist.recv(data, src, group=group)
    return data.numpy().tobytes()


class BackgroundSend:
    """:func:`send_checkpoint` on a thread of its own, so that a rank sends to its holder while
    it receives from its wards (a blocking send waits for the peer's receive)."""

    def __init__(self, path: str | None, step: int, dst: int, group: Any) -> None:
        self._sent = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(path, step, dst, group), name="ckptd-replica-send", daemon=True
        )
        self._thread.start()

    def _run(self, path: str | None, step: int, dst: int, group: Any) -> None:
        try:
            self._sent = send_checkpoint(path, step, dst, group)
        except BaseException as e:  # noqa: BLE001 - raised by join()
            self._error = e

    def join(self) -> int:
        self._thread.join()
        if self._error is not None:
            raise ReplicationError(f"sending a snapshot failed: {self._error}") from self._error
        return self._sent
