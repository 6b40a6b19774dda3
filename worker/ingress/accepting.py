"""Accepting a posted message: its request row and its event, in one transaction; and reading
back what became of it.

Invariant: a request is recorded if and only if its event is in the outbox (one transaction
holds both), and a (handler, key) is accepted at most once, so a client's retry, concurrent or
not, never appends a second event. A retry with the same body gets the first answer again (the
same message id); one with another body is a ``KeyReused``. The event carries the client's key
as its ``idempotency-key``, so the handler runs under the key the client chose and its stored
result is the one a GET reads.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy.ext.asyncio import AsyncEngine

from worker.core.codec import JSON_CONTENT_TYPE
from worker.core.envelope import Envelope
from worker.errors import KeyReused
from worker.outbox import publish
from worker.sql import ingress

ATTEMPTS = 3
"""Inserts tried for one request: a conflicting row can vanish between the insert that met it
and the read that looks for it only when the janitor expires it in between."""


@dataclass(frozen=True)
class Accepted:
    """A request the ingress holds: the message id of its event, and whether this very request
    recorded it (False: an earlier one with the same key and body did)."""

    message_id: uuid.UUID
    new: bool


async def accept(engine: AsyncEngine, envelope: Envelope, *, exchange: str) -> Accepted:
    """Record ``envelope`` as an accepted request and append its event to the outbox (to
    ``exchange``) in one transaction; or, when its (handler, key) was accepted before, answer as
    then, or raise ``KeyReused`` when that request had another body.

    The event's body is the bytes the client sent (the consumer decodes them to the very value
    fingerprinted here, and they are within the consumer's ``max_body_bytes``).
    """
    handler = envelope.handler
    for _ in range(ATTEMPTS):
        async with engine.begin() as conn:
            row = ingress.RequestRow(
                handler.name, envelope.key, handler.routing_key, envelope.fingerprint, uuid.uuid4()
            )
            if await ingress.record_request(conn, row):
                await publish(
                    conn,
                    handler.routing_key,
                    envelope.delivery.body,
                    key=envelope.key,
                    exchange=exchange,
                    message_id=row.message_id,
                    content_type=JSON_CONTENT_TYPE,
                )
                return Accepted(row.message_id, new=True)
            found = await ingress.find_request(conn, handler.name, envelope.key)
        if found is not None:
            fingerprint, message_id = found
            if fingerprint != envelope.fingerprint:
                raise KeyReused(
                    f"Idempotency-Key {envelope.key!r} was accepted for {handler.routing_key} "
                    "with another body; this key must not be reused with a different payload"
                )
            return Accepted(message_id, new=False)
    raise RuntimeError(f"the request of key {envelope.key!r} vanished {ATTEMPTS} times")


Status = Literal["pending", "completed", "failed"]


@dataclass(frozen=True)
class Outcome:
    """What became of an accepted message, as ``GET /messages/{routing_key}/{key}`` shows it."""

    status: Status
    result: Any
    error: str | None

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "result": self.result, "error": self.error}


async def outcome(engine: AsyncEngine, handler_name: str, key: str) -> Outcome | None:
    """The state of (handler, key): ``completed`` with the handler's stored result, ``failed``
    with its error, ``pending`` while the request is accepted and its handler has not finished
    (no inbox row yet, or a workflow in progress); None when neither the ingress nor the inbox
    knows the key."""
    async with engine.begin() as conn:
        found = await ingress.message_status(conn, handler_name, key)
    if found is None:
        return None
    if found.inbox_status == "completed":
        return Outcome("completed", found.result, None)
    if found.inbox_status == "failed":
        return Outcome("failed", None, found.error)
    return Outcome("pending", None, None)
