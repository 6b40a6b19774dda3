"""What every request to the console passes, and what a page declares it needs.

``Guard`` (ASGI middleware) refuses a ``Host`` the console does not serve (against DNS
rebinding: localhost's names and ``console_url``'s host only) and a query string carrying a NUL
character (as ``read_form`` refuses a form that does: PostgreSQL's text holds none, and a
statement given one fails), and sets the security headers on
every answer: a Content-Security-Policy that lets the pages load only the console's own script
and style (no inline script, no other origin), no framing, no sniffing, no referrer sent to
another origin, no caching. A route that fails is answered by ``failed``'s page, never a bare
500 without those headers; ``Guard`` is the outermost layer, so the edge's 408 and 503 carry
them too, and ``secured`` puts them on what answers a connection over the cap.

A page's route takes a ``Viewer`` parameter to be seen by any logged-in user, or an
``OperatorAction`` for a POST that changes something. Invariant of the latter: the
action runs only for a live session, a POST from the console's own origin (``Origin`` and
``Sec-Fetch-Site`` checked when the browser sends them) carrying the session's CSRF token, and an
operator; each refusal is a 403 (written to the audit, who tried what), never a partial action.
A form body is read whole up to ``MAX_FORM_BYTES`` (``worker.ingress.edge`` has already bounded
the time and the requests in flight).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Annotated
from urllib.parse import parse_qs, quote

from fastapi import Depends, HTTPException
from starlette.datastructures import MutableHeaders
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from worker import logs
from worker.console import audit
from worker.console.sessions import Session
from worker.console.state import Console, console_of
from worker.console.templating import render
from worker.errors import innermost, unreachable_service
from worker.ingress.edge import host_allowed

log = logging.getLogger(__name__)

MAX_FORM_BYTES = 256 * 1024
"""Bytes a form's body may have (a selection of a thousand dead letters' ids fits)."""
MAX_FORM_FIELDS = 5000
MAX_ID = 2**63 - 1
"""The largest id a page's path, query or form may name: a ``BIGINT``'s. PostgreSQL refuses a
larger parameter outright, so a larger id is refused (400) before it reaches a statement."""
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
SECURITY_HEADERS = {
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    # (not no-referrer: under it a browser names the origin of the console's own form POSTs
    # `null`, and same_origin refuses them)
    "referrer-policy": "same-origin",
    "cache-control": "no-store",
    "cross-origin-opener-policy": "same-origin",
}


class Guard:
    """The middleware in front of every console route (see the module's docstring)."""

    def __init__(self, app: ASGIApp, console: Console) -> None:
        self.app = app
        self.console = console

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        started = False

        async def secured(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                _secure(message)
            await send(message)

        if not host_allowed(scope, frozenset(self.console.allowed_hosts)):
            await _refuse(secured, send, b"this Host is not served; set WORKER_CONSOLE_URL\n")
            return
        if _NUL in scope.get("query_string", b"").lower():
            await _refuse(secured, send, b"a NUL character is no value the console takes\n")
            return
        try:
            await self.app(scope, receive, secured)
        except Exception as exc:
            if started:
                raise
            await failed(scope, exc)(scope, receive, secured)


def secured(app: ASGIApp) -> ASGIApp:
    """``app`` with the security headers on every answer it starts (what serves a connection
    over the cap, before ``Guard`` could)."""

    async def securing(scope: Scope, receive: Receive, send: Send) -> None:
        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                _secure(message)
            await send(message)

        await app(scope, receive, sending)

    return securing


def _secure(start: Message) -> None:
    """Set the security headers on an ``http.response.start`` message."""
    headers = MutableHeaders(scope=start)
    for name, value in SECURITY_HEADERS.items():
        headers[name] = value


def failed(scope: Scope, exc: Exception) -> Response:
    """The page that answers a request whose route raised ``exc`` (logged here): a 503 that
    names the service it could not reach (PostgreSQL down: every page but the overview, which
    says so itself), else a 500 that points to the log; with the security headers, like every
    other answer."""
    request = Request(scope)
    where = f"{request.method} {logs.printable(request.url.path)[:200]}"
    service = unreachable_service(exc)
    if service is None:
        log.error("console: %s failed", where, exc_info=exc)
        return render(
            request,
            "error.html",
            status=HTTPStatus.INTERNAL_SERVER_ERROR,
            message="the console failed to answer: its log has the error",
        )
    why = logs.describe_error(innermost(exc))
    log.warning("console: %s: %s cannot be reached (%s)", where, service.value, why)
    return render(
        request,
        "error.html",
        status=HTTPStatus.SERVICE_UNAVAILABLE,
        message=f"{service.value} cannot be reached ({why}): try again when it is back",
    )


_NUL = b"%00"
"""A NUL character in a query string: PostgreSQL's text cannot hold one, so a value carrying it
is refused here (400) rather than fail its statement (a bare 500)."""


async def _refuse(start: Send, send: Send, why: bytes) -> None:
    """Answer 400 with ``why`` as plain text (its start through ``start``, the security
    headers')."""
    await start(
        {
            "type": "http.response.start",
            "status": HTTPStatus.BAD_REQUEST,
            "headers": [(b"content-type", b"text/plain; charset=utf-8")],
        }
    )
    await send({"type": "http.response.body", "body": why})


class LoginRequired(Exception):
    """A page asked for by a browser without a live session."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.path = path


@dataclass(frozen=True)
class Form:
    """A POSTed form's fields (``application/x-www-form-urlencoded``), each with its values."""

    fields: Mapping[str, list[str]]

    def one(self, name: str, default: str | None = None) -> str | None:
        """The field's first value, or ``default``."""
        values = self.fields.get(name)
        return values[0] if values else default

    def all(self, name: str) -> list[str]:
        """Every value of the field, in order."""
        return list(self.fields.get(name, []))


@dataclass(frozen=True)
class Action:
    """An operator's POST that passed every check: its session and its form."""

    session: Session
    form: Form


def session_of(request: Request) -> Session | None:
    """The live session of ``request``'s cookie, kept in ``request.state.session``."""
    console = console_of(request)
    session = console.sessions.find(request.cookies.get(console.cookie_name))
    request.state.session = session
    return session


async def viewer(request: Request) -> Session:
    """Dependency: the logged-in user's session (any role); a browser without one is sent to
    the login page (a GET) or refused 401."""
    session = session_of(request)
    if session is None:
        if request.method in ("GET", "HEAD"):
            raise LoginRequired(login_path(request))
        raise HTTPException(HTTPStatus.UNAUTHORIZED, "log in first")
    return session


def login_path(request: Request) -> str:
    """``/login`` with this request's path and query to come back to."""
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return "/login?next=" + quote(target, safe="")


async def read_form(request: Request) -> Form:
    """The request's form, read whole; 413 past ``MAX_FORM_BYTES``, 415 for another type, 400
    for one that is not UTF-8 or carries a NUL character."""
    kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if kind != "application/x-www-form-urlencoded":
        raise HTTPException(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, "send a form")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise HTTPException(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "the form is too large")
    try:
        fields = parse_qs(
            body.decode("utf-8"),
            keep_blank_values=True,
            max_num_fields=MAX_FORM_FIELDS,
            errors="strict",
        )
    except (UnicodeDecodeError, ValueError):
        raise HTTPException(HTTPStatus.BAD_REQUEST, "the form cannot be read") from None
    if any("\x00" in value for values in fields.values() for value in values):
        raise HTTPException(HTTPStatus.BAD_REQUEST, "a NUL character is no value the console takes")
    return Form(fields)


def same_origin(request: Request) -> bool:
    """False when the browser says the request comes from another site (``Sec-Fetch-Site``) or
    another origin (``Origin``); True when it says neither (the CSRF token then decides)."""
    site = request.headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        return False
    origin = request.headers.get("origin")
    return origin is None or origin == console_of(request).expected_origin(request)


async def operator_action(request: Request) -> Action:
    """Dependency of every POST that changes something (see the module's invariant)."""
    session = session_of(request)
    if session is None:
        raise HTTPException(HTTPStatus.UNAUTHORIZED, "log in first")
    form = await read_form(request)
    action = request.url.path
    if not same_origin(request) or not session.csrf_matches(form.one("csrf")):
        await audit.refused(console_of(request), session, action, "no valid CSRF token")
        raise HTTPException(HTTPStatus.FORBIDDEN, "refused: the form's CSRF token is missing")
    if not session.user.may_act:
        await audit.refused(console_of(request), session, action, "read-only user")
        raise HTTPException(HTTPStatus.FORBIDDEN, "refused: this user may only look")
    return Action(session, form)


Viewer = Annotated[Session, Depends(viewer)]
"""A route parameter: the logged-in user's session (any role)."""
OperatorAction = Annotated[Action, Depends(operator_action)]
"""A route parameter: an operator's checked POST (see ``operator_action``)."""
