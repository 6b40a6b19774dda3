"""The HTTP server of ``/metrics``, ``/healthz`` (alias ``/readyz``) and ``/livez``: a minimal
HTTP/1.0 responder.

It runs on ``loop.create_server`` with a protocol of its own: it reads the request line, skips
the headers, answers and closes. Invariant: no client can pin it, nor keep a probe out. The
whole exchange, closing included, must end within ``REQUEST_TIMEOUT`` or the connection is
dropped, and at most ``http_max_connections`` are open, so the process's open files stay bounded
whatever a client does. A connection accepted when they are all open closes the oldest one that
has not sent its whole request and has nothing waiting to be read: a probe sends its request as
it connects and is answered as soon as it is read, so it is never such a connection, while idle
or slow clients are; only when none is does the new one get closed unread. A dropped, evicted or
refused connection is logged at debug level only (a refusal or an eviction also counts in
``worker_http_connections_refused_total`` and in a warning at most once a minute), never with a
traceback.

It runs on the worker's event loop, so it needs no thread, no framework and no locking, binds
port 0 to an ephemeral port that tests can read, and closes with the loop's other components.
``wsgiref`` in a daemon thread would serve one client at a time, could not be stopped from the
loop without blocking it, and logs every request to stderr.
"""

from __future__ import annotations

import asyncio
import fcntl
import ipaddress
import json
import logging
import struct
import termios
import time
from http import HTTPStatus
from typing import Any, Protocol

from worker.ops.metrics import CONTENT_TYPE_LATEST, Metrics

log = logging.getLogger("worker.ops.metrics")  # the http lines, under the logger they had


class Health(Protocol):
    """What the server asks for ``/healthz`` and ``/livez`` (``health.Health`` is one)."""

    def report(self) -> tuple[bool, dict[str, Any]]: ...

    def liveness(self) -> tuple[bool, dict[str, Any]]: ...


REQUEST_TIMEOUT = 5.0
"""Seconds a client has for its whole exchange: send the request, read the answer, close."""

REFUSALS_LOG_INTERVAL = 60.0
"""Seconds between two warnings that connections are being refused."""


MAX_REQUEST_BYTES = 16 * 1024
"""Bytes of a request line and headers read at most; a longer request is dropped unanswered."""


class HttpServer:
    """``/metrics``, ``/healthz`` (``/readyz``) and ``/livez`` (GET or HEAD) over HTTP/1.0, one
    request per connection.

    ``await HttpServer(metrics, health).start(host, port)`` returns the bound port (an ephemeral
    one for port 0); ``close()`` stops listening and drops the connections still open. Also an
    async context manager once started. At most ``max_connections`` are served at once, each
    for at most ``timeout`` seconds.
    """

    def __init__(
        self,
        metrics: Metrics,
        health: Health,
        *,
        max_connections: int = 64,
        timeout: float = REQUEST_TIMEOUT,
    ) -> None:
        self.metrics = metrics
        self.health = health
        self.max_connections = max_connections
        self.timeout = timeout
        self.port: int | None = None
        self._server: asyncio.Server | None = None
        self._open: dict[_Exchange, None] = {}
        """The open connections, oldest first."""
        self._refused = 0
        self._next_warning = 0.0

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port``; returns the port bound."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Exchange(self), host, port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def close(self) -> None:
        """Stop listening and drop the connections still open."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for exchange in list(self._open):
            exchange.transport.abort()
        if server is not None:
            await server.wait_closed()  # from Python 3.12 on, it waits for every connection

    async def __aenter__(self) -> HttpServer:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    def _admit(self, exchange: _Exchange) -> bool:
        """Called as a connection is accepted, before anything is read: True to serve it
        (closing the oldest connection still waiting for its request, with nothing unread,
        when ``max_connections`` are open); False when it must be closed at once."""
        if len(self._open) >= self.max_connections:
            idle = next((each for each in self._open if each.idle()), None)
            self._count_refusal()
            if idle is None:
                return False
            self._forget(idle)
            idle.transport.abort()
        self._open[exchange] = None
        return True

    def _forget(self, exchange: _Exchange) -> None:
        self._open.pop(exchange, None)

    def _count_refusal(self) -> None:
        self.metrics.http_refused.inc()
        self._refused += 1
        now = time.monotonic()
        if now < self._next_warning:
            log.debug("http: refused a connection: %d open", len(self._open))
            return
        log.warning(
            "http: %d connection(s) refused or closed for a newer one, %d open "
            "(http_max_connections)",
            self._refused,
            len(self._open),
        )
        self._refused, self._next_warning = 0, now + REFUSALS_LOG_INTERVAL

    def answer(self, request_line: bytes) -> bytes:
        """The whole response to a request line, e.g. ``b"GET /metrics HTTP/1.1"``."""
        parts = request_line.decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return _response(HTTPStatus.BAD_REQUEST, "text/plain", b"bad request\n")
        method, target, _ = parts
        if method not in {"GET", "HEAD"}:
            return _response(
                HTTPStatus.METHOD_NOT_ALLOWED, "text/plain", b"use GET\n", allow="GET, HEAD"
            )
        path = target.split("?", 1)[0]
        if path == "/metrics":
            status, content_type, body = HTTPStatus.OK, CONTENT_TYPE_LATEST, self.metrics.render()
        elif path in ("/healthz", "/readyz", "/livez"):
            ok, report = self.health.liveness() if path == "/livez" else self.health.report()
            status = HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE
            content_type, body = "application/json", json.dumps(report).encode() + b"\n"
        else:
            status, content_type, body = HTTPStatus.NOT_FOUND, "text/plain", b"not found\n"
        return _response(status, content_type, body, head=method == "HEAD")


class _Exchange(asyncio.Protocol):
    """One connection: its request read as it arrives, answered from its request line once the
    headers end, then closed; dropped when it takes longer than the server's ``timeout``
    (closing included: a client that reads nothing would keep the answer buffered)."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.received = bytearray()
        self.answered = False
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if not self.server._admit(self):
            transport.abort()
            return
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_later(self.server.timeout, self._expire)

    def idle(self) -> bool:
        """Not answered yet, and nothing arrived that is not read yet."""
        return not self.answered and not unread_bytes(self.transport)

    def data_received(self, data: bytes) -> None:
        if self.answered:
            return  # (read and dropped: closing with unread input would reset the connection)
        self.received += data
        head = bytes(self.received)
        if b"\r\n\r\n" in head or b"\n\n" in head:
            self._answer(head.split(b"\n", 1)[0])
        elif len(head) > MAX_REQUEST_BYTES:
            log.debug("http: dropped a connection: a request longer than %d", MAX_REQUEST_BYTES)
            self.transport.abort()

    def eof_received(self) -> bool:
        if not self.answered:
            self._answer(bytes(self.received).split(b"\n", 1)[0])
        return False

    def _answer(self, request_line: bytes) -> None:
        self.answered = True
        self.received.clear()
        try:
            self.transport.write(self.server.answer(request_line))
        except Exception:
            log.exception("http: could not answer a request")
            self.transport.abort()
            return
        self.transport.close()

    def _expire(self) -> None:
        log.debug("http: dropped a connection: it took longer than %g s", self.server.timeout)
        self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self.server._forget(self)


def unread_bytes(transport: asyncio.BaseTransport) -> int:
    """Bytes that arrived on ``transport``'s socket and are not read yet (0 when unknown): a
    connection with some is about to be served, however idle it looked so far."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        waiting = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    except (OSError, ValueError):
        return 0
    return int(struct.unpack("i", waiting)[0])


def local_url(host: str, port: int, path: str) -> str:
    """The URL at which this host reaches an endpoint bound to ``host:port``: a wildcard address
    (``0.0.0.0``, ``::``, empty) asks the loopback address of its family, a host name is kept,
    and an IPv6 address is bracketed."""
    try:
        address: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(host)
    except ValueError:
        address = None
    if not host or (address is not None and address.is_unspecified):
        host = "::1" if address is not None and address.version == 6 else "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}{path}"


def _response(
    status: HTTPStatus, content_type: str, body: bytes, *, head: bool = False, allow: str = ""
) -> bytes:
    lines = [
        f"HTTP/1.0 {status.value} {status.phrase}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body)}",
        "Cache-Control: no-store",
        "Connection: close",
    ]
    if allow:
        lines.append(f"Allow: {allow}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (b"" if head else body)
