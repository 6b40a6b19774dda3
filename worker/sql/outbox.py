"""The outbox's statements: appending events in the caller's transaction (ordering-key
locks, NOTIFY), claiming, deleting or failing rows for a relay, and scheduled events.

Scheduled events are kept in ``outbox_scheduled`` until the database's clock says they are due,
then moved into ``outbox``, where a relay claims them like any other event. Invariant: a
scheduled event is never in ``outbox`` before its ``due_at`` by ``now()`` of the database, so no
relay can publish it early, whatever the clocks of the processes say. Keeping future events out of
``outbox`` keeps the relay's claim as fast with a million of them waiting as with none, and gives
an ordering key its meaning: a scheduled event takes its place in its key's order when it is
moved, i.e. when it is due. It never holds back the key's events due before it; events of one
key due at the same instant are moved in the order they were scheduled (``due_at, id``), in one
transaction that holds the key's ordering lock.

Each statement is a named constant written whole, with fixed ``$1..$n`` parameters, run on the
asyncpg connection of the caller's transaction (``driver.in_transaction``) as a prepared
statement; arrays and ``unnest`` carry a batch in one round trip.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from worker.core.codec import to_jsonable
from worker.sql import locks
from worker.sql.driver import Connection, in_transaction
from worker.sql.rows import OutboxMessage

OUTBOX_CHANNEL = "worker_outbox"
"""The LISTEN/NOTIFY channel relays wait on; a notification is only a hint to look now."""

ORDERING_LOCK_CLASS = locks.ORDERING
"""First key of the transaction-scoped advisory locks that serialize an ordering key's rows."""

RETRY_DELAY_CAP_SECONDS = 300.0
"""A failed outbox row is retried at least this often, however many attempts it has had."""


NOTIFY_RELAYS = f"pg_notify('{OUTBOX_CHANNEL}', '')"
"""The NOTIFY that wakes listening relays; delivered at commit, once however often it is sent."""

LOCK_ORDERING_KEYS = f"""
SELECT count(pg_advisory_xact_lock({ORDERING_LOCK_CLASS}, hashtext(k.key)))
FROM unnest($1::text[]) WITH ORDINALITY AS k(key, position)
"""
"""Take the advisory lock of each ordering key in the array ``$1``, in the array's order, held
until commit (an aggregate: one row)."""

LOCK_ORDERING_KEYS_AND_NOTIFY = f"""
SELECT {NOTIFY_RELAYS}, count(pg_advisory_xact_lock({ORDERING_LOCK_CLASS}, hashtext(k.key)))
FROM unnest($1::text[]) WITH ORDINALITY AS k(key, position)
"""
"""``LOCK_ORDERING_KEYS``, and one NOTIFY for relays (the aggregate makes it run once)."""

APPEND_OUTBOX = """
INSERT INTO outbox (message_id, exchange, routing_key, body, content_type, headers,
                    correlation_id, causation_id, ordering_key)
SELECT m.message_id, m.exchange, m.routing_key, m.body, m.content_type, m.headers::jsonb,
       m.correlation_id, m.causation_id, m.ordering_key
FROM unnest($1::uuid[], $2::text[], $3::text[], $4::bytea[], $5::text[],
            $6::text[], $7::text[], $8::text[], $9::text[])
     WITH ORDINALITY AS m(message_id, exchange, routing_key, body, content_type, headers,
                          correlation_id, causation_id, ordering_key, position)
ORDER BY m.position
"""
"""Insert the events given as nine arrays (``event_arrays``), in the arrays' order."""


def event_arrays(messages: Sequence[OutboxMessage]) -> list[list[Any]]:
    """The nine arrays ``APPEND_OUTBOX`` takes, one element per message (message ids, exchanges,
    routing keys, bodies, content types, headers as JSON text, correlation ids, causation ids,
    ordering keys)."""
    return [
        [m.message_id for m in messages],
        [m.exchange for m in messages],
        [m.routing_key for m in messages],
        [m.body for m in messages],
        [m.content_type for m in messages],
        [json.dumps(to_jsonable(m.headers)) for m in messages],
        [m.correlation_id for m in messages],
        [m.causation_id for m in messages],
        [m.ordering_key for m in messages],
    ]


def ordering_keys_of(messages: Sequence[OutboxMessage]) -> list[str]:
    """The distinct ordering keys of ``messages``, sorted: the order their locks are taken in, so
    that two transactions cannot deadlock on them."""
    return sorted({m.ordering_key for m in messages if m.ordering_key is not None})


async def lock_ordering_keys(
    conn: Connection, ordering_keys: Iterable[str], *, notify: bool
) -> None:
    """Take the ordering keys' advisory locks, held until commit, in sorted order (so two
    transactions cannot deadlock on them), and with ``notify`` queue one NOTIFY for relays; one
    round trip, of one statement text whatever the keys."""
    keys = sorted(ordering_keys)
    if not keys and not notify:
        return
    driver = await in_transaction(conn)
    # the locks are taken in the array's order; the aggregate makes the NOTIFY run once
    await driver.execute(LOCK_ORDERING_KEYS_AND_NOTIFY if notify else LOCK_ORDERING_KEYS, keys)


async def append_outbox(
    conn: Connection, messages: Sequence[OutboxMessage], *, notify: bool = False
) -> None:
    """Insert the events a handler recorded, in the order it recorded them, in one statement.

    For each ordering key among them, an advisory lock held until commit is taken first (keys
    sorted, so two transactions cannot deadlock on them). Rows of one ordering key therefore get
    their ids in commit order, and a row is only ever visible after every earlier row of its key.
    With ``notify``, one NOTIFY on ``OUTBOX_CHANNEL`` is delivered to listening relays at commit.
    A scheduled event (``OutboxMessage.scheduled``) goes to ``outbox_scheduled`` instead, with
    no lock (``append_scheduled``).
    """
    immediate, scheduled = split_scheduled(messages)
    if scheduled:
        await append_scheduled(conn, scheduled, notify=notify)
    if not immediate:
        return
    driver = await in_transaction(conn)
    await lock_ordering_keys(driver, ordering_keys_of(immediate), notify=notify)
    await driver.execute(APPEND_OUTBOX, *event_arrays(immediate))


def split_scheduled(
    messages: Sequence[OutboxMessage],
) -> tuple[list[OutboxMessage], list[OutboxMessage]]:
    """``messages`` as (due at once, scheduled), each in the given order."""
    immediate = [m for m in messages if not m.scheduled]
    if len(immediate) == len(messages):
        return immediate, []
    return immediate, [m for m in messages if m.scheduled]


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


CLAIM_OUTBOX = """
WITH claimed AS MATERIALIZED (
    SELECT o.id, o.message_id, o.exchange, o.routing_key, o.body, o.content_type, o.headers,
           o.correlation_id, o.causation_id, o.ordering_key, o.attempts, o.created_at
    FROM outbox AS o
    WHERE o.available_at <= now()
      AND (o.ordering_key IS NULL
           OR o.ordering_key != ALL ($1::text[])
              AND NOT EXISTS (SELECT * FROM outbox AS waiting
                              WHERE waiting.ordering_key = o.ordering_key
                                AND waiting.id < o.id AND waiting.available_at > now()))
    ORDER BY o.id
    LIMIT $2
    FOR UPDATE OF o SKIP LOCKED
)
SELECT claimed.id, claimed.message_id, claimed.exchange, claimed.routing_key, claimed.body,
       claimed.content_type, claimed.headers, claimed.correlation_id, claimed.causation_id,
       claimed.ordering_key, claimed.attempts, claimed.created_at
FROM claimed
WHERE claimed.ordering_key IS NULL
   OR NOT EXISTS (SELECT * FROM outbox AS older
                  WHERE older.ordering_key = claimed.ordering_key AND older.id < claimed.id
                    AND older.id NOT IN (SELECT claimed.id FROM claimed))
ORDER BY claimed.id
"""
"""``claim_outbox``'s one statement ($1: the busy ordering keys, $2: the limit): lock due rows,
then keep each key's unbroken run.

The ``claimed`` CTE (``MATERIALIZED``: it runs, and locks, exactly once) locks up to ``$2`` due
rows in id order, skipping rows other transactions hold, every row of an ordering key in ``$1``,
and every row of a key with an older row waiting for its retry (those could only be held back,
and a long run of them would fill every claim's limit and stall all other keys until the failed
row is published or parked). The outer query returns the rows of no key, and a key's row only
when no older row of its key is left outside ``claimed`` (held by another relay, committed since
the CTE looked, or beyond the limit)."""


async def claim_outbox(
    conn: Connection, limit: int, *, busy: Collection[str] = ()
) -> list[OutboxRow]:
    """Lock up to ``limit`` due rows in id order, skipping rows other relays hold and the rows
    of the ordering keys in ``busy`` (the keys this relay still has in flight); one round trip
    (``CLAIM_OUTBOX``).

    Of an ordering key's rows only an unbroken run from the key's oldest row is returned: a row
    whose older sibling is held by another relay, waiting for a retry, or not claimed here stays
    locked but unreturned, so no relay can publish a key's rows out of order. A ``busy`` key's
    rows are neither locked nor counted against ``limit``.
    """
    driver = await in_transaction(conn)
    rows = await driver.fetch(CLAIM_OUTBOX, list(busy), limit)
    return [_outbox_row(row) for row in rows]


def _outbox_row(row: Sequence[Any]) -> OutboxRow:
    """A claimed row as ``OutboxRow`` (its columns are the fields, in order); ``headers`` as a
    dict whether or not the connection decodes ``jsonb`` (SQLAlchemy's do, a bare one does not)."""
    fields = list(row)
    headers = fields[6]
    if isinstance(headers, str):
        fields[6] = json.loads(headers)
    return OutboxRow(*fields)


DELETE_OUTBOX = "DELETE FROM outbox WHERE id = ANY($1::bigint[])"
"""Delete the rows of the ids in ``$1``: one statement text however many ids (a statement whose
text changes with its batch is compiled and prepared again every time)."""


async def delete_outbox(conn: Connection, ids: Sequence[int]) -> None:
    """Delete published rows (in the transaction that claimed them), in one statement."""
    if ids:
        driver = await in_transaction(conn)
        await driver.execute(DELETE_OUTBOX, list(ids))


FAIL_OUTBOX_ROW = f"""
UPDATE outbox
SET attempts = attempts + 1, last_error = $2,
    available_at = now() + make_interval(
        secs => least({RETRY_DELAY_CAP_SECONDS}::float8, $3::float8 * power(2, attempts)))
WHERE id = $1
"""
"""Count a failed publish of row ``$1`` with error ``$2``: it waits ``$3 * 2**attempts`` seconds
(its attempts before this one; at most ``RETRY_DELAY_CAP_SECONDS``)."""

PARK_OUTBOX_ROWS = """
WITH moved AS (
    DELETE FROM outbox
    WHERE id = ANY($1::bigint[]) AND attempts >= $2
    RETURNING id, message_id, exchange, routing_key, body, content_type, headers,
              correlation_id, causation_id, ordering_key, attempts, last_error, created_at
)
INSERT INTO outbox_parked (id, message_id, exchange, routing_key, body, content_type, headers,
                           correlation_id, causation_id, ordering_key, attempts, last_error,
                           created_at)
SELECT id, message_id, exchange, routing_key, body, content_type, headers,
       correlation_id, causation_id, ordering_key, attempts, last_error, created_at
FROM moved
RETURNING id
"""
"""Move the rows of the ids in ``$1`` that have had ``$2`` attempts to ``outbox_parked``."""


async def fail_outbox(
    conn: Connection,
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
    driver = await in_transaction(conn)
    await driver.executemany(
        FAIL_OUTBOX_ROW, [(row_id, error, retry_delay) for row_id, error in errors.items()]
    )
    rows = await driver.fetch(PARK_OUTBOX_ROWS, list(errors), max_attempts)
    return [row_id for (row_id,) in rows]


# Scheduled events

SCHEDULED_NOTICE = "scheduled"
"""The payload of the NOTIFY on ``OUTBOX_CHANNEL`` sent by a commit that scheduled events: it
tells a relay that the earliest due time may have moved closer."""

MOVER_LOCK_CLASS = locks.MOVER
"""First key of the transaction-scoped advisory lock that lets one relay at a time move due
events (two movers could interleave one key's events due at the same instant)."""

APPEND_SCHEDULED = f"""
WITH notified AS (
    SELECT count(pg_notify('{OUTBOX_CHANNEL}', '{SCHEDULED_NOTICE}')) WHERE $12::boolean
)
INSERT INTO outbox_scheduled (message_id, exchange, routing_key, body, content_type, headers,
                              correlation_id, causation_id, ordering_key, due_at)
SELECT m.message_id, m.exchange, m.routing_key, m.body, m.content_type, m.headers::jsonb,
       m.correlation_id, m.causation_id, m.ordering_key,
       coalesce(m.due_at, now() + make_interval(secs => m.due_in))
FROM unnest($1::uuid[], $2::text[], $3::text[], $4::bytea[], $5::text[],
            $6::text[], $7::text[], $8::text[], $9::text[], $10::float8[], $11::timestamptz[])
     WITH ORDINALITY AS m(message_id, exchange, routing_key, body, content_type, headers,
                          correlation_id, causation_id, ordering_key, due_in, due_at, position)
WHERE (SELECT * FROM notified) >= 0
ORDER BY m.position
"""
"""Insert the scheduled events given as eleven arrays (``scheduled_arrays``), in their order, each
due at its ``due_at``, else ``due_in`` seconds after the transaction's start (``now()``); with
``$12``, one NOTIFY ``SCHEDULED_NOTICE`` for relays at commit."""


def scheduled_arrays(messages: Sequence[OutboxMessage]) -> list[list[Any]]:
    """The eleven arrays ``APPEND_SCHEDULED`` takes: ``event_arrays``' nine, then each message's
    ``due_in`` and ``due_at``."""
    return [
        *event_arrays(messages),
        [m.due_in for m in messages],
        [m.due_at for m in messages],
    ]


async def append_scheduled(
    conn: Connection, messages: Sequence[OutboxMessage], *, notify: bool
) -> None:
    """Insert scheduled events (``OutboxMessage.scheduled``) in ``conn``'s transaction, in one
    statement; no ordering lock is taken (a scheduled event's order is set when it is moved)."""
    if messages:
        driver = await in_transaction(conn)
        await driver.execute(APPEND_SCHEDULED, *scheduled_arrays(messages), notify)


DUE_SCHEDULED = f"""
SELECT s.id, s.ordering_key
FROM outbox_scheduled AS s
WHERE (SELECT pg_try_advisory_xact_lock({MOVER_LOCK_CLASS}, 0)) AND s.due_at <= now()
  AND NOT EXISTS (SELECT * FROM outbox AS o WHERE o.message_id = s.message_id)
  AND (s.ordering_key IS NULL OR s.ordering_key != ALL ($2::text[]))
ORDER BY s.due_at, s.id
LIMIT $1
FOR UPDATE OF s SKIP LOCKED
"""
"""Lock up to ``$1`` due events, earliest first, if this transaction is the one mover (else
none), leaving those of the ordering keys in ``$2``; their ids and ordering keys. An event whose
message id is still in ``outbox`` (an event of that id due at once, not yet published) waits
until that one has left: ``outbox``'s message ids are unique."""

TRY_ORDERING_LOCKS = f"""
SELECT k.key
FROM unnest($1::text[]) AS k(key)
WHERE pg_try_advisory_xact_lock({ORDERING_LOCK_CLASS}, hashtext(k.key))
"""
"""Of the ordering keys in ``$1``, those whose ordering lock this transaction now holds; a key
held by a transaction appending events of its own is skipped (never waited for, so a mover and a
producer cannot deadlock)."""

BLOCKED_KEYS = """
SELECT DISTINCT mine.ordering_key
FROM outbox_scheduled AS mine
WHERE mine.id = ANY($1::bigint[])
  AND EXISTS (SELECT * FROM outbox_scheduled AS earlier
              WHERE earlier.ordering_key = mine.ordering_key
                AND (earlier.due_at, earlier.id) < (mine.due_at, mine.id)
                AND earlier.id <> ALL ($1::bigint[]))
"""
"""Of the keyed scheduled events of the ids in ``$1``, the ordering keys with an earlier event
outside ``$1`` (one ``DUE_SCHEDULED`` skipped: another transaction holds it, or its message id
is still in ``outbox``): moving the key's later events would put them before it. One range scan
of ``ix_outbox_scheduled_ordering_key_due_at_id`` per event."""

MOVE_DUE = """
WITH moved AS (
    INSERT INTO outbox (message_id, exchange, routing_key, body, content_type, headers,
                        correlation_id, causation_id, ordering_key)
    SELECT message_id, exchange, routing_key, body, content_type, headers,
           correlation_id, causation_id, ordering_key
    FROM outbox_scheduled
    WHERE id = ANY($1::bigint[])
    ORDER BY due_at, id
    ON CONFLICT (message_id) DO NOTHING
    RETURNING message_id
), removed AS (
    DELETE FROM outbox_scheduled
    WHERE id = ANY($1::bigint[]) AND message_id IN (SELECT moved.message_id FROM moved)
    RETURNING id
)
SELECT count(*)::int FROM removed
"""
"""Move the scheduled events of the ids in ``$1`` into ``outbox``, in due order: their outbox
ids, and so their places in their keys' order, are given now; how many moved. One whose message
id an event committed to ``outbox`` since ``DUE_SCHEDULED`` looked has stays scheduled (a unique
violation would fail every move, and the relay)."""


NEXT_DUE_IN = """
SELECT extract(epoch FROM min(due_at) - now())::float8 FROM outbox_scheduled
"""
"""Seconds until the earliest scheduled event is due (negative: overdue); NULL when none is."""


async def move_due(conn: Connection, limit: int) -> int:
    """Move up to ``limit`` due events from ``outbox_scheduled`` into ``outbox``, earliest first,
    in ``conn``'s transaction; returns how many moved. None are moved while another transaction
    is moving (one mover at a time, by advisory lock): then ``next_due_in`` is negative.

    An ordering key's due events are left for a later call, whole, while another transaction
    holds the key (appending events of its own) or holds one of them (cancelling it: a rolled
    back cancel would leave that event behind the key's later ones) (``BLOCKED_KEYS``). When
    every event chosen is of such a key, the next ones of the other keys are chosen: those keys'
    events never hold back the rest."""
    driver = await in_transaction(conn)
    skipped: list[str] = []
    while True:
        due = await driver.fetch(DUE_SCHEDULED, limit, skipped)
        if not due:
            return 0
        keys = sorted({key for _, key in due if key is not None})
        held = {key for (key,) in await driver.fetch(TRY_ORDERING_LOCKS, keys)} if keys else set()
        chosen = [(row_id, key) for row_id, key in due if key is None or key in held]
        keyed = [row_id for row_id, key in chosen if key is not None]
        blocked = {key for (key,) in await driver.fetch(BLOCKED_KEYS, keyed)} if keyed else set()
        ids = [row_id for row_id, key in chosen if key is None or key not in blocked]
        if ids:
            moved: int = await driver.fetchval(MOVE_DUE, ids)
            return moved
        skipped += keys  # all held or blocked: each round leaves at least one more key


async def next_due_in(conn: Connection) -> float | None:
    """Seconds until the earliest scheduled event is due (negative when overdue), or None."""
    driver = await in_transaction(conn)
    seconds: float | None = await driver.fetchval(NEXT_DUE_IN)
    return seconds


BRING_FORWARD = """
UPDATE outbox_scheduled SET due_at = due_at - make_interval(secs => $1::float8)
"""
"""Make every scheduled event due ``$1`` seconds sooner (the test harness's ``advance``)."""


async def bring_forward(conn: Connection, seconds: float) -> None:
    """Make every scheduled event due ``seconds`` sooner, in ``conn``'s transaction: for tests,
    which cannot move the database's clock (``worker.testing.Harness.advance``)."""
    driver = await in_transaction(conn)
    await driver.execute(BRING_FORWARD, seconds)


CANCEL_SCHEDULED = "DELETE FROM outbox_scheduled WHERE message_id = $1 RETURNING true"
"""Delete the scheduled event of message id ``$1``; a row when there was one."""

CANCEL_DUE = "DELETE FROM outbox WHERE message_id = $1 RETURNING true"
"""Delete the unpublished event of message id ``$1`` from ``outbox`` (a relay publishing it holds
its row lock: the statement waits for that relay's transaction, then finds it gone)."""


async def cancel(conn: Connection, message_id: uuid.UUID) -> bool:
    """Delete the unpublished event ``message_id`` in ``conn``'s transaction: True if it was
    scheduled or waiting in ``outbox``, so that once this transaction commits it is never
    published; False if it was published already, parked, or never existed.

    Scheduled table first, then ``outbox`` (also when it was scheduled: the two tables' message
    ids are unique each, so an event published at once may share its id): an event a relay moves
    meanwhile is found in ``outbox`` by the next statement (a new snapshot under READ
    COMMITTED). No ordering lock is taken: while this transaction holds a scheduled event's
    row, the mover moves none of its key's later events (``BLOCKED_KEYS``), in case the cancel
    is rolled back.
    """
    if not isinstance(message_id, uuid.UUID):
        raise TypeError(f"message_id must be a uuid.UUID, not {type(message_id).__name__}")
    driver = await in_transaction(conn)
    if not await driver.fetchval(CANCEL_SCHEDULED, message_id):
        return bool(await driver.fetchval(CANCEL_DUE, message_id))
    await driver.fetchval(CANCEL_DUE, message_id)  # an event due at once may share its id
    return True
