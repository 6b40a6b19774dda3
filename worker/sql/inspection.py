"""Read-mostly statements for operators: metrics' counts, the admin and verify views,
and putting parked outbox rows back.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    and_,
    delete,
    func,
    literal,
    null,
    or_,
    select,
    text,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from worker.sql.outbox import lock_ordering_keys
from worker.sql.tables import (
    inbox,
    interval,
    outbox,
    outbox_parked,
    outbox_scheduled,
    workflow_waits,
)
from worker.sql.waits import TIMER_HEADER


@dataclass(frozen=True)
class WorkflowState:
    """An in-progress workflow, as ``worker workflows`` shows it: running (or due to be taken
    over), or waiting (``wait`` names its open wait: for the signal ``wait_routing_key`` with
    ``wait_correlation``, or a sleep when that is None, until ``wait_due_at`` by the database's
    clock)."""

    handler: str
    key: str
    recovery_point: str | None
    owner: str | None
    lease_until: datetime | None
    attempts: int
    created_at: datetime
    updated_at: datetime
    wait: str | None = None
    wait_routing_key: str | None = None
    wait_correlation: str | None = None
    wait_due_at: datetime | None = None


_OPEN_WAIT = and_(
    workflow_waits.c.handler == inbox.c.handler,
    workflow_waits.c.key == inbox.c.key,
    workflow_waits.c.outcome.is_(None),
)
"""Joins an inbox row to its workflow's open wait (a workflow has at most one)."""

_WORKFLOW_COLUMNS = [
    *(inbox.c[name] for name in list(WorkflowState.__dataclass_fields__)[:8]),
    workflow_waits.c.name.label("wait"),
    workflow_waits.c.routing_key.label("wait_routing_key"),
    workflow_waits.c.correlation.label("wait_correlation"),
    workflow_waits.c.due_at.label("wait_due_at"),
]


async def in_progress_workflows(
    conn: AsyncConnection, limit: int, *, waiting: bool | None = None
) -> list[WorkflowState]:
    """Workflows under way, waiting (for a signal or a deadline) or to be resumed, least
    recently advanced first; with ``waiting``, only those that wait (True) or do not (False)."""
    stmt = (
        select(*_WORKFLOW_COLUMNS)
        .select_from(inbox.outerjoin(workflow_waits, _OPEN_WAIT))
        .where(inbox.c.status == "in_progress")
        .order_by(inbox.c.updated_at)
        .limit(limit)
    )
    if waiting is not None:
        opened = workflow_waits.c.name.is_not(None)
        stmt = stmt.where(opened if waiting else ~opened)
    return [WorkflowState(**row._asdict()) for row in await conn.execute(stmt)]


async def waiting_workflows(conn: AsyncConnection) -> int:
    """How many workflows wait (for a signal or a deadline): their open waits, one at most per
    workflow (read from the partial index of open waits)."""
    stmt = (
        select(func.count()).select_from(workflow_waits).where(workflow_waits.c.outcome.is_(None))
    )
    return int((await conn.execute(stmt)).scalar_one())


@dataclass(frozen=True)
class OutboxStats:
    """The outbox at a glance: rows waiting, how long the oldest has waited, rows backing off
    after a failed publish, rows parked, and events scheduled for later (``scheduled``, an
    estimate when ``scheduled_estimated``) with the age of the oldest one due but not yet moved
    into the outbox (``scheduled_overdue_seconds``, 0 when none is)."""

    backlog: int
    oldest_age_seconds: float
    waiting_for_retry: int
    parked: int
    scheduled: int
    scheduled_estimated: bool
    scheduled_overdue_seconds: float


EXACT_SCHEDULED_COUNT_LIMIT = 100_000
"""Up to this many rows ``outbox_stats`` counts ``outbox_scheduled`` exactly (an index range read
that stops after one more); above, it takes PostgreSQL's statistics' estimate."""

SCHEDULED_SIZE = text(
    "SELECT greatest(s.n_live_tup, c.reltuples, 0)::bigint"
    " FROM pg_class AS c"
    " LEFT JOIN pg_stat_user_tables AS s ON s.relid = c.oid"
    " WHERE c.oid = 'outbox_scheduled'::regclass"
)
"""``outbox_scheduled``'s live rows as the statistics know them (the larger of the cumulative
statistics' count and the last VACUUM or ANALYZE's); no table is read."""


async def outbox_stats(
    conn: AsyncConnection, *, exact_scheduled_up_to: int = EXACT_SCHEDULED_COUNT_LIMIT
) -> OutboxStats:
    """Rows waiting to be published (due or backing off), the age in seconds of the oldest (0 when
    there is none), those backing off (``available_at`` still ahead), the rows in
    ``outbox_parked``, and the scheduled events, in two statements.

    One pass over each of ``outbox`` and ``outbox_parked``: cheap while the relay keeps up (both
    hold few rows), a scan of the backlog when it does not. ``outbox_scheduled`` may hold millions
    of future events and is never read whole: its rows are counted up to ``exact_scheduled_up_to``
    (a read of the ``(due_at, id)`` index that stops after one more row) and estimated from the
    statistics above; its earliest ``due_at`` is the first entry of that index. The overdue age,
    ``now() - min(due_at)`` when that is past, is how long a due event has waited for a relay to
    move it (0 when none is due).
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
    first = select(outbox_scheduled.c.due_at).order_by(outbox_scheduled.c.due_at).limit(1)
    overdue = func.greatest(func.extract("epoch", func.now() - first.scalar_subquery()), 0)
    some = select(outbox_scheduled.c.id).limit(exact_scheduled_up_to + 1).subquery()
    counted = select(func.count()).select_from(some).scalar_subquery()
    row = (
        await conn.execute(
            select(
                waiting.c.rows,
                func.coalesce(age, 0),
                waiting.c.backing_off,
                parked,
                counted,
                func.coalesce(overdue, 0),
            )
        )
    ).one()
    scheduled, estimated = int(row[4]), False
    if scheduled > exact_scheduled_up_to:
        scheduled, estimated = int((await conn.execute(SCHEDULED_SIZE)).scalar_one()), True
    return OutboxStats(
        backlog=int(row[0]),
        oldest_age_seconds=float(row[1]),
        waiting_for_retry=int(row[2]),
        parked=int(row[3]),
        scheduled=scheduled,
        scheduled_estimated=estimated,
        scheduled_overdue_seconds=float(row[5]),
    )


async def inbox_counts(conn: AsyncConnection) -> dict[str, int]:
    """Inbox keys by status, exactly; a status without keys is absent.

    ``GROUP BY status`` reads the whole inbox (no index covers ``status``): on an inbox of
    millions of keys it takes seconds and much I/O, so call it rarely (``worker status``);
    the metrics use ``inbox_gauge``.
    """
    stmt = select(inbox.c.status, func.count()).group_by(inbox.c.status)
    return {status: int(count) for status, count in await conn.execute(stmt)}


EXACT_INBOX_COUNT_LIMIT = 100_000
"""Up to about this many rows ``inbox_gauge`` counts the inbox exactly (a whole-inbox read of
some 2,500 pages); above, it estimates."""

INBOX_SIZE = text(
    "SELECT greatest(s.n_live_tup, c.reltuples)::bigint,"
    " p.most_common_vals::text::text[], p.most_common_freqs"
    " FROM pg_class AS c"
    " LEFT JOIN pg_stat_user_tables AS s ON s.relid = c.oid"
    " LEFT JOIN pg_stats AS p ON p.schemaname = c.relnamespace::regnamespace::text"
    "  AND p.tablename = c.relname AND p.attname = 'status'"
    " WHERE c.oid = 'inbox'::regclass"
)
"""The inbox's live rows as the statistics know them (the larger of the cumulative statistics'
count and the last VACUUM or ANALYZE's), and the shares of ``status`` values the last ANALYZE
found; no table is read."""


@dataclass(frozen=True)
class InboxGauge:
    """Inbox keys by status for the metrics; ``estimated`` when they come from the statistics."""

    counts: dict[str, int]
    estimated: bool


async def inbox_gauge(
    conn: AsyncConnection, *, exact_up_to: int = EXACT_INBOX_COUNT_LIMIT
) -> InboxGauge:
    """Inbox keys by status, cheaply whatever the inbox's size.

    An inbox the statistics put at ``exact_up_to`` rows or fewer is counted exactly
    (``inbox_counts``). A larger one is never read as a whole: ``in_progress`` keys are counted
    exactly through their partial index, ``failed`` ones estimated from the share of the status
    the last ANALYZE found (0 before any, and when its sample held none), ``completed`` as the
    rest of the live rows.
    """
    size, values, shares = (await conn.execute(INBOX_SIZE)).one()
    if size is None or size <= exact_up_to:
        return InboxGauge(await inbox_counts(conn), estimated=False)
    in_progress = int(
        await conn.scalar(
            select(func.count()).select_from(inbox).where(inbox.c.status == "in_progress")
        )
        or 0
    )
    share = dict(zip(values or (), shares or (), strict=True))
    failed = round(share.get("failed", 0.0) * size)
    completed = max(0, size - in_progress - failed)
    counts = {"completed": completed, "failed": failed, "in_progress": in_progress}
    return InboxGauge(counts, estimated=True)


OUTBOX_STATES = ("scheduled", "pending", "backing-off", "parked")
"""The states of an unpublished event, in the order an event moves through them: ``scheduled``
(in ``outbox_scheduled``, waiting for its ``due_at``, or due and not yet moved by a relay),
``pending`` (in ``outbox``, due: a relay takes it next), ``backing-off`` (in ``outbox``, its
``available_at`` still ahead after a failed publish) and ``parked`` (in ``outbox_parked``: the
relay gave up on it)."""

RETRY_STATES = ("backing-off", "parked")
"""The states ``worker outbox retry`` acts on (a pending row is due already)."""


@dataclass(frozen=True)
class OutboxCounts:
    """Unpublished events by state (of ``OUTBOX_STATES``), each counted exactly up to
    ``up_to``; a count above ``up_to`` means "more than ``up_to``" (``more_than``)."""

    counts: dict[str, int]
    up_to: int

    def more_than(self, state: str) -> bool:
        """Whether ``state`` holds more rows than were counted."""
        return self.counts[state] > self.up_to


OUTBOX_COUNT_LIMIT = 1_000
"""Rows ``outbox_counts`` counts at most in each state (a range of an index, never a table)."""


def outbox_counts_query(up_to: int = OUTBOX_COUNT_LIMIT) -> Any:
    """The statement of ``outbox_counts``: one capped count per state, each the first
    ``up_to + 1`` entries of the index ``entries_query`` reads that state's rows from."""

    def counted(state: str) -> Any:
        entries = entries_query(state, up_to + 1)
        first = entries.with_only_columns(entries.selected_columns.id).subquery()
        return select(func.count()).select_from(first).scalar_subquery()

    return select(*(counted(state) for state in OUTBOX_STATES))


async def outbox_counts(conn: AsyncConnection, up_to: int = OUTBOX_COUNT_LIMIT) -> OutboxCounts:
    """Unpublished events by state, each counted exactly up to ``up_to`` rows and read from
    an index range that stops there: unlike ``outbox_stats``, it costs the same on an outbox
    of millions (a backlog the relay does not keep up with)."""
    row = (await conn.execute(outbox_counts_query(up_to))).one()
    return OutboxCounts(dict(zip(OUTBOX_STATES, map(int, row), strict=True)), up_to)


@dataclass(frozen=True)
class OutboxEntry:
    """An unpublished event as ``worker outbox list`` shows it (without its body or headers).

    ``available_at`` is when a relay may next publish it (a scheduled event's ``due_at``) and
    ``due_in_seconds`` how long that is from the database's ``now()``: 0 once due, except for a
    scheduled event, where it is negative once overdue (due, and not yet moved into the outbox
    by a relay). Both are None for a parked row, and ``parked_at`` is None for any other.
    ``last_error`` is the last failed publish's error (kept by a row moved back from
    ``outbox_parked`` until a new failure replaces it); a scheduled event has none, and 0
    ``attempts``. ``timer`` is, for a waiting workflow's timer, the name of the wait it ends
    (None for any other event).
    """

    state: str
    id: int
    message_id: uuid.UUID
    exchange: str
    routing_key: str
    ordering_key: str | None
    attempts: int
    last_error: str | None
    created_at: datetime
    available_at: datetime | None
    due_in_seconds: float | None
    parked_at: datetime | None
    timer: str | None


_ENTRY_COLUMNS = (
    *("id", "message_id", "exchange", "routing_key", "ordering_key"),
    *("attempts", "last_error", "created_at"),
)


def _routing_key_is(table: Any, routing_key: str | None) -> list[Any]:
    return [] if routing_key is None else [table.c.routing_key == routing_key]


@dataclass(frozen=True)
class OutboxCursor:
    """Where a page of ``outbox_entries`` ends: the last row's ``available_at`` (a scheduled
    event's ``due_at``; None for a parked row) and its id. The next page starts after it."""

    at: datetime | None
    id: int

    @classmethod
    def of(cls, entry: OutboxEntry) -> OutboxCursor:
        """The cursor just after ``entry``."""
        return cls(entry.available_at, entry.id)


async def outbox_entries(
    conn: AsyncConnection,
    state: str,
    limit: int,
    *,
    routing_key: str | None = None,
    ids: Sequence[int] | None = None,
    after: OutboxCursor | None = None,
    scan: int | None = None,
) -> list[OutboxEntry]:
    """Up to ``limit`` rows in ``state`` (one of ``OUTBOX_STATES``), of ``routing_key`` if given,
    with ``ids`` if given, after the cursor ``after`` if given.

    Scheduled rows come earliest due first (``due_at``, then id), pending and backing-off rows in
    the order the relay takes them (``available_at``, then id), parked rows oldest first (by id,
    the id they had in the outbox). Each is one range scan of an index
    (``ix_outbox_scheduled_due_at_id``, ``ix_outbox_available_at_id``, the parked table's primary
    key) that stops after ``limit`` rows: cheap on an outbox of millions; a page after a cursor
    starts where the previous one ended, in the same index (keyset pagination). A
    ``routing_key`` is a filter on that scan (no index holds it, and one more on the outbox would
    cost every publish), so a routing key with few rows among many reads further before it finds
    ``limit`` of them. With ``scan`` it seeks them among the first ``scan`` rows of the range
    only (a LIMIT under the filter, so the read is bounded however rare the routing key), and
    ``scan_end`` says where the next window of ``scan`` rows starts.
    """
    stmt = entries_query(state, limit, routing_key=routing_key, ids=ids, after=after, scan=scan)
    entries = []
    for row in await conn.execute(stmt):
        values = row._asdict()
        if values["due_in_seconds"] is not None:
            values["due_in_seconds"] = float(values["due_in_seconds"])  # (numeric: a Decimal)
        entries.append(OutboxEntry(state=state, **values))
    return entries


def entries_query(
    state: str,
    limit: int,
    *,
    routing_key: str | None = None,
    ids: Sequence[int] | None = None,
    after: OutboxCursor | None = None,
    scan: int | None = None,
) -> Any:
    """The statement ``outbox_entries`` runs (exposed for its query plan to be checked)."""
    columns: list[Any]
    where: list[Any]
    due_in: Any
    if state == "parked":
        table = outbox_parked
        extra = [null().label("available_at"), null().label("due_in_seconds"), table.c.parked_at]
        where = []
        order = [table.c.id]
        columns = [table.c[name] for name in _ENTRY_COLUMNS]
    elif state == "scheduled":
        table = outbox_scheduled
        due_in = func.extract("epoch", table.c.due_at - func.now())
        extra = [
            table.c.due_at.label("available_at"),
            due_in.label("due_in_seconds"),
            null().label("parked_at"),
        ]
        where = []
        order = [table.c.due_at, table.c.id]
        unpublished = {"attempts": literal(0), "last_error": null()}
        columns = [
            unpublished[name].label(name) if name in unpublished else table.c[name]
            for name in _ENTRY_COLUMNS
        ]
    else:
        table = outbox
        due_in = func.greatest(func.extract("epoch", table.c.available_at - func.now()), 0)
        extra = [table.c.available_at, due_in.label("due_in_seconds"), null().label("parked_at")]
        due = table.c.available_at <= func.now()
        where = [due if state == "pending" else ~due]
        order = [table.c.available_at, table.c.id]
        columns = [table.c[name] for name in _ENTRY_COLUMNS]
    if ids is not None:
        where.append(table.c.id.in_(list(ids)))
    if after is not None:
        where.append(
            table.c.id > after.id
            if len(order) == 1 or after.at is None
            else tuple_(*order) > tuple_(literal(after.at, order[0].type), literal(after.id))
        )
    timer = table.c.headers[TIMER_HEADER].astext.label("timer")
    keyed = _routing_key_is(table, routing_key)
    if scan is None or not keyed:
        return select(*columns, *extra, timer).where(*where, *keyed).order_by(*order).limit(limit)
    # The routing key among the first ``scan`` rows of the range: the filter over a LIMIT.
    window = select(*columns, *extra, timer).where(*where).order_by(*order).limit(scan)
    rows = window.subquery("window")
    listed = [rows.c[_LISTED_AS.get(column.name, column.name)] for column in order]
    return select(rows).where(rows.c.routing_key == routing_key).order_by(*listed).limit(limit)


_LISTED_AS = {"due_at": "available_at"}
"""The name an ordering column has among ``entries_query``'s columns (a scheduled event's
``due_at`` is listed as its ``available_at``)."""


def scan_end_query(state: str, scan: int, *, after: OutboxCursor | None = None) -> Any:
    """The statement of ``scan_end``: the cursor columns of the ``scan``-th row of the range
    after ``after`` and of the row past it, as far as there are (an index range of ``scan`` + 1
    entries)."""
    entries = entries_query(state, 2, after=after).offset(scan - 1)
    return entries.with_only_columns(
        entries.selected_columns.available_at, entries.selected_columns.id
    )


async def scan_end(
    conn: AsyncConnection, state: str, scan: int, *, after: OutboxCursor | None = None
) -> OutboxCursor | None:
    """Where the window of ``scan`` rows of ``state`` after ``after`` ends (the cursor after
    its last row) when the range holds more rows past it; None when the window reaches the
    range's end. A page of one routing key read with ``scan`` continues from there."""
    found = (await conn.execute(scan_end_query(state, scan, after=after))).all()
    if len(found) < 2:
        return None
    return OutboxCursor(found[0].available_at, found[0].id)


async def parked_message_ids(
    conn: AsyncConnection, message_ids: Sequence[uuid.UUID]
) -> list[uuid.UUID]:
    """Those of ``message_ids`` parked in ``outbox_parked`` (through its unique index on
    ``message_id``)."""
    stmt = select(outbox_parked.c.message_id).where(
        outbox_parked.c.message_id.in_(list(message_ids))
    )
    return [message_id for (message_id,) in await conn.execute(stmt)]


async def open_wait_timers(
    conn: AsyncConnection, message_ids: Sequence[uuid.UUID]
) -> list[uuid.UUID]:
    """Those of ``message_ids`` that are the timer of a workflow's open wait: the only thing
    that ends that wait if its signal never comes (a sleep's, the only thing at all)."""
    stmt = select(workflow_waits.c.timer_id).where(
        workflow_waits.c.timer_id.in_(list(message_ids)), workflow_waits.c.outcome.is_(None)
    )
    return [message_id for (message_id,) in await conn.execute(stmt)]


@dataclass(frozen=True)
class HurriedOutboxRow:
    """A backing-off row made due now: its id, message id, routing key and failed attempts."""

    id: int
    message_id: uuid.UUID
    routing_key: str
    attempts: int


async def hurry_outbox(
    conn: AsyncConnection,
    ids: Sequence[int] | None,
    *,
    routing_key: str | None = None,
    notify: bool = False,
) -> list[HurriedOutboxRow]:
    """Make backing-off rows (``available_at`` ahead of the database's ``now()``) due now: those
    with ``ids``, else those of ``routing_key``, else all; one ``UPDATE``, on the
    ``available_at`` index's range of rows still ahead.

    A row keeps its ``attempts`` and ``last_error``: it is tried now, not forgiven, so one that
    fails again backs off from where it was (and is parked after its last attempt). It keeps its
    id, hence its place among its ordering key's rows. With ``notify``, relays are woken at
    commit.
    """
    if ids is not None and not ids:
        return []
    which = [] if ids is None else [outbox.c.id.in_(list(ids))]
    stmt = (
        update(outbox)
        .where(outbox.c.available_at > func.now(), *which, *_routing_key_is(outbox, routing_key))
        .values(available_at=func.now())
        .returning(outbox.c.id, outbox.c.message_id, outbox.c.routing_key, outbox.c.attempts)
    )
    hurried = [HurriedOutboxRow(**row._asdict()) for row in await conn.execute(stmt)]
    if hurried:
        await lock_ordering_keys(conn, (), notify=notify)
    return sorted(hurried, key=lambda row: row.id)


async def pending_outbox_ids(conn: AsyncConnection, ids: Sequence[int]) -> list[int]:
    """Those of ``ids`` that are in the outbox and due: nothing to hurry, a relay takes them."""
    due = outbox.c.available_at <= func.now()
    stmt = select(outbox.c.id).where(outbox.c.id.in_(list(ids)), due)
    return sorted(row_id for (row_id,) in await conn.execute(stmt))


@dataclass(frozen=True)
class RetriedOutboxRow:
    """A parked row moved back into the outbox: its parked (old) id and its new outbox id."""

    parked_id: int
    id: int
    message_id: uuid.UUID
    routing_key: str


async def retry_parked_outbox(
    conn: AsyncConnection,
    ids: Sequence[int] | None,
    *,
    routing_key: str | None = None,
    notify: bool = False,
) -> list[RetriedOutboxRow]:
    """Move parked rows (those in ``ids``, else those of ``routing_key``, else all) back into
    ``outbox`` in one statement: ``DELETE ... RETURNING`` feeding an ``INSERT``, the reverse of
    ``fail_outbox``.

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
    which += _routing_key_is(outbox_parked, routing_key)
    keys = (
        select(outbox_parked.c.ordering_key)
        .distinct()
        .where(*which, outbox_parked.c.ordering_key.is_not(None))
    )
    await lock_ordering_keys(conn, (key for (key,) in await conn.execute(keys)), notify=notify)
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
        .returning(outbox.c.id, outbox.c.message_id, outbox.c.routing_key)
        .cte("inserted")
    )
    stmt = (
        select(
            moved.c.id.label("parked_id"),
            inserted.c.id,
            inserted.c.message_id,
            inserted.c.routing_key,
        )
        .join_from(moved, inserted, moved.c.message_id == inserted.c.message_id)
        .order_by(inserted.c.id)
    )
    return [RetriedOutboxRow(**row._asdict()) for row in await conn.execute(stmt)]


@dataclass(frozen=True)
class InProgressKey:
    """An in-progress inbox key that ``worker verify`` names as stuck; ``wait_due_at`` is the
    deadline of the workflow's open wait, if it waits."""

    handler: str
    key: str
    recovery_point: str | None
    lease_until: datetime | None
    updated_at: datetime
    wait_due_at: datetime | None = None


_IN_PROGRESS_KEY_COLUMNS = [
    *(inbox.c[name] for name in ("handler", "key", "recovery_point", "lease_until", "updated_at")),
    workflow_waits.c.due_at.label("wait_due_at"),
]


async def _in_progress_keys(
    conn: AsyncConnection, limit: int, *conditions: Any
) -> tuple[int, list[InProgressKey]]:
    """How many in-progress keys match ``conditions``, and the ``limit`` least recently updated."""
    stmt = (
        select(*_IN_PROGRESS_KEY_COLUMNS, func.count().over().label("total"))
        .select_from(inbox.outerjoin(workflow_waits, _OPEN_WAIT))  # (one open wait at most)
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
    expired more than ``expired_for`` seconds ago: nobody has resumed them since. A workflow that
    waits released its lease on purpose: it is stuck only when its wait's deadline passed more
    than ``expired_for`` seconds ago (its timer should have resumed it). Returns the count and
    the ``limit`` oldest."""
    long_ago = func.now() - interval(expired_for)
    not_waiting_in_time = or_(  # (the open wait that _in_progress_keys joins, if any)
        workflow_waits.c.due_at.is_(None), workflow_waits.c.due_at < long_ago
    )
    return await _in_progress_keys(
        conn,
        limit,
        inbox.c.lease_until.is_not(None),
        inbox.c.handler.not_in(list(handlers)),
        inbox.c.lease_until < long_ago,
        not_waiting_in_time,
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
        .where(outbox.c.created_at < func.now() - interval(age))
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
