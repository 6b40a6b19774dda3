"""The ingress's connections under uvicorn: how many stay open, and how long one may say nothing.

Invariant: no client can hold a connection, and so a file descriptor, without sending a request.
A connection must send its request's headers within ``header_timeout`` of being accepted, or of
the first byte of its next request; an idle keep-alive connection is closed after
``ingress_keep_alive`` (by uvicorn). At most ``max_connections`` are served: a connection
accepted when they are all open closes the oldest one that has no request in progress and no
bytes waiting to be read (an idle or a slow client loses its place to a new one, so a probe of
``/healthz`` gets through a flood of idle connections). When every one has a request in
progress, the new connection is served by the overflow application once its headers arrive
(within ``OVERFLOW_GRACE``): the probes' paths as ever, anything else a 503; and beyond ``overflow``
such connections a new one is closed unread. Open descriptors stay below ``max_connections +
overflow`` and the connections accepted in one turn of the event loop (the listener's backlog).

The protocol is uvicorn's h11 one with timers around it: ``LimitedH11Protocol.limited(limits)``
is the class to give ``uvicorn.Config(http=...)``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from worker.ops.http import unread_bytes

log = logging.getLogger(__name__)

OVERFLOW_GRACE = 1.0
"""Seconds a connection over the cap has to send its headers before it is closed unanswered."""

ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]


@dataclass
class Limits:
    """The bounds shared by every connection of one server, and its open connections, oldest
    first."""

    max_connections: int
    header_timeout: float
    overflow_app: Callable[[ASGIApp], ASGIApp]
    """What serves, around the application, a connection over the cap (a 503 but for health)."""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    """Headers added to the 400 the protocol itself sends for a request it cannot parse."""
    open: dict[LimitedH11Protocol, None] = field(default_factory=dict)
    overflowing: int = 0
    evicted: int = 0

    @property
    def overflow(self) -> int:
        """Connections over the cap that are answered 503 rather than closed unread."""
        return max(16, self.max_connections // 8)


class LimitedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a header deadline and a connection cap (``Limits``)."""

    limits: Limits

    @classmethod
    def limited(cls, limits: Limits) -> type[LimitedH11Protocol]:
        """This protocol bound to ``limits``: a class for ``uvicorn.Config(http=...)``."""
        return type("LimitedH11Protocol", (cls,), {"limits": limits})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._overflowing = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        limits = self.limits
        if len(limits.open) >= limits.max_connections and not self._evict_idle():
            if limits.overflowing >= limits.overflow:
                log.debug("ingress: closed a connection unread: %d open", len(limits.open))
                transport.abort()
                return
            limits.overflowing += 1
            self._overflowing = True
            self.app = limits.overflow_app(self.app)
            self._arm(OVERFLOW_GRACE)
            return
        limits.open[self] = None
        self._arm(limits.header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._overflowing:
            self._overflowing = False
            self.limits.overflowing -= 1
        self.limits.open.pop(self, None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:
            self._disarm()  # a request's headers arrived
        elif self._deadline is None and not self._in_progress() and not self._overflowing:
            self._arm(self.limits.header_timeout)  # the first bytes of the next request

    def send_400_response(self, msg: str) -> None:
        """uvicorn's 400 for a request h11 cannot parse, with ``Limits.headers``."""
        headers = [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"connection", b"close"),
            *self.limits.headers,
        ]
        event = h11.Response(status_code=400, headers=headers, reason=b"Bad Request")
        for output in (event, h11.Data(data=msg.encode("ascii")), h11.EndOfMessage()):
            self.transport.write(self.conn.send(output) or b"")
        self.transport.close()

    def _in_progress(self) -> bool:
        """Whether a request has arrived whose answer is not complete yet."""
        return self.cycle is not None and not self.cycle.response_complete

    def _idle(self) -> bool:
        """Whether this connection has no request in progress and nothing waiting to be read."""
        return not self._in_progress() and not unread_bytes(self.transport)

    def _evict_idle(self) -> bool:
        """Close the oldest idle open connection; False if there is none."""
        idle = next((each for each in self.limits.open if each._idle()), None)
        if idle is None:
            return False
        self.limits.open.pop(idle)
        self.limits.evicted += 1
        log.debug("ingress: closed the oldest idle connection to make room for a new one")
        idle.transport.close()
        return True

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if not self._in_progress() and not self.transport.is_closing():
            log.debug("ingress: closed a connection that sent no complete request headers in time")
            self.transport.close()
