"""The HTTP server of ``/metrics``, ``/healthz`` (alias ``/readyz``) and ``/livez``: a minimal
HTTP/1.0 responder.

It runs on ``asyncio.start_server``: it reads the request line, skips the headers, answers and
closes. Invariant: no client can pin it. The whole exchange, closing included, must end within
``REQUEST_TIMEOUT`` or the connection is dropped, and beyond ``http_max_connections`` open
connections a new one is closed as it is accepted, unread, so the process's open files stay
bounded whatever a client does. A dropped or refused connection is logged at debug level only (a
refusal also counts in ``worker_http_connections_refused_total`` and in a warning at most once a
minute), never with a traceback.

It runs on the worker's event loop, so it needs no thread, no framework and no locking, binds
port 0 to an ephemeral port that tests can read, and closes with the loop's other components.
``wsgiref`` in a daemon thread would serve one client at a time, could not be stopped from the
loop without blocking it, and logs every request to stderr.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import time
from collections.abc import Coroutine
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
        self._clients: set[asyncio.Task[Any]] = set()
        self._open = 0
        self._refused = 0
        self._next_warning = 0.0

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port``; returns the port bound."""
        self._server = await asyncio.start_server(self._accept, host, port, limit=16 * 1024)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def close(self) -> None:
        """Stop listening and drop the connections still open."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for client in list(self._clients):
            client.cancel()
        await asyncio.gather(*self._clients, return_exceptions=True)
        if server is not None:
            await server.wait_closed()  # from Python 3.12 on, it waits for every connection

    async def __aenter__(self) -> HttpServer:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    def _accept(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> Coroutine[Any, Any, None] | None:
        """Called as a connection is accepted, before anything is read: serve it, or close it at
        once when ``max_connections`` are open."""
        if self._open >= self.max_connections:
            writer.transport.abort()
            self._count_refusal()
            return None
        self._open += 1
        return self._serve(reader, writer)

    def _count_refusal(self) -> None:
        self.metrics.http_refused.inc()
        self._refused += 1
        now = time.monotonic()
        if now < self._next_warning:
            log.debug("http: refused a connection: %d open", self._open)
            return
        log.warning(
            "http: %d connection(s) refused, %d open (http_max_connections)",
            self._refused,
            self._open,
        )
        self._refused, self._next_warning = 0, now + REFUSALS_LOG_INTERVAL

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._clients.add(task)
        try:
            # Closing counts too: a client that reads nothing would keep the answer buffered.
            async with asyncio.timeout(self.timeout):
                request = await reader.readline()
                # Headers are read but ignored: closing with unread input would reset the
                # connection, and the client could lose the answer.
                while (await reader.readline()).strip():
                    pass
                writer.write(self.answer(request))
                await writer.drain()
                writer.close()
                await writer.wait_closed()
        except (TimeoutError, OSError, ValueError) as exc:  # slow, gone, or a line too long
            log.debug("http: dropped a connection: %r", exc)
        except Exception:
            log.exception("http: could not answer a request")
        finally:
            writer.transport.abort()  # nothing left to send: the socket closes now
            self._open -= 1
            self._clients.discard(task)

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
