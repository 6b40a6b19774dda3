"""The one statement that ends a batch's unit of work, before its commit: the keys that ran are
marked completed with their results, the claims of messages taken out of the batch are released,
and the events are appended to the outbox behind their ordering keys' locks, with one NOTIFY.

One round trip instead of four, built from the same parts as ``inbox.complete_keys``,
``inbox.delete_claims`` and ``outbox.append_outbox``, and keeping their promises: the advisory
locks (in sorted order) and the NOTIFY are taken by a one-time filter of the outbox insert, so
before any event row gets its id, and only when there are events.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from worker.sql.driver import Connection, in_transaction
from worker.sql.inbox import completion_arrays, delete_claims, mark_completed
from worker.sql.outbox import (
    NOTIFY_RELAYS,
    event_arrays,
    insert_events,
    lock_keys,
    ordering_keys_of,
)
from worker.sql.rows import InboxKey, OutboxMessage

FINISH_BATCH = f"""
WITH completed AS ({mark_completed(1)}
), released AS ({delete_claims(4)}
), locked AS (
    SELECT {lock_keys(6)}
), notified AS (
    SELECT count({NOTIFY_RELAYS}) WHERE $7::boolean
)
{insert_events(8, "(SELECT * FROM locked) >= 0 AND (SELECT * FROM notified) >= 0")}
"""


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
    statement in ``conn``'s transaction."""
    driver = await in_transaction(conn)
    await driver.execute(
        FINISH_BATCH,
        *completion_arrays(completed),
        [handler for handler, _ in released],
        [key for _, key in released],
        ordering_keys_of(events),
        notify and bool(events),
        *event_arrays(events),
    )
