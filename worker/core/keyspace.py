"""The HTTP ingress's key space: a key ``http:<client>:<key>`` is the ingress's alone.

Invariant: a delivery whose key is in that space runs only if the ingress accepted a request of
that handler, client, key and body (its ``ingress_requests`` row, written in the transaction
that appended the event): so a broker publisher cannot take, fail or park an HTTP client's key
before or after the client posts it. Any other delivery is refused as ``KeyReserved``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from sqlalchemy.ext.asyncio import AsyncEngine

from worker.core.envelope import Envelope
from worker.errors import KeyReserved
from worker.sql import ingress

HTTP_KEY_PREFIX = "http:"
"""Opens every key the ingress hands a handler."""

M = TypeVar("M")


def handler_key(client: str, key: str) -> str:
    """The key the handler runs under for ``client``'s Idempotency-Key ``key``:
    ``http:<client>:<key>``. A key sent over AMQP as ``order-1`` and one posted as ``order-1``
    are two keys, and so are two clients' ``order-1``."""
    return f"{HTTP_KEY_PREFIX}{client}:{key}"


def claim_of(envelope: Envelope) -> ingress.KeyClaim | None:
    """What ``envelope``'s key claims of the ingress's space; None for a key outside it. A key
    of that space the ingress could not have made (no client name before a colon) claims a
    client no request has, so it is refused like any other the ingress did not accept."""
    if not envelope.key.startswith(HTTP_KEY_PREFIX):
        return None
    client, _, key = envelope.key.removeprefix(HTTP_KEY_PREFIX).partition(":")
    return ingress.KeyClaim(envelope.handler.name, client, key, envelope.key, envelope.fingerprint)


async def refused_keys(
    engine: AsyncEngine, opened: Sequence[tuple[M, Envelope]]
) -> tuple[list[tuple[M, Envelope]], list[tuple[M, Envelope, KeyReserved]]]:
    """``opened`` split into the deliveries that may run and those whose key of the ingress's
    space the ingress did not accept; asks the database only when a key of that space is
    among them (one statement), so other batches cost nothing."""
    claims = {id(envelope): claim for _, envelope in opened if (claim := claim_of(envelope))}
    if not claims:
        return list(opened), []
    async with engine.connect() as conn, conn.begin():
        accepted = await ingress.accepted_keys(conn, list(claims.values()))
    kept: list[tuple[M, Envelope]] = []
    refused: list[tuple[M, Envelope, KeyReserved]] = []
    for message, envelope in opened:
        if id(envelope) in claims and envelope.inbox_key not in accepted:
            refused.append(
                (
                    message,
                    envelope,
                    KeyReserved(
                        f"key {envelope.key!r} is in the HTTP ingress's key space, and the "
                        "ingress accepted no such request of this body"
                    ),
                )
            )
        else:
            kept.append((message, envelope))
    return kept, refused
