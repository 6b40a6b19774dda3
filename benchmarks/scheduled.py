"""Scheduled events against baselines measured in the same run: what a million future events cost
the relay, how late due events go out, and how fast a backlog that fell due during a downtime
drains.

Every scenario runs a relay alone on one fresh database, publishing to queues of this run's
exchange: ``worker.ops.runner.run_relay`` in this process, but for the lateness, where it is
``python -m worker relay`` in a process of its own (as deployed), so that the consumer timing
1,000 arrivals a second in this process does not share the relay's event loop:

d0, d1. ``drain``: N immediate rows in ``outbox``, drained by a relay, with 0 future events in
   ``outbox_scheduled`` (d0) and with ``--future`` of them (d1), each twice, in the order d0 d1
   d1 d0 after an unreported warm-up drain (so that neither side gets only the warm or only the
   cold turns); the ratio d1/d0 is of the mean rates, target >= 0.95x. The future events are
   loaded with one ``INSERT ... SELECT generate_series`` (due from an hour to about three hours
   ahead), then VACUUM (ANALYZE) and CHECKPOINT (``fill``).
w0, w1. ``wake-up``: ``benchmarks.relay_latency``'s relay scenario (one row committed per
   transaction with its NOTIFY, at ``--wake-rate``; commit -> arrival at a consumer) with 0 and
   with ``--future`` future events.
over. ``after downtime``: N events in ``outbox_scheduled`` that fell due during the last N ms,
   while no relay ran (the future ones still there); a relay is started and timed from its
   start until the last is published, against d1 (the same rows due at once, same table sizes).
l0, l1. ``lateness``: ``--rate`` events per second falling due for ``--seconds``, scheduled
   ahead through ``worker.outbox.publish_many`` with ``at=`` at 1/rate steps while the relay
   runs, with 0 (l0) and with ``--future`` (l1) future events waiting beside them; lateness =
   arrival at a consumer - due, both on the database's clock: each body carries its due time,
   and arrival times are converted with the offset between this process's clock and
   ``clock_timestamp()`` measured in the run (its uncertainty, half the best round trip, is
   printed). Target p99 < 1 s; an arrival before its due time by more than that uncertainty is
   counted as early (the promise is never early).
alt. ``future rows in outbox``: the design not taken, for contrast: the future events kept in
   ``outbox`` itself with a future ``available_at`` (no ``outbox_scheduled``), and d's drain.

``claim`` times the relay's claim (``claim_outbox``, one batch, rolled back) and, while the
scheduled table has rows, the mover (``move_due``, none due) over N rows: with 0 future events,
with the future events in ``outbox_scheduled``, and with them in ``outbox``.

Everything runs next to PostgreSQL and RabbitMQ, so the figures include that contention. A
fresh database ``worker_bench_<hex>`` is created next to the one in ``WORKER_DATABASE_URL``,
migrated and dropped at the end; exchanges and queues on ``WORKER_AMQP_URL`` are named
``bench-<hex>...`` and deleted at the end. From the repository root::

    .venv/bin/python -m benchmarks.scheduled [--rows 20000] [--future 1000000] [--rate 1000]
        [--seconds 25] [--wakeups 200] [--wake-rate 20]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import IO, Any

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractExchange, AbstractQueue
from sqlalchemy.ext.asyncio import AsyncEngine

from benchmarks.common import reset_tables, stop_process
from benchmarks.processes import ROOT
from benchmarks.relay_latency import (
    OUT_KEY,
    START_SECONDS,
    STOP_SECONDS,
    Result,
    capturing,
    delete_broker_objects,
    percentile,
    progress,
    relay_scenario,
)
from benchmarks.throughput import POLL_INTERVAL, Stopwatch, queue_depth, serving, unusual
from worker.core.events import Event
from worker.database import create_engine
from worker.ops import runner
from worker.outbox import publish_many
from worker.settings import Settings, positive_float, positive_int
from worker.sql import outbox
from worker.sql.driver import in_transaction
from worker.telemetry import Count
from worker.testing import scratch_database

log = logging.getLogger("benchmarks.scheduled")

DRAIN_KEY = "bench.drain"
"""The routing key of the drained rows, bound to this run's sink queue."""
FUTURE_KEY = "bench.future"
"""The routing key of the future events (never published in the run)."""
SCHEDULE_BATCH = 1000
"""Events scheduled per transaction in the lateness scenario."""
LEAD_SECONDS = 5.0
"""How far ahead of the first due time the lateness scenario starts scheduling."""
DRAIN_SECONDS = 30.0
"""How long to wait, after the last due time, for events still missing."""
EXPECTED_STATS = (Count.SCHEDULED_DUE,)
"""Stats counters of an undisturbed run besides ``benchmarks.throughput``'s; others are noted."""
WARM_UP_ROWS = 2000
"""Rows drained before the first timed drain, not reported: connections, caches, imports."""
CLAIM_TRIES = 30
"""Claims timed per case in ``claim``; the median is printed."""
CLOCK_SAMPLES = 20
"""Round trips to the database's clock; the fastest gives the offset."""

FILL_OUTBOX = """
INSERT INTO outbox (message_id, exchange, routing_key, body, content_type)
SELECT gen_random_uuid(), $1, $2, convert_to('{"i": ' || g || '}', 'UTF8'), 'application/json'
FROM generate_series(1, $3) AS g
"""
"""``$3`` immediate rows to exchange ``$1``, routing key ``$2``."""

FILL_FUTURE_SCHEDULED = """
INSERT INTO outbox_scheduled (message_id, exchange, routing_key, body, content_type, due_at)
SELECT gen_random_uuid(), $1, $2, convert_to('{"i": ' || g || '}', 'UTF8'), 'application/json',
       now() + interval '1 hour' + g * interval '10 ms'
FROM generate_series(1, $3) AS g
"""
"""``$3`` scheduled events due from an hour ahead, 10 ms apart."""

FILL_FUTURE_OUTBOX = """
INSERT INTO outbox (message_id, exchange, routing_key, body, content_type, available_at)
SELECT gen_random_uuid(), $1, $2, convert_to('{"i": ' || g || '}', 'UTF8'), 'application/json',
       now() + interval '1 hour' + g * interval '10 ms'
FROM generate_series(1, $3) AS g
"""
"""The same ``$3`` future events as ``FILL_FUTURE_SCHEDULED``, kept in ``outbox`` instead."""

FILL_OVERDUE = """
INSERT INTO outbox_scheduled (message_id, exchange, routing_key, body, content_type, due_at)
SELECT gen_random_uuid(), $1, $2, convert_to('{"i": ' || g || '}', 'UTF8'), 'application/json',
       now() - ($3 - g) * interval '1 ms'
FROM generate_series(1, $3) AS g
"""
"""``$3`` scheduled events that fell due during the last ``$3`` ms, one per ms."""

LISTENING = f"""
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND query = 'LISTEN "{outbox.OUTBOX_CHANNEL}"'
"""
"""How many sessions of this database listen on the relays' channel."""

DB_CLOCK = "SELECT extract(epoch FROM clock_timestamp())::float8"
DB_NOW_PLUS = "SELECT now() + make_interval(secs => $1)"


@dataclass(frozen=True)
class Options:
    """What to run, from the command line."""

    rows: int
    future: int
    rate: float
    seconds: float
    wakeups: int
    wake_rate: float
    timeout: float


@dataclass
class Drain:
    """One timed drain: rows published (all of them unless it timed out) in ``seconds``."""

    key: str
    label: str
    rows: int
    published: int
    seconds: float
    cpu_seconds: float

    @property
    def rate(self) -> float:
        return self.published / self.seconds

    @property
    def finished(self) -> bool:
        return self.published >= self.rows


@dataclass
class Lateness:
    """Arrival - due time of each scheduled event that arrived, in seconds, on the DB's clock."""

    key: str
    label: str
    count: int
    late: list[float]
    duplicates: int
    scheduling_seconds: float
    clock_uncertainty: float


@dataclass
class Bench:
    """What every scenario shares: settings, connections, the sink queue and the results."""

    settings: Settings
    options: Options
    engine: AsyncEngine
    channel: AbstractChannel
    exchange: AbstractExchange
    sink: AbstractQueue
    drains: list[Drain] = field(default_factory=list)
    wakeups: list[Result] = field(default_factory=list)
    claims: dict[str, tuple[float, float | None]] = field(default_factory=dict)
    lateness: list[Lateness] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def note(self, key: str, text: str) -> None:
        self.notes.append(f"({key}) {text}")


# The database


async def execute(engine: AsyncEngine, sql: str, *args: Any) -> None:
    """Run one statement in a transaction of its own."""
    async with engine.begin() as conn:
        driver = await in_transaction(conn)
        await driver.execute(sql, *args)


async def fill(bench: Bench, sql: str, routing_key: str, rows: int, what: str) -> None:
    """Insert ``rows`` with one of the ``FILL_*`` statements, then VACUUM and ANALYZE (and for
    the future events, CHECKPOINT); prints the time.

    The VACUUM does now what autovacuum would do after a bulk insert (PostgreSQL vacuums a table
    that grew by a fifth): for a million rows, it would otherwise run during the next drains and
    be measured as their cost, when it is the cost of loading the rows at once."""
    started = time.perf_counter()
    await execute(bench.engine, sql, bench.settings.exchange, routing_key, rows)
    async with bench.engine.connect() as conn:
        await conn.execution_options(isolation_level="AUTOCOMMIT")
        await conn.exec_driver_sql("VACUUM (ANALYZE) outbox, outbox_scheduled")
        if routing_key == FUTURE_KEY:
            await conn.exec_driver_sql("CHECKPOINT")
    progress(f"  loaded {rows} {what} in {time.perf_counter() - started:.1f} s")


async def clock_offset(engine: AsyncEngine) -> tuple[float, float]:
    """The database's clock (epoch seconds) minus ``time.perf_counter()``, from the fastest of
    ``CLOCK_SAMPLES`` round trips, and its uncertainty: half that round trip."""
    best: tuple[float, float] | None = None
    async with engine.connect() as conn:
        driver = (await conn.get_raw_connection()).driver_connection
        assert driver is not None
        for _ in range(CLOCK_SAMPLES):
            before = time.perf_counter()
            db_time: float = await driver.fetchval(DB_CLOCK)
            after = time.perf_counter()
            sample = (db_time - (before + after) / 2, (after - before) / 2)
            if best is None or sample[1] < best[1]:
                best = sample
    assert best is not None
    return best


# Scenarios


async def drain(
    bench: Bench, key: str, label: str, sql: str = FILL_OUTBOX, rows: int | None = None
) -> Drain:
    """A relay started on ``rows`` (default ``--rows``) rows inserted by ``sql`` (immediate by
    default), timed from its start until it has published them all (or ``--timeout`` passed)."""
    rows = bench.options.rows if rows is None else rows
    await reset_tables(bench.engine, ("outbox",))
    await fill(bench, sql, DRAIN_KEY, rows, "rows to drain")
    relay = functools.partial(runner.run_relay, bench.settings)
    async with serving("relay", relay) as (task, stats):
        watch = Stopwatch()
        while stats[Count.RELAY_PUBLISHED] < rows and watch.elapsed < bench.options.timeout:
            if task.done():
                task.result()
                raise RuntimeError("the relay stopped before the drain finished")
            await asyncio.sleep(POLL_INTERVAL)
        timing = watch.read()
    published = stats[Count.RELAY_PUBLISHED]
    result = Drain(key, label, rows, published, timing.seconds, timing.cpu_seconds)
    if not result.finished:
        bench.note(key, f"{result.published} of {rows} published in {bench.options.timeout:g} s")
    if (delivered := await queue_depth(bench.sink)) != result.published:
        bench.note(key, f"{delivered} in the sink queue, {result.published} published")
    await bench.sink.purge()
    if odd := unusual(stats, EXPECTED_STATS):
        bench.note(key, f"{odd} (all stats: {dict(stats)})")
    bench.drains.append(result)
    progress(f"  {result.published} rows in {result.seconds:.2f} s ({result.rate:.0f}/s)")
    return result


async def wake_up(bench: Bench, key: str, label: str) -> None:
    """``benchmarks.relay_latency``'s relay scenario: commit -> arrival, woken by NOTIFY."""
    options = bench.options
    result = await relay_scenario(
        f"({key}) {label}",
        bench.settings,
        bench.engine,
        bench.channel,
        bench.exchange,
        options.wakeups,
        options.wake_rate,
    )
    bench.wakeups.append(result)
    if len(result.latencies) < result.expected or result.duplicates:
        bench.note(
            key,
            f"{len(result.latencies)} of {result.expected} arrived, {result.duplicates} duplicates",
        )


async def time_claims(bench: Bench, case: str) -> None:
    """Median seconds of ``CLAIM_TRIES`` claims of one batch over ``--rows`` immediate rows, and
    of as many ``move_due`` calls (None when ``outbox_scheduled`` is empty), each rolled back."""
    await reset_tables(bench.engine, ("outbox",))
    await fill(bench, FILL_OUTBOX, DRAIN_KEY, bench.options.rows, "rows to claim")
    claims: list[float] = []
    moves: list[float] = []
    scheduled = False
    async with bench.engine.connect() as conn:
        driver = (await conn.get_raw_connection()).driver_connection
        assert driver is not None
        scheduled = bool(await driver.fetchval("SELECT EXISTS (SELECT FROM outbox_scheduled)"))
        for _ in range(CLAIM_TRIES):
            async with conn.begin() as transaction:
                started = time.perf_counter()
                await outbox.claim_outbox(conn, bench.settings.relay_batch_size)
                claims.append(time.perf_counter() - started)
                await transaction.rollback()
            if scheduled:
                async with conn.begin() as transaction:
                    started = time.perf_counter()
                    await outbox.move_due(conn, bench.settings.relay_batch_size)
                    moves.append(time.perf_counter() - started)
                    await transaction.rollback()
    await reset_tables(bench.engine, ("outbox",))
    bench.claims[case] = (statistics.median(claims), statistics.median(moves) if moves else None)


@contextlib.asynccontextmanager
async def relay_process(bench: Bench) -> AsyncIterator[asyncio.subprocess.Process]:
    """``python -m worker relay`` on this run's database and exchange, in a process of its own,
    yielded once it listens for NOTIFY (it has started); stopped by SIGTERM on exit."""
    settings = bench.settings
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    env.update(
        WORKER_DATABASE_URL=settings.database_url,
        WORKER_AMQP_URL=settings.amqp_url,
        WORKER_EXCHANGE=settings.exchange,
        WORKER_QUEUE=settings.queue,
        WORKER_HTTP_PORT="0",
    )
    with tempfile.TemporaryFile() as errors:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "worker",
            "relay",
            cwd=ROOT,
            env=env,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=errors,
        )
        try:
            deadline = time.perf_counter() + START_SECONDS
            while not await listening(bench.engine):
                check_running(process, errors)
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"the relay process did not listen within {START_SECONDS} s")
                await asyncio.sleep(POLL_INTERVAL)
            yield process
            check_running(process, errors)
        finally:
            await stop_process(process, STOP_SECONDS)


def check_running(process: asyncio.subprocess.Process, errors: IO[bytes]) -> None:
    """Raise, with the end of its standard error, if ``process`` has exited."""
    if process.returncode is not None:
        errors.seek(0)
        tail = errors.read()[-2000:].decode(errors="replace")
        raise RuntimeError(f"the relay process exited with {process.returncode}: {tail}")


async def listening(engine: AsyncEngine) -> bool:
    """Whether a session of this database listens on the relays' channel."""
    async with engine.connect() as conn:
        driver = (await conn.get_raw_connection()).driver_connection
        assert driver is not None
        return bool(await driver.fetchval(LISTENING))


def scheduled_events(bench: Bench, first_due: datetime, count: int) -> Iterator[Event]:
    """``count`` events due ``1/--rate`` s apart from ``first_due``, each body with its index
    and its due time in epoch seconds."""
    step = timedelta(seconds=1 / bench.options.rate)
    for i in range(count):
        due = first_due + i * step
        body = {"i": i, "due": due.timestamp()}
        yield Event(OUT_KEY, body, exchange=bench.settings.exchange, at=due)


async def lateness(bench: Bench, key: str, label: str) -> None:
    """Schedule ``--rate`` x ``--seconds`` events due from ``LEAD_SECONDS`` ahead, with a relay
    process running, and take each one's arrival - due time, both on the database's clock."""
    count = round(bench.options.rate * bench.options.seconds)
    offset, uncertainty = await clock_offset(bench.engine)
    due: dict[str, float] = {}

    def index(message: aio_pika.abc.AbstractIncomingMessage) -> str:
        return str(json.loads(message.body)["i"])

    async with (
        capturing(bench.channel, bench.exchange, index) as capture,
        relay_process(bench) as relay,
    ):
        async with bench.engine.connect() as conn:
            driver = (await conn.get_raw_connection()).driver_connection
            assert driver is not None
            first_due: datetime = await driver.fetchval(DB_NOW_PLUS, LEAD_SECONDS)
        watch = Stopwatch()
        events = scheduled_events(bench, first_due, count)
        while batch := list(itertools.islice(events, SCHEDULE_BATCH)):
            async with bench.engine.begin() as conn:
                await publish_many(conn, batch)
            for event in batch:
                due[str(event.body["i"])] = event.body["due"]
        scheduling = watch.elapsed
        progress(f"  scheduled {count} events in {scheduling:.1f} s")
        deadline = time.perf_counter() + LEAD_SECONDS + bench.options.seconds + DRAIN_SECONDS
        while len(capture.arrived) < count and time.perf_counter() < deadline:
            if relay.returncode is not None:
                break  # relay_process raises, with the relay's error
            await asyncio.sleep(POLL_INTERVAL)
    late = [at + offset - due[key] for key, at in capture.arrived.items()]
    result = Lateness(key, label, count, late, capture.duplicates, scheduling, uncertainty)
    bench.lateness.append(result)
    if scheduling > LEAD_SECONDS:
        bench.note(
            key,
            f"scheduling took {scheduling:.1f} s, more than the lead: early "
            "events were committed after they were due",
        )


async def run_scenarios(settings: Settings, options: Options) -> Bench:
    """Every scenario in order, on one producer connection, one small engine and one sink."""
    connection = await runner.connect_broker(settings, name="bench")
    engine = create_engine(settings, application_name="bench", pool_size=2)
    sink_name = f"{settings.queue}.sink"
    try:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.declare_exchange(
            settings.exchange, aio_pika.ExchangeType.TOPIC, durable=True
        )
        sink = await channel.declare_queue(sink_name, durable=True)
        await sink.bind(exchange, DRAIN_KEY)
        bench = Bench(settings, options, engine, channel, exchange, sink)
        future = f"{options.future} future events"
        await step("warm-up", "drain", drain(bench, "warm-up", "", rows=WARM_UP_ROWS))
        bench.drains.clear()
        await step("d0", "drain, 0 future events", drain(bench, "d0", "0 future events"))
        await step("w0", "wake-up, 0 future events", wake_up(bench, "w0", "0 future events"))
        await time_claims(bench, "0 future events")
        late = f"lateness at {options.rate:g}/s"
        await step("l0", late, lateness(bench, "l0", "0 future events"))
        progress(f"loading {future} into outbox_scheduled ...")
        await fill(bench, FILL_FUTURE_SCHEDULED, FUTURE_KEY, options.future, "future events")
        await time_claims(bench, f"{future} in outbox_scheduled")
        await step("d1", f"drain, {future}", drain(bench, "d1", f"{future} in outbox_scheduled"))
        await step("d1", f"drain, {future}", drain(bench, "d1", f"{future}, again"))
        await step("w1", f"wake-up, {future}", wake_up(bench, "w1", future))
        await step(
            "over",
            "after downtime",
            drain(bench, "over", f"{options.rows} overdue, {future}", FILL_OVERDUE),
        )
        await step("l1", late, lateness(bench, "l1", future))
        await reset_tables(bench.engine, ("outbox", "outbox_scheduled"))
        await step("d0", "drain, 0 future events", drain(bench, "d0", "0 future events, again"))
        progress(f"loading {future} into outbox ...")
        await fill(bench, FILL_FUTURE_OUTBOX, FUTURE_KEY, options.future, "future rows")
        await time_claims(bench, f"{future} in outbox")
        await step("alt", f"drain, {future} in outbox", drain(bench, "alt", f"{future} in outbox"))
        return bench
    finally:
        await engine.dispose()
        try:
            await delete_broker_objects(settings, [sink_name])
        finally:
            await connection.close()


async def step(key: str, label: str, scenario: Any) -> None:
    """Run one scenario's coroutine, saying which."""
    progress(f"running ({key}) {label} ...")
    await scenario


def run_in_scratch_database(options: Options) -> Bench:
    """A fresh, migrated database and broker names for this run, the scenarios, the cleanup."""
    run_id = uuid.uuid4().hex[:10]
    base = Settings.load(exchange=f"bench-{run_id}-events", queue=f"bench-{run_id}", http_port=0)
    with scratch_database(base, prefix="worker_bench") as settings:
        return asyncio.run(run_scenarios(settings, options))


# The report


def ms(seconds: float) -> str:
    return f"{1000 * seconds:.1f}"


def report(bench: Bench) -> str:
    """The drains, the claim costs, the wake-ups, the lateness, the ratios, then notes."""
    options = bench.options
    lines = [
        f"scheduled events: {options.rows} rows per drain, {options.future} future events, "
        f"relay batch {bench.settings.relay_batch_size}, cpu count {os.cpu_count()}, "
        f"load average at the end {os.getloadavg()[1]:.1f} (5 min)",
        f"{'drain':<52}{'rows':>8}{'seconds':>9}{'msg/s':>9}{'cpu %':>7}",
    ]
    for d in bench.drains:
        cpu = 100 * d.cpu_seconds / d.seconds
        figures = f"{d.published:>8}{d.seconds:>9.2f}{d.rate:>9.0f}{cpu:>7.0f}"
        lines.append(f"{f'({d.key}) {d.label}':<52}{figures}")
    lines += ["", f"{'claim of one batch over the rows to drain':<52}{'claim ms':>9}{'move ms':>9}"]
    for case, (claim, move) in bench.claims.items():
        lines.append(f"{case:<52}{ms(claim):>9}{ms(move) if move is not None else '-':>9}")
    lines += ["", f"{'wake-up, commit -> arrival (ms)':<52}{'n':>5}{'p50':>8}{'p99':>8}{'max':>8}"]
    for r in bench.wakeups:
        ordered = sorted(r.latencies)
        figures = "".join(f"{ms(x):>8}" for x in wake_points(ordered)) if ordered else ""
        lines.append(f"{r.label:<52}{len(ordered):>5}{figures}")
    lines += ["", *lateness_lines(bench)]
    lines += ["", *ratio_lines(bench)]
    if bench.notes:
        lines += ["", *bench.notes]
    return "\n".join(lines)


def wake_points(ordered: list[float]) -> list[float]:
    """p50, p99 and max of an ascending list."""
    return [percentile(ordered, 50), percentile(ordered, 99), ordered[-1]]


def lateness_lines(bench: Bench) -> list[str]:
    """Each lateness run: its percentiles, then what arrived early, never or twice."""
    options = bench.options
    lines = [f"lateness at {options.rate:g} due/s for {options.seconds:g} s (arrival - due)"]
    for result in bench.lateness:
        name = f"({result.key}) {result.label}"
        if not result.late:
            lines.append(f"{name}: none of {result.count} arrived")
            continue
        ordered = sorted(result.late)
        early = sum(late < -result.clock_uncertainty for late in ordered)
        lines += [
            f"{name}: n {len(ordered)} of {result.count}, p50 {ms(percentile(ordered, 50))} ms, "
            f"p99 {ms(percentile(ordered, 99))} ms, max {ms(ordered[-1])} ms, "
            f"min {ms(ordered[0])} ms",
            f"  early {early}, missing {result.count - len(ordered)}, duplicates "
            f"{result.duplicates} (DB clock +- {1000 * result.clock_uncertainty:.2f} ms; "
            f"scheduling took {result.scheduling_seconds:.1f} s)",
        ]
    return lines


def mean_rate(bench: Bench, key: str) -> float | None:
    """The mean rate of the finished drains of ``key``; None when there is none."""
    rates = [d.rate for d in bench.drains if d.key == key and d.finished]
    return statistics.mean(rates) if rates else None


def ratio_line(name: str, value: float | None, target: str, met: bool | None) -> str:
    figure = f"{value:>7.2f}x" if value is not None else f"{'-':>8}"
    verdict = "" if met is None else "met" if met else "missed"
    return f"{name:<14}{figure}   {target:<12} {verdict}".rstrip()


def ratio_lines(bench: Bench) -> list[str]:
    """Each figure against its same-run baseline, with its target where the issue gives one."""
    d0, d1 = mean_rate(bench, "d0"), mean_rate(bench, "d1")
    over, alt = mean_rate(bench, "over"), mean_rate(bench, "alt")

    def ratio(top: float | None, bottom: float | None) -> float | None:
        return top / bottom if top is not None and bottom else None

    lines = [f"{'ratio':<14}{'value':>8}   {'target':<12}"]
    d1_d0 = ratio(d1, d0)
    lines.append(ratio_line("d1/d0", d1_d0, ">= 0.95x", None if d1_d0 is None else d1_d0 >= 0.95))
    if len(bench.wakeups) == 2 and all(r.latencies for r in bench.wakeups):
        w0, w1 = (sorted(r.latencies) for r in bench.wakeups)
        for p in (50, 99):
            value = percentile(w1, p) / percentile(w0, p)
            lines.append(ratio_line(f"w1/w0 p{p}", value, "(compare)", None))
    lines.append(ratio_line("over/d1", ratio(over, d1), "(compare)", None))
    lines.append(ratio_line("alt/d0", ratio(alt, d0), "(compare)", None))
    p99s = {r.key: percentile(sorted(r.late), 99) for r in bench.lateness if r.late}
    lines.append(ratio_line("l1/l0 p99", ratio(p99s.get("l1"), p99s.get("l0")), "(compare)", None))
    for r in bench.lateness:
        if r.key in p99s:
            met = p99s[r.key] < 1.0 and len(r.late) == r.count
            verdict = "met" if met else "missed"
            lines.append(f"{f'{r.key} p99':<14}{p99s[r.key]:>7.3f}s   {'< 1 s':<12} {verdict}")
    return lines


def parse_options(argv: list[str] | None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.scheduled",
        description="What future events cost the relay; lateness of due ones; a due backlog.",
    )
    parser.add_argument("--rows", type=positive_int, default=20_000, help="rows per drain")
    parser.add_argument(
        "--future", type=positive_int, default=1_000_000, help="future events loaded"
    )
    parser.add_argument("--rate", type=positive_float, default=1000.0, help="due events per s")
    parser.add_argument(
        "--seconds", type=positive_float, default=25.0, help="seconds of due events"
    )
    parser.add_argument("--wakeups", type=positive_int, default=200, help="wake-ups timed")
    parser.add_argument("--wake-rate", type=positive_float, default=20.0, help="wake-ups per s")
    parser.add_argument(
        "--timeout", type=positive_float, default=120.0, help="seconds a drain may take"
    )
    args = parser.parse_args(argv)
    return Options(
        args.rows, args.future, args.rate, args.seconds, args.wakeups, args.wake_rate, args.timeout
    )


def main(argv: list[str] | None = None) -> None:
    options = parse_options(argv)
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    bench = run_in_scratch_database(options)
    print(report(bench))


if __name__ == "__main__":
    main()
