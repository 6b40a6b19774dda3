"""What the ingress's OpenAPI document says: each routing key's request body, from its handler's
own body type, and the shapes of the answers.

Invariant: the documented body of a routing key is the JSON schema of the very ``TypeAdapter``
the consumer validates it with (``Handler.adapter``), so the documentation cannot drift from
what is accepted. It is self-contained (nested models inlined), so it stays correct wherever the
router is mounted, under any prefix. Every refusal is documented as ``application/problem+json``,
as it is answered, and every path parameter (the GET's ``key``) is declared.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

from worker.core.handler import Handler
from worker.ingress.problems import PROBLEM_JSON
from worker.ingress.reading import MAX_CLIENT_KEY_LENGTH

_REF_PREFIX = "#/$defs/"


class AcceptedBody(BaseModel):
    """The answer to an accepted message (202), the same for every retry with its key."""

    status_url: str = Field(description="where GET tells what became of the message")
    message_id: uuid.UUID = Field(description="the message id of the event appended")
    routing_key: str
    key: str = Field(description="the Idempotency-Key sent")
    handler_key: str = Field(
        description="the key the handler runs under (`http:<client>:<key>`): HTTP clients and "
        "AMQP messages never share a key"
    )


class OutcomeBody(BaseModel):
    """What became of an accepted message (200)."""

    status: Literal["pending", "completed", "failed", "parked"]
    result: Any = Field(None, description="the handler's return value, once completed")
    error: str | None = Field(
        None, description="once failed: the exception's type, never its text (see the log)"
    )
    reason: str | None = Field(
        None, description="once failed: `handler-error`; once parked: `parked`"
    )


class ValidationErrorItem(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class ProblemBody(BaseModel):
    """An RFC 9457 problem (``application/problem+json``); ``type`` names the reason."""

    type: str = Field(examples=["urn:rabbit-outbox-worker:problem:key-reused"])
    title: str
    status: int
    detail: str
    instance: str | None = None
    errors: list[ValidationErrorItem] | None = Field(
        None, description="with a 422 for a body that fails validation: where and why"
    )
    errors_total: int | None = None


def body_schema(handler: Handler) -> dict[str, Any]:
    """The JSON schema of ``handler``'s body type, its ``$defs`` inlined (a recursive reference
    is left as any JSON value)."""
    schema = handler.adapter.json_schema(ref_template=_REF_PREFIX + "{model}")
    return _inlined(schema)


def _inlined(schema: dict[str, Any]) -> dict[str, Any]:
    definitions = schema.pop("$defs", {})
    inlined = _inline(schema, definitions, frozenset())
    assert isinstance(inlined, dict)
    return inlined


def _inline(node: Any, definitions: dict[str, Any], expanding: frozenset[str]) -> Any:
    if isinstance(node, list):
        return [_inline(item, definitions, expanding) for item in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith(_REF_PREFIX):
        name = ref.removeprefix(_REF_PREFIX)
        if name in expanding or name not in definitions:
            return {"description": f"{name} (recursive)"}
        siblings = {k: v for k, v in node.items() if k != "$ref"}
        target = _inline(definitions[name], definitions, expanding | {name})
        return {**target, **_inline(siblings, definitions, expanding)}
    return {k: _inline(v, definitions, expanding) for k, v in node.items()}


def _problem(description: str) -> dict[str, Any]:
    """A problem+json response: the schema inlined, since FastAPI registers a ``model`` under
    ``application/json`` only."""
    return {"description": description, "content": {PROBLEM_JSON: {"schema": _PROBLEM_SCHEMA}}}


def _schema_of(model: type[BaseModel]) -> dict[str, Any]:
    """``model``'s JSON schema, its ``$defs`` inlined."""
    return _inlined(model.model_json_schema(ref_template=_REF_PREFIX + "{model}"))


_PROBLEM_SCHEMA = _schema_of(ProblemBody)

_KEY_SCHEMA = {"type": "string", "minLength": 1, "maxLength": MAX_CLIENT_KEY_LENGTH}
"""A client's Idempotency-Key (``reading.check_client_key``: also no NUL, and UTF-8)."""

POST_RESPONSES: dict[int | str, dict[str, Any]] = {
    202: {"model": AcceptedBody, "description": "accepted (or accepted before with this key)"},
    400: _problem("no valid Idempotency-Key, or a body that is not UTF-8 JSON or nests too deep"),
    401: _problem("bearer tokens are configured and none accepted was sent"),
    404: _problem("no handler serves this routing key"),
    413: _problem("the body is larger than max_body_bytes"),
    415: _problem("the body is not declared as JSON"),
    422: _problem("the body fails validation, or the key was used with another body"),
    503: _problem("the database did not answer; nothing was recorded, send it again"),
}

GET_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": OutcomeBody, "description": "pending, completed, failed or parked"},
    401: _problem("bearer tokens are configured and none accepted was sent"),
    404: _problem("no such routing key, or no message with this key"),
    503: _problem("the database did not answer"),
}


def post_documentation(handler: Handler) -> dict[str, Any]:
    """The ``openapi_extra`` of a routing key's POST: its body's schema and the key header."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": body_schema(handler)}},
        },
        "parameters": [
            {
                "name": "Idempotency-Key",
                "in": "header",
                "required": True,
                "description": "the key the handler runs under; the same key with the same body "
                "is the same request, however often it is sent",
                "schema": _KEY_SCHEMA,
            }
        ],
    }


GET_DOCUMENTATION: dict[str, Any] = {
    "parameters": [
        {
            "name": "key",
            "in": "path",
            "required": True,
            "description": "the Idempotency-Key the message was posted with (percent-encoded); "
            "only the client that posted it reads it",
            "schema": _KEY_SCHEMA,
        }
    ]
}
"""The ``openapi_extra`` of a routing key's GET: the key in its path."""
