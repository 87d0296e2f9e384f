"""The parent-side client of the writer process: start, handshake, requests, health, restart.

The writer runs as its own small program (``python -m ckptd.writer.process``), not through
``multiprocessing``: it never imports the trainer's ``__main__`` and needs no torch.  Control
messages travel over a Unix socket pair; staging arenas are passed as file descriptors.  A reader
thread routes responses to per-request futures; if the writer dies, every pending request fails
with :class:`~ckptd.errors.WriterError` carrying the exit status and the tail of its stderr.

Two locks: ``_lock`` serialises starting the writer and handing it arenas (held while waiting
for the writer's answers), ``_io_lock`` guards only the socket and the table of pending requests
and is never held while waiting, so the reader thread can always fail the requests of a writer
that died, whoever holds ``_lock``.

The module is a little longer than the usual ~450 lines: the request path, the restart after a
death and the reader thread share those two locks, and splitting them apart would spread one
locking protocol over two modules.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import itertools
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import IO

from ..errors import MissingFileError, StorageError, WriterError
from . import protocol
from .gate import PendingWrite
from .inprocess import InProcessWriter
from .launch import helper_command, helper_environment
from .owner import check_process, reset_in_fork_child
from .protocol import (
    AttachArena,
    Channel,
    ChannelClosed,
    DetachArena,
    Failed,
    Freed,
    Hello,
    Message,
    Ping,
    Pong,
    Shutdown,
    Staged,
    Throttle,
    WriteFiles,
    WriteOrder,
)
from .shm import SharedSegment

__all__ = ["InProcessWriter", "PendingWrite", "WriterClient", "describe_exit"]  # the first two: re-exported

logger = logging.getLogger(__name__)

_STDERR_LINES = 40


def describe_exit(returncode: int | None) -> str:
    """Human words for a process exit status (``killed by SIGKILL``, ``exited with status 1``)."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


class WriterClient:
    """Owns one writer process; safe to call from several threads.

    ``nice`` lowers the writer's CPU priority and ``ionice`` (0-7, best-effort class) its I/O
    priority, so it competes less with the training loop.
    """

    def __init__(
        self, *, start_timeout: float = 60.0, nice: int = 0, ionice: int | None = None, label: str = ""
    ) -> None:
        self.start_timeout = start_timeout
        self.nice = nice
        self.ionice = ionice
        self.label = label
        self._lock = threading.RLock()
        self._io_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, Future[Message]] = {}
        self._freed_listeners: dict[int, Callable[[int], None]] = {}  # streamed requests in flight
        self._arenas: dict[int, SharedSegment] = {}
        self._arenas_lock = threading.Lock()
        self._attached: set[int] = set()
        self._detach_later: set[int] = set()
        self._process: subprocess.Popen[bytes] | None = None
        self._channel: Channel | None = None
        self._hello: Future[Hello] | None = None
        self._stderr_tail: collections.deque[str] = collections.deque(maxlen=_STDERR_LINES)
        self._owner_pid = os.getpid()
        self.restarts = -1
        self.info: Hello | None = None
        self._abandoned = False
        reset_in_fork_child(self)

    # ---- lifecycle -------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def alive(self) -> bool:
        """True when the writer process is running and its socket is open."""
        return self._process is not None and self._process.poll() is None and self._channel is not None

    def ensure_running(self) -> None:
        """Start the writer (or restart it after a crash) and attach every known arena."""
        self._check_owner()
        if self._abandoned:
            raise WriterError(
                "the ckptd writer was stopped: the saves in flight were abandoned (Ctrl-C, or close(wait=False))"
            )
        with self._lock:
            if not self.alive():
                self._reap()
                self._spawn()
            self._send_detaches()
            with self._arenas_lock:
                unattached = [(i, seg) for i, seg in self._arenas.items() if i not in self._attached]
            for arena_id, segment in unattached:
                self._attach(arena_id, segment)

    def _spawn(self) -> None:
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = helper_environment()
        command = helper_command(
            "ckptd.writer.process",
            "--fd",
            str(child_sock.fileno()),
            "--parent-pid",
            str(os.getpid()),
            "--nice",
            str(self.nice),
        )
        if self.ionice is not None:
            command += ["--ionice", str(self.ionice)]
        try:
            process = subprocess.Popen(
                command,
                pass_fds=(child_sock.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                env=env,
                close_fds=True,
            )
        except OSError as e:
            parent_sock.close()
            raise WriterError(f"cannot start the ckptd writer process: {e}") from e
        finally:
            child_sock.close()
        self._process = process
        self._attached = set()
        self._hello = Future()
        channel = Channel(parent_sock)  # the reader gets this one: abandon() may clear _channel at any time
        with self._io_lock:
            self._channel = channel
            self._pending = {}  # this writer's requests: a dead predecessor's reader must not fail them
        self._stderr_tail.clear()
        threading.Thread(
            target=self._read_stderr, args=(process.stderr,), name="ckptd-writer-stderr", daemon=True
        ).start()
        threading.Thread(
            target=self._read_responses,
            args=(channel, process, self._pending),
            name="ckptd-writer-rx",
            daemon=True,
        ).start()
        try:
            hello = self._hello.result(timeout=self.start_timeout)
        except TimeoutError:
            self._kill()
            raise WriterError(
                f"the ckptd writer did not start within {self.start_timeout:.0f}s{self._stderr_suffix()}"
            ) from None
        except WriterError:
            raise
        if hello.protocol_version != protocol.PROTOCOL_VERSION:
            self._kill()
            raise WriterError(
                f"writer speaks protocol {hello.protocol_version}, expected {protocol.PROTOCOL_VERSION}; "
                "is an older ckptd installed beside this one?"
            )
        self.info = hello
        self.restarts += 1
        logger.debug("ckptd writer %s started (pid %d)", self.label, hello.pid)

    def close(self, timeout: float = 30.0) -> None:
        """Ask the writer to exit, then forget every arena (the caller frees them).  A writer
        that has not exited ``timeout`` seconds after the call (one deadline for its answer and
        its exit: a stopped writer answers neither) is killed."""
        deadline = time.monotonic() + timeout
        with self._lock:
            if self.alive() and os.getpid() == self._owner_pid:
                try:
                    self._request(Shutdown(self._next_id())).result(timeout=timeout)
                except Exception:  # noqa: BLE001 - it is going away either way
                    pass
            self._reap(timeout=max(0.0, deadline - time.monotonic()))
            with self._arenas_lock:
                self._arenas.clear()

    @property
    def abandoned(self) -> bool:
        """:meth:`abandon` was called: no writer runs or starts again."""
        return self._abandoned

    def abandon(self) -> None:
        """Stop the writer without letting it finish (a second Ctrl-C while waiting for saves):
        its socket is shut down, so it abandons the write in flight, removes that save's
        staging directory (aborting its multipart uploads) and exits; the requests waiting on it
        fail with WriterError.  No writer is started again.  Returns at once: :meth:`close`
        waits for the exit (and kills a writer that does not exit in time)."""
        self._abandoned = True
        with self._io_lock:
            channel, self._channel = self._channel, None
        if channel is not None:
            with contextlib.suppress(OSError):
                channel.sock.shutdown(socket.SHUT_RDWR)  # close() alone would not wake the reader thread
            channel.close()

    def kill(self) -> None:
        """Kill the writer at once (tests and emergencies)."""
        self._kill()

    def _kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()

    def _reap(self, timeout: float = 5.0) -> None:
        with self._io_lock:
            channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()
        if self._process is not None:
            try:
                self._process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None

    def forget_after_fork(self) -> None:
        """In a child created by ``fork()``: drop what belongs to the parent's writer.

        Fresh locks (a parent thread may have held them at the fork; it does not exist here), no
        pending requests, and the child's copy of the socket closed (never shut down: the parent
        still talks through it), so the writer sees EOF when the parent dies even while the child
        lives.  The writer itself is left alone: it is the parent's.
        """
        self._lock = threading.RLock()
        self._io_lock = threading.Lock()
        self._arenas_lock = threading.Lock()
        self._pending = {}
        self._arenas = {}
        self._detach_later = set()
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()
        self._process = None

    def _check_owner(self) -> None:
        check_process(self._owner_pid, "Checkpointer")

    # ---- requests --------------------------------------------------------------------------

    def _next_id(self) -> int:
        return next(self._ids)

    def _request(self, message: Message, fds: tuple[int, ...] = ()) -> Future[Message]:
        future: Future[Message] = Future()
        request_id = getattr(message, "request_id", None)
        if request_id is None:
            raise WriterError(f"cannot send {type(message).__name__} as a request")
        with self._io_lock:
            channel = self._channel
            if channel is None:
                raise WriterError(f"the ckptd writer is not running ({self._exit_words()}){self._stderr_suffix()}")
            pending = self._pending
            pending[request_id] = future
        try:
            channel.send(message, fds)
        except OSError as e:
            pending.pop(request_id, None)
            with self._io_lock:
                if self._channel is channel:
                    self._channel = None  # its socket is dead: alive() is False, ensure_running() restarts it
            raise _Unreachable(f"cannot reach the ckptd writer ({self._exit_words()}){self._stderr_suffix()}") from e
        return future

    def _submit(self, build: Callable[[int], Message]) -> tuple[Future[Message], int, Channel | None]:
        """Send the request ``build(request_id)`` to a running writer; returns its future, id and
        channel.

        A writer that died just before can still look alive: ``Popen.poll()`` answers "running"
        while the reader thread is reaping it.  The send then fails and nothing reached the
        writer, so the writer is restarted (arenas attached again) and the request sent once more.
        """
        try:
            return self._send_to_running(build)
        except _Unreachable:
            logger.debug("ckptd writer %s: gone before a request reached it; restarting it", self.label)
            return self._send_to_running(build)

    def _send_to_running(self, build: Callable[[int], Message]) -> tuple[Future[Message], int, Channel | None]:
        self.ensure_running()
        with self._lock:
            request_id = self._next_id()
            return self._request(build(request_id)), request_id, self._channel

    def attach_arena(self, arena_id: int, segment: SharedSegment) -> None:
        """Register a staging arena; it is handed to the writer before the next write (and again
        after every restart), so registering never waits for the writer."""
        with self._arenas_lock:
            self._arenas[arena_id] = segment

    def _attach(self, arena_id: int, segment: SharedSegment) -> None:
        # If the writer dies meanwhile, the reader thread fails this future at once (it does not
        # need _lock, which we hold); the timeout only bounds a writer that is alive but stuck.
        future = self._request(AttachArena(self._next_id(), arena_id, segment.size), (segment.fd,))
        try:
            response = future.result(timeout=self.start_timeout)
        except TimeoutError:
            raise WriterError(
                f"the ckptd writer (pid {self.pid}, {self._exit_words()}) did not map staging arena {arena_id} "
                f"({segment.size} bytes) within {self.start_timeout:.0f}s; is it stopped or swapping? "
                f"(writer_start_timeout sets this bound){self._stderr_suffix()}"
            ) from None
        _raise_if_failed(response)
        self._attached.add(arena_id)

    def detach_arena(self, arena_id: int) -> None:
        """Forget an arena and tell the writer to unmap it (only when no write uses it).

        Does not wait for the answer: the caller may be the training thread.
        """
        with self._arenas_lock:
            self._arenas.pop(arena_id, None)
            self._detach_later.add(arena_id)
        if self._lock.acquire(blocking=False):  # else the next ensure_running() sends it
            try:
                self._send_detaches()
            finally:
                self._lock.release()

    def _send_detaches(self) -> None:
        with self._arenas_lock:
            arena_ids, self._detach_later = self._detach_later, set()
        for arena_id in arena_ids:
            if arena_id in self._attached and self.alive():
                self._attached.discard(arena_id)
                try:
                    self._request(DetachArena(self._next_id(), arena_id))
                except WriterError:
                    pass

    def write_files(self, order: WriteOrder) -> Future[Message]:
        """Submit ``order`` as a :class:`~ckptd.writer.protocol.WriteFiles` request; the future
        resolves to :class:`~ckptd.writer.protocol.FilesWritten` or fails with WriterError /
        StorageError."""
        future, _, _ = self._submit(lambda request_id: WriteFiles.of(order, request_id))
        return future

    def write_pipelined(
        self, staged: int, order: WriteOrder, on_freed: Callable[[int], None] | None = None
    ) -> PendingWrite:
        """Submit ``order`` as a pipelined :class:`~ckptd.writer.protocol.WriteFiles`: the arena
        bytes below ``staged`` are in place, the rest follow; report them with
        :meth:`PendingWrite.advance`.  ``on_freed(upto)`` receives the writer's
        :class:`~ckptd.writer.protocol.Freed` notices (a streamed order), on the reader thread."""

        def build(request_id: int) -> WriteFiles:
            if on_freed is not None:
                self._freed_listeners[request_id] = on_freed  # before the request can be answered
            return WriteFiles.of(order, request_id, staged)

        future, request_id, channel = self._submit(build)
        if on_freed is not None:
            future.add_done_callback(lambda _: self._freed_listeners.pop(request_id, None))
        return PendingWrite(future, lambda upto, error: self._notify(channel, Staged(request_id, upto, error)), staged)

    def _notify(self, channel: Channel | None, message: Message) -> None:
        """Send a notice that has no answer; a writer that died meanwhile fails its request anyway."""
        if channel is None:
            return
        try:
            channel.send(message)
        except OSError:
            logger.debug("ckptd writer %s: could not send %s", self.label, type(message).__name__)

    def throttle(self, action: str) -> None:
        """Adjust the writer's adaptive I/O throttle (``"slower"``, ``"faster"``, ``"hold"``,
        ``"release"``); a notice, so the training thread never waits for it."""
        with self._io_lock:
            channel = self._channel
        self._notify(channel, Throttle(action))

    def ping(self, timeout: float = 10.0) -> Pong:
        """Health check: the writer answers at once, even while it writes."""
        self._check_owner()
        if not self.alive():
            raise WriterError(f"the ckptd writer is not running ({self._exit_words()}){self._stderr_suffix()}")
        future = self._request(Ping(self._next_id()))  # not under _lock: an attach may hold it
        try:
            response = future.result(timeout=timeout)
        except TimeoutError:
            raise WriterError(f"the ckptd writer (pid {self.pid}) did not answer a ping within {timeout}s") from None
        if not isinstance(response, Pong):
            raise WriterError(f"unexpected answer to ping: {response!r}")
        return response

    # ---- background threads ----------------------------------------------------------------

    def _read_stderr(self, stream: IO[bytes] | None) -> None:
        if stream is None:
            return
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip()
            self._stderr_tail.append(line)
            logger.warning("ckptd writer: %s", line)
        stream.close()

    def _read_responses(
        self, channel: Channel, process: subprocess.Popen[bytes], pending_requests: dict[int, Future[Message]]
    ) -> None:
        hello = self._hello
        try:
            while True:
                message, fds = channel.receive()
                for fd in fds:
                    os.close(fd)
                if isinstance(message, Hello):
                    if hello is not None and not hello.done():
                        hello.set_result(message)
                    continue
                if isinstance(message, Freed):
                    listener = self._freed_listeners.get(message.write_id)
                    if listener is not None:
                        listener(message.upto)
                    continue
                future = pending_requests.pop(getattr(message, "request_id", -1), None)
                if future is not None and not future.done():
                    if isinstance(message, Failed):
                        future.set_exception(_failure_error(message))
                    else:
                        future.set_result(message)
        except (ChannelClosed, OSError):
            pass
        # The socket closed: the writer exited or is exiting.  Wait for its exit status (at once
        # for a killed writer) so the error can name it; never take _lock here.
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        error = WriterError(
            f"the ckptd writer process {process.pid} {describe_exit(process.poll())}{self._stderr_suffix()}"
        )
        if hello is not None and not hello.done():
            hello.set_exception(error)
        with self._io_lock:
            if self._channel is channel:
                self._channel = None
            pending = list(pending_requests.values())
            pending_requests.clear()
        for future in pending:
            if not future.done():
                future.set_exception(error)

    def _exit_words(self) -> str:
        return describe_exit(self._process.poll()) if self._process is not None else "not started"

    def _stderr_suffix(self) -> str:
        tail = [line for line in self._stderr_tail if line.strip()]
        return ("; its last output:\n" + "\n".join(tail[-10:])) if tail else ""


class _Unreachable(WriterError):
    """A request could not be sent: the writer's socket is closed (it died)."""


def _failure_error(message: Failed) -> Exception:
    if message.kind == "storage":
        kind = MissingFileError if message.errno == errno.ENOENT else StorageError
        error = kind(message.errno or 0, message.message)
        error.filename = message.path
        return error
    return WriterError(f"the ckptd writer failed: {message.message}", message.traceback)


def _raise_if_failed(response: Message) -> None:
    if isinstance(response, Failed):
        raise _failure_error(response)
