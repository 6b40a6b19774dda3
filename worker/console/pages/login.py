"""``/login`` and ``/logout``: a token in, a session cookie out, and back.

Invariant: the login form is protected against login CSRF by a double-submitted random value
(a cookie of its own and a hidden field, equal, compared as bytes whatever characters a client
sends); failed logins are throttled by ``worker.console.throttle`` (429); the token is never
echoed, logged or kept (the session keeps the user's name and role only); ``next`` leads only
to a path of this console.
"""

from __future__ import annotations

import hmac
import secrets
from http import HTTPStatus

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from worker.console import audit
from worker.console.guard import Viewer, read_form, same_origin, session_of
from worker.console.state import console_of
from worker.console.templating import render

router = APIRouter()

LOGIN_COOKIE = "worker-console-login"
"""The cookie holding the login form's double-submitted value."""


def _next(target: str | None) -> str:
    """``target`` when it is a path of this console, else ``/``."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target


def _same(sent: str, kept: str) -> bool:
    """Whether the form's value is the cookie's, in constant time (as bytes: ``compare_digest``
    refuses a ``str`` that is not ASCII)."""
    return hmac.compare_digest(sent.encode("utf-8", "replace"), kept.encode("utf-8", "replace"))


def _login_page(
    request: Request,
    *,
    error: str | None = None,
    status: int = 200,
    next_path: str | None = None,
) -> Response:
    """The login form; its ``next`` is ``next_path`` (a refused login's own) or the query's."""
    value = secrets.token_urlsafe(32)
    response = render(
        request,
        "login.html",
        status=status,
        login_csrf=value,
        next=_next(request.query_params.get("next") if next_path is None else next_path),
        error=error,
    )
    response.set_cookie(
        LOGIN_COOKIE,
        value,
        httponly=True,
        samesite="strict",
        secure=console_of(request).secure,
        path="/login",
    )
    return response


@router.get("/login")
async def login_form(request: Request) -> Response:
    if session_of(request) is not None:
        return RedirectResponse(_next(request.query_params.get("next")), HTTPStatus.SEE_OTHER)
    return _login_page(request)


@router.post("/login")
async def login(request: Request) -> Response:
    console = console_of(request)
    address = console.client_address(request.scope)
    if not console.logins.allowed(address):
        return _login_page(
            request,
            error="Too many failed logins: wait a minute.",
            status=HTTPStatus.TOO_MANY_REQUESTS,
        )
    form = await read_form(request)
    sent, kept = form.one("login_csrf") or "", request.cookies.get(LOGIN_COOKIE) or ""
    if not same_origin(request) or not kept or not _same(sent, kept):
        return _login_page(
            request,
            error="The form expired: log in again.",
            status=HTTPStatus.FORBIDDEN,
            next_path=form.one("next"),
        )
    user = console.accounts.user(form.one("token") or "")
    if user is None:
        console.logins.failed(address)
        return _login_page(
            request,
            error="That token is not accepted.",
            status=HTTPStatus.UNAUTHORIZED,
            next_path=form.one("next"),
        )
    console.logins.succeeded(address)
    cookie, _ = console.sessions.start(user)
    await audit.record(console, user, "login", "", 0, "done")
    response = RedirectResponse(_next(form.one("next")), HTTPStatus.SEE_OTHER)
    response.set_cookie(
        console.cookie_name,
        cookie,
        httponly=True,
        samesite="strict",
        secure=console.secure,
        path="/",
    )
    response.delete_cookie(LOGIN_COOKIE, path="/login")
    return response


@router.post("/logout")
async def logout(request: Request, session: Viewer) -> Response:
    console = console_of(request)
    form = await read_form(request)
    if same_origin(request) and session.csrf_matches(form.one("csrf")):
        console.sessions.end(request.cookies.get(console.cookie_name))
        await audit.record(console, session.user, "logout", "", 0, "done")
    response = RedirectResponse("/login", HTTPStatus.SEE_OTHER)
    return response
