"""A small HTTP/1.1 proxy on 127.0.0.1 that sits between a client and a real server.

It forwards requests unchanged, records what went through (method, path, status, response body
bytes, the request's headers, its ``x-amz-checksum-crc32c`` header, its body's length and CRC32C),
and on demand injects faults: ``503 SlowDown`` answers, connection resets, stalls (a server that
stops reading, or never answers), or going down entirely (refusing connections) and coming back on
the same port.
"""

from __future__ import annotations

import base64
import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import crc32c

Matcher = Callable[[str, str], bool]

_SLOW_DOWN = (
    b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
    b"<Message>Please reduce your request rate.</Message></Error>"
)


@dataclass
class Exchange:
    """One request that went through the proxy."""

    method: str
    path: str
    status: int
    response_bytes: int
    sent_crc32c: str | None = None  # the request's x-amz-checksum-crc32c header
    body_crc32c: str = ""  # base64 of the big-endian CRC32C of the request body, as S3 spells it
    request_bytes: int = 0  # the request body's length as received (chunked framing included)
    request_headers: dict[str, str] = field(default_factory=dict)  # lower-case names


@dataclass
class _Rule:
    # "503", "reset" (before forwarding), "lost-reply" (after forwarding), "down", "stall" (stop
    # reading after the request's head and never answer), "stall-reply" (read the request whole,
    # never forward or answer it) or "slow" (read the body at slow_rate bytes/s, then forward)
    kind: str
    remaining: int
    match: Matcher
    after: int = 0  # for "down": let this many matching requests through first


class _Closed(Exception):
    pass


def _read_until(sock: socket.socket, buffer: bytearray, marker: bytes) -> bytes:
    while marker not in buffer:
        data = sock.recv(65536)
        if not data:
            raise _Closed()
        buffer.extend(data)
    index = buffer.index(marker) + len(marker)
    head = bytes(buffer[:index])
    del buffer[:index]
    return head


def _read_exact(sock: socket.socket, buffer: bytearray, count: int) -> bytes:
    while len(buffer) < count:
        data = sock.recv(max(65536, count - len(buffer)))
        if not data:
            raise _Closed()
        buffer.extend(data)
    out = bytes(buffer[:count])
    del buffer[:count]
    return out


def _read_slowly(sock: socket.socket, buffer: bytearray, count: int, rate: float) -> bytes:
    """``count`` bytes, taken from the socket at about ``rate`` bytes per second."""
    out = bytearray()
    while len(out) < count:
        if not buffer:
            data = sock.recv(min(65536, count - len(out)))
            if not data:
                raise _Closed()
            buffer.extend(data)
        piece = bytes(buffer[: count - len(out)])
        del buffer[: len(piece)]
        out.extend(piece)
        time.sleep(len(piece) / rate)
    return bytes(out)


def _headers(head: bytes) -> dict[str, str]:
    lines = head.decode("latin-1").split("\r\n")[1:]
    out = {}
    for line in lines:
        if ":" in line:
            name, value = line.split(":", 1)
            out[name.strip().lower()] = value.strip()
    return out


def _read_body(sock: socket.socket, buffer: bytearray, headers: dict[str, str], until_close: bool = False) -> bytes:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        raw = bytearray()
        while True:
            size_line = _read_until(sock, buffer, b"\r\n")
            raw.extend(size_line)
            size = int(size_line.split(b";")[0].strip(), 16)
            if size == 0:
                while True:
                    trailer = _read_until(sock, buffer, b"\r\n")
                    raw.extend(trailer)
                    if trailer == b"\r\n":
                        return bytes(raw)
            raw.extend(_read_exact(sock, buffer, size + 2))
    if "content-length" not in headers and until_close:
        while True:
            data = sock.recv(65536)
            if not data:
                out = bytes(buffer)
                buffer.clear()
                return out
            buffer.extend(data)
    length = int(headers.get("content-length", "0") or 0)
    return _read_exact(sock, buffer, length)


def _reset(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class FaultProxy:
    """Forwards to ``upstream`` (host, port); see the module docstring.

    ``receive_buffer`` (bytes) fixes the kernel receive buffer of the connections it accepts: a
    small one keeps a stalled request's body out of the kernel's buffers, so the client is still
    sending it when the proxy stops reading (as with a frozen server and a large part).
    """

    def __init__(self, upstream_host: str, upstream_port: int, receive_buffer: int | None = None) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.receive_buffer = receive_buffer
        self.slow_rate = 1024.0 * 1024.0  # bytes per second a "slow" request's body is read at
        self.exchanges: list[Exchange] = []
        self.injected: list[tuple[str, str, str]] = []
        self._rules: list[_Rule] = []
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self.port = 0
        self.down_event = threading.Event()
        self._released = threading.Event()  # set: stalled connections are let go (reset)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ---- control ---------------------------------------------------------------------------

    def start(self) -> FaultProxy:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self.receive_buffer is not None:  # inherited by accepted sockets (and no autotuning)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.receive_buffer)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(128)
        self.port = listener.getsockname()[1]
        self._listener = listener
        self.down_event.clear()
        self._released.clear()
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def stop(self) -> None:
        """Go down: refuse new connections and reset every open one (stalled ones included)."""
        self.down_event.set()
        self._released.set()
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            sockets = list(self._sockets)
            self._sockets.clear()
        for sock in sockets:
            _reset(sock)

    def restart(self) -> None:
        """Come back on the same port."""
        self.start()

    def inject(self, kind: str, count: int, match: Matcher = lambda m, p: True) -> None:
        """Answer the next ``count`` matching requests with a fault: ``"503"``, ``"reset"`` (the
        request never reaches the server), ``"lost-reply"`` (it does; the answer is lost),
        ``"stall"`` (the proxy reads the request's head, then neither reads the rest nor answers:
        a frozen server), ``"stall-reply"`` (it reads the whole request and never answers) or
        ``"slow"`` (it reads the body at ``slow_rate`` bytes per second: a slow, healthy link).
        A stalled connection is held until :meth:`release_stalls` or :meth:`stop`; the request
        never reaches the server."""
        with self._lock:
            self._rules.append(_Rule(kind, count, match))

    def release_stalls(self) -> None:
        """Let go of every stalled connection (reset it); later stalls are held again."""
        self._released.set()
        self._released = threading.Event()

    def go_down_after(self, count: int, match: Matcher) -> None:
        """Let ``count`` matching requests through, then go down at the next one."""
        with self._lock:
            self._rules.append(_Rule("down", 1, match, after=count))

    def bytes_received(self, match: Matcher) -> int:
        """Response body bytes of the matching exchanges so far."""
        with self._lock:
            return sum(e.response_bytes for e in self.exchanges if match(e.method, e.path))

    def matching(self, match: Matcher) -> list[Exchange]:
        """The matching exchanges so far, in the order they were recorded."""
        with self._lock:
            return [e for e in self.exchanges if match(e.method, e.path)]

    def count(self, match: Matcher) -> int:
        return len(self.matching(match))

    # ---- serving ---------------------------------------------------------------------------

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            with self._lock:
                self._sockets.add(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _fault_for(self, method: str, path: str) -> str | None:
        with self._lock:
            for rule in self._rules:
                if rule.remaining > 0 and rule.match(method, path):
                    if rule.after > 0:
                        rule.after -= 1
                        continue
                    rule.remaining -= 1
                    self.injected.append((rule.kind, method, path))
                    return rule.kind
        return None

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        inbound = bytearray()
        outbound = bytearray()
        try:
            while True:
                head = _read_until(client, inbound, b"\r\n\r\n")
                request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
                method, path = request_line.split(" ")[:2]
                headers = _headers(head)
                fault = self._fault_for(method, path)
                if fault == "stall":  # a frozen server: not even "100 Continue"
                    self._hold(client)
                    return
                if headers.get("expect", "").lower() == "100-continue":
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                    head = b"\r\n".join(line for line in head.split(b"\r\n") if not line.lower().startswith(b"expect:"))
                if fault == "slow" and "content-length" in headers:
                    body = _read_slowly(client, inbound, int(headers["content-length"]), self.slow_rate)
                else:
                    body = _read_body(client, inbound, headers)
                sent = base64.b64encode(crc32c.crc32c(body).to_bytes(4, "big")).decode("ascii")
                request_bytes = len(body)
                if fault == "stall-reply":
                    self._hold(client)
                    return
                if fault == "down":
                    self.stop()
                    return
                if fault == "reset":
                    _reset(client)
                    return
                if fault == "503":
                    client.sendall(
                        b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                        + f"Content-Length: {len(_SLOW_DOWN)}\r\n\r\n".encode()
                        + _SLOW_DOWN
                    )
                    with self._lock:
                        self.exchanges.append(
                            Exchange(
                                method, path, 503, 0, headers.get("x-amz-checksum-crc32c"), sent, request_bytes, headers
                            )
                        )
                    continue
                if upstream is None:
                    upstream = socket.create_connection(self.upstream)
                    with self._lock:
                        self._sockets.add(upstream)
                upstream.sendall(head + body)
                if fault == "lost-reply":
                    self._drain_response(upstream, outbound, method)
                    _reset(client)
                    return
                status, head, body = self._relay_response(upstream, outbound, client, method)
                exchange = Exchange(
                    method, path, status, len(body), headers.get("x-amz-checksum-crc32c"), sent, request_bytes, headers
                )
                with self._lock:  # recorded before the client sees the reply: no race with the test
                    self.exchanges.append(exchange)
                client.sendall(head + body)
        except (_Closed, OSError):
            pass
        finally:
            for sock in (client, upstream):
                if sock is not None:
                    with self._lock:
                        self._sockets.discard(sock)
                    with contextlib.suppress(OSError):
                        sock.close()

    def _hold(self, client: socket.socket) -> None:
        """Keep ``client`` open without reading from it or answering, until released."""
        self._released.wait()
        _reset(client)

    def _drain_response(self, upstream: socket.socket, buffer: bytearray, method: str) -> None:
        head = _read_until(upstream, buffer, b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if method != "HEAD" and status not in (204, 304):
            _read_body(upstream, buffer, _headers(head), until_close=True)

    def _relay_response(
        self, upstream: socket.socket, buffer: bytearray, client: socket.socket, method: str
    ) -> tuple[int, bytes, bytes]:
        while True:
            head = _read_until(upstream, buffer, b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            if status >= 200 or status == 101:
                break
            client.sendall(head)  # interim 1xx answers
        headers = _headers(head)
        no_body = method == "HEAD" or status in (204, 304)
        body = b"" if no_body else _read_body(upstream, buffer, headers, until_close=True)
        return status, head, body
