"""The HTTP ingress's statements: recording an accepted request, finding one, reading a message's
status from the inbox, and expiring old requests.

Invariant: a request row is inserted only in the transaction that appends its event, and a
(handler, key) has at most one row. A concurrent insert of the same (handler, key) waits on the
uncommitted row and then finds it committed (a retry: answer as the first did) or rolled back
(it inserts the row itself), as the inbox's claim does.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from worker.sql.driver import Connection, in_transaction
from worker.sql.inbox import interval
from worker.sql.tables import ingress_requests


@dataclass(frozen=True)
class RequestRow:
    """An accepted request: its effect's (handler, key), the routing key it was posted to, its
    body's fingerprint and the message id of its event."""

    handler: str
    key: str
    routing_key: str
    fingerprint: bytes
    message_id: uuid.UUID


@dataclass(frozen=True)
class MessageStatus:
    """What the ingress and the inbox know of a (handler, key): ``accepted`` when the ingress has
    its request, ``inbox_status`` (None: no inbox row yet) with the stored result or error."""

    accepted: bool
    inbox_status: str | None
    result: Any
    error: str | None


RECORD_REQUEST = """
INSERT INTO ingress_requests (handler, key, routing_key, fingerprint, message_id)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (handler, key) DO NOTHING
RETURNING message_id
"""

FIND_REQUEST = """
SELECT fingerprint, message_id FROM ingress_requests WHERE handler = $1 AND key = $2
"""

MESSAGE_STATUS = """
SELECT r.key IS NOT NULL AS accepted, i.status, i.result::text AS result, i.error
FROM (SELECT $1::text AS handler, $2::text AS key) AS k
LEFT JOIN ingress_requests AS r ON r.handler = k.handler AND r.key = k.key
LEFT JOIN inbox AS i ON i.handler = k.handler AND i.key = k.key
WHERE r.key IS NOT NULL OR i.key IS NOT NULL
"""


async def record_request(conn: Connection, row: RequestRow) -> bool:
    """Insert ``row`` unless its (handler, key) has one; True when this transaction inserted it.

    Waits while another transaction holds an uncommitted row of the same (handler, key). False
    means a committed row exists: ``find_request``, in a statement of its own (hence a snapshot
    taken after the wait), reads it.
    """
    driver = await in_transaction(conn)
    inserted = await driver.fetchval(
        RECORD_REQUEST, row.handler, row.key, row.routing_key, row.fingerprint, row.message_id
    )
    return inserted is not None


async def find_request(conn: Connection, handler: str, key: str) -> tuple[bytes, uuid.UUID] | None:
    """The fingerprint and event message id of the committed request of (handler, key), if any."""
    driver = await in_transaction(conn)
    found = await driver.fetchrow(FIND_REQUEST, handler, key)
    return None if found is None else (bytes(found[0]), found[1])


async def message_status(conn: Connection, handler: str, key: str) -> MessageStatus | None:
    """What the ingress accepted and the inbox recorded of (handler, key); None when neither
    knows it."""
    driver = await in_transaction(conn)
    found = await driver.fetchrow(MESSAGE_STATUS, handler, key)
    if found is None:
        return None
    accepted, status, result, error = found
    return MessageStatus(accepted, status, None if result is None else json.loads(result), error)


async def delete_expired_requests(conn: AsyncConnection, *, retention: float, limit: int) -> int:
    """Delete up to ``limit`` requests accepted more than ``retention`` seconds ago, oldest
    first; returns how many. Rows another transaction holds are skipped, never waited on."""
    expired = (
        select(ingress_requests.c.handler, ingress_requests.c.key)
        .where(ingress_requests.c.accepted_at < func.now() - interval(retention))
        .order_by(ingress_requests.c.accepted_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
        .cte("expired")
    )
    stmt = delete(ingress_requests).where(
        ingress_requests.c.handler == expired.c.handler, ingress_requests.c.key == expired.c.key
    )
    return (await conn.execute(stmt)).rowcount
