"""The statements of workflows that wait: their waits, the signals that resolve them, and the
signals that came before anyone waited for them.

Invariant: a wait is resolved once. Its ``outcome`` goes from NULL to ``event`` or ``timeout``
only by an ``UPDATE … WHERE outcome IS NULL``, so of a signal and a timeout that race, the row
lock lets exactly one change it; the other finds it resolved and changes nothing. A signal and
the registration of a wait for the same (routing key, correlation) both take
``lock_correlation`` first, so whichever commits second sees what the first did: a signal either
resolves the open wait or is buffered in ``workflow_signals``, where the wait registered after it
finds it.

Each statement is a named constant written whole, with fixed ``$1..$n`` parameters, run on the
asyncpg connection of the caller's transaction (``driver.in_transaction``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from worker.core.codec import to_jsonable
from worker.sql import locks
from worker.sql.driver import Connection, in_transaction
from worker.sql.rows import OutboxMessage

CORRELATION_LOCK_CLASS = locks.CORRELATION
"""First key of the transaction-scoped advisory lock of one (routing key, correlation): taken by
a signal before it resolves or buffers, and by a wait before it registers."""

TIMER_HEADER = "x-worker-timer"
"""On a wait's timer (its scheduled resume message): the name of the wait it times out."""

EVENT = "event"
"""The ``outcome`` of a wait a signal resolved."""

TIMEOUT = "timeout"
"""The ``outcome`` of a wait whose deadline passed first (for a sleep: that it has passed)."""

LOCK_CORRELATION = f"""
SELECT pg_advisory_xact_lock({CORRELATION_LOCK_CLASS}, hashtext($1 || chr(10) || $2))
"""
"""Take the lock of (routing key ``$1``, correlation ``$2``) until commit."""


async def lock_correlation(conn: Connection, routing_key: str, correlation: str) -> None:
    """Serialize this transaction with every other that signals or waits for (``routing_key``,
    ``correlation``), until commit."""
    driver = await in_transaction(conn)
    await driver.execute(LOCK_CORRELATION, routing_key, correlation)


@dataclass(frozen=True)
class WaitState:
    """A registered wait as a replay finds it: its outcome (None: open), the event that resolved
    it, and whether its deadline has passed by the database's clock."""

    outcome: str | None
    event: Any
    due: bool


FIND_WAIT = """
SELECT outcome, event::text, due_at <= now() FROM workflow_waits
WHERE handler = $1 AND key = $2 AND name = $3
FOR UPDATE
"""
"""The wait ``$3`` of workflow (``$1``, ``$2``), row-locked until commit."""


async def find_wait(conn: Connection, handler: str, key: str, name: str) -> WaitState | None:
    """The wait ``name`` of the workflow (``handler``, ``key``), locked until commit, or None."""
    driver = await in_transaction(conn)
    row = await driver.fetchrow(FIND_WAIT, handler, key, name)
    if row is None:
        return None
    outcome, event, due = row
    return WaitState(outcome, None if event is None else json.loads(event), bool(due))


RESOLVE_WAIT = """
UPDATE workflow_waits
SET outcome = $4, event = $5::text::jsonb, resolved_at = now()
WHERE handler = $1 AND key = $2 AND name = $3 AND outcome IS NULL
RETURNING true
"""
"""Resolve the open wait ``$3`` of workflow (``$1``, ``$2``) with outcome ``$4`` and event
``$5`` (JSON text); a row only if it was open."""


async def resolve_wait(
    conn: Connection, handler: str, key: str, name: str, *, outcome: str, event: Any = None
) -> bool:
    """Resolve the wait if it is open; False if it was resolved already (the other side won)."""
    driver = await in_transaction(conn)
    encoded = None if event is None else json.dumps(to_jsonable(event))
    return bool(await driver.fetchval(RESOLVE_WAIT, handler, key, name, outcome, encoded))


TAKE_BUFFERED_SIGNAL = """
WITH oldest AS (
    SELECT id FROM workflow_signals
    WHERE routing_key = $1 AND correlation = $2 AND consumed_at IS NULL
    ORDER BY id
    LIMIT 1
    FOR UPDATE
)
UPDATE workflow_signals AS s
SET consumed_at = now(), consumed_by_handler = $3, consumed_by_key = $4
FROM oldest
WHERE s.id = oldest.id
RETURNING s.event::text
"""
"""Mark the oldest unconsumed signal of (``$1``, ``$2``) consumed by workflow (``$3``, ``$4``);
its event as JSON text."""


async def take_buffered_signal(
    conn: Connection, routing_key: str, correlation: str, *, handler: str, key: str
) -> Any | None:
    """The event of the oldest signal of (``routing_key``, ``correlation``) that arrived before
    any wait for it, now consumed by the workflow (``handler``, ``key``); None if there is none.
    Call it holding ``lock_correlation``."""
    driver = await in_transaction(conn)
    event = await driver.fetchval(TAKE_BUFFERED_SIGNAL, routing_key, correlation, handler, key)
    return None if event is None else json.loads(event)


@dataclass(frozen=True)
class NewWait:
    """A wait to register: whose it is, what it waits for (no routing key: a sleep), how long,
    and the message that resumes its workflow (``resume``, scheduled ``timeout`` seconds later:
    the timer). ``event``: the buffered signal that resolves it at once (then no timer)."""

    handler: str
    key: str
    name: str
    routing_key: str | None
    correlation: str | None
    timeout: float
    resume: OutboxMessage
    event: Any = None


REGISTER_WAIT = """
INSERT INTO workflow_waits (handler, key, name, routing_key, correlation, due_at, timer_id,
                            resume_exchange, resume_routing_key, resume_body,
                            resume_content_type, resume_headers, resume_correlation_id,
                            outcome, event, resolved_at)
VALUES ($1, $2, $3, $4, $5, now() + make_interval(secs => $6::float8), $7, $8, $9, $10, $11,
        $12::text::jsonb, $13, $14, $15::text::jsonb, CASE WHEN $14::text IS NULL THEN NULL
                                                            ELSE now() END)
"""
"""Insert a wait due ``$6`` seconds after the transaction's start, by the database's clock (the
same ``now()`` its timer, scheduled in the same transaction with the same seconds, is due at)."""


async def register_wait(conn: Connection, wait: NewWait) -> None:
    """Insert ``wait``: open, with its timer's message id, or resolved at once by its ``event``
    (a buffered signal; then it has no timer)."""
    driver = await in_transaction(conn)
    resume = wait.resume
    resolved = wait.event is not None
    await driver.execute(
        REGISTER_WAIT,
        wait.handler,
        wait.key,
        wait.name,
        wait.routing_key,
        wait.correlation,
        wait.timeout,
        None if resolved else resume.message_id,
        resume.exchange,
        resume.routing_key,
        resume.body,
        resume.content_type,
        json.dumps(to_jsonable(resume.headers)),
        resume.correlation_id,
        EVENT if resolved else None,
        json.dumps(to_jsonable(wait.event)) if resolved else None,
    )


@dataclass(frozen=True)
class ResolvedWait:
    """A wait a signal just resolved: whose it is, its timer to cancel (None: none), and the
    message that resumes its workflow now (a new message id; the resume message of the wait)."""

    handler: str
    key: str
    name: str
    timer_id: uuid.UUID | None
    resume: OutboxMessage


RESOLVE_BY_SIGNAL = f"""
UPDATE workflow_waits
SET outcome = '{EVENT}', event = $3::text::jsonb, resolved_at = now()
WHERE routing_key = $1 AND correlation = $2 AND outcome IS NULL
RETURNING handler, key, name, timer_id, resume_exchange, resume_routing_key, resume_body,
          resume_content_type, resume_headers::text, resume_correlation_id
"""
"""Resolve every open wait for (``$1``, ``$2``) with event ``$3`` (JSON text); what resumes
each."""


async def resolve_by_signal(
    conn: Connection, routing_key: str, correlation: str, event: Any
) -> list[ResolvedWait]:
    """Resolve the open waits for (``routing_key``, ``correlation``) with ``event``: those whose
    timeout has not resolved them first. Call it holding ``lock_correlation``."""
    driver = await in_transaction(conn)
    rows = await driver.fetch(
        RESOLVE_BY_SIGNAL, routing_key, correlation, json.dumps(to_jsonable(event))
    )
    return [
        ResolvedWait(handler, key, name, timer_id, _resume_message(key, resume))
        for (handler, key, name, timer_id, *resume) in rows
    ]


def _resume_message(key: str, stored: Sequence[Any]) -> OutboxMessage:
    """A new message (its own id) from a wait's stored resume message (its ``resume_*`` columns,
    headers as JSON text), caused by the workflow's key."""
    exchange, routing_key, body, content_type, headers, correlation_id = stored
    return OutboxMessage(
        message_id=uuid.uuid4(),
        exchange=exchange,
        routing_key=routing_key,
        body=bytes(body),
        content_type=content_type,
        headers=json.loads(headers),
        correlation_id=correlation_id,
        causation_id=key,
        ordering_key=None,
    )


@dataclass(frozen=True)
class LastWait:
    """A workflow's open wait, else its last resolved one: its name, outcome (None: open),
    whether its deadline has passed, and a new copy of the message that resumes the workflow."""

    name: str
    outcome: str | None
    due: bool
    resume: OutboxMessage


LAST_WAIT = """
SELECT name, outcome, due_at <= now(), resume_exchange, resume_routing_key, resume_body,
       resume_content_type, resume_headers::text, resume_correlation_id
FROM workflow_waits
WHERE handler = $1 AND key = $2
ORDER BY outcome IS NULL DESC, resolved_at DESC, created_at DESC
LIMIT 1
"""


async def last_wait(conn: Connection, handler: str, key: str) -> LastWait | None:
    """The workflow's open wait, else the one resolved last; None if it never waited."""
    driver = await in_transaction(conn)
    row = await driver.fetchrow(LAST_WAIT, handler, key)
    if row is None:
        return None
    name, outcome, due, *resume = row
    return LastWait(name, outcome, bool(due), _resume_message(key, resume))


BUFFER_SIGNAL = """
INSERT INTO workflow_signals (routing_key, correlation, message_id, event)
VALUES ($1, $2, $3, $4::text::jsonb)
"""
"""Keep a signal no wait was open for, for a wait registered later (or retention)."""


async def buffer_signal(
    conn: Connection, routing_key: str, correlation: str, message_id: str | None, event: Any
) -> None:
    """Record a signal that found no open wait. Call it holding ``lock_correlation``."""
    driver = await in_transaction(conn)
    await driver.execute(
        BUFFER_SIGNAL, routing_key, correlation, message_id, json.dumps(to_jsonable(event))
    )


BRING_FORWARD = """
UPDATE workflow_waits SET due_at = due_at - make_interval(secs => $1::float8)
WHERE outcome IS NULL
"""
"""Make every open wait due ``$1`` seconds sooner (the test harness's ``advance``)."""


async def bring_forward(conn: Connection, seconds: float) -> None:
    """Make every open wait due ``seconds`` sooner, in ``conn``'s transaction, as
    ``outbox.bring_forward`` does for their timers: for tests, which cannot move the database's
    clock (``worker.testing.Harness.advance``)."""
    driver = await in_transaction(conn)
    await driver.execute(BRING_FORWARD, seconds)


DELETE_EXPIRED_SIGNALS = """
DELETE FROM workflow_signals
WHERE id IN (SELECT id FROM workflow_signals
             WHERE received_at < now() - make_interval(secs => $1::float8)
             ORDER BY received_at
             LIMIT $2
             FOR UPDATE SKIP LOCKED)
"""
"""Delete up to ``$2`` signals received more than ``$1`` seconds ago, oldest first."""


async def delete_expired_signals(conn: Connection, *, retention: float, limit: int) -> int:
    """Delete up to ``limit`` signals received more than ``retention`` (the inbox's) seconds
    ago, consumed by a wait or not (one nobody waited for within that time is dropped), oldest
    first; returns how many. Rows another transaction holds are skipped, never waited on."""
    driver = await in_transaction(conn)
    status: str = await driver.execute(DELETE_EXPIRED_SIGNALS, retention, limit)
    return int(status.split()[-1])
