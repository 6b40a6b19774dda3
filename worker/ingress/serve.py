"""``worker serve``: the ingress under uvicorn, in this process's event loop, until stopped.

Invariant: a stop (SIGTERM or SIGINT, through ``worker.ops.cli``) is graceful. uvicorn stops
accepting connections, closes idle keep-alive connections, and lets requests in flight finish
their transactions for up to ``SHUTDOWN_GRACE`` seconds; then the process exits 0. uvicorn's own
signal handling is left out, so the stop comes from the caller's event and the signal is not
raised again after the shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import resource
import socket
from collections.abc import Callable, Iterator, Mapping

import uvicorn
from starlette.types import ASGIApp

from worker import database, schema
from worker.backoff import first, while_starting
from worker.core.router import Router
from worker.errors import ConfigurationError
from worker.ingress.app import APPLICATION_NAME, create_app
from worker.ingress.connections import LimitedH11Protocol, Limits
from worker.ingress.edge import overflow_app
from worker.ingress.routes import exposed
from worker.settings import Settings, redact

log = logging.getLogger(__name__)

SHUTDOWN_GRACE = 10
"""Seconds requests in flight get after a stop. A request's transaction takes milliseconds; only
a client still sending its body is cut off."""

MAX_HEADER_BYTES = 16 * 1024
"""Bytes of a request line and headers h11 buffers at most before it refuses the request (400)."""

BACKLOG = 128
"""Connections the kernel queues before the ingress accepts them, and so the most asyncio accepts
in one turn of the event loop: the connections closed to make room for them close in the next,
so for a moment the process may hold this many more files than its cap."""

SPARE_FILES = 128
"""Open files kept for what is not a client connection: the database pool, logs, the listener,
the connections over the cap being answered 503."""


class _Server(uvicorn.Server):
    """uvicorn's server, stopped by its ``should_exit`` only (the caller handles the signals),
    which sets ``listening`` once it listens."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.listening = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.listening.set()


async def serve(
    settings: Settings,
    router: Router,
    stop: asyncio.Event,
    *,
    started: Callable[[int], object] | None = None,
) -> None:
    """Serve the ingress on ``ingress_host``:``ingress_port`` until ``stop`` is set, then shut
    down gracefully. ``started`` is called with the port bound (a free one for port 0) once it
    listens. Raises ``ConfigurationError`` before listening when the database's schema is behind
    the code."""
    engine = database.create_engine(
        settings, application_name=APPLICATION_NAME, pool_size=settings.ingress_pool_size
    )
    try:
        await while_starting(log, settings.startup_timeout)(
            schema.require_current, engine, settings, router
        )

        def listening(port: int) -> None:
            log.info(
                "serving the ingress for %s on http://%s:%d (database %s)",
                ", ".join(handler.routing_key for handler in served),
                settings.ingress_host,
                port,
                redact(settings.database_url),
            )
            if started is not None:
                started(port)

        served = exposed(router, settings.ingress_routing_keys)
        app = create_app(settings, engine=engine, router=router)
        await serve_app(
            app, settings.ingress_host, settings.ingress_port, stop, listening, settings=settings
        )
    finally:
        await engine.dispose()
    log.info("the ingress stopped")


async def serve_app(
    app: ASGIApp,
    host: str,
    port: int,
    stop: asyncio.Event,
    started: Callable[[int], object] | None = None,
    *,
    settings: Settings | None = None,
    name: str = "ingress",
    port_setting: str = "ingress_port",
    overflow: Callable[[ASGIApp], ASGIApp] | None = None,
    headers: Mapping[str, str] | None = None,
) -> None:
    """Serve ``app`` under uvicorn as ``worker serve`` does (HTTP/1.1 by h11, no uvicorn access
    log, no ``Server`` header, forwarded headers not trusted, the connection bounds of
    ``settings``: see ``worker.ingress.connections``) until ``stop`` is set, then shut down
    gracefully; ``started`` gets the port bound once it listens. ``name`` and ``port_setting``
    (the setting of its port) are what a failure to start names; ``overflow`` answers a
    connection over the cap (default: ``edge.overflow_app``), and ``headers`` go on the 400 the
    protocol sends for a request it cannot parse."""
    settings = Settings() if settings is None else settings
    limits = Limits(
        max_connections=open_files_allow(settings.ingress_max_connections),
        header_timeout=settings.ingress_header_timeout,
        overflow_app=overflow_app(settings) if overflow is None else overflow,
        headers=tuple((name.encode(), value.encode()) for name, value in (headers or {}).items()),
    )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="none",
        http=LimitedH11Protocol.limited(limits),
        timeout_keep_alive=math.ceil(settings.ingress_keep_alive),
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        backlog=BACKLOG,
        lifespan="on",
        log_config=None,
        access_log=False,
        server_header=False,
        proxy_headers=False,
        timeout_graceful_shutdown=SHUTDOWN_GRACE,
    )
    server = _Server(config)
    task = asyncio.create_task(_serving(server, name, port_setting), name=name)
    await first(server.listening.wait(), asyncio.shield(task))
    if server.started:
        if started is not None:
            started(int(server.servers[0].sockets[0].getsockname()[1]))
        await first(stop.wait(), asyncio.shield(task))
        server.should_exit = True
    await task


def open_files_allow(connections: int) -> int:
    """``connections``, or fewer if the process may not open that many files: the soft limit of
    open files is raised to the hard one when that is needed, and beyond it the cap is lowered
    (with a warning) so that a flood meets the cap, never "Too many open files"."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = connections + connections // 8 + BACKLOG + SPARE_FILES
    if soft != resource.RLIM_INFINITY and soft < needed:
        raised = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return connections
    allowed = max(1, (soft - BACKLOG - SPARE_FILES) * 8 // 9)
    log.warning(
        "ingress_max_connections is %d, but the process may open %d files: serving %d "
        "connections at most (raise `ulimit -n`)",
        connections,
        soft,
        allowed,
    )
    return allowed


async def _serving(server: uvicorn.Server, name: str, port_setting: str) -> None:
    """``server.serve()``, whose failure to start (it calls ``sys.exit``: a port taken, the
    application's startup refused) becomes a ``ConfigurationError`` instead of a ``SystemExit``
    that would leave the event loop at once."""
    try:
        await server.serve()
    except SystemExit as exc:
        raise ConfigurationError(
            f"the {name} did not start (uvicorn exited with {exc.code}): see the log above; "
            f"a port another process holds is changed with WORKER_{port_setting.upper()} "
            f"(--{port_setting.replace('_', '-')})"
        ) from None
