"""Accepting a posted message: its request row and its event, in one transaction; and reading
back what became of it.

Invariant: a request is recorded if and only if its event is in the outbox (one transaction
holds both), and a (handler, client, key) is accepted at most once, so a client's retry,
concurrent or not, never appends a second event. A retry with the same body gets the first
answer again (the same message id); one with another body is a ``KeyReused``. The event carries
the client's ``handler_key`` as its ``idempotency-key``, so the handler runs under a key of the
client's own, and a GET reads the result stored by that very event, for that client alone.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy.ext.asyncio import AsyncEngine

from worker.core.codec import JSON_CONTENT_TYPE
from worker.core.envelope import Envelope
from worker.errors import KeyReused, Reason
from worker.outbox import publish
from worker.sql import ingress, parkings

ATTEMPTS = 3
"""Inserts tried for one request: a conflicting row can vanish between the insert that met it
and the read that looks for it only when the janitor expires it in between."""


@dataclass(frozen=True)
class Accepted:
    """A request the ingress holds: the message id of its event, and whether this very request
    recorded it (False: an earlier one with the same key and body did)."""

    message_id: uuid.UUID
    new: bool


async def accept(
    engine: AsyncEngine, envelope: Envelope, client: str, key: str, *, exchange: str
) -> Accepted:
    """Record ``envelope`` as ``client``'s request of Idempotency-Key ``key`` and append its event
    to the outbox (to ``exchange``) in one transaction; or, when the client's (handler, key) was
    accepted before, answer as then, or raise ``KeyReused`` when that request had another body
    or when the inbox already holds the envelope's key (a message that did not come through the
    ingress took it: its event would be parked as a reused key).

    The envelope is the one ``read_envelope`` made: its key is ``client``'s ``handler_key`` and its
    body the canonical JSON the consumer will decode to the very value fingerprinted here (within
    the consumer's ``max_body_bytes``, which ``open_envelope`` checked); that body is the event's.
    """
    handler = envelope.handler
    for _ in range(ATTEMPTS):
        async with engine.begin() as conn:
            row = ingress.RequestRow(
                handler.name,
                client,
                key,
                envelope.key,
                handler.routing_key,
                envelope.fingerprint,
                uuid.uuid4(),
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
            found = await ingress.find_request(conn, handler.name, client, key)
            taken = found is None and await ingress.key_handled(conn, handler.name, envelope.key)
        if found is not None:
            fingerprint, message_id = found
            if fingerprint != envelope.fingerprint:
                raise KeyReused(
                    f"Idempotency-Key {key!r} was accepted for {handler.routing_key} with "
                    "another body; this key must not be reused with a different payload"
                )
            return Accepted(message_id, new=False)
        if taken:
            raise KeyReused(
                f"Idempotency-Key {key!r} is taken for {handler.routing_key}: choose another key"
            )
    raise RuntimeError(f"the request of key {key!r} vanished {ATTEMPTS} times")


Status = Literal["pending", "completed", "failed", "parked"]


@dataclass(frozen=True)
class Outcome:
    """What became of an accepted message, as ``GET /messages/{routing_key}/{key}`` shows it. A
    failure shows a reason and a message fit for the client, never the stored error itself
    (which may quote SQL, constraint names or another system's answer)."""

    status: Status
    result: Any
    error: str | None
    reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "result": self.result,
            "error": self.error,
            "reason": self.reason,
        }


FAILED_REASON = Reason.HANDLER_ERROR.value
"""The reason a failed message shows: the inbox records a key as failed only when its handler
failed for good (its exception, or a transient one past the last delayed retry)."""

_EXCEPTION_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]{0,99}")


def failure_message(stored: str | None) -> str:
    """What a client is told of a failure whose stored error is ``stored``: the exception's type
    name (the word before the first colon: ``DuplicatePayment``), never its text."""
    name = (stored or "").split(":", 1)[0].strip()
    shown = name if _EXCEPTION_NAME.fullmatch(name) else "an error"
    return f"{shown}: the handler failed; the worker's log and dead-letter queue have the details"


PARKED_REASON = "parked"
"""The reason a parked message shows: its event is in the dead-letter queue, unhandled."""


def parked_message(handler_key: str) -> str:
    """What a client is told of a message parked before its handler ran: where an operator
    finds it (the key is one the ingress checked and namespaced, safe to echo)."""
    return (
        "the message was parked in the dead-letter queue before its handler ran; "
        f"`worker dlq list --key {handler_key}` shows why"
    )


async def outcome(engine: AsyncEngine, handler_name: str, client: str, key: str) -> Outcome | None:
    """The state of ``client``'s request (handler, key): ``completed`` with the handler's stored
    result, ``failed`` with a safe message, ``parked`` when its event went to the dead-letter
    queue before its key was claimed (the worker's own record of the parking says so),
    ``pending`` while its event has not been handled (no inbox row of that event yet, or a
    workflow in progress); None when ``client`` has no such request."""
    async with engine.begin() as conn:
        found = await ingress.message_status(conn, handler_name, client, key)
        parked = (
            found is not None
            and found.inbox_status is None
            and await parkings.is_parked(conn, handler_name, found.handler_key)
        )
    if found is None:
        return None
    if parked:
        return Outcome("parked", None, parked_message(found.handler_key), PARKED_REASON)
    if found.inbox_status == "completed":
        return Outcome("completed", found.result, None)
    if found.inbox_status == "failed":
        return Outcome("failed", None, failure_message(found.error), FAILED_REASON)
    return Outcome("pending", None, None)
