"""Every SQL statement the worker runs on its own tables, and nowhere else.

Statements are SQLAlchemy Core with bound parameters; each function takes the caller's connection
so that it runs inside the caller's transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, text, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from worker.codec import to_jsonable
from worker.context import OutboxMessage
from worker.envelope import Envelope
from worker.tables import inbox, outbox


@dataclass(frozen=True)
class InboxEntry:
    """The committed record of a key that someone else already claimed."""

    status: str
    fingerprint: bytes
    result: Any
    error: str | None


async def claim_key(conn: AsyncConnection, envelope: Envelope) -> bool:
    """Insert the envelope's inbox row; False when the key is already taken.

    A concurrent claim of the same key waits here until the other transaction ends: it then sees
    the committed row (False) or, if the other rolled back, takes the key itself (True).
    """
    stmt = (
        insert(inbox)
        .values(
            handler=envelope.handler.name,
            key=envelope.key,
            fingerprint=envelope.fingerprint,
            status="in_progress",
            message_id=envelope.delivery.message_id,
            routing_key=envelope.delivery.routing_key,
        )
        .on_conflict_do_nothing(index_elements=[inbox.c.handler, inbox.c.key])
        .returning(inbox.c.handler)
    )
    return (await conn.execute(stmt)).first() is not None


async def fetch_key(conn: AsyncConnection, handler: str, key: str) -> InboxEntry | None:
    """The committed inbox row of (handler, key), if any."""
    stmt = select(inbox.c.status, inbox.c.fingerprint, inbox.c.result, inbox.c.error).where(
        inbox.c.handler == handler, inbox.c.key == key
    )
    row = (await conn.execute(stmt)).first()
    return (
        None
        if row is None
        else InboxEntry(row.status, bytes(row.fingerprint), row.result, row.error)
    )


async def complete_key(conn: AsyncConnection, handler: str, key: str, result: Any) -> None:
    """Mark (handler, key) completed and store the handler's result with it."""
    stmt = (
        update(inbox)
        .where(inbox.c.handler == handler, inbox.c.key == key)
        .values(status="completed", result=to_jsonable(result), updated_at=func.now())
    )
    await conn.execute(stmt)


async def append_outbox(conn: AsyncConnection, messages: Sequence[OutboxMessage]) -> None:
    """Insert the events a handler recorded, in the order it recorded them, in one statement."""
    if not messages:
        return
    await conn.execute(
        insert(outbox),
        [
            {
                "message_id": m.message_id,
                "exchange": m.exchange,
                "routing_key": m.routing_key,
                "body": m.body,
                "content_type": m.content_type,
                "headers": to_jsonable(m.headers),
                "correlation_id": m.correlation_id,
                "causation_id": m.causation_id,
                "ordering_key": m.ordering_key,
            }
            for m in messages
        ],
    )


async def synchronous_commit(conn: AsyncConnection) -> str:
    """The server's ``synchronous_commit`` for this connection ('off' breaks ack-after-commit)."""
    return str((await conn.execute(text("SHOW synchronous_commit"))).scalar_one())
