"""The ingress as an application of its own: ``create_app``, which ``worker serve`` runs.

Invariant: the application serves only a database whose schema is at the code's head (its
startup refuses another), and disposes of the engine it created, never of one it was given.
``/healthz`` asks no token and answers from a probe at most ``HEALTH_TTL`` old, so however often
it is asked, it holds at most one database connection at a time. Every request passes the edge
first (``worker.ingress.edge``: Host check, requests in flight, the body read within its deadline,
the access log).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.responses import JSONResponse

from worker import database, schema
from worker.core.router import Router
from worker.ingress.edge import Edge
from worker.ingress.routes import ingress_router
from worker.ops.plugins import load_routers
from worker.settings import Settings

APPLICATION_NAME = "worker-ingress"
"""The ``application_name`` of the ingress's database connections."""

HEALTH_TTL = 1.0
"""Seconds a ``/healthz`` answer is reused for."""


def create_app(
    settings: Settings | None = None,
    *,
    engine: AsyncEngine | None = None,
    router: Router | None = None,
) -> FastAPI:
    """The ingress: ``POST``/``GET`` ``/messages/...`` for every routing key of ``router``
    (default: the handler modules of ``settings.handlers`` and the installed entry points),
    OpenAPI at ``/docs``, and ``/healthz``, behind ``worker.ingress.edge.Edge``.

    Without ``engine``, the application makes one (``ingress_pool_size`` connections) and
    disposes of it at shutdown; an ``engine`` given stays the caller's. ``settings`` default to
    the ``WORKER_*`` environment. At startup it refuses (raises ``ConfigurationError``) a
    database whose migrations are behind the code.
    """
    settings = Settings.load() if settings is None else settings
    if router is None:
        router = load_routers(settings.handlers, include_installed=settings.installed_handlers)
    owned = engine is None
    if engine is None:
        engine = database.create_engine(
            settings, application_name=APPLICATION_NAME, pool_size=settings.ingress_pool_size
        )
    serving = engine

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            await schema.require_current(serving, settings, router)
            yield
        finally:
            if owned:
                await serving.dispose()

    app = FastAPI(
        title="worker ingress",
        summary="Messages for the worker's handlers, over HTTP, each accepted once per key.",
        version="1",
        lifespan=lifespan,
        docs_url="/docs",
        redoc_url=None,
    )
    app.include_router(ingress_router(settings, engine=engine, router=router))
    app.add_middleware(Edge, settings=settings)
    health = DatabaseHealth(engine)

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> JSONResponse:
        healthy = await health.check()
        body = {"status": "ok" if healthy else "failing", "database": healthy}
        return JSONResponse(body, status_code=200 if healthy else 503)

    return app


class DatabaseHealth:
    """Whether PostgreSQL answers ``SELECT 1`` (``database.probe``), asked at most once per
    ``HEALTH_TTL``; concurrent checks share one probe."""

    def __init__(self, engine: AsyncEngine, ttl: float = HEALTH_TTL) -> None:
        self.engine = engine
        self.ttl = ttl
        self._healthy = False
        self._expires = 0.0
        self._lock = asyncio.Lock()

    async def check(self) -> bool:
        async with self._lock:
            if time.monotonic() >= self._expires:
                try:
                    await database.probe(self.engine)
                    self._healthy = True
                except Exception:
                    self._healthy = False
                self._expires = time.monotonic() + self.ttl
            return self._healthy
