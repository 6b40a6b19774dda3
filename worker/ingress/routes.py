"""The ingress's routes: ``POST /messages/{routing_key}`` and ``GET /messages/{routing_key}/{key}``
for every routing key of a router, as a FastAPI ``APIRouter`` to mount anywhere.

Invariant: nothing is stored before every check a consumer would make has passed, in this order:
the bearer token (401), the routing key (404), the Idempotency-Key (400, ``.`` and ``..``
included: their status URL would be another path), the declared content
type (415), the body's size (413, before it is read past the limit), its JSON (400) and its
validation against the handler's body type (422); then the request and its event are recorded in
one transaction (202), or a retry answered as the first was. Every refusal is problem+json.

Defaults deny: without ``ingress_routing_keys`` the ingress serves only the routing keys no
handler declares it publishes (``publishes=``), so the worker's own events cannot be posted. A
request speaks for the client of its token (``auth``), and reads back only its own requests.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from http import HTTPStatus
from urllib.parse import quote

from fastapi import APIRouter, Security
from fastapi.security import HTTPBearer
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.convertors import PathConvertor, register_url_convertor
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from worker import logs
from worker.core.handler import Handler
from worker.core.keyspace import handler_key
from worker.core.router import Router
from worker.errors import ConfigurationError, Fault, InvalidKey, NoHandler, Rejected, classify
from worker.ingress import schemas
from worker.ingress.accepting import accept, outcome
from worker.ingress.auth import Tokens
from worker.ingress.problems import (
    Problem,
    internal_error,
    unavailable,
    unknown_message,
)
from worker.ingress.reading import check_client_key, client_key, read_envelope
from worker.settings import Settings

log = logging.getLogger(__name__)

Endpoint = Callable[[Request], Awaitable[Response]]

REPLAYED_HEADER = "Idempotent-Replayed"
"""Set to ``true`` on the answer to a retry: the request had been accepted before."""


class _KeyConvertor(PathConvertor):
    """A key in a path: anything after the routing key's segment, a ``/`` or a line break
    (``%0A``) included (Starlette's ``path`` stops at a line break, and the request would miss
    every route: no problem+json 404)."""

    regex = "(?s:.*)"


KEY_CONVERTOR = "worker_key"
register_url_convertor(KEY_CONVERTOR, _KeyConvertor())

_SERVABLE_ROUTING_KEY = re.compile(r"[A-Za-z0-9._~!$&'()*+,;=:@-]+")
"""A routing key that is a path segment as it is (RFC 3986's ``pchar``, no ``%``)."""


def ingress_router(settings: Settings, *, engine: AsyncEngine, router: Router) -> APIRouter:
    """The ingress's routes for the routing keys of ``router`` it serves (``exposed``), on
    ``engine`` (which the caller owns: create it with ``worker.database.create_engine`` and
    dispose of it at shutdown).

    Mount it with ``app.include_router(ingress_router(...))``, under a prefix if you like; the
    ``Location`` of an accepted message follows the prefix. The routes check their bearer
    tokens themselves (``ingress_tokens``) and answer every refusal as problem+json, whatever the
    application's own exception handlers.
    """
    tokens = Tokens(settings.ingress_tokens)
    documented = (
        [Security(HTTPBearer(auto_error=False, description="one of ingress_tokens"))]
        if tokens.required
        else []
    )
    api = APIRouter(tags=["messages"])
    handlers = exposed(router, settings.ingress_routing_keys)
    withheld = sorted(set(router.routing_keys()) - {handler.routing_key for handler in handlers})
    if withheld and not settings.ingress_routing_keys:
        log.info(
            "ingress_routing_keys is not set: serving %s; not %s, which handlers publish",
            ", ".join(handler.routing_key for handler in handlers),
            ", ".join(withheld),
        )
    for handler in handlers:
        routing_key = servable(handler.routing_key)
        api.add_api_route(
            f"/messages/{routing_key}",
            _post(handler, router, settings, engine, tokens),
            methods=["POST"],
            name=f"post {routing_key}",
            summary=f"Send a {routing_key} message",
            description=f"Handled by `{handler.name}` ({handler.kind.value}).",
            status_code=HTTPStatus.ACCEPTED,
            response_class=JSONResponse,
            responses=schemas.POST_RESPONSES,
            openapi_extra=schemas.post_documentation(handler),
            dependencies=documented,
        )
        api.add_api_route(
            f"/messages/{routing_key}/{{key:{KEY_CONVERTOR}}}",
            _get(handler, engine, tokens),
            methods=["GET"],
            name=f"get {routing_key}",
            summary=f"What became of a {routing_key} message",
            response_class=JSONResponse,
            responses=schemas.GET_RESPONSES,
            openapi_extra=schemas.GET_DOCUMENTATION,
            dependencies=documented,
        )
    unknown = _unknown_routing_key(tokens)
    api.add_api_route("/messages/{routing_key}", unknown, methods=["POST"], include_in_schema=False)
    api.add_api_route(
        f"/messages/{{routing_key}}/{{key:{KEY_CONVERTOR}}}",
        unknown,
        methods=["GET"],
        include_in_schema=False,
    )
    # (a path under /messages that names no routing key: ``/messages``, ``/messages/``)
    api.add_api_route("/messages", unknown, methods=["GET", "POST"], include_in_schema=False)
    api.add_api_route("/messages/", unknown, methods=["GET", "POST"], include_in_schema=False)
    return api


def exposed(router: Router, routing_keys: Sequence[str]) -> list[Handler]:
    """The handlers the ingress serves, by routing key: those of ``routing_keys``; when it is
    empty, those of every routing key of ``router`` that no handler declares it publishes (its
    events are the worker's own). A ``ConfigurationError`` for a listed key no handler serves,
    or when nothing is left to serve."""
    if routing_keys:
        unknown = [key for key in routing_keys if router.find(key) is None]
        if unknown:
            raise ConfigurationError(
                f"ingress_routing_keys names {', '.join(map(repr, unknown))}, which no handler "
                f"module serves (they serve: {', '.join(router.routing_keys()) or 'nothing'})"
            )
        return [handler for key in sorted(set(routing_keys)) if (handler := router.find(key))]
    published = published_routing_keys(router)
    served = [key for key in router.routing_keys() if key not in published]
    if not served:
        raise ConfigurationError(
            "the ingress has no routing key to serve: every one the handler modules serve is "
            "one a handler publishes (the worker's own events); name those clients may post "
            "in ingress_routing_keys"
        )
    return [handler for key in served if (handler := router.find(key))]


def published_routing_keys(router: Router) -> set[str]:
    """The routing keys of the events ``router``'s handlers declare they publish."""
    return {key for handler in router.handlers() for key, _ in handler.publishes}


def servable(routing_key: str) -> str:
    """``routing_key``, which must be a URL path segment as it is; a ``ConfigurationError``
    naming it otherwise (a handler whose key the ingress cannot serve must not be skipped)."""
    if not _SERVABLE_ROUTING_KEY.fullmatch(routing_key):
        raise ConfigurationError(
            f"routing key {routing_key!r} cannot be a URL path segment: the ingress serves "
            "routing keys of letters, digits and -._~!$&'()*+,;=:@ only"
        )
    return routing_key


def _post(
    handler: Handler, router: Router, settings: Settings, engine: AsyncEngine, tokens: Tokens
) -> Endpoint:
    async def post(request: Request) -> Response:
        try:
            client = tokens.check(request)
            key = addressable(client_key(request, handler.routing_key))
            envelope = await read_envelope(
                request, router, handler.routing_key, handler_key(client, key), settings
            )
            accepted = await accept(engine, envelope, client, key, exchange=settings.exchange)
        except Exception as exc:
            return _refusal(exc, request)
        status_url = f"{quote(request.url.path)}/{quote(key, safe='')}"
        body = {
            "status_url": status_url,
            "message_id": str(accepted.message_id),
            "routing_key": handler.routing_key,
            "key": key,
            "handler_key": envelope.key,
        }
        headers = {"Location": status_url, "Cache-Control": "no-store"}
        if not accepted.new:
            headers[REPLAYED_HEADER] = "true"
        return JSONResponse(body, status_code=HTTPStatus.ACCEPTED, headers=headers)

    return post


DOT_SEGMENTS = frozenset({".", ".."})
"""Keys a status URL cannot name: as its last segment, a client resolves them to another path
(``/messages/a/..`` is ``/messages/``), and percent-encoded they are the same to a browser
(WHATWG's URL reads ``%2e`` as ``.``)."""


def addressable(key: str) -> str:
    """``key``, whose status URL (its ``Location``) is the request's own; ``InvalidKey`` for a
    key that is a dot segment."""
    if key in DOT_SEGMENTS:
        raise InvalidKey(f"Idempotency-Key {key!r} cannot name a status URL: choose another")
    return key


def _get(handler: Handler, engine: AsyncEngine, tokens: Tokens) -> Endpoint:
    async def get(request: Request) -> Response:
        try:
            client = tokens.check(request)
            key = _path_key(request)
            found = await outcome(engine, handler.name, client, key) if key is not None else None
        except Exception as exc:
            return _refusal(exc, request)
        if found is None:
            return unknown_message().response(request.url.path)
        return JSONResponse(found.to_json(), headers={"Cache-Control": "no-store"})

    return get


def _path_key(request: Request) -> str | None:
    """The key a GET names, if a client's key passes the check (a key it refuses was never
    accepted: None)."""
    try:
        return check_client_key(request.path_params["key"])
    except Rejected:
        return None


def _unknown_routing_key(tokens: Tokens) -> Endpoint:
    async def unknown(request: Request) -> Response:
        try:
            tokens.check(request)
        except Problem as problem:
            return problem.response(request.url.path)
        routing_key = request.path_params.get("routing_key", "")
        refused = NoHandler(f"no handler serves routing key {routing_key!r}")
        return Problem.of(refused).response(request.url.path)

    return unknown


def _refusal(exc: Exception, request: Request) -> Response:
    """The problem that answers ``exc``: its own, a refused message's, 503 when the database is
    unreachable or not migrated (logged), 500 for anything else (logged with its traceback)."""
    if isinstance(exc, Problem):
        return exc.response(request.url.path)
    if isinstance(exc, Rejected):
        return Problem.of(exc).response(request.url.path)
    fault = classify(exc)
    path = logs.printable(request.url.path)  # (a decoded path may hold any character)
    if fault is Fault.PERMANENT:
        log.error("ingress: %s %s failed", request.method, path, exc_info=exc)
        return internal_error().response(request.url.path)
    log.warning("ingress: %s %s: %s failure: %r", request.method, path, fault.value, exc)
    return unavailable().response(request.url.path)
