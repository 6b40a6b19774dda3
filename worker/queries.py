"""Every SQL statement the worker runs on its own tables, and nowhere else.

Statements are SQLAlchemy Core with bound parameters; each function takes the caller's connection
so that it runs inside the caller's transaction.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    Float,
    Text,
    bindparam,
    cast,
    column,
    delete,
    func,
    or_,
    select,
    table,
    text,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, insert
from sqlalchemy.ext.asyncio import AsyncConnection

from worker.codec import to_jsonable
from worker.context import OutboxMessage
from worker.envelope import MAX_ATTEMPTS, Envelope
from worker.tables import inbox, outbox, outbox_parked, workflow_steps


@dataclass(frozen=True)
class InboxEntry:
    """The committed record of a key that someone else already claimed."""

    status: str
    fingerprint: bytes
    result: Any
    error: str | None


InboxKey = tuple[str, str]
"""(handler name, idempotency key): what identifies an effect in the inbox."""


async def claim_keys(
    conn: AsyncConnection,
    envelopes: Sequence[Envelope],
    *,
    owner: str | None = None,
    lease: float | None = None,
) -> set[InboxKey]:
    """Insert the envelopes' inbox rows in one statement; return the keys it claimed (the others
    were taken). The envelopes must have distinct keys, in the caller's lock order.

    A concurrent claim of the same key waits here until the other transaction ends: it then sees
    the committed row (not claimed) or, if the other rolled back, takes the key itself. A
    workflow's claim names its ``owner`` and holds the key for ``lease`` seconds.
    """
    stmt = (
        insert(inbox)
        .values(
            status="in_progress",
            owner=owner,
            lease_until=None if lease is None else func.now() + _seconds(lease),
        )
        .on_conflict_do_nothing(index_elements=[inbox.c.handler, inbox.c.key])
        .returning(inbox.c.handler, inbox.c.key)
    )
    rows = [
        {
            "handler": envelope.handler.name,
            "key": envelope.key,
            "fingerprint": envelope.fingerprint,
            "message_id": envelope.delivery.message_id,
            "routing_key": envelope.delivery.routing_key,
        }
        for envelope in envelopes
    ]
    # executemany: SQLAlchemy sends the rows as one multi-row INSERT of a cached statement
    return {(row.handler, row.key) for row in await conn.execute(stmt, rows)}


def _seconds(value: float) -> Any:
    """An SQL interval of ``value`` seconds."""
    return func.make_interval(0, 0, 0, 0, 0, 0, bindparam(None, value, type_=Float))


async def fetch_keys(conn: AsyncConnection, keys: Sequence[InboxKey]) -> dict[InboxKey, InboxEntry]:
    """The committed inbox rows of ``keys`` that exist."""
    stmt = select(
        inbox.c.handler,
        inbox.c.key,
        inbox.c.status,
        inbox.c.fingerprint,
        inbox.c.result,
        inbox.c.error,
    ).where(tuple_(inbox.c.handler, inbox.c.key).in_(keys))
    return {
        (row.handler, row.key): InboxEntry(
            row.status, bytes(row.fingerprint), row.result, row.error
        )
        for row in await conn.execute(stmt)
    }


async def complete_keys(conn: AsyncConnection, results: Sequence[tuple[str, str, Any]]) -> None:
    """Mark each (handler, key, result)'s key completed and store the handler's result with it,
    in one statement."""
    done = (
        func.unnest(
            bindparam("handlers", type_=ARRAY(Text)),
            bindparam("keys", type_=ARRAY(Text)),
            bindparam("results", type_=ARRAY(Text)),
        )
        .table_valued("handler", "key", "result")
        .render_derived()
    )
    stmt = (
        update(inbox)
        .where(inbox.c.handler == done.c.handler, inbox.c.key == done.c.key)
        .values(
            status="completed",
            result=cast(done.c.result, JSONB),
            owner=None,
            lease_until=None,
            updated_at=func.now(),
        )
    )
    # one statement of a fixed text, the rows as three arrays
    params = {
        "handlers": [handler for handler, _, _ in results],
        "keys": [key for _, key, _ in results],
        "results": [json.dumps(to_jsonable(result)) for _, _, result in results],
    }
    await conn.execute(stmt, params)


async def record_failure(
    conn: AsyncConnection, envelope: Envelope, *, error: str, attempts: int
) -> None:
    """Mark (handler, key) failed with ``error`` unless its effect has committed meanwhile.

    A later delivery of the key is then acknowledged without running the handler, until
    ``clear_failure`` (a DLQ replay) lets it run again.
    """
    stmt = insert(inbox).values(
        handler=envelope.handler.name,
        key=envelope.key,
        fingerprint=envelope.fingerprint,
        status="failed",
        error=error,
        attempts=attempts,
        message_id=envelope.delivery.message_id,
        routing_key=envelope.delivery.routing_key,
    )
    await conn.execute(
        stmt.on_conflict_do_update(
            index_elements=[inbox.c.handler, inbox.c.key],
            set_={
                "status": "failed",
                "error": stmt.excluded.error,
                "attempts": func.least(inbox.c.attempts + stmt.excluded.attempts, MAX_ATTEMPTS),
                "owner": None,
                "lease_until": None,
                "updated_at": func.now(),
            },
            where=inbox.c.status != "completed",
        )
    )


async def clear_failure(conn: AsyncConnection, handler: str, key: str) -> bool:
    """Forget that (handler, key) failed, so its next delivery runs; False if it had not.

    A workflow that had committed steps goes back to in progress with its lease expired, so the
    next delivery takes it over and resumes after its last committed step.
    """
    failed = (inbox.c.handler == handler, inbox.c.key == key, inbox.c.status == "failed")
    resumed = await conn.execute(
        update(inbox)
        .where(*failed, inbox.c.recovery_point.is_not(None))
        .values(status="in_progress", error=None, owner=None, lease_until=func.now())
        .returning(inbox.c.key)
    )
    if resumed.first() is not None:
        return True
    deleted = await conn.execute(delete(inbox).where(*failed).returning(inbox.c.key))
    return deleted.first() is not None


async def applied_revisions(conn: AsyncConnection, version_table: str) -> frozenset[str]:
    """The revisions an Alembic version table records; empty when the table does not exist."""
    if await conn.scalar(select(func.to_regclass(version_table))) is None:
        return frozenset()
    versions = table(version_table, column("version_num"))
    return frozenset((await conn.execute(select(versions.c.version_num))).scalars())


async def ping(conn: AsyncConnection) -> None:
    """One round trip to the server: raises when PostgreSQL does not answer."""
    await conn.execute(select(1))


async def take_over_workflow(
    conn: AsyncConnection, handler: str, key: str, *, owner: str, lease: float
) -> bool:
    """Make ``owner`` the owner of an in-progress workflow whose lease expired or was released.

    Compare-and-set: a workflow with a live lease, or one whose step transaction holds its row
    right now (``SKIP LOCKED``), is left alone and False is returned.
    """
    free = (
        select(inbox.c.handler, inbox.c.key)
        .where(
            inbox.c.handler == handler,
            inbox.c.key == key,
            inbox.c.status == "in_progress",
            or_(inbox.c.owner.is_(None), inbox.c.lease_until <= func.now()),
        )
        .with_for_update(skip_locked=True)
        .cte("free")
    )
    taken = await conn.execute(
        update(inbox)
        .where(inbox.c.handler == free.c.handler, inbox.c.key == free.c.key)
        .values(
            owner=owner,
            lease_until=func.now() + _seconds(lease),
            attempts=inbox.c.attempts + 1,
            updated_at=func.now(),
        )
        .returning(inbox.c.key)
    )
    return taken.first() is not None


async def hold_workflow(conn: AsyncConnection, handler: str, key: str, owner: str) -> bool:
    """Lock the workflow's inbox row until commit if ``owner`` still owns it; False if not.

    While a step's transaction holds the row, no other delivery can take the workflow over.
    """
    stmt = (
        select(inbox.c.key)
        .where(
            inbox.c.handler == handler,
            inbox.c.key == key,
            inbox.c.owner == owner,
            inbox.c.status == "in_progress",
        )
        .with_for_update()
    )
    return (await conn.execute(stmt)).first() is not None


async def workflow_outputs(conn: AsyncConnection, handler: str, key: str) -> dict[str, Any]:
    """The outputs of the workflow's committed steps, by step name, in the order they ran."""
    stmt = (
        select(workflow_steps.c.step, workflow_steps.c.output)
        .where(workflow_steps.c.handler == handler, workflow_steps.c.key == key)
        .order_by(workflow_steps.c.position)
    )
    return {step: output for step, output in await conn.execute(stmt)}


async def record_step(
    conn: AsyncConnection,
    handler: str,
    key: str,
    *,
    step: str,
    position: int,
    output: Any,
    lease: float,
) -> None:
    """Store a step's output, make it the recovery point and renew the owner's lease."""
    await conn.execute(
        insert(workflow_steps).values(
            handler=handler, key=key, step=step, position=position, output=to_jsonable(output)
        )
    )
    await conn.execute(
        update(inbox)
        .where(inbox.c.handler == handler, inbox.c.key == key)
        .values(
            recovery_point=step,
            lease_until=func.now() + _seconds(lease),
            updated_at=func.now(),
        )
    )


async def release_workflow(conn: AsyncConnection, handler: str, key: str, owner: str) -> None:
    """Give up ownership at once (after a failed try) so the next delivery need not wait."""
    await conn.execute(
        update(inbox)
        .where(
            inbox.c.handler == handler,
            inbox.c.key == key,
            inbox.c.owner == owner,
            inbox.c.status == "in_progress",
        )
        .values(owner=None, lease_until=func.now())
    )


@dataclass(frozen=True)
class WorkflowState:
    """An in-progress workflow, as ``worker workflows`` shows it."""

    handler: str
    key: str
    recovery_point: str | None
    owner: str | None
    lease_until: datetime | None
    attempts: int
    created_at: datetime
    updated_at: datetime


async def in_progress_workflows(conn: AsyncConnection, limit: int) -> list[WorkflowState]:
    """Workflows under way or waiting to be resumed, least recently advanced first."""
    columns = [inbox.c[name] for name in WorkflowState.__dataclass_fields__]
    stmt = (
        select(*columns)
        .where(inbox.c.status == "in_progress")
        .order_by(inbox.c.updated_at)
        .limit(limit)
    )
    return [WorkflowState(**row._asdict()) for row in await conn.execute(stmt)]


OUTBOX_CHANNEL = "worker_outbox"
"""The LISTEN/NOTIFY channel relays wait on; a notification is only a hint to look now."""

ORDERING_LOCK_CLASS = 7_262_001
"""First key of the transaction-scoped advisory locks that serialize an ordering key's rows."""

RETRY_DELAY_CAP_SECONDS = 300.0
"""A failed outbox row is retried at least this often, however many attempts it has had."""


async def _lock_ordering_keys(
    conn: AsyncConnection, ordering_keys: Iterable[str], *, notify: bool
) -> None:
    """Take the ordering keys' advisory locks, held until commit, in sorted order (so two
    transactions cannot deadlock on them), and with ``notify`` queue one NOTIFY for relays; one
    round trip, of one statement text whatever the keys."""
    keys = sorted(ordering_keys)
    if not keys and not notify:
        return
    locked = func.unnest(bindparam("keys", type_=ARRAY(Text))).table_valued("key").render_derived()
    lock = func.pg_advisory_xact_lock(ORDERING_LOCK_CLASS, func.hashtext(locked.c.key))
    stmt = select(func.count(lock)).select_from(locked)  # locks taken in the array's order
    if notify:
        stmt = stmt.add_columns(func.pg_notify(OUTBOX_CHANNEL, ""))
    await conn.execute(stmt, {"keys": keys})


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
    ordering_keys = {m.ordering_key for m in messages if m.ordering_key is not None}
    await _lock_ordering_keys(conn, ordering_keys, notify=notify)
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


async def synchronous_commit(conn: AsyncConnection) -> str:
    """The server's ``synchronous_commit`` for this connection ('off' breaks ack-after-commit)."""
    return str((await conn.execute(text("SHOW synchronous_commit"))).scalar_one())


# Retention

JANITOR_LOCK_CLASS = 7_262_002
"""First key of the session-level advisory lock (second key 0) held by the one sweeping janitor."""


async def try_lock_janitor(conn: AsyncConnection) -> bool:
    """Take the janitor lock for this session unless another session holds it; never waits."""
    stmt = select(func.pg_try_advisory_lock(JANITOR_LOCK_CLASS, 0))
    return bool((await conn.execute(stmt)).scalar_one())


async def unlock_janitor(conn: AsyncConnection) -> None:
    """Release the janitor lock this session holds."""
    await conn.execute(select(func.pg_advisory_unlock(JANITOR_LOCK_CLASS, 0)))


async def delete_expired_keys(conn: AsyncConnection, *, retention: float, limit: int) -> int:
    """Delete up to ``limit`` completed or failed keys untouched for ``retention`` seconds, oldest
    first; returns how many. Rows another transaction holds are skipped, never waited on, and
    ``in_progress`` keys are left alone whatever their age.
    """
    expired = (
        select(inbox.c.handler, inbox.c.key)
        .where(
            inbox.c.status.in_(("completed", "failed")),
            inbox.c.updated_at < func.now() - _seconds(retention),
        )
        .order_by(inbox.c.updated_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
        .cte("expired")
    )
    stmt = delete(inbox).where(inbox.c.handler == expired.c.handler, inbox.c.key == expired.c.key)
    return (await conn.execute(stmt)).rowcount


# Metrics


@dataclass(frozen=True)
class OutboxStats:
    """The outbox at a glance: rows waiting, how long the oldest has waited, rows backing off
    after a failed publish, rows parked."""

    backlog: int
    oldest_age_seconds: float
    waiting_for_retry: int
    parked: int


async def outbox_stats(conn: AsyncConnection) -> OutboxStats:
    """Rows waiting to be published (due or backing off), the age in seconds of the oldest (0 when
    there is none), those backing off (``available_at`` still ahead) and the rows in
    ``outbox_parked``, in one statement.

    One pass over each table: cheap while the relay keeps up (both hold few rows), a scan of the
    backlog when it does not.
    """
    waiting = (
        select(
            func.count().label("rows"),
            func.min(outbox.c.created_at).label("oldest"),
            func.count().filter(outbox.c.available_at > func.now()).label("backing_off"),
        )
        .select_from(outbox)
        .subquery()
    )
    age = func.greatest(func.extract("epoch", func.now() - waiting.c.oldest), 0)
    parked = select(func.count()).select_from(outbox_parked).scalar_subquery()
    row = (
        await conn.execute(
            select(waiting.c.rows, func.coalesce(age, 0), waiting.c.backing_off, parked)
        )
    ).one()
    return OutboxStats(
        backlog=int(row[0]),
        oldest_age_seconds=float(row[1]),
        waiting_for_retry=int(row[2]),
        parked=int(row[3]),
    )


async def inbox_counts(conn: AsyncConnection) -> dict[str, int]:
    """Inbox keys by status, exactly; a status without keys is absent.

    ``GROUP BY status`` reads the whole inbox (no index covers ``status``): on an inbox of
    millions of keys it takes seconds and much I/O, so call it rarely. ``pg_class.reltuples``
    would be free but only estimates the total, and not per status, until the next ANALYZE.
    """
    stmt = select(inbox.c.status, func.count()).group_by(inbox.c.status)
    return {status: int(count) for status, count in await conn.execute(stmt)}


# Admin


@dataclass(frozen=True)
class ParkedOutboxRow:
    """A row the relay gave up on, as ``worker outbox list`` shows it (without its body)."""

    id: int
    message_id: uuid.UUID
    exchange: str
    routing_key: str
    attempts: int
    last_error: str | None
    created_at: datetime
    parked_at: datetime
    ordering_key: str | None


async def parked_outbox(conn: AsyncConnection, limit: int) -> list[ParkedOutboxRow]:
    """Up to ``limit`` rows of ``outbox_parked``, parked longest first."""
    columns = [outbox_parked.c[name] for name in ParkedOutboxRow.__dataclass_fields__]
    stmt = select(*columns).order_by(outbox_parked.c.parked_at, outbox_parked.c.id).limit(limit)
    return [ParkedOutboxRow(**row._asdict()) for row in await conn.execute(stmt)]


@dataclass(frozen=True)
class RetriedOutboxRow:
    """A parked row moved back into the outbox: its parked (old) id and its new outbox id."""

    parked_id: int
    id: int
    message_id: uuid.UUID


async def retry_parked_outbox(
    conn: AsyncConnection, ids: Sequence[int] | None, *, notify: bool = False
) -> list[RetriedOutboxRow]:
    """Move parked rows (those in ``ids``, or all when None) back into ``outbox`` in one
    statement: ``DELETE ... RETURNING`` feeding an ``INSERT``, the reverse of ``fail_outbox``.

    A moved row keeps its ``message_id`` (consumers deduplicate a copy they already got), body,
    headers, ``created_at`` and ``last_error`` (why it was parked, until a new failure replaces
    it); ``attempts`` restarts at 0 and ``available_at`` is now, so the relay gives it a full
    ``relay_max_attempts`` again, at once. ``outbox.id`` is an identity column: the row gets a new
    id, after every row already in the outbox. Rows moved together keep their relative order.

    The ordering keys' advisory locks are taken first (sorted, as ``append_outbox`` does), so a
    moved row is placed among its key's rows as if it were emitted at this commit: its original
    place, before the key's newer rows, is not restored. With ``notify``, relays are woken at
    commit.
    """
    if ids is not None and not ids:
        return []
    which = [] if ids is None else [outbox_parked.c.id.in_(list(ids))]
    keys = (
        select(outbox_parked.c.ordering_key)
        .distinct()
        .where(*which, outbox_parked.c.ordering_key.is_not(None))
    )
    await _lock_ordering_keys(conn, (key for (key,) in await conn.execute(keys)), notify=notify)
    # A row parked by a relay after the keys were read is moved too, its key perhaps unlocked:
    # it then lands among its key's rows near, not exactly at, this commit.
    columns = [c.name for c in outbox_parked.c if c.name not in {"id", "attempts", "parked_at"}]
    moved = (
        delete(outbox_parked)
        .where(*which)
        .returning(outbox_parked.c.id, *(outbox_parked.c[name] for name in columns))
        .cte("moved")
    )
    inserted = (
        insert(outbox)
        .from_select(columns, select(*(moved.c[name] for name in columns)).order_by(moved.c.id))
        .returning(outbox.c.id, outbox.c.message_id)
        .cte("inserted")
    )
    stmt = (
        select(moved.c.id.label("parked_id"), inserted.c.id, inserted.c.message_id)
        .join_from(moved, inserted, moved.c.message_id == inserted.c.message_id)
        .order_by(inserted.c.id)
    )
    return [RetriedOutboxRow(**row._asdict()) for row in await conn.execute(stmt)]


# Verify


@dataclass(frozen=True)
class InProgressKey:
    """An in-progress inbox key that ``worker verify`` names as stuck."""

    handler: str
    key: str
    recovery_point: str | None
    lease_until: datetime | None
    updated_at: datetime


_IN_PROGRESS_KEY_COLUMNS = [inbox.c[name] for name in InProgressKey.__dataclass_fields__]


async def _in_progress_keys(
    conn: AsyncConnection, limit: int, *conditions: Any
) -> tuple[int, list[InProgressKey]]:
    """How many in-progress keys match ``conditions``, and the ``limit`` least recently updated."""
    stmt = (
        select(*_IN_PROGRESS_KEY_COLUMNS, func.count().over().label("total"))
        .where(inbox.c.status == "in_progress", *conditions)
        .order_by(inbox.c.updated_at, inbox.c.handler, inbox.c.key)
        .limit(limit)
    )
    rows = (await conn.execute(stmt)).all()
    keys = [InProgressKey(*row[: len(_IN_PROGRESS_KEY_COLUMNS)]) for row in rows]
    return (int(rows[0].total) if rows else 0), keys


async def stuck_unit_of_work_keys(
    conn: AsyncConnection, handlers: Sequence[str], limit: int
) -> tuple[int, list[InProgressKey]]:
    """In-progress keys no workflow holds: those of the (non-workflow) ``handlers``, and any
    without a lease (only a workflow's claim sets one). A unit of work never commits its key in
    progress, so each of these is stuck. Returns the count and the ``limit`` oldest."""
    condition = or_(inbox.c.lease_until.is_(None), inbox.c.handler.in_(list(handlers)))
    return await _in_progress_keys(conn, limit, condition)


async def expired_workflows(
    conn: AsyncConnection, handlers: Sequence[str], *, expired_for: float, limit: int
) -> tuple[int, list[InProgressKey]]:
    """In-progress workflows (keys with a lease, not of the non-workflow ``handlers``) whose lease
    expired more than ``expired_for`` seconds ago: nobody has resumed them since. Returns the
    count and the ``limit`` oldest."""
    return await _in_progress_keys(
        conn,
        limit,
        inbox.c.lease_until.is_not(None),
        inbox.c.handler.not_in(list(handlers)),
        inbox.c.lease_until < func.now() - _seconds(expired_for),
    )


async def in_progress_count(conn: AsyncConnection) -> int:
    """Inbox keys in progress (read from the partial index of in-progress keys)."""
    stmt = select(func.count()).select_from(inbox).where(inbox.c.status == "in_progress")
    return int((await conn.execute(stmt)).scalar_one())


@dataclass(frozen=True)
class LateOutboxRow:
    """An outbox row still unpublished after the age ``worker verify`` allows."""

    id: int
    message_id: uuid.UUID
    routing_key: str
    attempts: int
    last_error: str | None
    age_seconds: float


async def outbox_older_than(
    conn: AsyncConnection, age: float, limit: int
) -> tuple[int, list[LateOutboxRow]]:
    """Outbox rows created more than ``age`` seconds ago: how many, and the ``limit`` oldest."""
    stmt = (
        select(
            outbox.c.id,
            outbox.c.message_id,
            outbox.c.routing_key,
            outbox.c.attempts,
            outbox.c.last_error,
            func.extract("epoch", func.now() - outbox.c.created_at).label("age_seconds"),
            func.count().over().label("total"),
        )
        .where(outbox.c.created_at < func.now() - _seconds(age))
        .order_by(outbox.c.created_at, outbox.c.id)
        .limit(limit)
    )
    rows = (await conn.execute(stmt)).all()
    late = [
        LateOutboxRow(
            row.id,
            row.message_id,
            row.routing_key,
            row.attempts,
            row.last_error,
            float(row.age_seconds),
        )
        for row in rows
    ]
    return (int(rows[0].total) if rows else 0), late
