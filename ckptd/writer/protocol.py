"""Typed messages between the trainer (parent) and its writer process, and their framing.

Frames travel over a Unix stream socket: a 4-byte little-endian length and a UTF-8 JSON object
whose ``"type"`` names the message class.  A file descriptor (a staging arena) can ride along
with a frame (``SCM_RIGHTS``).  Every request carries a ``request_id`` that its response repeats.

Conversation:
1. The writer starts and sends :class:`Hello`; the parent checks the protocol version.
2. The parent sends :class:`AttachArena` (with the segment's fd) for every staging arena.
3. For each save the parent sends :class:`WriteFiles` (a :class:`WriteOrder`: files to write
   from the arena, files to link or copy from the last checkpoint); the writer answers
   :class:`FilesWritten` or :class:`Failed`.  :class:`Ping` may arrive at any time and is answered at once.
   A pipelined request (``staged`` not ``None``: the arena is still being filled) is followed by
   :class:`Staged` notices (no answer) as the parent's staging copy advances; the writer writes
   each chunk once the notices cover it.  A notice with ``error`` set cancels the request: the
   writer removes the file it was writing and answers :class:`Failed`.  A streamed request
   (``streamed``: the save is larger than its arena, which it fills as a ring) is also answered
   by :class:`Freed` notices as the writer is done with the bytes, so the copy can reuse them.
4. :class:`Shutdown` (or the parent's death) ends the writer.

This module imports nothing heavy: the writer process uses it too.
"""

from __future__ import annotations

import array
import json
import socket
import struct
import threading
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, ClassVar

__all__ = [
    "PROTOCOL_VERSION",
    "AttachArena",
    "Channel",
    "ChannelClosed",
    "CopySpec",
    "DetachArena",
    "Failed",
    "FileResult",
    "Freed",
    "FileSpec",
    "FilesWritten",
    "HOW_WRITTEN",
    "Hello",
    "Message",
    "Ok",
    "Ping",
    "Pong",
    "Shutdown",
    "Staged",
    "Throttle",
    "WriteFiles",
    "WriteOrder",
]

# 2: pipelined writes (WriteFiles.staged, Staged); 3: Throttle; 4: copies, digests; 5: Freed; 6: FileSpec.adopt
PROTOCOL_VERSION = 6
_MAX_FRAME = 256 * 1024 * 1024
_MAX_FDS = 4


@dataclass(frozen=True)
class FileSpec:
    """Bytes to write: ``arena[arena_offset : arena_offset + size]`` into file ``name`` under the
    target directory.  ``whole_file``: the bytes are the entire file (created new); otherwise
    they go at ``file_offset`` of a file other ranks write into too (``pwrite``).

    ``digest``: also compute the SHA-256 of the bytes (``incremental="hash"`` records it in the
    manifest, for the next save to compare with).  ``unchanged_if`` (``"sha256:<hex>"``) and
    ``source``: the file ``source`` of the last committed checkpoint has that digest; if these
    bytes have it too, ``name`` is made from ``source`` (a link or server-side copy) instead of
    being written.  ``recycle``: a file of a retired checkpoint of a held-memory root (its
    spare, ``.ckptd-spare``), renamed into place and overwritten when it can be (no larger than
    ``size``, no other link: :func:`~ckptd.storage.local.open_recycled` decides): its
    pages are reused instead of new ones allocated and cleared (a whole file only).

    ``adopt``: the id of an attached segment that *is* this file (a held-memory root's staging
    file, :mod:`ckptd.save.file_arena`): the writer checksums its first ``size`` bytes, once
    staged up to ``arena_offset + size``, and hard-links it to ``name`` instead of writing.  If
    the link fails it writes the bytes from that segment."""

    name: str
    arena_offset: int
    size: int
    file_offset: int = 0
    whole_file: bool = True
    digest: bool = False
    unchanged_if: str | None = None
    source: str | None = None
    recycle: str | None = None
    adopt: int | None = None


@dataclass(frozen=True)
class CopySpec:
    """A file of the save that the last committed checkpoint holds already (an incremental
    save's frozen tensors, not staged): ``name`` under the target directory gets the bytes of
    ``source`` by the storage's ``copy_file`` (a hard link, a copy, a server-side copy).
    ``size`` is checked; ``crc32c`` (the source's, from its manifest) is echoed in the result."""

    name: str
    source: str
    size: int
    crc32c: int
    digest: str | None = None


HOW_WRITTEN = "write"
""":attr:`FileResult.how` of bytes written from the arena (the others: ``"link"``, ``"copy"``,
``"server_copy"``, what ``Storage.copy_file`` answered)."""


@dataclass(frozen=True)
class FileResult:
    """What the writer did for one :class:`FileSpec` or :class:`CopySpec`: ``how`` the file was
    made, the CRC32C of those bytes only, and their SHA-256 when asked (``"sha256:<hex>"``).

    ``spread_end`` > 0: a rank's report of every piece it wrote of a file other ranks write parts
    of (:func:`~ckptd.save.file_checksums.fold_shared_pieces`): ``size`` bytes in all, ``crc32c``
    their :func:`~ckptd.formats.checksum.crc32c_spread` (zeros between them, up to ``spread_end``).
    """

    name: str
    size: int
    crc32c: int
    seconds: float
    file_offset: int = 0
    how: str = HOW_WRITTEN
    digest: str | None = None
    spread_end: int = 0

    @property
    def reused(self) -> bool:
        """The file was made from an earlier checkpoint's (linked or copied), not written."""
        return self.how != HOW_WRITTEN


@dataclass(frozen=True)
class Message:
    """Base of every message; subclasses register themselves by class name."""

    registry: ClassVar[dict[str, type[Message]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        Message.registry[cls.__name__] = cls


@dataclass(frozen=True)
class Hello(Message):
    pid: int
    protocol_version: int
    library_version: str
    torch_loaded: bool


@dataclass(frozen=True)
class AttachArena(Message):
    request_id: int
    arena_id: int
    size: int


@dataclass(frozen=True)
class DetachArena(Message):
    request_id: int
    arena_id: int


@dataclass(frozen=True)
class WriteOrder:
    """What one save asks its writer to do: write ``files`` from arena ``arena_id`` into
    ``directory`` (a local path or fsspec URL) and make ``copies`` there (the typed body of a
    :class:`WriteFiles` request, built by the saver, sent by the client).

    ``abandon_directory`` tells the writer which directory to delete if its parent dies while
    this request is in flight.  ``resume_throttle``: the trainer is training, so the adaptive
    throttle starts at the limit it learned (:mod:`ckptd.writer.throttle`).  ``streamed``: the
    arena offsets are logical, taken modulo the arena's size (a ring the copy refills as the
    writer answers :class:`Freed`; :mod:`ckptd.writer.ring`).
    """

    arena_id: int
    directory: str
    files: list[FileSpec]
    copies: list[CopySpec] = field(default_factory=list)
    storage_options: dict[str, Any] = field(default_factory=dict)
    fsync: bool = True
    chunk_size: int = 16 * 1024 * 1024
    threads: int = 1
    abandon_directory: str | None = None
    tuning: dict[str, Any] = field(default_factory=dict)
    resume_throttle: bool = False
    streamed: bool = False


@dataclass(frozen=True, kw_only=True)
class WriteFiles(WriteOrder, Message):
    """A :class:`WriteOrder` sent as request ``request_id``.  ``staged``: ``None`` when every
    byte is in the arena already; otherwise the arena offset below which the bytes are staged so
    far, raised by later :class:`Staged` notices (a pipelined save)."""

    request_id: int
    staged: int | None = None

    @classmethod
    def of(cls, order: WriteOrder, request_id: int, staged: int | None = None) -> WriteFiles:
        return cls(request_id=request_id, staged=staged, **{f.name: getattr(order, f.name) for f in fields(WriteOrder)})


@dataclass(frozen=True)
class Staged(Message):
    """The arena bytes of write request ``write_id`` below ``upto`` are staged (a notice, not a
    request: nothing answers it).  ``error`` set: staging failed, abandon that request."""

    write_id: int
    upto: int
    error: str = ""


@dataclass(frozen=True)
class Freed(Message):
    """The writer of streamed request ``write_id`` no longer needs the bytes below the logical
    offset ``upto``: the copy may overwrite their place in the ring (a notice, writer to parent)."""

    write_id: int
    upto: int


@dataclass(frozen=True)
class Throttle(Message):
    """Adjust the writer's adaptive I/O throttle (a notice: nothing answers it).  ``action`` is
    one of :data:`~ckptd.writer.throttle.THROTTLE_ACTIONS` (see :mod:`ckptd.writer.throttle`)."""

    action: str


@dataclass(frozen=True)
class Ping(Message):
    request_id: int


@dataclass(frozen=True)
class Shutdown(Message):
    request_id: int


@dataclass(frozen=True)
class Ok(Message):
    request_id: int


@dataclass(frozen=True)
class Pong(Message):
    request_id: int
    busy: bool
    bytes_written: int
    write_rate: float | None = None  # the throttle's current limit in bytes/s (None: unthrottled)
    throttled_seconds: float = 0.0  # slept by the throttle since the writer started


@dataclass(frozen=True)
class FilesWritten(Message):
    request_id: int
    results: list[FileResult]
    seconds: float
    retries: int = 0  # object-store requests the writer retried for these files
    throttled: float = 0.0  # seconds the adaptive throttle held these writes back


@dataclass(frozen=True)
class Failed(Message):
    """A request failed in the writer; ``kind`` is ``"storage"`` for I/O errors, else ``"internal"``."""

    request_id: int
    kind: str
    message: str
    path: str | None = None
    errno: int | None = None
    traceback: str = ""


_NESTED = {
    ("WriteFiles", "files"): FileSpec,
    ("WriteFiles", "copies"): CopySpec,
    ("FilesWritten", "results"): FileResult,
}


def _plain(value: Any) -> Any:
    """``value`` with dataclasses turned into dicts (what ``asdict`` gives, without its deep
    copies: a message is encoded once per request, on the threads that compete with training)."""
    names = _FIELD_NAMES.get(type(value))
    if names is None and is_dataclass(value) and not isinstance(value, type):
        names = _FIELD_NAMES[type(value)] = tuple(f.name for f in fields(value))
    if names is not None:
        return {name: _plain(getattr(value, name)) for name in names}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def encode(message: Message) -> bytes:
    """Serialize a message to JSON bytes."""
    body = _plain(message)
    body["type"] = type(message).__name__
    return json.dumps(body, separators=(",", ":")).encode("utf-8")


def decode(payload: bytes) -> Message:
    """Parse JSON bytes back into the message class named by ``"type"``."""
    body = json.loads(payload.decode("utf-8"))
    name = body.pop("type")
    cls = Message.registry[name]
    known = {f.name for f in fields(cls)}
    kwargs = {k: v for k, v in body.items() if k in known}
    for (owner, attr), item_cls in _NESTED.items():
        if owner == name and attr in kwargs:
            kwargs[attr] = [item_cls(**item) for item in kwargs[attr]]
    return cls(**kwargs)


class ChannelClosed(ConnectionError):
    """The peer closed the socket (or died)."""


class Channel:
    """Framed, thread-safe message passing over a connected Unix stream socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, message: Message, fds: tuple[int, ...] = ()) -> None:
        payload = encode(message)
        frame = struct.pack("<I", len(payload)) + payload
        with self._send_lock:
            sent = socket.send_fds(self.sock, [frame], list(fds)) if fds else 0
            if sent < len(frame):
                self.sock.sendall(frame[sent:])

    def receive(self) -> tuple[Message, list[int]]:
        """Block until a whole message arrives; returns it with any file descriptors it carried."""
        fds: list[int] = []
        (length,) = struct.unpack("<I", self._read_exactly(4, fds))
        if length > _MAX_FRAME:
            raise ChannelClosed(f"frame of {length} bytes exceeds the protocol limit")
        return decode(self._read_exactly(length, fds)), fds

    def _read_exactly(self, count: int, fds: list[int]) -> bytes:
        chunks: list[bytes] = []
        remaining = count
        ancillary_size = socket.CMSG_SPACE(_MAX_FDS * array.array("i").itemsize)
        while remaining:
            data, ancillary, _flags, _addr = self.sock.recvmsg(remaining, ancillary_size)
            for level, kind, cdata in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    received = array.array("i")
                    received.frombytes(cdata[: len(cdata) - (len(cdata) % received.itemsize)])
                    fds.extend(received)
            if not data:
                raise ChannelClosed("peer closed the connection")
            chunks.append(data)
            remaining -= len(data)
        return b"".join(chunks)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
