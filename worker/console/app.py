"""The console as an application of its own: ``create_app``, which ``worker console`` runs.

Invariant: the application serves only a database whose schema is at the code's head (its
startup refuses another) and never starts without a token to log in with (``Accounts.of``).
Every request passes ``worker.ingress.edge.Edge`` (requests in flight, the body's deadline, the
access log) and ``guard.Guard`` (Host, security headers); every page but the login's asks for a
session. There is no OpenAPI document and no interactive docs: nothing is served that a page
does not need.
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
from worker.ingress.edge import Edge
from worker.settings import Settings


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

    app.add_middleware(Guard, console=console)
    edge_settings = dataclasses.replace(
        settings, ingress_allowed_hosts=("*",), max_body_bytes=MAX_FORM_BYTES
    )
    app.add_middleware(Edge, settings=edge_settings)
    return app
