"""Publish events through the outbox from your own code, in your own transaction.

``publish`` (one event) and ``publish_many`` (several, in one statement) append events to the
worker's outbox in the caller's open transaction; the worker's relay publishes them to RabbitMQ,
with publisher confirms, once that transaction has committed. Invariant: the event exists if and
only if the caller's transaction commits; a rollback takes it back with the caller's own writes.
This module is the contract: the outbox's tables are internal and may change between versions.

Events of one ``ordering_key`` are published in the order their transactions commit (an advisory
lock on the key is held until commit), and each commit that adds events wakes listening relays
with one NOTIFY, as ``ctx.publish`` inside a handler does. Each event carries an
``idempotency-key`` header (``key``, else its message id), so a consumer of it (this worker, or
another) applies it once however often it is delivered: give a retried business transaction the
same ``key`` and its event is deduplicated too.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.exc import InvalidRequestError
from sqlalchemy.ext.asyncio import AsyncSession

from worker.core.events import Event
from worker.database import engine_from_env
from worker.settings import field
from worker.sql import outbox
from worker.sql.driver import Connection, NotInTransaction

__all__ = ["Event", "NotInTransaction", "cancel", "engine_from_env", "publish", "publish_many"]


def default_exchange() -> str:
    """Where an event that names no exchange goes: ``WORKER_EXCHANGE`` when the environment sets
    it (the worker's own setting, so a producer deployed beside the worker follows it), else the
    worker's default, ``events``."""
    return str(field("exchange").read())


async def publish(
    conn: Connection | AsyncSession,
    routing_key: str,
    body: Any,
    *,
    key: str | None = None,
    ordering_key: str | None = None,
    headers: Mapping[str, Any] | None = None,
    exchange: str | None = None,
    message_id: uuid.UUID | None = None,
    correlation_id: str | None = None,
    content_type: str | None = None,
    delay: timedelta | None = None,
    at: datetime | None = None,
) -> uuid.UUID:
    """Append one event to the outbox in ``conn``'s open transaction; return its message id.

    ``conn`` is an SQLAlchemy ``AsyncConnection`` in a transaction, an ``AsyncSession`` (the
    event joins the session's transaction, begun now if it has none, and commits with
    ``session.commit()``), or an asyncpg ``Connection`` inside ``conn.transaction()``. Outside a
    transaction, ``NotInTransaction`` is raised and nothing is written.

    ``body`` is JSON-encoded unless it is ``bytes`` (then give ``content_type``). ``key`` is the
    event's idempotency key (default: its message id, a new UUID unless ``message_id`` is given).
    ``ordering_key``: events with the same one are published in commit order. ``exchange``
    defaults to ``default_exchange()``. An event the broker or the outbox could never take (a
    routing key over 255 bytes, a NUL character, a body JSON cannot encode) raises
    ``ValueError`` or ``TypeError`` here, before anything is written.

    ``delay`` or ``at`` (not both) schedules the event: it is published once the *database's*
    clock reaches ``now() + delay`` (``now()``: the start of this transaction) or ``at`` (an
    aware datetime; a naive one is a ``ValueError``), never before, at least once (see
    docs/scheduling.md). Until then ``cancel(conn, message_id)`` takes it back.
    """
    event = Event(
        routing_key,
        body,
        key=key,
        ordering_key=ordering_key,
        headers=headers,
        exchange=exchange,
        message_id=message_id,
        correlation_id=correlation_id,
        content_type=content_type,
        delay=delay,
        at=at,
    )
    (published,) = await publish_many(conn, [event])
    return published


async def publish_many(conn: Connection | AsyncSession, events: Iterable[Event]) -> list[uuid.UUID]:
    """Append ``events`` to the outbox in ``conn``'s open transaction, in their order, with one
    statement; return their message ids in the same order. Every event is checked before any is
    written; see ``publish`` for ``conn`` and the fields."""
    exchange = default_exchange()
    messages = [event.to_outbox(exchange, keyed=True) for event in events]
    if not messages:
        return []
    await outbox.append_outbox(await _connection(conn), messages, notify=True)
    return [message.message_id for message in messages]


async def cancel(conn: Connection | AsyncSession, message_id: uuid.UUID) -> bool:
    """Take back the unpublished event ``message_id`` in ``conn``'s open transaction.

    True if the event had not been published and, once this transaction commits, never will be
    (it was scheduled, or waiting in the outbox for a relay); False if it was published already,
    parked by the relay, cancelled before, or never existed. An event a relay is publishing at
    this moment is waited for: the answer is False once that relay has committed it. A rollback
    of this transaction undoes the cancel.
    """
    return await outbox.cancel(await _connection(conn), message_id)


async def _connection(conn: Connection | AsyncSession) -> Connection:
    """The connection of ``conn``'s transaction; a session's, begun if the session has none."""
    if not isinstance(conn, AsyncSession):
        return conn
    try:
        return await conn.connection()
    except InvalidRequestError as exc:  # (a session made with autobegin=False, not begun)
        raise NotInTransaction(NotInTransaction.__doc__) from exc
