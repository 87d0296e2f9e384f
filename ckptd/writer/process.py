"""The writer process: ``python -m ckptd.writer.process --fd N --parent-pid P``.

It maps the staging arenas it is handed and streams shard files from them to storage,
checksumming as it goes.  It imports no torch and never touches the trainer's ``__main__``, so it
starts in a fraction of a second and is safe after CUDA initialisation.

Threads: the main thread answers the control socket at once (pings, arena attach/detach) and
watches the parent; one worker thread executes :class:`~ckptd.writer.protocol.WriteFiles` requests in
order.  When the parent dies (socket EOF or re-parenting) the writer abandons the save in flight,
deletes that save's staging directory, unmaps every arena and exits.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import queue
import select
import signal
import socket
import sys
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor

from .._version import __version__
from ..errors import StorageError, WriterError
from ..storage import Stopped, storage_for
from .gate import StagingGate
from .priority import lower_priority
from .protocol import (
    PROTOCOL_VERSION,
    AttachArena,
    Channel,
    ChannelClosed,
    DetachArena,
    Failed,
    FilesWritten,
    Freed,
    Hello,
    Ok,
    Ping,
    Pong,
    Shutdown,
    Staged,
    Throttle,
    WriteFiles,
)
from .shm import SharedSegment
from .stream import write_files
from .throttle import WriteThrottle

__all__ = ["main"]

logger = logging.getLogger("ckptd.writer")

_PARENT_POLL_SECONDS = 0.5


class _Abandoned(Exception):
    """The parent died: stop writing."""


class _Writer:
    def __init__(self, channel: Channel, parent_pid: int) -> None:
        self.channel = channel
        self.parent_pid = parent_pid
        self.arenas: dict[int, SharedSegment] = {}
        self.requests: queue.Queue[WriteFiles | None] = queue.Queue()
        self.abandon = threading.Event()
        self.current: WriteFiles | None = None
        self.gates: dict[int, StagingGate] = {}  # pipelined requests not finished yet, by request id
        self.gates_lock = threading.Lock()
        self.bytes_written = 0
        self.throttle = WriteThrottle()
        self.checksums = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ckptd-crc")
        self.worker = threading.Thread(target=self._work, name="ckptd-write", daemon=True)

    def run(self) -> int:
        try:
            self.channel.send(Hello(os.getpid(), PROTOCOL_VERSION, __version__, "torch" in sys.modules))
        except (ConnectionError, OSError):
            return 0  # the trainer closed (or died) while this writer started: nothing to do, nothing to say
        self.worker.start()
        try:
            while True:
                if os.getppid() != self.parent_pid:
                    raise ChannelClosed("parent process is gone")
                readable, _, _ = select.select([self.channel.sock], [], [], _PARENT_POLL_SECONDS)
                if not readable:
                    continue
                message, fds = self.channel.receive()
                if isinstance(message, Shutdown):
                    self.requests.put(None)
                    self.worker.join()
                    self.channel.send(Ok(message.request_id))
                    return 0
                try:
                    self._dispatch(message, fds)
                except Exception as e:  # noqa: BLE001 - reported, the writer stays up
                    self.channel.send(_failure(getattr(message, "request_id", -1), e))
        except (ChannelClosed, ConnectionError, OSError):
            self._abandon()
            return 0
        finally:
            self._close_arenas()

    def _dispatch(self, message: object, fds: list[int]) -> None:
        if isinstance(message, AttachArena):
            old = self.arenas.pop(message.arena_id, None)
            if old is not None:
                old.close()
            self.arenas[message.arena_id] = SharedSegment.attach(fds[0], message.size)
            self.channel.send(Ok(message.request_id))
        elif isinstance(message, DetachArena):
            segment = self.arenas.pop(message.arena_id, None)
            if segment is not None:
                segment.close()
            self.channel.send(Ok(message.request_id))
        elif isinstance(message, Ping):
            self.channel.send(
                Pong(
                    message.request_id,
                    self.current is not None,
                    self.bytes_written,
                    self.throttle.rate,
                    self.throttle.throttled_seconds,
                )
            )
        elif isinstance(message, WriteFiles):
            if message.staged is not None:
                with self.gates_lock:
                    self.gates[message.request_id] = StagingGate(message.staged)
            self.requests.put(message)
        elif isinstance(message, Throttle):
            self.throttle.adjust(message.action)
        elif isinstance(message, Staged):
            with self.gates_lock:
                gate = self.gates.get(message.write_id)
            if gate is not None:  # else that request has finished (or failed) already
                gate.advance(message.upto, message.error)
        else:
            for fd in fds:
                os.close(fd)
            logger.warning("ckptd writer: ignoring unexpected %s message", type(message).__name__)

    def _abandon(self) -> None:
        self.abandon.set()
        self.requests.put(None)
        self.worker.join(timeout=30)
        request = self.current
        if request is not None and request.abandon_directory:
            try:
                storage_for(request.abandon_directory, request.storage_options).discard(request.abandon_directory)
            except Exception:  # noqa: BLE001 - best effort on the way out
                logger.warning("ckptd writer: could not remove %s", request.abandon_directory)

    def _close_arenas(self) -> None:
        for segment in self.arenas.values():
            segment.close()
        self.arenas.clear()
        self.checksums.shutdown(wait=False, cancel_futures=True)

    def _work(self) -> None:
        while True:
            request = self.requests.get()
            if request is None or self.abandon.is_set():
                return
            self.current = request
            try:
                response: FilesWritten | Failed = self._write(request)
            except _Abandoned:
                return
            except BaseException as e:  # noqa: BLE001 - every failure is reported to the parent
                response = _failure(request.request_id, e)
            finally:
                with self.gates_lock:
                    self.gates.pop(request.request_id, None)
            if self.abandon.is_set():
                return
            self.current = None
            try:
                self.channel.send(response)
            except OSError:
                return

    def _write(self, request: WriteFiles) -> FilesWritten:
        segment = self.arenas.get(request.arena_id)
        # Arena 0: only copies, or files that are attached segments of their own (adopt)
        if segment is None and (request.arena_id or any(f.adopt is None for f in request.files)):
            raise WriterError(
                f"write request {request.request_id} names staging arena {request.arena_id}, "
                f"which is not attached to the writer (attached: {sorted(self.arenas)})"
            )
        with self.gates_lock:
            gate = self.gates.get(request.request_id)
        view = segment.view() if segment is not None else memoryview(b"")  # only copies to make
        self.throttle.reset(resume=request.resume_throttle)  # full speed unless training goes on
        slept_before = self.throttle.throttled_seconds
        try:
            written = write_files(
                request,
                view,
                checksums=self.checksums,
                should_stop=self.abandon.is_set,
                on_progress=self._count,
                gate=gate,
                on_freed=lambda upto: self._tell_freed(request.request_id, upto),
                segments=self.arenas,
            )
            return dataclasses.replace(written, throttled=self.throttle.throttled_seconds - slept_before)
        except Stopped as e:
            raise _Abandoned() from e
        finally:
            view.release()

    def _tell_freed(self, request_id: int, upto: int) -> None:
        try:
            self.channel.send(Freed(request_id, upto))
        except OSError:
            pass  # the parent is gone: the request is abandoned at its next chunk

    def _count(self, written: int) -> None:
        self.bytes_written += written
        self.throttle.consume(written, self.abandon.is_set)


def _failure(request_id: int, error: BaseException) -> Failed:
    kind = "storage" if isinstance(error, (StorageError, OSError)) else "internal"
    # An OSError's str() repeats its errno and file name; the parent rebuilds both.
    text = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
    return Failed(
        request_id=request_id,
        kind=kind,
        message=text,
        path=getattr(error, "filename", None),
        errno=getattr(error, "errno", None),
        traceback="".join(traceback.format_exception(error)),
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of the writer process."""
    parser = argparse.ArgumentParser(prog="ckptd-writer", description="ckptd background writer (internal)")
    parser.add_argument("--fd", type=int, required=True, help="control socket file descriptor")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--nice", type=int, default=0, help="CPU niceness increment")
    parser.add_argument("--ionice", type=int, default=None, help="best-effort I/O priority, 0-7")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    # Ctrl-C in the terminal reaches the whole process group; the trainer decides, not us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "SIGXFSZ"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # report EFBIG as an error instead of dying
    lower_priority(args.nice, args.ionice)  # before any thread starts: they inherit it
    sock = socket.socket(fileno=args.fd)
    return _Writer(Channel(sock), args.parent_pid).run()


if __name__ == "__main__":
    sys.exit(main())
