"""Every statement on ``process_samples``: the row each running worker and relay process writes
of itself every few seconds, and what ``worker status`` and the console read of every process.

Invariant: every statement is bounded however large the table grows. A write inserts one row and
expires at most ``limit`` old rows, oldest first, skipping rows another process's expiry holds;
every read is an index range of ``sampled_at`` (or, per process, of ``(process, sampled_at)``)
under a LIMIT, so none reads the whole table. Times are the database's: a row's ``sampled_at`` is
``now()`` when it was written, and ages are measured against ``now()`` when it is read.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    DateTime,
    Delete,
    Float,
    Integer,
    Text,
    any_,
    bindparam,
    cast,
    delete,
    func,
    literal,
    literal_column,
    select,
    true,
    tuple_,
)
from sqlalchemy.dialects.postgresql import JSONB, distinct_on, insert
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql import Select

from worker.sql.tables import interval, process_samples

MAX_PROCESSES = 500
"""The most processes one read returns (or, for ``series``, looks at): a deployment runs a few,
and a restart makes a new one; beyond this the rest are left out rather than read."""


class Gauge(enum.StrEnum):
    """The keys of a sample's ``gauges``: the backlogs its process saw. Each is a number, or
    null when the process could not see it (a missing queue, a refresh that failed)."""

    OUTBOX_BACKLOG = "outbox_backlog"
    """Outbox rows not yet published (due or backing off)."""
    OUTBOX_OLDEST_AGE = "outbox_oldest_age_seconds"
    """Seconds the oldest unpublished outbox row has waited (0 when there is none)."""
    OUTBOX_BACKING_OFF = "outbox_backing_off"
    """Outbox rows waiting out a retry delay after a failed publish."""
    OUTBOX_PARKED = "outbox_parked"
    """Rows in ``outbox_parked``, given up by a relay."""
    OUTBOX_SCHEDULED = "outbox_scheduled"
    """Events scheduled for later (estimated above ``inspection.EXACT_SCHEDULED_COUNT_LIMIT``)."""
    WORK_QUEUE = "work_queue_ready"
    """Ready messages in the work queue (a passive declare: unacked deliveries not counted)."""
    DEAD_LETTER_QUEUE = "dead_letter_queue_ready"
    """Ready messages in the dead-letter queue."""
    QUEUE_LAG = "queue_lag_seconds"
    """Age of the most recently taken delivery that carried a timestamp: how long the head of
    the work queue waited (0 when nothing waits)."""


@dataclass(frozen=True)
class NewSample:
    """One sample as its process writes it. ``started_at`` None: the database's ``now()``, on
    the process's first write (``insert`` returns it, for the next ones)."""

    process: str
    role: str
    host: str
    pid: int
    started_at: datetime | None
    state: str
    reason: str | None
    counters: Mapping[str, int]
    gauges: Mapping[str, float | None]
    head_timestamp: datetime | None = None
    """The timestamp property of the delivery ``Gauge.QUEUE_LAG`` measures: its age is taken
    against the database's ``now()`` (the relay stamps what it publishes with the database's
    clock), and set in ``gauges`` at the insert."""


@dataclass(frozen=True)
class Sample:
    """One sample as read back: ``age_seconds`` since it was written, ``up_seconds`` since its
    process started, both by the database's clock at the read."""

    process: str
    role: str
    host: str
    pid: int
    age_seconds: float
    up_seconds: float
    state: str
    reason: str | None
    counters: dict[str, int]
    gauges: dict[str, float | None]


@dataclass(frozen=True)
class Point:
    """A few numbers of one sample, for a chart: its process, its age in seconds, and the
    counters and gauges asked for (None when the sample has none)."""

    process: str
    age_seconds: float
    values: dict[str, float | None]


async def insert_sample(conn: AsyncConnection, sample: NewSample) -> datetime:
    """Write ``sample``, stamped with the database's ``now()``; returns its process's start (the
    database's ``now()`` at its first write, when ``started_at`` is None)."""
    gauges: Any = bindparam("gauges", dict(sample.gauges), type_=JSONB)
    if sample.head_timestamp is not None:
        age = func.greatest(
            func.extract(
                "epoch", func.now() - bindparam("head", sample.head_timestamp, DateTime(True))
            ),
            0,
        )
        gauges = gauges.op("||")(
            func.jsonb_build_object(literal(Gauge.QUEUE_LAG.value, Text), func.round(age, 3))
        )
    started = bindparam("started_at", sample.started_at, DateTime(timezone=True))
    stmt = (
        insert(process_samples)
        .values(
            process=sample.process,
            role=sample.role,
            host=sample.host,
            pid=sample.pid,
            started_at=func.coalesce(started, func.now()),
            state=sample.state,
            reason=sample.reason,
            counters=bindparam("counters", dict(sample.counters), type_=JSONB),
            gauges=gauges,
        )
        .returning(process_samples.c.started_at)
    )
    started_at: datetime = (await conn.execute(stmt)).scalar_one()
    return started_at


async def expire_samples(conn: AsyncConnection, *, kept: float, limit: int) -> int:
    """Delete up to ``limit`` samples older than ``kept`` seconds, oldest first; returns how
    many. Rows another transaction holds (another process expiring) are skipped, never waited
    on."""
    return (await conn.execute(expiry(kept=kept, limit=limit))).rowcount


def expiry(*, kept: float, limit: int) -> Delete:
    """``expire_samples``'s statement: an index range of ``sampled_at``, oldest first."""
    old = (
        select(process_samples.c.id)
        .where(process_samples.c.sampled_at < func.now() - interval(kept))
        .order_by(process_samples.c.sampled_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    # (= ANY(ARRAY(...)): the ids are found first, then each deleted through the primary key;
    # an IN (...) may be planned as a hash join over the whole table)
    found = func.array(old.scalar_subquery())
    return delete(process_samples).where(process_samples.c.id == any_(found))


_INFINITY = literal_column("'infinity'::timestamptz", DateTime(timezone=True))
"""The ``timestamptz`` later than any."""


def _age(column: Any) -> Any:
    return func.greatest(func.extract("epoch", func.now() - column), 0)


_SAMPLE_COLUMNS = (
    process_samples.c.process,
    process_samples.c.role,
    process_samples.c.host,
    process_samples.c.pid,
    cast(_age(process_samples.c.sampled_at), Float).label("age"),
    cast(_age(process_samples.c.started_at), Float).label("up"),
    process_samples.c.state,
    process_samples.c.reason,
    process_samples.c.counters,
    process_samples.c.gauges,
)


async def latest_samples(
    conn: AsyncConnection, *, within: float, newest: bool = True, limit: int = MAX_PROCESSES
) -> list[Sample]:
    """The newest sample (the oldest, with ``newest`` False) of each process that wrote one in
    the last ``within`` seconds, at most ``limit`` processes, by process.

    ``DISTINCT ON (process)`` over the index range of ``sampled_at`` in the window: it reads the
    window's rows only, a few per process.
    """
    stmt = latest_query(within=within, newest=newest, limit=limit)
    return [_sample(row) for row in (await conn.execute(stmt)).all()]


def latest_query(*, within: float, newest: bool = True, limit: int = MAX_PROCESSES) -> Select[Any]:
    """``latest_samples``'s statement."""
    order = process_samples.c.sampled_at.desc() if newest else process_samples.c.sampled_at
    return (
        select(*_SAMPLE_COLUMNS)
        .where(process_samples.c.sampled_at >= func.now() - interval(within))
        .ext(distinct_on(process_samples.c.process))
        .order_by(process_samples.c.process, order)
        .limit(limit)
    )


async def series(
    conn: AsyncConnection,
    *,
    within: float,
    per_process: int,
    counters: Sequence[str] = (),
    gauges: Sequence[str] = (),
    processes: int = MAX_PROCESSES,
) -> list[Point]:
    """The samples of the last ``within`` seconds, at most ``per_process`` of each process (its
    newest), of at most ``processes`` processes: for each, its age and the ``counters`` and
    ``gauges`` named (only those leave the database), in no particular order.

    The processes are found by a skip scan of the ``(process, sampled_at)`` index (one probe per
    process the table holds, ``processes`` at most); each one's samples are an index range of
    the same index under ``per_process``. So at most ``processes * per_process`` rows are read,
    however many samples a process wrote.
    """
    stmt = series_query(
        within=within,
        per_process=per_process,
        counters=counters,
        gauges=gauges,
        processes=processes,
    )
    names = [*counters, *gauges]
    return [
        Point(row[0], float(row[1]), dict(zip(names, map(_number, row[2:]), strict=True)))
        for row in (await conn.execute(stmt)).all()
    ]


def series_query(
    *,
    within: float,
    per_process: int,
    counters: Sequence[str] = (),
    gauges: Sequence[str] = (),
    processes: int = MAX_PROCESSES,
) -> Select[Any]:
    """``series``'s statement."""
    ps = process_samples
    following = ps.alias("following")
    anchor = select(func.min(ps.c.process).label("process"), literal(1, Integer).label("n"))
    known = anchor.cte("known", recursive=True)
    next_process = (
        select(func.min(following.c.process))
        .where(following.c.process > known.c.process)
        .scalar_subquery()
    )
    known = known.union_all(
        select(next_process, known.c.n + 1).where(
            known.c.process.is_not(None), known.c.n < processes
        )
    )
    s = ps.alias("s")
    fields = [
        *(cast(s.c.counters[bindparam(None, name, Text)].astext, Float) for name in counters),
        *(cast(s.c.gauges[bindparam(None, name, Text)].astext, Float) for name in gauges),
    ]
    # This process's samples in the window as a range of the (process, sampled_at) index,
    # written as row comparisons, which only that index can serve: with ``process = ...`` and
    # ``sampled_at >= ...``, the planner may walk the index on sampled_at alone instead and
    # read every process's samples of the window to find this one's.
    key = tuple_(s.c.process, s.c.sampled_at)
    recent = (
        select(s.c.sampled_at, *(f.label(f"f{i}") for i, f in enumerate(fields)))
        .where(
            key >= tuple_(known.c.process, func.now() - interval(within)),
            key <= tuple_(known.c.process, _INFINITY),
        )
        .order_by(s.c.process.desc(), s.c.sampled_at.desc())
        .limit(per_process)
        .lateral("recent")
    )
    return (
        select(
            known.c.process,
            cast(_age(recent.c.sampled_at), Float),
            *(recent.c[f"f{i}"] for i in range(len(fields))),
        )
        .select_from(known.join(recent, true()))
        .where(known.c.process.is_not(None))
        .limit(processes * per_process)  # (no ORDER BY: sorting them all spilled to disk)
    )


def _sample(row: Any) -> Sample:
    return Sample(
        process=row.process,
        role=row.role,
        host=row.host,
        pid=row.pid,
        age_seconds=float(row.age),
        up_seconds=float(row.up),
        state=row.state,
        reason=row.reason,
        counters={
            str(k): int(v)
            for k, v in _mapping(row.counters).items()
            if isinstance(v, int) and not isinstance(v, bool)
        },
        gauges={str(k): _number(v) for k, v in _mapping(row.gauges).items()},
    )


def _mapping(value: object) -> Mapping[str, object]:
    return value if isinstance(value, Mapping) else {}


def _number(value: object) -> float | None:
    """A JSON number as a float; anything else (null, a string, a bool) None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)
