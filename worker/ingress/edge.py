"""What every request to the ingress passes before a route sees it: its access log line, the
Host check, the cap on requests in flight and a body read whole, within a deadline.

Invariant: a route runs only for a request whose body has fully arrived (or is known to pass
``max_body_bytes``), whose ``Host`` is allowed, and while its pool has a free slot; so at most
``ingress_max_requests`` bodies of at most ``max_body_bytes`` are held at once, a body that is
not sent within its deadline gets a 408, and a client that goes away mid-body is a debug line
(and status 499 in the access log), never a route's error. An application that tells trusted
requests apart (``Edge(trusted=...)``: the console's, a live session's) gives the others a pool
of their own (``Pools``), so untrusted clients, however many and slow, never take a trusted
request's slot; and it may give a body a deadline that fits its declared size (``BodyDeadline``).
``/healthz`` passes the Host check, and the probes' paths (``PROBE_PATHS``) the cap: an
orchestrator's probe names the pod's address and must get through a flood. Nothing here logs a
token or a body.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from worker import logs
from worker.ingress.problems import Problem
from worker.ingress.reading import within_limit
from worker.settings import Settings

log = logging.getLogger(__name__)
access_log = logging.getLogger("worker.ingress.access")

HEALTH_PATH = "/healthz"
PROBE_PATHS = frozenset({HEALTH_PATH, "/openapi.json"})
"""What an orchestrator's probes ask (readiness, liveness): answered past the caps on requests
and connections, as they hold no body and no database connection but ``/healthz``'s one."""
CLIENT_CLOSED = 499
"""The status an access line gives a request whose client went away before its answer (nginx's)."""
MAX_LOGGED_KEY = 128
"""Characters of an Idempotency-Key an access line shows at most."""
TRIM_AFTER_BYTES = 16 * 1024 * 1024
"""Bodies read since the last trim after which an idle ingress gives freed memory back."""

_KEY_HEADER = b"idempotency-key"


class BodyTimeout(Exception):
    """The client did not send the whole body in time."""


class ClientGone(Exception):
    """The client closed its connection before the body ended."""


@dataclass(frozen=True)
class BodyDeadline:
    """Seconds a body may take: ``floor`` plus its declared Content-Length at ``min_rate`` bytes
    per second, at most ``ceiling``; ``ceiling`` for a body without one (chunked)."""

    ceiling: float
    floor: float | None = None
    """None: every body has ``ceiling`` (the ingress's ``ingress_body_timeout``)."""
    min_rate: float = 16 * 1024

    def of(self, declared: bytes | None) -> float:
        if self.floor is None or declared is None or not within_limit(declared, 2**40):
            return self.ceiling
        return min(self.ceiling, self.floor + int(declared) / self.min_rate)


class Pools:
    """Requests in flight, in two pools: ``trusted`` ones (up to ``max_trusted``) and the
    others (up to ``max_untrusted``, and ``per_address`` of one client address), so that
    untrusted requests never hold a trusted one's slot. With ``max_untrusted`` None, one pool
    for all (the ingress's: its routes check the tokens)."""

    def __init__(
        self, max_trusted: int, max_untrusted: int | None = None, per_address: int | None = None
    ) -> None:
        self.max_trusted = max_trusted
        self.max_untrusted = max_untrusted
        self.per_address = per_address
        self.trusted = 0
        self.untrusted: Counter[str] = Counter()

    def take(self, trusted: bool, address: str) -> bool:
        """Take a slot for a request; False when its pool (or its address's share) is full."""
        if trusted or self.max_untrusted is None:
            if self.trusted >= self.max_trusted:
                return False
            self.trusted += 1
            return True
        if self.untrusted.total() >= self.max_untrusted or (
            self.per_address is not None and self.untrusted[address] >= self.per_address
        ):
            return False
        self.untrusted[address] += 1
        return True

    def give_back(self, trusted: bool, address: str) -> None:
        if trusted or self.max_untrusted is None:
            self.trusted -= 1
            return
        self.untrusted[address] -= 1
        if self.untrusted[address] <= 0:
            del self.untrusted[address]

    def __len__(self) -> int:
        return self.trusted + self.untrusted.total()


class Edge:
    """The ASGI middleware in front of the ingress's routes (see the module's invariant).

    ``trusted`` tells a request that may use ``pools``' trusted slots (default: every request,
    one pool of ``ingress_max_requests``), ``address`` the client an untrusted one counts
    against (default: the peer's address); ``deadline`` gives a body its time (default:
    ``ingress_body_timeout`` for every body)."""

    def __init__(
        self,
        app: ASGIApp,
        settings: Settings,
        *,
        pools: Pools | None = None,
        trusted: Callable[[Scope], bool] | None = None,
        address: Callable[[Scope], str] | None = None,
        deadline: BodyDeadline | None = None,
    ) -> None:
        self.app = app
        self.address = client_address if address is None else address
        self.pools = Pools(settings.ingress_max_requests) if pools is None else pools
        self.trusted = trusted
        self.max_body_bytes = settings.max_body_bytes
        self.deadline = (
            BodyDeadline(settings.ingress_body_timeout) if deadline is None else deadline
        )
        self.access_log = settings.ingress_access_log
        self.allowed_hosts = (
            None
            if settings.ingress_tokens or "*" in settings.ingress_allowed_hosts
            else frozenset(host.lower() for host in settings.ingress_allowed_hosts)
        )
        self._unreturned = 0
        self._memory = _Memory()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = [CLIENT_CLOSED]

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self._guarded(scope, receive, sending)
        except Exception:
            if status[0] == CLIENT_CLOSED:  # no answer started: uvicorn answers 500
                status[0] = HTTPStatus.INTERNAL_SERVER_ERROR
            raise
        finally:
            if self.access_log:
                log_access(scope, status[0], time.perf_counter() - started)

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] == HEALTH_PATH:
            await self.app(scope, receive, send)
            return
        if self.allowed_hosts is not None and not host_allowed(scope, self.allowed_hosts):
            await host_not_allowed().response(scope["path"])(scope, receive, send)
            return
        if scope["path"] in PROBE_PATHS and scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        trusted = self.trusted is None or self.trusted(scope)
        address = self.address(scope)
        if not self.pools.take(trusted, address):
            await busy().response(scope["path"])(scope, receive, send)
            return
        try:
            seconds = self.deadline.of(_header(scope, b"content-length"))
            try:
                replay = await self._read_body(scope, receive, seconds)
            except BodyTimeout:
                await body_timeout(seconds).response(scope["path"])(scope, receive, send)
                return
            except ClientGone as gone:
                log.debug("ingress: %s %s: %s", scope["method"], _path(scope), gone)
                return
            await self.app(scope, replay, send)
        finally:
            self.pools.give_back(trusted, address)
            if not self.pools and self._unreturned >= TRIM_AFTER_BYTES:
                self._unreturned = 0
                self._memory.trim()

    async def _read_body(self, scope: Scope, receive: Receive, seconds: float) -> Receive:
        """A ``receive`` that gives the request's whole body as one message, read here within
        ``seconds``; the body is read no further than past ``max_body_bytes`` (the route
        refuses it then, as it refuses a Content-Length over the limit, which is not read)."""
        declared = _header(scope, b"content-length")
        if declared is not None and not within_limit(declared, self.max_body_bytes):
            return receive  # (refused by the route before it reads a byte)
        chunks: list[bytes] = []
        size = 0
        more = True
        try:
            async with asyncio.timeout(seconds):
                while more:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise ClientGone(f"the client went away after {size} bytes of the body")
                    chunk = message.get("body", b"")
                    chunks.append(chunk)
                    size += len(chunk)
                    self._unreturned += len(chunk)
                    more = message.get("more_body", False) and size <= self.max_body_bytes
        except TimeoutError:
            raise BodyTimeout from None
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        del chunks
        return _replaying(body, receive)


def _replaying(body: bytes, receive: Receive) -> Receive:
    """``receive`` for a body already read: the body as one message, then the client's own."""
    pending = [body]

    async def replay() -> Message:
        if pending:
            return {"type": "http.request", "body": pending.pop(), "more_body": False}
        return await receive()

    return replay


def client_address(scope: Scope) -> str:
    """The address of the request's peer (``-`` when the server does not say)."""
    client = scope.get("client")
    return str(client[0]) if client else "-"


def log_access(scope: Scope, status: int, seconds: float) -> None:
    """One line for a request: method, path, status, duration, Idempotency-Key, client."""
    method = scope.get("method", "")
    path = _path(scope)
    raw_key = _header(scope, _KEY_HEADER)
    key = logs.printable(raw_key.decode("utf-8", "replace")) if raw_key is not None else "-"
    if len(key) > MAX_LOGGED_KEY:
        key = key[:MAX_LOGGED_KEY] + "..."
    client = scope.get("client")
    peer = f"{client[0]}:{client[1]}" if client else "-"
    milliseconds = round(seconds * 1000, 1)
    access_log.info(
        "%s %s %d %.1fms key=%s client=%s",
        method,
        path,
        status,
        milliseconds,
        key,
        peer,
        extra={
            logs.FIELDS: {
                "method": method,
                "path": path,
                "status": status,
                "duration_ms": milliseconds,
                "key": None if raw_key is None else key,
                "client": peer,
            }
        },
    )


def _path(scope: Scope) -> str:
    return logs.printable(str(scope.get("path", "")))[:1024]


def _header(scope: Scope, name: bytes) -> bytes | None:
    values: list[tuple[bytes, bytes]] = scope.get("headers", [])
    return next((value for key, value in values if key == name), None)


def host_allowed(scope: Scope, allowed: frozenset[str]) -> bool:
    """Whether the request's ``Host`` (without its port) is one of ``allowed``."""
    host = _header(scope, b"host")
    if host is None:
        return False
    name = host.decode("latin-1").strip().lower()
    if name.startswith("["):
        name = name[: name.find("]") + 1]
    else:
        name = name.rsplit(":", 1)[0] if name.count(":") == 1 else name
    return name in allowed


def host_not_allowed() -> Problem:
    """A Host the ingress does not serve while it asks no token (a DNS rebinding, or a proxy
    that should set ``ingress_allowed_hosts``)."""
    return Problem(
        HTTPStatus.BAD_REQUEST,
        "host-not-allowed",
        "The Host is not allowed",
        "the ingress serves only the hosts of ingress_allowed_hosts while it asks no token",
    )


def busy() -> Problem:
    """``ingress_max_requests`` requests are in progress."""
    return Problem(
        HTTPStatus.SERVICE_UNAVAILABLE,
        "busy",
        "The ingress is busy",
        "too many requests are in progress; send it again later (with the same "
        "Idempotency-Key, to the ingress)",
        # (no Connection: close: closing with the body unread would reset the connection, and
        # the client could lose the answer; the body is read and dropped, within the header
        # deadline, and the idle connection is the first closed when they are all open)
        headers={"Retry-After": "1"},
    )


def body_timeout(seconds: float) -> Problem:
    """The body did not arrive within its deadline (``BodyDeadline``)."""
    return Problem(
        HTTPStatus.REQUEST_TIMEOUT,
        "body-timeout",
        "The body took too long",
        f"the whole body must arrive within {seconds:g} s of the headers",
        headers={"Connection": "close"},
    )


def overflow_app(settings: Settings) -> Callable[[ASGIApp], ASGIApp]:
    """What serves a connection over ``ingress_max_connections``, around the application
    ``app``: the probes' paths as ever (a probe must get through), anything else a 503, and the
    connection closed."""

    def overflow(app: ASGIApp) -> ASGIApp:
        async def answer(scope: Scope, receive: Receive, send: Send) -> None:
            if scope.get("path") in PROBE_PATHS:
                await app(scope, receive, send)
                return
            started = time.perf_counter()
            problem = Problem(
                HTTPStatus.SERVICE_UNAVAILABLE,
                "busy",
                "The ingress is busy",
                "too many connections are open; connect again later",
                headers={"Retry-After": "1", "Connection": "close"},
            )
            await problem.response(scope.get("path"))(scope, receive, send)
            if settings.ingress_access_log:
                log_access(scope, HTTPStatus.SERVICE_UNAVAILABLE, time.perf_counter() - started)

        return answer

    return overflow


class _Memory:
    """glibc's ``malloc_trim``, which gives freed heap pages back to the system: bodies are
    freed once answered, but the allocator keeps their pages (RSS stays where a flood left it)
    until asked. Elsewhere than glibc, nothing."""

    def __init__(self) -> None:
        self._trim: Callable[[int], int] | None = None
        name = ctypes.util.find_library("c")
        if name is not None:
            libc = ctypes.CDLL(name)
            self._trim = getattr(libc, "malloc_trim", None)

    def trim(self) -> None:
        if self._trim is not None:
            self._trim(0)
