"""What the console's overview and ``worker status`` show of every process, read from the samples
the processes write (``ops.samples``): each one's state and rates now (``overview``,
``read_processes``), and throughput, failures and backlog over the last hour (``history``).

Invariant: a read costs the same however busy the system is. Processes and the outbox come from
the samples (an index range of ``process_samples``, bounded: ``worker.sql.samples``), never from
a count of the outbox or the inbox; the broker is asked about two queues by passive declares. The
arithmetic (rates from counter differences, buckets of a chart) is pure functions, below the
reads.

Why the outbox's numbers come from the samples and not from ``inspection.outbox_stats``: that
read counts the whole outbox, a scan of its backlog exactly when the backlog is large, and a
console open during an incident would repeat it every few seconds for every viewer. Every
process's monitor already reads it every few seconds; the freshest sample carries it, with its
age (``OutboxView.as_of_seconds``).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

from aio_pika.abc import AbstractConnection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from worker.logs import describe_error
from worker.ops.samples import Role
from worker.settings import Settings, format_duration
from worker.settings import field as setting_field
from worker.sql import samples
from worker.sql.samples import Gauge, Point, Sample
from worker.telemetry import Count
from worker.transport.topology import QueueCounts, count_queues

SEEN_INTERVALS = 3
"""A process is listed while its last sample is at most this many sample intervals old."""

RATE_WINDOW = 60.0
"""Seconds over which a process's rates are taken (the difference of its counters between its
oldest sample in the window and its newest)."""

DEFAULT_INTERVAL: float = setting_field("sample_interval").default
"""The ``sample_interval`` a reader assumes when its own is 0 (it writes none; others may)."""

HISTORY_LIMIT = 100_000
"""The most samples one ``history`` reads, whatever the processes and the window."""

PROCESSED: tuple[str, ...] = (Count.PROCESSED,)
"""The counters whose sum is a process's throughput: deliveries handled."""

FAILURES: tuple[str, ...] = (Count.DEAD_LETTERED, Count.RETRY_SCHEDULED)
"""The counters whose sum is a process's failures: deliveries parked or sent to a retry."""

PUBLISHED: tuple[str, ...] = (Count.RELAY_PUBLISHED,)
"""The counters whose sum is a relay's throughput: outbox rows published."""

READ_TIMEOUT = 5.0
"""Seconds PostgreSQL has to answer an overview's or a history's reads, and the broker the
overview's passive declares."""


@dataclass(frozen=True)
class Rates:
    """A process's rates over ``RATE_WINDOW``, per second; None while it has one sample in it."""

    processed: float | None
    failures: float | None
    published: float | None


@dataclass(frozen=True)
class ProcessView:
    """A process as its newest sample shows it: ``reported_seconds_ago`` when it wrote it, by
    the database's clock, and ``up_seconds`` since it started."""

    process: str
    role: str
    host: str
    pid: int
    state: str
    reason: str | None
    reported_seconds_ago: float
    up_seconds: float
    rates: Rates


@dataclass(frozen=True)
class QueueView:
    """One of the worker's queues now: None counts when it does not exist."""

    name: str
    exists: bool
    messages: int | None
    consumers: int | None


@dataclass(frozen=True)
class OutboxView:
    """The outbox as the freshest sample saw it, ``as_of_seconds`` ago (``process`` read it);
    ``oldest_age_seconds`` None when nothing waits."""

    pending: int
    backing_off: int | None
    scheduled: int | None
    parked: int | None
    oldest_age_seconds: float | None
    as_of_seconds: float
    process: str


@dataclass(frozen=True)
class Overview:
    """The console's overview. ``processes`` seen within ``SEEN_INTERVALS`` sample intervals; a
    queue is None when the broker could not be read, ``outbox`` when no process reported it,
    ``queue_lag_seconds`` when no worker did; ``errors`` says, by part (``database``,
    ``broker``), what could not be read."""

    processes: list[ProcessView]
    work_queue: QueueView | None
    dead_letter_queue: QueueView | None
    queue_lag_seconds: float | None
    outbox: OutboxView | None
    errors: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class History:
    """Series of the last ``window`` seconds in buckets of ``bucket_seconds``, oldest first;
    None where no sample fell. Rates are summed over the processes; a backlog, which every
    process sees whole, is the largest any of them saw."""

    window: float
    bucket_seconds: float
    processed: tuple[float | None, ...]
    """Deliveries handled per second."""
    failures: tuple[float | None, ...]
    """Deliveries dead-lettered or sent to a delayed retry per second."""
    work_queue: tuple[float | None, ...]
    """Ready messages in the work queue."""
    outbox_backlog: tuple[float | None, ...]
    """Outbox rows not yet published."""


def seen_within(interval: float) -> float:
    """Seconds within which a process's last sample lists it, for a reader whose
    ``sample_interval`` is ``interval``."""
    return SEEN_INTERVALS * (interval or DEFAULT_INTERVAL)


async def read_samples(
    conn: AsyncConnection, *, interval: float
) -> tuple[list[Sample], list[Sample]]:
    """The newest sample of every process that wrote one within ``seen_within(interval)``, and
    the oldest of each within ``RATE_WINDOW`` (none when no process is seen): two bounded reads
    (``samples.latest_samples``)."""
    newest = await samples.latest_samples(conn, within=seen_within(interval))
    if not newest:
        return [], []
    return newest, await samples.latest_samples(conn, within=RATE_WINDOW, newest=False)


async def read_processes(conn: AsyncConnection, *, interval: float) -> list[ProcessView]:
    """Every process seen within ``seen_within(interval)``, with its rates over
    ``RATE_WINDOW``."""
    return process_views(*await read_samples(conn, interval=interval))


async def overview(
    engine: AsyncEngine, connection: AbstractConnection | None, settings: Settings
) -> Overview:
    """The processes, the work queue and the DLQ, the queue's lag and the outbox, read at once:
    the database's part and the broker's each fail on their own (``Overview.errors``); without
    ``connection`` (none could be made) the broker's part is not read."""
    errors: dict[str, str] = {}

    async def read_database() -> tuple[list[Sample], list[Sample]]:
        snapshot = engine.execution_options(
            isolation_level="REPEATABLE READ", postgresql_readonly=True
        )
        async with asyncio.timeout(READ_TIMEOUT), snapshot.begin() as conn:
            return await read_samples(conn, interval=settings.sample_interval)

    async def read_broker() -> tuple[QueueCounts | None, QueueCounts | None]:
        if connection is None:
            raise ConnectionError("no connection to the broker")
        async with asyncio.timeout(READ_TIMEOUT):
            work, dead = await count_queues(
                connection, [settings.queue, settings.dead_letter_queue]
            )
        return work, dead

    database, broker = await asyncio.gather(read_database(), read_broker(), return_exceptions=True)
    newest: list[Sample] = []
    oldest: list[Sample] = []
    if isinstance(database, BaseException):
        errors["database"] = unread(database)
    else:
        newest, oldest = database
    work = dead = None
    if isinstance(broker, BaseException):
        errors["broker"] = unread(broker)
    else:
        work = _queue_view(settings.queue, broker[0])
        dead = _queue_view(settings.dead_letter_queue, broker[1])
    return Overview(
        processes=process_views(newest, oldest),
        work_queue=work,
        dead_letter_queue=dead,
        queue_lag_seconds=queue_lag(newest),
        outbox=outbox_view(newest),
        errors=errors,
    )


async def history(
    engine: AsyncEngine,
    *,
    window: float = 3600.0,
    points: int = 120,
    interval: float = DEFAULT_INTERVAL,
) -> History:
    """Throughput, failures, the work queue and the outbox backlog over the last ``window``
    seconds in ``points`` buckets, from the samples of every process that wrote some.

    Reads at most ``window / interval`` (+2) samples per process (``interval``: the sample
    interval the processes write at), ``HISTORY_LIMIT`` in all, and of each only the few
    numbers drawn. Raises ``TimeoutError`` when PostgreSQL takes over ``READ_TIMEOUT``."""
    per_process = math.ceil(window / (interval or DEFAULT_INTERVAL)) + 2
    async with asyncio.timeout(READ_TIMEOUT), engine.connect() as conn:
        found = await samples.series(
            conn,
            within=window,
            per_process=per_process,
            counters=[*PROCESSED, *FAILURES],
            gauges=[Gauge.WORK_QUEUE, Gauge.OUTBOX_BACKLOG],
            processes=min(samples.MAX_PROCESSES, max(1, HISTORY_LIMIT // per_process)),
        )
    return bucketed(found, window=window, buckets=points)


# The arithmetic: pure functions of the samples read.


def increase(before: float | None, after: float | None) -> float | None:
    """How much a counter grew from ``before`` to ``after``. A counter only grows while its
    process runs, so a smaller ``after`` means it restarted from 0: it grew by ``after``. None
    when either is unknown."""
    if before is None or after is None:
        return None
    return after - before if after >= before else after


def rate(before: float | None, after: float | None, seconds: float) -> float | None:
    """``increase`` per second over ``seconds``; None over no time at all."""
    grown = increase(before, after)
    if grown is None or not seconds > 0:
        return None
    return grown / seconds


def total(counters: Mapping[str, float | None], names: Iterable[str]) -> float:
    """The sum of the counters ``names``; one a process never counted is 0."""
    return sum(counters.get(name) or 0 for name in names)


def process_views(newest: Sequence[Sample], oldest: Sequence[Sample]) -> list[ProcessView]:
    """Each process of ``newest`` (its newest sample) with its rates since its sample in
    ``oldest`` (its oldest within ``RATE_WINDOW``), in the order of ``newest``."""
    first = {sample.process: sample for sample in oldest}
    return [
        ProcessView(
            process=last.process,
            role=last.role,
            host=last.host,
            pid=last.pid,
            state=last.state,
            reason=last.reason,
            reported_seconds_ago=last.age_seconds,
            up_seconds=last.up_seconds,
            rates=rates_between(first.get(last.process), last),
        )
        for last in newest
    ]


def rates_between(before: Sample | None, after: Sample) -> Rates:
    """A process's rates from its sample ``before`` to its sample ``after`` (none without one
    before, or when both are the same sample)."""
    seconds = 0.0 if before is None else before.age_seconds - after.age_seconds

    def per_second(names: Sequence[str]) -> float | None:
        if before is None:
            return None
        return rate(total(before.counters, names), total(after.counters, names), seconds)

    return Rates(per_second(PROCESSED), per_second(FAILURES), per_second(PUBLISHED))


def outbox_view(newest: Sequence[Sample]) -> OutboxView | None:
    """The outbox as the freshest of ``newest`` that saw it saw it; None when none did."""
    seen = [s for s in newest if s.gauges.get(Gauge.OUTBOX_BACKLOG) is not None]
    if not seen:
        return None
    sample = min(seen, key=lambda s: s.age_seconds)
    gauges = sample.gauges
    pending = int(gauges[Gauge.OUTBOX_BACKLOG] or 0)
    return OutboxView(
        pending=pending,
        backing_off=_count(gauges.get(Gauge.OUTBOX_BACKING_OFF)),
        scheduled=_count(gauges.get(Gauge.OUTBOX_SCHEDULED)),
        parked=_count(gauges.get(Gauge.OUTBOX_PARKED)),
        oldest_age_seconds=gauges.get(Gauge.OUTBOX_OLDEST_AGE) if pending else None,
        as_of_seconds=sample.age_seconds,
        process=sample.process,
    )


def queue_lag(newest: Sequence[Sample]) -> float | None:
    """The work queue's lag as the freshest worker that measured it saw it; None when none did."""
    seen = [
        s for s in newest if s.role == Role.WORKER and s.gauges.get(Gauge.QUEUE_LAG) is not None
    ]
    if not seen:
        return None
    return min(seen, key=lambda s: s.age_seconds).gauges[Gauge.QUEUE_LAG]


def bucketed(found: Sequence[Point], *, window: float, buckets: int) -> History:
    """``History`` of ``found`` (``samples.series``'s points: any processes', in any order).

    A rate in a bucket is, for each process, the growth of its counters between its samples
    that ended in the bucket over the time they span, summed over the processes; a gauge is,
    for each process, its newest value in the bucket, the largest of them.
    """
    width = window / buckets
    spans: list[dict[str, float]] = [{} for _ in range(buckets)]
    growth: dict[str, list[dict[str, float]]] = {
        "processed": [{} for _ in range(buckets)],
        "failures": [{} for _ in range(buckets)],
    }
    newest: dict[str, list[dict[str, float]]] = {
        Gauge.WORK_QUEUE: [{} for _ in range(buckets)],
        Gauge.OUTBOX_BACKLOG: [{} for _ in range(buckets)],
    }
    by_process: dict[str, list[Point]] = {}
    for point in found:
        by_process.setdefault(point.process, []).append(point)
    for process, points in by_process.items():
        ordered = sorted(points, key=lambda p: -p.age_seconds)  # oldest first
        for point in ordered:  # (oldest first: the newest in a bucket stays)
            i = _bucket(point.age_seconds, width, buckets)
            for name, series in newest.items():
                value = point.values.get(name)
                if i is not None and value is not None:
                    series[i][process] = value
        for before, after in pairwise(ordered):
            i = _bucket(after.age_seconds, width, buckets)
            seconds = before.age_seconds - after.age_seconds
            if i is None or not seconds > 0:
                continue
            spans[i][process] = spans[i].get(process, 0.0) + seconds
            for name, counters in (("processed", PROCESSED), ("failures", FAILURES)):
                grown = increase(total(before.values, counters), total(after.values, counters))
                per = growth[name][i]
                per[process] = per.get(process, 0.0) + (grown or 0.0)
    gauges = {
        name: tuple(max(per.values()) if per else None for per in series)
        for name, series in newest.items()
    }
    return History(
        window=window,
        bucket_seconds=width,
        processed=_rates(growth["processed"], spans),
        failures=_rates(growth["failures"], spans),
        work_queue=gauges[Gauge.WORK_QUEUE],
        outbox_backlog=gauges[Gauge.OUTBOX_BACKLOG],
    )


def _rates(
    growth: Sequence[Mapping[str, float]], spans: Sequence[Mapping[str, float]]
) -> tuple[float | None, ...]:
    """Per bucket, the sum over processes of each one's growth over its span; None where no
    process has a span."""
    return tuple(
        sum(grown[process] / spans_[process] for process in spans_) if spans_ else None
        for grown, spans_ in zip(growth, spans, strict=True)
    )


def _bucket(age: float, width: float, buckets: int) -> int | None:
    """The bucket (0 the oldest) a sample ``age`` seconds old falls in; None outside the
    window."""
    back = math.floor(age / width)
    if back >= buckets or back < 0:
        return None
    return buckets - 1 - back


def unread(exc: BaseException) -> str:
    """Why a part could not be read, in one line (no URL's password): ``no answer within 5s``
    for a timeout."""
    if isinstance(exc, TimeoutError):
        return f"no answer within {format_duration(READ_TIMEOUT)}"
    return describe_error(exc)


def _count(value: float | None) -> int | None:
    return None if value is None else int(value)


def _queue_view(name: str, found: QueueCounts | None) -> QueueView:
    if found is None:
        return QueueView(name, exists=False, messages=None, consumers=None)
    return QueueView(name, exists=True, messages=found.messages, consumers=found.consumers)
