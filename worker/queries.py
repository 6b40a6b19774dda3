"""Every SQL statement the worker runs on its own tables, and nowhere else.

Statements are SQLAlchemy Core with bound parameters; each function takes the caller's connection
so that it runs inside the caller's transaction.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, delete, func, select, text, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from worker.codec import to_jsonable
from worker.context import OutboxMessage
from worker.envelope import Envelope
from worker.tables import inbox, outbox, outbox_parked


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


OUTBOX_CHANNEL = "worker_outbox"
"""The LISTEN/NOTIFY channel relays wait on; a notification is only a hint to look now."""

ORDERING_LOCK_CLASS = 7_262_001
"""First key of the transaction-scoped advisory locks that serialize an ordering key's rows."""

RETRY_DELAY_CAP_SECONDS = 300.0
"""A failed outbox row is retried at least this often, however many attempts it has had."""


async def append_outbox(
    conn: AsyncConnection, messages: Sequence[OutboxMessage], *, notify: bool = False
) -> None:
    """Insert the events a handler recorded, in the order it recorded them, in one statement.

    For each ordering key among them, an advisory lock held until commit is taken first (keys
    sorted, so two transactions cannot deadlock on them). Rows of one ordering key therefore get
    their ids in commit order, and a row is only ever visible after every earlier row of its key.
    With ``notify``, one NOTIFY on ``OUTBOX_CHANNEL`` is delivered to listening relays at commit.
    """
    if not messages:
        return
    # One round trip for the locks and the notification; PostgreSQL evaluates a select list
    # left to right, so the locks are taken in key order.
    before_insert = [
        func.pg_advisory_xact_lock(ORDERING_LOCK_CLASS, func.hashtext(key))
        for key in sorted({m.ordering_key for m in messages if m.ordering_key is not None})
    ]
    if notify:
        before_insert.append(func.pg_notify(OUTBOX_CHANNEL, ""))
    if before_insert:
        await conn.execute(select(*before_insert))
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


@dataclass(frozen=True)
class OutboxRow:
    """An outbox row claimed by a relay: everything needed to publish it."""

    id: int
    message_id: uuid.UUID
    exchange: str
    routing_key: str
    body: bytes
    content_type: str
    headers: dict[str, Any]
    correlation_id: str | None
    causation_id: str | None
    ordering_key: str | None
    attempts: int
    created_at: datetime


_OUTBOX_ROW_COLUMNS = [outbox.c[name] for name in OutboxRow.__dataclass_fields__]


async def claim_outbox(conn: AsyncConnection, limit: int) -> list[OutboxRow]:
    """Lock up to ``limit`` due rows in id order, skipping rows other relays hold.

    Of an ordering key's rows only an unbroken run from the key's oldest row is returned: a row
    whose older sibling is held by another relay, waiting for a retry, or not claimed here stays
    locked but unreturned, so no relay can publish a key's rows out of order.
    """
    stmt = (
        select(*_OUTBOX_ROW_COLUMNS)
        .where(outbox.c.available_at <= func.now())
        .order_by(outbox.c.id)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    rows = [
        OutboxRow(**{**row._asdict(), "body": bytes(row.body)}) for row in await conn.execute(stmt)
    ]
    last_of_key: dict[str, int] = {}
    for row in rows:
        if row.ordering_key is not None:
            last_of_key[row.ordering_key] = row.id
    if not last_of_key:
        return rows
    older = (
        select(outbox.c.id, outbox.c.ordering_key)
        .where(
            outbox.c.ordering_key.in_(list(last_of_key)),
            outbox.c.id <= max(last_of_key.values()),
        )
        .order_by(outbox.c.id)
    )
    claimed = {row.id for row in rows}
    first_gap: dict[str, int] = {}
    for row_id, key in await conn.execute(older):
        if row_id not in claimed and key not in first_gap:
            first_gap[key] = row_id
    return [
        row
        for row in rows
        if row.ordering_key is None or row.id < first_gap.get(row.ordering_key, row.id + 1)
    ]


async def delete_outbox(conn: AsyncConnection, ids: Sequence[int]) -> None:
    """Delete published rows (in the transaction that claimed them)."""
    if ids:
        await conn.execute(delete(outbox).where(outbox.c.id.in_(list(ids))))


async def fail_outbox(
    conn: AsyncConnection,
    errors: Mapping[int, str],
    *,
    max_attempts: int,
    retry_delay: float,
) -> list[int]:
    """Count a failed publish of each row in ``errors`` and move it out by exponential backoff.

    The n-th failure makes a row wait ``retry_delay * 2**(n-1)`` seconds (at most
    ``RETRY_DELAY_CAP_SECONDS``); the ``max_attempts``-th moves it to ``outbox_parked``. Returns
    the ids of the rows parked.
    """
    if not errors:
        return []
    delay = func.least(
        RETRY_DELAY_CAP_SECONDS,
        bindparam("retry_delay") * func.power(2, outbox.c.attempts),
    )
    await conn.execute(
        update(outbox)
        .where(outbox.c.id == bindparam("row_id"))
        .values(
            attempts=outbox.c.attempts + 1,
            last_error=bindparam("error"),
            available_at=func.now() + func.make_interval(0, 0, 0, 0, 0, 0, delay),
        ),
        [{"row_id": i, "error": e, "retry_delay": retry_delay} for i, e in errors.items()],
    )
    columns = [c.name for c in outbox_parked.c if c.name != "parked_at"]
    moved = (
        delete(outbox)
        .where(outbox.c.id.in_(list(errors)), outbox.c.attempts >= max_attempts)
        .returning(*(outbox.c[name] for name in columns))
        .cte("moved")
    )
    park = (
        insert(outbox_parked)
        .from_select(columns, select(*(moved.c[name] for name in columns)))
        .returning(outbox_parked.c.id)
    )
    return [row_id for (row_id,) in await conn.execute(park)]


async def outbox_backlog(conn: AsyncConnection) -> int:
    """Rows waiting to be published."""
    return int((await conn.execute(select(func.count()).select_from(outbox))).scalar_one())


async def synchronous_commit(conn: AsyncConnection) -> str:
    """The server's ``synchronous_commit`` for this connection ('off' breaks ack-after-commit)."""
    return str((await conn.execute(text("SHOW synchronous_commit"))).scalar_one())
