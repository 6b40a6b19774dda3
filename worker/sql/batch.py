"""The one statement that ends a batch's unit of work, before its commit: the keys that ran are
marked completed with their results, the claims of messages taken out of the batch are released,
and the events are appended to the outbox behind their ordering keys' locks, with one NOTIFY.

One round trip instead of four, doing what ``inbox.complete_keys``, a release of the claims and
``outbox.append_outbox`` do, and keeping their promises: the advisory locks (in sorted order) and
the NOTIFY are taken by a one-time filter of the outbox insert, so before any event row gets its
id, and only when there are events. Written whole, with fixed parameters, like every statement
of ``worker.sql`` on the hot path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from worker.sql.driver import Connection, in_transaction
from worker.sql.inbox import completion_arrays
from worker.sql.outbox import (
    NOTIFY_RELAYS,
    ORDERING_LOCK_CLASS,
    append_scheduled,
    event_arrays,
    ordering_keys_of,
    split_scheduled,
)
from worker.sql.rows import InboxKey, OutboxMessage

FINISH_BATCH = f"""
WITH completed AS (
    UPDATE inbox AS i
    SET status = 'completed', result = d.result::jsonb, owner = NULL, lease_until = NULL,
        updated_at = now()
    FROM unnest($1::text[], $2::text[], $3::text[]) AS d(handler, key, result)
    WHERE i.handler = d.handler AND i.key = d.key
), released AS (
    DELETE FROM inbox AS i
    USING unnest($4::text[], $5::text[]) AS r(handler, key)
    WHERE i.handler = r.handler AND i.key = r.key
), locked AS (
    SELECT count(pg_advisory_xact_lock({ORDERING_LOCK_CLASS}, hashtext(k.key)))
    FROM unnest($6::text[]) WITH ORDINALITY AS k(key, position)
), notified AS (
    SELECT count({NOTIFY_RELAYS}) WHERE $7::boolean
)
INSERT INTO outbox (message_id, exchange, routing_key, body, content_type, headers,
                    correlation_id, causation_id, ordering_key)
SELECT m.message_id, m.exchange, m.routing_key, m.body, m.content_type, m.headers::jsonb,
       m.correlation_id, m.causation_id, m.ordering_key
FROM unnest($8::uuid[], $9::text[], $10::text[], $11::bytea[], $12::text[],
            $13::text[], $14::text[], $15::text[], $16::text[])
     WITH ORDINALITY AS m(message_id, exchange, routing_key, body, content_type, headers,
                          correlation_id, causation_id, ordering_key, position)
WHERE (SELECT * FROM locked) >= 0 AND (SELECT * FROM notified) >= 0
ORDER BY m.position
"""
"""The batch's end, parameters: $1-$3 the completed keys' handlers, keys and results as JSON
text (``inbox.completion_arrays``); $4-$5 the released claims' handlers and keys; $6 the sorted
ordering keys to lock; $7 whether to NOTIFY; $8-$16 the events (``outbox.event_arrays``)."""


async def finish_batch(
    conn: Connection,
    completed: Sequence[tuple[str, str, Any]],
    released: Sequence[InboxKey],
    events: Sequence[OutboxMessage],
    *,
    notify: bool,
) -> None:
    """Mark each (handler, key, result) completed with its result, release the ``released``
    claims and append ``events`` (with ``notify``: one NOTIFY to relays at commit), in one
    statement in ``conn``'s transaction; scheduled events, if any, in a second one."""
    driver = await in_transaction(conn)
    events, scheduled = split_scheduled(events)
    if scheduled:
        await append_scheduled(driver, scheduled, notify=notify)
    await driver.execute(
        FINISH_BATCH,
        *completion_arrays(completed),
        [handler for handler, _ in released],
        [key for _, key in released],
        ordering_keys_of(events),
        notify and bool(events),
        *event_arrays(events),
    )
