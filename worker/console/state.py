"""What the console's pages share: the settings, the database, the broker connection (made on
first use), the sessions and the accounts; one ``Console`` per application, at
``app.state.console``.

Invariant: the console holds at most one broker connection and the engine's pool (``POOL_SIZE``)
of database connections, whatever its users do, and closes both when it stops, once the actions
in progress (``Console.acting``) have ended and written their audit entries.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from urllib.parse import SplitResult, urlsplit

from aio_pika.abc import AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.requests import Request, cookie_parser
from starlette.types import Scope

from worker.console.accounts import Accounts
from worker.console.sessions import Sessions
from worker.console.throttle import ClientAddress, LoginThrottle
from worker.liveness import Liveness
from worker.settings import Settings
from worker.transport.connection import connect

APPLICATION_NAME = "worker-console"
"""The ``application_name`` of the console's database connections and broker connection."""
POOL_SIZE = 4
"""Database connections the console holds at most."""
LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]"})
ACTIONS_GRACE = 10.0
"""Seconds a stopping console waits for the actions in progress to end (``Console.acting``)."""


class Console:
    """The state of one console application (see the module's invariant)."""

    def __init__(self, settings: Settings, engine: AsyncEngine, accounts: Accounts) -> None:
        self.settings = settings
        self.engine = engine
        self.accounts = accounts
        self.sessions = Sessions()
        self._broker: AbstractRobustConnection | None = None
        self._acting: set[asyncio.Future[None]] = set()
        self._broker_lock = asyncio.Lock()
        self.logins = LoginThrottle()
        self.client_address = ClientAddress(settings.console_trusted_proxies)
        """The client a request counts against (``console_trusted_proxies``)."""
        url = urlsplit(settings.console_url) if settings.console_url else None
        self.secure = url is not None and url.scheme == "https"
        """Whether the session cookie is ``Secure`` (the console is reached over TLS)."""
        self.allowed_hosts = LOCAL_HOSTS | (
            {(url.hostname or "").lower()} if url is not None else set()
        )
        self.origin = None if url is None else origin_of(url)
        """The origin a browser names on a POST (``console_url``'s); None: the request's Host."""

    @property
    def cookie_name(self) -> str:
        """The session cookie's name; ``__Host-`` bound to this host and path when Secure."""
        return "__Host-worker-console" if self.secure else "worker-console"

    def has_session(self, scope: Scope) -> bool:
        """Whether the request of ``scope`` carries a live session's cookie."""
        headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
        for name, value in headers:
            if name == b"cookie":
                cookie = cookie_parser(value.decode("latin-1")).get(self.cookie_name)
                if self.sessions.live(cookie):
                    return True
        return False

    def expected_origin(self, request: Request) -> str:
        """The origin a same-site POST to this console names."""
        if self.origin is not None:
            return self.origin
        return f"{request.url.scheme}://{request.headers.get('host', '')}"

    async def broker(self) -> AbstractRobustConnection:
        """The console's broker connection, made on first use and kept."""
        async with self._broker_lock:
            if self._broker is None or self._broker.is_closed:
                self._broker = await connect(
                    self.settings.amqp_url,
                    name=APPLICATION_NAME,
                    liveness=Liveness.of(self.settings),
                )
            return self._broker

    @contextlib.asynccontextmanager
    async def acting(self) -> AsyncIterator[None]:
        """An action in progress, which ``close`` waits for: a stop that cancels it mid-way
        (uvicorn cancels the requests still running after its grace) still lets it write its
        audit entry before the console closes."""
        ended = asyncio.get_running_loop().create_future()
        self._acting.add(ended)
        try:
            yield
        finally:
            self._acting.discard(ended)
            ended.set_result(None)

    async def close(self) -> None:
        """Wait for the actions in progress (up to ``ACTIONS_GRACE``), and close the broker
        connection, if one was made."""
        if self._acting:
            await asyncio.wait(set(self._acting), timeout=ACTIONS_GRACE)
        if self._broker is not None:
            broker, self._broker = self._broker, None
            await broker.close()


DEFAULT_PORTS = {"http": 80, "https": 443}


def origin_of(url: SplitResult) -> str:
    """The origin a browser names in ``Origin`` for pages of ``url``, as it serializes one:
    scheme and host in lower case, the scheme's default port left out
    (``HTTPS://Console.Example.com:443`` is ``https://console.example.com``)."""
    scheme = url.scheme.lower()
    host = (url.hostname or "").lower()
    if ":" in host:
        host = f"[{host}]"
    port = url.port
    return f"{scheme}://{host}" + ("" if port in (None, DEFAULT_PORTS.get(scheme)) else f":{port}")


def console_of(request: Request) -> Console:
    """The ``Console`` of the application serving ``request``."""
    console: Console = request.app.state.console
    return console
