"""The HTTP ingress's statements: recording an accepted request, finding one, reading a message's
status from the inbox, and expiring old requests.

Invariant: a request row is inserted only in the transaction that appends its event, and a
(handler, client, key) has at most one row. A concurrent insert of the same (handler, client,
key) waits on the uncommitted row and then finds it committed (a retry: answer as the first did)
or rolled back (it inserts the row itself), as the inbox's claim does. A status is read only by
the client that posted the request, and only from the inbox row of the request's own event.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from worker.sql.driver import Connection, in_transaction
from worker.sql.tables import ingress_requests, interval


@dataclass(frozen=True)
class RequestRow:
    """An accepted request: its handler, the client that posted it and the Idempotency-Key it
    sent, the key its handler runs under, the routing key it was posted to, its body's
    fingerprint and the message id of its event."""

    handler: str
    client: str
    key: str
    handler_key: str
    routing_key: str
    fingerprint: bytes
    message_id: uuid.UUID


@dataclass(frozen=True)
class MessageStatus:
    """What the inbox recorded of an accepted request's own event: ``inbox_status`` (None: not
    handled yet) with the stored result or error, and the key its handler runs under."""

    inbox_status: str | None
    result: Any
    error: str | None
    handler_key: str


# (client '': a request accepted before the ingress told clients apart, migration 0005. No
# client is named so, hence none reads it; a retry of its key still finds it.)
RECORD_REQUEST = """
INSERT INTO ingress_requests
    (handler, client, key, handler_key, routing_key, fingerprint, message_id)
SELECT $1::text, $2::text, $3::text, $4::text, $5::text, $6::bytea, $7::uuid
WHERE NOT EXISTS (
        SELECT FROM ingress_requests WHERE handler = $1 AND client = '' AND key = $3)
  AND NOT EXISTS (SELECT FROM inbox WHERE handler = $1 AND key = $4)
ON CONFLICT (handler, client, key) DO NOTHING
RETURNING message_id
"""

FIND_REQUEST = """
SELECT fingerprint, message_id FROM ingress_requests
WHERE handler = $1 AND key = $3 AND client IN ($2, '')
ORDER BY client = ''
LIMIT 1
"""

ACCEPTED_KEYS = """
SELECT v.handler, v.handler_key
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bytea[])
    AS v (handler, client, key, handler_key, fingerprint)
WHERE EXISTS (
    SELECT FROM ingress_requests AS r
    WHERE r.handler = v.handler AND r.client IN (v.client, '') AND r.key = v.key
      AND r.handler_key = v.handler_key AND r.fingerprint = v.fingerprint)
"""

KEY_HANDLED = """
SELECT EXISTS (SELECT FROM inbox WHERE handler = $1 AND key = $2)
"""

MESSAGE_STATUS = """
SELECT i.status, i.result::text AS result, i.error, r.handler_key
FROM ingress_requests AS r
LEFT JOIN inbox AS i
    ON i.handler = r.handler AND i.key = r.handler_key AND i.message_id = r.message_id::text
WHERE r.handler = $1 AND r.client = $2 AND r.key = $3
"""


async def record_request(conn: Connection, row: RequestRow) -> bool:
    """Insert ``row`` unless its (handler, client, key) has one, a request accepted before
    clients were told apart has its (handler, key), or the inbox already holds its handler key
    (a message that did not come through the ingress took it); True when this transaction
    inserted it.

    Waits while another transaction holds an uncommitted row of the same (handler, client, key).
    False means a committed row exists (``find_request``, in a statement of its own, hence a
    snapshot taken after the wait, reads it) or the handler key is taken (``key_handled``).
    """
    driver = await in_transaction(conn)
    inserted = await driver.fetchval(
        RECORD_REQUEST,
        row.handler,
        row.client,
        row.key,
        row.handler_key,
        row.routing_key,
        row.fingerprint,
        row.message_id,
    )
    return inserted is not None


async def find_request(
    conn: Connection, handler: str, client: str, key: str
) -> tuple[bytes, uuid.UUID] | None:
    """The fingerprint and event message id of the committed request of (handler, client, key),
    else of one of (handler, key) accepted before clients were told apart, if any."""
    driver = await in_transaction(conn)
    found = await driver.fetchrow(FIND_REQUEST, handler, client, key)
    return None if found is None else (bytes(found[0]), found[1])


@dataclass(frozen=True)
class KeyClaim:
    """A delivery's claim to a key of the ingress's space: its handler, the client and
    Idempotency-Key its key names, the key itself and its body's fingerprint."""

    handler: str
    client: str
    key: str
    handler_key: str
    fingerprint: bytes


async def accepted_keys(conn: Connection, claims: list[KeyClaim]) -> set[tuple[str, str]]:
    """The (handler, handler_key) of ``claims`` whose request the ingress accepted with that
    very body: one statement, each row found by its primary key."""
    driver = await in_transaction(conn)
    rows = await driver.fetch(
        ACCEPTED_KEYS,
        [c.handler for c in claims],
        [c.client for c in claims],
        [c.key for c in claims],
        [c.handler_key for c in claims],
        [c.fingerprint for c in claims],
    )
    return {(row[0], row[1]) for row in rows}


async def key_handled(conn: Connection, handler: str, handler_key: str) -> bool:
    """Whether the inbox has a row of (handler, handler_key)."""
    driver = await in_transaction(conn)
    return bool(await driver.fetchval(KEY_HANDLED, handler, handler_key))


async def message_status(
    conn: Connection, handler: str, client: str, key: str
) -> MessageStatus | None:
    """What the inbox recorded of the event of ``client``'s request (handler, key), counting
    only an inbox row of that very event (its message id); None when ``client`` has no such
    request (another client's, a key sent over AMQP, an expired one)."""
    driver = await in_transaction(conn)
    found = await driver.fetchrow(MESSAGE_STATUS, handler, client, key)
    if found is None:
        return None
    status, result, error, handler_key = found
    return MessageStatus(status, None if result is None else json.loads(result), error, handler_key)


async def delete_expired_requests(conn: AsyncConnection, *, retention: float, limit: int) -> int:
    """Delete up to ``limit`` requests accepted more than ``retention`` seconds ago, oldest
    first; returns how many. Rows another transaction holds are skipped, never waited on."""
    expired = (
        select(ingress_requests.c.handler, ingress_requests.c.client, ingress_requests.c.key)
        .where(ingress_requests.c.accepted_at < func.now() - interval(retention))
        .order_by(ingress_requests.c.accepted_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
        .cte("expired")
    )
    stmt = delete(ingress_requests).where(
        ingress_requests.c.handler == expired.c.handler,
        ingress_requests.c.client == expired.c.client,
        ingress_requests.c.key == expired.c.key,
    )
    return (await conn.execute(stmt)).rowcount
