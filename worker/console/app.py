"""The console as an application of its own: ``create_app``, which ``worker console`` runs.

Invariant: the application serves only a database whose schema is at the code's head (its
startup refuses another) and never starts without a token to log in with (``Accounts.of``).
Every request passes ``guard.Guard`` (Host, security headers, on every answer, the edge's
own included) and then ``worker.ingress.edge.Edge`` (requests in flight, the body's deadline,
the access log); every page but the login's asks for a session. A request without a live
session's cookie takes a slot of its own pool (``UNTRUSTED_REQUESTS``, ``PER_ADDRESS`` of one
client address), never one of the ``ingress_max_requests`` logged-in requests', and its body
has the time its declared size needs (``FORM_BODY_FLOOR`` plus ``FORM_BODY_RATE``), so no
number of slow, anonymous clients takes a logged-in operator's capacity. There is no OpenAPI
document and no interactive docs: nothing is served that a page does not need.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from http import HTTPStatus
from importlib.resources import files

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.staticfiles import StaticFiles

from worker import database, schema
from worker.console.accounts import Accounts
from worker.console.guard import MAX_FORM_BYTES, Guard, LoginRequired
from worker.console.pages import NAV, ROUTERS
from worker.console.state import APPLICATION_NAME, POOL_SIZE, Console
from worker.console.templating import render
from worker.ingress.edge import BodyDeadline, Edge, Pools
from worker.settings import Settings

UNTRUSTED_REQUESTS = 16
"""Requests without a live session (the login's, anyone's) in flight at once; more are 503."""
PER_ADDRESS = 4
"""Of those, the requests of one client address (``console_trusted_proxies``)."""
FORM_BODY_FLOOR = 2.0
"""Seconds any form's body has, on top of its size at ``FORM_BODY_RATE``."""
FORM_BODY_RATE = 16 * 1024
"""Bytes per second a form's body must arrive at, at the least (``MAX_FORM_BYTES``: 18 s)."""


def create_app(settings: Settings, *, engine: AsyncEngine | None = None) -> FastAPI:
    """The console for ``settings``'s database and broker. Without ``engine``, it makes one
    (``POOL_SIZE`` connections) and disposes of it at shutdown. Raises ``ConfigurationError``
    when no console token is configured."""
    accounts = Accounts.of(settings)
    owned = engine is None
    if engine is None:
        engine = database.create_engine(
            settings, application_name=APPLICATION_NAME, pool_size=POOL_SIZE
        )
    console = Console(settings, engine, accounts)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            await schema.require_current(console.engine, settings, None)
            yield
        finally:
            await console.close()
            if owned:
                await console.engine.dispose()

    app = FastAPI(
        title="worker console",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.console = console
    app.state.nav = NAV
    for router in ROUTERS:
        app.include_router(router)
    app.mount("/static", StaticFiles(directory=str(files("worker.console") / "static")), "static")

    @app.get("/", include_in_schema=False)
    async def home() -> Response:
        return RedirectResponse(NAV[0][1], HTTPStatus.SEE_OTHER)

    @app.exception_handler(LoginRequired)
    async def login_required(request: Request, exc: LoginRequired) -> Response:
        return RedirectResponse(exc.path, HTTPStatus.SEE_OTHER)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        return render(request, "error.html", status=exc.status_code, message=str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        return render(
            request,
            "error.html",
            status=HTTPStatus.BAD_REQUEST,
            message="the request's parameters are not valid",
        )

    edge_settings = dataclasses.replace(
        settings, ingress_allowed_hosts=("*",), max_body_bytes=MAX_FORM_BYTES
    )
    app.add_middleware(
        Edge,
        settings=edge_settings,
        pools=Pools(settings.ingress_max_requests, UNTRUSTED_REQUESTS, PER_ADDRESS),
        trusted=console.has_session,
        address=console.client_address,
        deadline=BodyDeadline(settings.ingress_body_timeout, FORM_BODY_FLOOR, FORM_BODY_RATE),
    )
    app.add_middleware(Guard, console=console)  # (the outermost: its headers go on every answer)
    return app
