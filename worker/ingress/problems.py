"""Every refusal of the HTTP ingress as an RFC 9457 problem (``application/problem+json``).

Invariant: a refusal's status and ``type`` are decided here, in one table, from the same
``Rejected`` reasons the worker parks a message with, so a body the ingress refuses with a reason
is one the consumer would dead-letter with that reason, and a client can branch on ``type``.
Nothing a problem carries repeats the refused input: validation errors say where and why, never
the value.
"""

from __future__ import annotations

from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

from pydantic import ValidationError
from starlette.responses import JSONResponse

from worker.errors import (
    BodyTooDeep,
    BodyTooLarge,
    InvalidBody,
    InvalidKey,
    KeyReused,
    MissingKey,
    NoHandler,
    Rejected,
    UndecodableBody,
)

PROBLEM_JSON = "application/problem+json"

TYPE_PREFIX = "urn:rabbit-outbox-worker:problem:"
"""A problem's ``type`` is this prefix and a reason: the worker's dead-letter reason when there
is one (``invalid``, ``key-reused``, ...), else one of the ingress's own (``unauthorized``...)."""

MAX_VALIDATION_ERRORS = 50
"""Validation errors a 422 lists at most (``errors_total`` says how many there were)."""

REFUSALS: Mapping[type[Rejected], tuple[HTTPStatus, str]] = {
    MissingKey: (HTTPStatus.BAD_REQUEST, "Idempotency-Key is missing"),
    InvalidKey: (HTTPStatus.BAD_REQUEST, "Idempotency-Key is not a valid key"),
    NoHandler: (HTTPStatus.NOT_FOUND, "No handler serves this routing key"),
    BodyTooLarge: (HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "The body is too large"),
    UndecodableBody: (HTTPStatus.BAD_REQUEST, "The body is not UTF-8 JSON"),
    BodyTooDeep: (HTTPStatus.BAD_REQUEST, "The body nests JSON too deeply"),
    InvalidBody: (HTTPStatus.UNPROCESSABLE_ENTITY, "The body fails the handler's validation"),
    # (the title of draft-ietf-httpapi-idempotency-key-header for a key reused with another body)
    KeyReused: (HTTPStatus.UNPROCESSABLE_ENTITY, "Idempotency-Key is already used"),
}
"""The status and title of each refusal a ``Rejected`` describes."""


class Problem(Exception):
    """A refusal the ingress answers with ``application/problem+json``."""

    def __init__(
        self,
        status: HTTPStatus,
        reason: str,
        title: str,
        detail: str,
        *,
        headers: Mapping[str, str] | None = None,
        **members: Any,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.reason = reason
        self.title = title
        self.detail = detail
        self.headers = dict(headers or {})
        self.members = members

    @classmethod
    def of(cls, rejected: Rejected) -> Problem:
        """The problem that answers ``rejected``: its status and title from ``REFUSALS``, its
        reason as the type, its message as the detail, and the validation errors of a 422."""
        status, title = REFUSALS[type(rejected)]
        members: dict[str, Any] = {}
        if isinstance(rejected, InvalidBody) and isinstance(rejected.__cause__, ValidationError):
            errors = rejected.__cause__.errors(
                include_url=False, include_input=False, include_context=False
            )
            members["errors"] = [
                {"loc": list(error["loc"]), "msg": error["msg"], "type": error["type"]}
                for error in errors[:MAX_VALIDATION_ERRORS]
            ]
            members["errors_total"] = len(errors)
        headers = {"Connection": "close"} if isinstance(rejected, BodyTooLarge) else None
        return cls(status, rejected.reason, title, str(rejected), headers=headers, **members)

    def response(self, instance: str | None = None) -> JSONResponse:
        """This problem as a response; ``instance`` names the resource refused, if any."""
        body: dict[str, Any] = {
            "type": TYPE_PREFIX + self.reason,
            "title": self.title,
            "status": self.status.value,
            "detail": self.detail,
        }
        if instance is not None:
            body["instance"] = instance
        body.update(self.members)
        return JSONResponse(
            body,
            status_code=self.status.value,
            media_type=PROBLEM_JSON,
            headers={"Cache-Control": "no-store", **self.headers},
        )


def unauthorized() -> Problem:
    """No bearer token, or one the ingress does not accept."""
    return Problem(
        HTTPStatus.UNAUTHORIZED,
        "unauthorized",
        "Authentication required",
        "send Authorization: Bearer <token> with a token the ingress accepts",
        headers={"WWW-Authenticate": 'Bearer realm="worker"'},
    )


def unsupported_media_type(content_type: str | None) -> Problem:
    """A body not declared as JSON. (Requiring the declaration also keeps browsers from posting
    to the ingress from other sites without asking first: JSON is no form encoding.)"""
    return Problem(
        HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
        "unsupported-media-type",
        "The body must be JSON",
        f"content type {content_type!r}: send Content-Type: application/json",
    )


def unknown_message() -> Problem:
    """A GET of a key that neither the ingress nor the inbox knows."""
    return Problem(
        HTTPStatus.NOT_FOUND,
        "unknown-message",
        "No message with this key",
        "neither an accepted request nor a handled message has this key (or it expired)",
    )


def unavailable() -> Problem:
    """The database did not answer, or is not as the code expects: the request's transaction did
    not commit, and the same request (same key) may be sent again."""
    return Problem(
        HTTPStatus.SERVICE_UNAVAILABLE,
        "unavailable",
        "The ingress cannot reach its database",
        "the request was not recorded; send it again, with the same Idempotency-Key, later",
        headers={"Retry-After": "1"},
    )


def internal_error() -> Problem:
    """A failure of the ingress itself, logged. Whether the request was recorded is unknown to
    the client, and a retry with the same key is safe either way."""
    return Problem(
        HTTPStatus.INTERNAL_SERVER_ERROR,
        "internal-error",
        "The ingress failed",
        "send the request again with the same Idempotency-Key; the failure is in the log",
    )
