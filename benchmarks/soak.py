"""The inbox and the outbox under a steady load for a long time: do their tables stay bounded?

``worker run`` (a subprocess, as an operator starts it, with the payments example, its in-process
relay and its janitor) is offered payment requests at ``--rate`` per second for ``--minutes``, a
share ``--duplicates`` of them repeats of a payment sent a moment before (the inbox recognises
them). Each settled payment's ``payment.settled`` event is consumed twice: by the worker itself
(the example's settlement notices, a second inbox key per payment) and by a queue of this script's
bound to the exchange, drained as it fills, so that the published events do not pile up in the
broker. Every ``--sample`` it writes a row of the CSV (``--csv``):

- for ``inbox`` and ``outbox``: total, heap and index bytes (``pg_total_relation_size``,
  ``pg_relation_size``, ``pg_indexes_size``), each index's bytes, live and dead tuples, rows
  inserted, deleted and updated (and of those HOT, with no new index entries), and the counts
  and last times of vacuums, autovacuums, analyzes and autoanalyzes (``pg_stat_user_tables``);
- the outbox backlog and its oldest row's age, the requests waiting in the work queue, the CPU
  of the machine, of the worker and of this script;
- the counts so far and their rates over the interval: requests offered (confirmed by the broker);
  requests processed and recognised as duplicates, settlement notices processed, events published
  by the relay, inbox keys expired by the janitor (the worker's ``/metrics``); events received
  downstream.

The inbox reaches a steady state once keys expire as fast as they come: ``--retention`` (default
5 minutes, where a deployment keeps them 7 days; it must outlast the delayed-retry chain, 71 s by
default) after the start, plus a janitor interval. The janitor runs with the worker's own
``janitor_interval`` and ``janitor_batch_size`` unless ``--janitor-interval`` and
``--janitor-batch-size`` say otherwise; all of them are printed first.

Where the server runs with ``autovacuum = off`` (a CI setting), nothing would ever vacuum the
tables: the script then stands in for the daemon (``--autovacuum stand-in``, the default there)
and applies its rule to every table of the scratch database every ``autovacuum_naptime``: VACUUM a
table whose dead tuples exceed ``autovacuum_vacuum_threshold + autovacuum_vacuum_scale_factor x
reltuples`` (or whose inserts since its last vacuum pass the insert threshold), ANALYZE one whose
changes pass the analyze threshold, with the table's own storage parameters where it has them and
the daemon's cost-based delay. Those runs count as ``vacuum_count`` and ``analyze_count``, not
``autovacuum_count``. ``--autovacuum none`` measures the tables with no vacuum at all.

The summary says, for every table, its heap, its indexes and each index, the size at the start, at
the end of the warm-up (``--warm-up``, default the first third of the run), the largest in the rest
of the first two thirds, the largest in the last third, and at the end; a relation is **bounded**
when the last third's largest is within ``--tolerance`` (10 %) plus 64 KiB of the larger of the
two before it. Then dead tuples and vacuums, and the offered rate against those achieved. It
asserts nothing. The soak stops early, with its summary, on SIGINT or SIGTERM.

A fresh database ``worker_soak_<hex>`` is created next to the one in ``WORKER_DATABASE_URL``,
migrated for the worker and the payments example, and dropped at the end; the exchange and queues
on ``WORKER_AMQP_URL`` are named ``soak-<hex>...`` and deleted at the end. PostgreSQL, RabbitMQ,
the worker and this script share the machine. From the repository root::

    .venv/bin/python -m benchmarks.soak [--minutes 30] [--rate 300] [--sample 30s] [--csv FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import csv
import itertools
import math
import os
import random
import re
import resource
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from aio_pika.abc import AbstractChannel, AbstractExchange, AbstractQueue
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from benchmarks.processes import (
    WorkerFailed,
    busy_since,
    cpu_times,
    stop_worker,
    tail,
    until,
    worker_run,
)
from benchmarks.relay_latency import delete_broker_objects, progress
from benchmarks.throughput import fraction
from examples.payments import router as payments_router
from examples.payments.demo import request_message
from worker.database import create_engine
from worker.ops.runner import connect_broker
from worker.settings import Settings, duration, format_duration, positive_float, positive_int
from worker.sql.inspection import outbox_stats
from worker.testing import scratch_database
from worker.transport.topology import Topology, declare_topology

REQUESTED = "payment.requested"
SETTLED = "payment.settled"
TABLES = ("inbox", "outbox")
SEED = 1
RECENT = 1000
"""A duplicate repeats one of the last ``RECENT`` payments sent."""
TICK = 0.05
"""Seconds between two publishes of the requests due (all due ones at once, confirmed)."""
SLACK_BYTES = 64 * 1024
"""Growth allowed beyond the tolerance before a relation counts as growing: 8 pages."""
START_SECONDS = 60.0
"""How long the worker may take to consume from its queue."""
OUTAGE_PAUSE = 1.0
"""Seconds the producer waits after a failed publish (the broker away) before the next."""

TABLE_STATS = """
SELECT s.relname, pg_total_relation_size(s.relid), pg_relation_size(s.relid),
       pg_indexes_size(s.relid), s.n_live_tup, s.n_dead_tup, s.n_tup_ins, s.n_tup_del,
       s.n_tup_upd, s.n_tup_hot_upd, s.vacuum_count, s.autovacuum_count, s.analyze_count,
       s.autoanalyze_count,
       s.last_vacuum, s.last_autovacuum, s.last_analyze, s.last_autoanalyze
FROM pg_stat_user_tables AS s
WHERE s.schemaname = current_schema() AND s.relname = ANY(:tables)
"""
TABLE_COLUMNS = (
    "total_bytes",
    "heap_bytes",
    "indexes_bytes",
    "n_live_tup",
    "n_dead_tup",
    "n_tup_ins",
    "n_tup_del",
    "n_tup_upd",
    "n_tup_hot_upd",
    "vacuum_count",
    "autovacuum_count",
    "analyze_count",
    "autoanalyze_count",
    "last_vacuum",
    "last_autovacuum",
    "last_analyze",
    "last_autoanalyze",
)
"""Per table, in ``TABLE_STATS``'s order after the name; a CSV column each, ``<table>_<column>``."""

INDEX_SIZES = """
SELECT s.indexrelname, pg_relation_size(s.indexrelid), s.relname
FROM pg_stat_user_indexes AS s
WHERE s.schemaname = current_schema() AND s.relname = ANY(:tables)
ORDER BY s.relname, s.indexrelname
"""

COUNTERS = (
    "offered",
    "requests_processed",
    "requests_duplicate",
    "notices_processed",
    "relay_published",
    "downstream",
    "inbox_expired",
    "other_outcomes",
    "publish_failures",
)
"""Counts so far, a CSV column each; ``other_outcomes``: deliveries that ended otherwise (dead
letters, retries: none in an undisturbed run); ``publish_failures``: requests the broker did not
confirm (none unless it went away)."""
RATES = {
    "offered_per_s": ("offered",),
    "handled_per_s": ("requests_processed", "requests_duplicate"),
    "published_per_s": ("relay_published",),
    "downstream_per_s": ("downstream",),
    "expired_per_s": ("inbox_expired",),
}
"""Rates over the interval before each sample, from the sums of counters."""
GAUGES = (
    "queue_depth",
    "outbox_backlog",
    "outbox_oldest_age_s",
    "machine_busy_pct",
    "worker_cpu_pct",
    "soak_cpu_pct",
)
"""Since the previous sample: ``machine_busy_pct``, the whole machine's CPU busy (every core and
process: PostgreSQL, RabbitMQ, the worker, this script and whatever else runs), 100 when all its
cores were; ``worker_cpu_pct`` and ``soak_cpu_pct``, the worker's and this script's CPU time, 100
for one core's."""

Counter = collections.Counter[str]


@dataclass(frozen=True)
class Options:
    """What to run, from the command line."""

    minutes: float
    rate: float
    sample: float
    csv: Path
    duplicates: float
    accounts: int
    retention: float
    janitor_interval: float | None
    janitor_batch_size: int | None
    warm_up: float | None
    tolerance: float
    autovacuum: str

    @property
    def seconds(self) -> float:
        return self.minutes * 60

    @property
    def warm_up_seconds(self) -> float:
        return self.seconds / 3 if self.warm_up is None else self.warm_up


# The offered load


class Payments:
    """Payment requests, numbered; a share ``duplicates`` of them repeat one of the last
    ``RECENT`` sent (well within any retention, so the inbox must recognise every one)."""

    def __init__(self, run_id: str, duplicates: float, accounts: int) -> None:
        self._rng = random.Random(SEED)
        self._numbers = itertools.count()
        self._recent: collections.deque[dict[str, object]] = collections.deque(maxlen=RECENT)
        self._run_id, self._duplicates, self._accounts = run_id, duplicates, accounts

    def next(self) -> dict[str, object]:
        """The next payment to request: a new one, or now and then a recent one again."""
        if self._recent and self._rng.random() < self._duplicates:
            return self._rng.choice(self._recent)
        payment: dict[str, object] = {
            "payment_id": f"soak-{self._run_id}-{next(self._numbers)}",
            "account": f"account-{self._rng.randrange(self._accounts)}",
            "amount_cents": self._rng.randint(100, 10_000),
        }
        self._recent.append(payment)
        return payment


async def offer(
    exchange: AbstractExchange, payments: Payments, rate: float, until: float, soak: Soak
) -> None:
    """Publish requests on absolute deadlines, ``rate`` per second until ``until`` (a
    ``time.monotonic`` time): every ``TICK`` those due, concurrently, each confirmed (a slow tick
    makes the next one larger, not the rate lower). Those confirmed count in ``offered``; those
    that fail (the broker away: the connection restores itself) in ``publish_failures``, with
    the first error kept, and are not sent again: the run goes on at the rate once it can."""
    start, scheduled, counts = time.monotonic(), 0, soak.counts
    while (now := time.monotonic()) < until:
        due = math.floor(rate * (now - start)) + 1 - scheduled
        scheduled += due
        messages = [request_message(payments.next()) for _ in range(due)]
        sent = await asyncio.gather(
            *(exchange.publish(m, REQUESTED, mandatory=True) for m in messages),
            return_exceptions=True,
        )
        failures = [error for error in sent if isinstance(error, BaseException)]
        counts["offered"] += len(sent) - len(failures)
        if failures:
            counts["publish_failures"] += len(failures)
            soak.first_publish_error = soak.first_publish_error or repr(failures[0])
            await asyncio.sleep(OUTAGE_PAUSE)
        await asyncio.sleep(max(0.0, TICK - (time.monotonic() - now)))


# The worker's own counts


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def worker_counts(port: int) -> Counter:
    """The worker's counts from its ``/metrics``, under ``COUNTERS``' names (blocking)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        exposition = response.read().decode()
    counts: Counter = collections.Counter()
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            labels, value = sample.labels, int(sample.value)
            if sample.name == "worker_messages_total":
                handler, outcome = labels.get("handler"), labels.get("outcome")
                if handler == REQUESTED and outcome in ("processed", "duplicate"):
                    counts[f"requests_{outcome}"] += value
                elif handler == SETTLED and outcome == "processed":
                    counts["notices_processed"] += value
                else:
                    counts["other_outcomes"] += value
            elif sample.name == "worker_relay_messages_total" and labels["result"] == "published":
                counts["relay_published"] += value
            elif sample.name == "worker_inbox_expired_total":
                counts["inbox_expired"] += value
    return counts


# The tables


async def index_names(conn: AsyncConnection) -> dict[str, list[str]]:
    """The indexes of each of ``TABLES``, by name: a CSV column each, ``<index>_bytes``."""
    indexes: dict[str, list[str]] = {table: [] for table in TABLES}
    for name, _, table in await conn.execute(text(INDEX_SIZES), {"tables": list(TABLES)}):
        indexes[table].append(name)
    return indexes


async def table_sample(conn: AsyncConnection) -> dict[str, object]:
    """``TABLE_COLUMNS`` of each of ``TABLES`` and every index's bytes, as CSV columns."""
    row: dict[str, object] = {}
    for name, *values in await conn.execute(text(TABLE_STATS), {"tables": list(TABLES)}):
        for column, value in zip(TABLE_COLUMNS, values, strict=True):
            row[f"{name}_{column}"] = value.isoformat() if isinstance(value, datetime) else value
    for name, size, _ in await conn.execute(text(INDEX_SIZES), {"tables": list(TABLES)}):
        row[f"{name}_bytes"] = size
    stats = await outbox_stats(conn)
    row["outbox_backlog"] = stats.backlog
    row["outbox_oldest_age_s"] = round(stats.oldest_age_seconds, 3)
    return row


# Autovacuum, or a stand-in where the server has it off


SERVER_SETTINGS = """
SELECT name, setting FROM pg_settings
WHERE name LIKE 'autovacuum%' OR name IN ('vacuum_cost_delay', 'vacuum_cost_limit',
      'shared_buffers', 'maintenance_work_mem', 'server_version')
"""
TABLES_TO_CHECK = """
SELECT s.relname, greatest(c.reltuples, 0), coalesce(c.reloptions, '{}'), s.n_dead_tup,
       s.n_ins_since_vacuum, s.n_mod_since_analyze
FROM pg_stat_user_tables AS s JOIN pg_class AS c ON c.oid = s.relid
WHERE s.schemaname = current_schema()
"""
RELOPTIONS = """
SELECT c.relname, coalesce(c.reloptions, '{}') FROM pg_class AS c
WHERE c.relname = ANY(:tables) AND c.relnamespace = current_schema()::regnamespace
"""


@dataclass(frozen=True)
class Work:
    """What autovacuum's rule asks of one table now, and with which cost-based delay."""

    table: str
    vacuum: bool
    analyze: bool
    cost_delay_ms: float
    cost_limit: int

    def statements(self) -> list[str]:
        quoted = '"' + self.table.replace('"', '""') + '"'
        command = (
            f"VACUUM (SKIP_LOCKED, ANALYZE) {quoted}"
            if self.vacuum and self.analyze
            else f"VACUUM (SKIP_LOCKED) {quoted}"
            if self.vacuum
            else f"ANALYZE (SKIP_LOCKED) {quoted}"
        )
        return [
            f"SET vacuum_cost_delay = {self.cost_delay_ms:g}",
            f"SET vacuum_cost_limit = {self.cost_limit}",
            command,
        ]


def autovacuum_work(
    table: str,
    reltuples: float,
    reloptions: Sequence[str],
    changes: tuple[int, int, int],
    server: Mapping[str, str],
) -> Work | None:
    """What the autovacuum daemon would do to ``table`` (PostgreSQL 15's
    ``relation_needs_vacanalyze``, wraparound aside): ``changes`` are its dead tuples, inserts
    since its last vacuum and changes since its last analyze; ``reloptions`` override
    ``server``'s settings."""
    options = dict(option.split("=", 1) for option in reloptions)
    if options.get("autovacuum_enabled", "true").lower() in ("false", "off", "0"):
        return None

    def value(name: str) -> float:
        return float(options.get(name, server[name]))

    dead, inserted, changed = changes
    vacuum = dead > value("autovacuum_vacuum_threshold") + value(
        "autovacuum_vacuum_scale_factor"
    ) * reltuples or (
        value("autovacuum_vacuum_insert_threshold") >= 0
        and inserted
        > value("autovacuum_vacuum_insert_threshold")
        + value("autovacuum_vacuum_insert_scale_factor") * reltuples
    )
    analyze = (
        changed
        > value("autovacuum_analyze_threshold")
        + value("autovacuum_analyze_scale_factor") * reltuples
    )
    if not (vacuum or analyze):
        return None
    delay = value("autovacuum_vacuum_cost_delay")
    limit = value("autovacuum_vacuum_cost_limit")
    return Work(
        table,
        vacuum,
        analyze,
        float(server["vacuum_cost_delay"]) if delay < 0 else delay,
        int(float(server["vacuum_cost_limit"])) if limit < 0 else int(limit),
    )


@dataclass(frozen=True)
class Ran:
    """Work the stand-in did, and how long it took."""

    work: Work
    seconds: float


async def stand_in_for_autovacuum(
    engine: AsyncEngine, server: Mapping[str, str], done: list[Ran]
) -> None:
    """Every ``autovacuum_naptime``, the daemon's work on each table of the database, one table
    after another (as one autovacuum worker does), until cancelled; appends what it ran."""
    naptime = float(server["autovacuum_naptime"])
    async with engine.connect() as conn:
        await conn.execution_options(isolation_level="AUTOCOMMIT")
        while True:
            await asyncio.sleep(naptime)
            rows = (await conn.execute(text(TABLES_TO_CHECK))).all()
            for table, reltuples, reloptions, dead, inserted, changed in rows:
                work = autovacuum_work(
                    table, reltuples, reloptions, (dead, inserted, changed), server
                )
                if work is not None:
                    started = time.perf_counter()
                    for statement in work.statements():
                        await conn.exec_driver_sql(statement)
                    done.append(Ran(work, time.perf_counter() - started))


# Sampling


@dataclass
class Soak:
    """What the run shares: its options and settings, the columns, the samples so far."""

    options: Options
    settings: Settings
    server: dict[str, str]
    reloptions: dict[str, list[str]]
    indexes: dict[str, list[str]]
    stand_in: bool
    samples: list[dict[str, Any]] = field(default_factory=list)
    vacuums: list[Ran] = field(default_factory=list)
    cpu: tuple[int, int] | None = None
    """The machine's CPU times at the previous sample."""
    clock: tuple[float, float | None, float] | None = None
    """At the previous sample: ``time.monotonic``, the worker's and this process's CPU time."""
    worker_warnings: list[str] = field(default_factory=list)
    counts: Counter = field(default_factory=collections.Counter)
    """This process's counts: ``offered``, ``downstream``, ``publish_failures``."""
    first_publish_error: str | None = None
    stopped_early_at: float | None = None
    stopped_by: str | None = None
    """Why the run ended early: a signal's name, or the part of it that failed."""
    failed: bool = False
    """A part of the run failed: it did not measure what was asked."""

    @property
    def columns(self) -> list[str]:
        per_table = [f"{t}_{c}" for t in TABLES for c in TABLE_COLUMNS]
        indexes = [f"{name}_bytes" for t in TABLES for name in self.indexes[t]]
        return ["elapsed_s", "time", *COUNTERS, *RATES, *GAUGES, *per_table, *indexes]


async def take_sample(
    soak: Soak,
    engine: AsyncEngine,
    queue: AbstractQueue,
    port: int,
    at: float,
    pid: int,
) -> dict[str, Any]:
    """One row: the time, the counts (the worker's, and this process's), the rates since the
    previous row, the work queue's depth and the tables."""
    worker = await asyncio.to_thread(worker_counts, port)
    try:
        depth: int | str = (await queue.declare()).message_count or 0
    except Exception:  # the broker away for a moment: the sample goes on without it
        depth = ""
    async with engine.connect() as conn:
        tables = await table_sample(conn)
    row: dict[str, Any] = {
        "elapsed_s": round(at, 1),
        "time": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    row |= {name: soak.counts[name] + worker[name] for name in COUNTERS}
    previous = soak.samples[-1] if soak.samples else None
    for rate, names in RATES.items():
        if previous is None or at <= previous["elapsed_s"]:
            row[rate] = ""
            continue
        gained = sum(row[n] - previous[n] for n in names)
        row[rate] = round(gained / (at - previous["elapsed_s"]), 1)
    row["queue_depth"] = depth
    return row | cpu_use(soak, pid) | tables


def cpu_use(soak: Soak, pid: int) -> dict[str, object]:
    """``GAUGES``' CPU shares since the previous call (empty the first time)."""
    busy = busy_since(soak.cpu)
    now, worker, own = time.monotonic(), process_cpu_seconds(pid), own_cpu_seconds()
    shares: dict[str, object] = {
        "machine_busy_pct": "" if busy is None else round(100 * busy),
        "worker_cpu_pct": "",
        "soak_cpu_pct": "",
    }
    if soak.clock is not None:
        then, worker_before, own_before = soak.clock
        if worker is not None and worker_before is not None:
            shares["worker_cpu_pct"] = round(100 * (worker - worker_before) / (now - then))
        shares["soak_cpu_pct"] = round(100 * (own - own_before) / (now - then))
    soak.cpu, soak.clock = cpu_times(), (now, worker, own)
    return shares


def process_cpu_seconds(pid: int) -> float | None:
    """The CPU time (user + system) process ``pid`` has used, from Linux's ``/proc``."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def sample_until_done(
    soak: Soak,
    engine: AsyncEngine,
    queue: AbstractQueue,
    port: int,
    worker: subprocess.Popen[bytes],
    stop: asyncio.Event,
    writer: csv.DictWriter[str],
    sink: IO[str],
) -> None:
    """A row at the start and every ``--sample`` until the end (or ``stop``), the last one at the
    end; each written and flushed as it is taken."""
    options = soak.options
    start = time.monotonic()
    for k in itertools.count():
        at = min(k * options.sample, options.seconds)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, start + at - time.monotonic()))
        if stop.is_set():
            soak.stopped_early_at = time.monotonic() - start
            at = soak.stopped_early_at
        if worker.poll() is not None:
            raise WorkerFailed(f"the worker exited {worker.returncode} during the soak")
        row = await take_sample(soak, engine, queue, port, at, worker.pid)
        soak.samples.append(row)
        writer.writerow(row)
        sink.flush()
        progress(progress_line(row))
        if stop.is_set() or at >= options.seconds:
            return


def progress_line(row: Mapping[str, Any]) -> str:
    return (
        f"  {row['elapsed_s']:>7.0f} s  offered {row['offered']:>8}  handled "
        f"{row['requests_processed'] + row['requests_duplicate']:>8}  inbox "
        f"{mib(row['inbox_total_bytes'])} ({row['inbox_n_live_tup']} live, "
        f"{row['inbox_n_dead_tup']} dead)  outbox {mib(row['outbox_total_bytes'])} "
        f"({row['outbox_n_dead_tup']} dead, backlog {row['outbox_backlog']})  queue "
        f"{row['queue_depth']}"
    )


# The run


@contextlib.asynccontextmanager
async def downstream(
    channel: AbstractChannel, exchange: AbstractExchange, name: str, counts: Counter
) -> AsyncIterator[None]:
    """A queue of ours bound to ``SETTLED``, drained as it fills (no acks), counted in
    ``downstream``; deleted on exit."""
    queue = await channel.declare_queue(name, exclusive=True, auto_delete=True)
    await queue.bind(exchange, SETTLED)

    async def received(_: Any) -> None:
        counts["downstream"] += 1

    tag = await queue.consume(received, no_ack=True)
    try:
        yield
    finally:
        if not channel.is_closed:
            await queue.cancel(tag)
            await queue.delete(if_unused=False, if_empty=False)


def stopping_on_signals(soak: Soak, stop: asyncio.Event) -> None:
    """SIGINT and SIGTERM end the soak early (with its summary), not the process."""

    def stopped(number: signal.Signals) -> None:
        soak.stopped_by = soak.stopped_by or number.name
        stop.set()

    loop = asyncio.get_running_loop()
    for number in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(number, stopped, number)


def stopping_on_failure(soak: Soak, stop: asyncio.Event, task: asyncio.Task[None]) -> None:
    """A part of the run that fails ends it early (with its summary), marked failed."""

    def ended(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and (error := task.exception()) is not None:
            soak.stopped_by = soak.stopped_by or f"{task.get_name()} failed: {error!r}"
            soak.failed = True
            stop.set()

    task.add_done_callback(ended)


async def run_soak(settings: Settings, options: Options) -> Soak:
    """Start the worker, offer the load and sample until the end; stop the worker."""
    engine = create_engine(settings, application_name="soak", pool_size=2)
    connection = await connect_broker(settings, name="soak")
    stop = asyncio.Event()
    try:
        async with engine.connect() as conn:
            server = {n: str(v) for n, v in await conn.execute(text(SERVER_SETTINGS))}
            reloptions = {
                name: list(values)
                for name, values in await conn.execute(text(RELOPTIONS), {"tables": list(TABLES)})
            }
            indexes = await index_names(conn)
        stand_in = options.autovacuum == "stand-in" or (
            options.autovacuum == "auto" and server["autovacuum"] == "off"
        )
        soak = Soak(options, settings, server, reloptions, indexes, stand_in)
        stopping_on_signals(soak, stop)
        print(preamble(soak), flush=True)
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        topology = await declare_topology(channel, settings, payments_router.routing_keys())
        port = free_port()
        name = f"{settings.queue}.downstream"
        async with downstream(channel, topology.exchange, name, soak.counts):
            with worker_run(settings, *worker_arguments(settings, port)) as (worker, output):
                try:
                    await _soak_with(soak, engine, topology, port, worker, stop)
                    await stop_worker(worker)
                except WorkerFailed as exc:
                    raise WorkerFailed(f"{exc}; the worker's last lines:\n{tail(output)}") from None
                soak.worker_warnings = warnings_in(output)
        return soak
    finally:
        await connection.close()
        await engine.dispose()


async def _soak_with(
    soak: Soak,
    engine: AsyncEngine,
    topology: Topology,
    port: int,
    worker: subprocess.Popen[bytes],
    stop: asyncio.Event,
) -> None:
    """Once the worker consumes: the offered load, the stand-in if any, the samples; a part that
    fails ends the run early."""
    queue = await topology.channel.declare_queue(soak.settings.queue, passive=True)

    async def consuming() -> bool:
        return bool((await queue.declare()).consumer_count)

    await asyncio.wait_for(until(consuming, worker), START_SECONDS)
    options = soak.options
    payments = Payments(uuid.uuid4().hex[:8], options.duplicates, options.accounts)
    ends = time.monotonic() + options.seconds
    parts = {"the producer": offer(topology.exchange, payments, options.rate, ends, soak)}
    if soak.stand_in:
        parts["the autovacuum stand-in"] = stand_in_for_autovacuum(
            engine, soak.server, soak.vacuums
        )
    tasks = [asyncio.create_task(part, name=name) for name, part in parts.items()]
    for task in tasks:
        stopping_on_failure(soak, stop, task)
    try:
        with options.csv.open("w", newline="") as sink:
            writer = csv.DictWriter(sink, soak.columns)
            writer.writeheader()
            await sample_until_done(soak, engine, queue, port, worker, stop, writer, sink)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # a failure is in stopped_by


def worker_arguments(settings: Settings, port: int) -> list[str]:
    """``worker run``'s flags: the soak's retention and janitor, its metrics on ``port``."""
    return [
        "--inbox-retention",
        format_duration(settings.inbox_retention),
        "--janitor-interval",
        format_duration(settings.janitor_interval),
        "--janitor-batch-size",
        str(settings.janitor_batch_size),
        "--http-host",
        "127.0.0.1",
        "--http-port",
        str(port),
    ]


def warnings_in(output: IO[bytes]) -> list[str]:
    """The worker's log lines at WARNING or above."""
    output.seek(0)
    lines = output.read().decode(errors="replace").splitlines()
    return [line for line in lines if re.search(r"\b(WARNING|ERROR|CRITICAL)\b", line)]


# Reporting


def mib(size: float) -> str:
    return f"{size / 1024 / 1024:7.2f} MiB"


def preamble(soak: Soak) -> str:
    """The settings of the run, the server's and the tables' own, before the first sample."""
    options, settings, server = soak.options, soak.settings, soak.server
    vacuum = (
        "the script stands in for it (every table of the database, the daemon's rule)"
        if soak.stand_in
        else "none at all (--autovacuum none)"
        if server["autovacuum"] == "off"
        else "the server's daemon"
    )
    lines = [
        f"soak: {options.minutes:g} min at {options.rate:g} requests/s "
        f"({100 * options.duplicates:g} % duplicates, {options.accounts} accounts), a sample "
        f"every {format_duration(options.sample)}, "
        f"warm-up {format_duration(options.warm_up_seconds)}",
        f"  csv: {options.csv}",
        f"  worker: inbox_retention {format_duration(settings.inbox_retention)} (retry chain "
        f"{format_duration(settings.retry_chain)}), janitor_interval "
        f"{format_duration(settings.janitor_interval)}, janitor_batch_size "
        f"{settings.janitor_batch_size}, batch_size {settings.batch_size}, concurrency "
        f"{settings.concurrency}, relay in process",
        f"  server: PostgreSQL {server['server_version']}, shared_buffers "
        f"{int(server['shared_buffers']) * 8 // 1024} MiB, autovacuum {server['autovacuum']}; "
        f"vacuum: {vacuum}",
        f"  autovacuum rule: naptime {server['autovacuum_naptime']}s, vacuum at "
        f"{server['autovacuum_vacuum_threshold']} + {server['autovacuum_vacuum_scale_factor']} x "
        f"rows dead, or {server['autovacuum_vacuum_insert_threshold']} + "
        f"{server['autovacuum_vacuum_insert_scale_factor']} x rows inserted; analyze at "
        f"{server['autovacuum_analyze_threshold']} + {server['autovacuum_analyze_scale_factor']}"
        f" x rows changed; cost delay {server['autovacuum_vacuum_cost_delay']} ms, limit "
        f"{server['autovacuum_vacuum_cost_limit']} (vacuum_cost_limit "
        f"{server['vacuum_cost_limit']})",
    ]
    for table in TABLES:
        options_of = soak.reloptions.get(table) or ["(none)"]
        lines.append(f"  {table} storage parameters: {', '.join(options_of)}")
    return "\n".join(lines)


@dataclass(frozen=True)
class Growth:
    """One relation's size over the run (bytes): at the start, at the end of the warm-up, the
    largest from there to the last third, the largest in the last third, at the end (None where
    the run was too short to have it)."""

    start: int
    warm_up_end: int | None
    middle_max: int | None
    last_max: int | None
    end: int

    def verdict(self, tolerance: float, steady: bool) -> str:
        """Bounded when the last third's largest is within ``tolerance`` + ``SLACK_BYTES`` of the
        larger of the warm-up end and the middle's largest; not judged unless ``steady`` (the
        warm-up reached the inbox's steady state)."""
        if self.warm_up_end is None or self.last_max is None:
            return "not judged: the run is too short"
        reference = max(self.warm_up_end, self.middle_max or 0)
        change = f"{100 * (self.last_max - reference) / reference:+.0f} %" if reference else "-"
        if not steady:
            return f"not judged ({change}): the warm-up is short of the steady state"
        bounded = self.last_max <= reference * (1 + tolerance) + SLACK_BYTES
        return f"{'yes' if bounded else 'NO'} ({change})"


def growth(samples: Sequence[Mapping[str, Any]], column: str, warm_up: float) -> Growth:
    """``column``'s ``Growth`` over ``samples``, the warm-up ending at ``warm_up`` seconds."""
    last_third = 2 * samples[-1]["elapsed_s"] / 3

    def values(low: float, high: float) -> list[int]:
        return [int(s[column]) for s in samples if low <= s["elapsed_s"] < high]

    after = [s for s in samples if s["elapsed_s"] >= warm_up]
    warm_up_end = int(after[0][column]) if after and warm_up < last_third else None
    middle = values(warm_up, last_third)
    last = values(last_third, math.inf) if warm_up_end is not None else []
    return Growth(
        int(samples[0][column]),
        warm_up_end,
        max(middle) if middle else None,
        max(last) if last else None,
        int(samples[-1][column]),
    )


def steady_state(soak: Soak) -> float:
    """Seconds until the inbox can be steady: keys expire after the retention, the janitor
    sweeps them within an interval, and a vacuum comes within a naptime."""
    settings = soak.settings
    naptime = float(soak.server["autovacuum_naptime"])
    return settings.inbox_retention + settings.janitor_interval + naptime


def size_lines(soak: Soak) -> list[str]:
    """A line per table (total, heap, indexes) and per index: its ``Growth`` and verdict."""
    options = soak.options
    steady = options.warm_up_seconds >= steady_state(soak)
    widths = (34, 12, 14, 14, 14, 12)
    titles = ("relation", "start", "warm-up end", "max middle", "max last 1/3", "end")
    lines = [
        "".join(
            f"{t:<{w}}" if i == 0 else f"{t:>{w}}"
            for i, (t, w) in enumerate(zip(titles, widths, strict=True))
        )
        + "  bounded"
    ]
    relations = [
        (label, column)
        for t in TABLES
        for label, column in (
            (f"{t} (total)", f"{t}_total_bytes"),
            (f"{t} (heap)", f"{t}_heap_bytes"),
            (f"{t} (indexes)", f"{t}_indexes_bytes"),
            *((f"  {name}", f"{name}_bytes") for name in soak.indexes[t]),
        )
    ]
    for label, column in relations:
        g = growth(soak.samples, column, options.warm_up_seconds)
        cells = (g.start, g.warm_up_end, g.middle_max, g.last_max, g.end)
        shown = "".join(
            f"{'-' if v is None else mib(v).strip():>{w}}"
            for v, w in zip(cells, widths[1:], strict=True)
        )
        lines.append(f"{label:<{widths[0]}}{shown}  {g.verdict(options.tolerance, steady)}")
    return lines


def vacuum_lines(soak: Soak) -> list[str]:
    """Dead tuples and vacuums of each table over the run."""
    first, last = soak.samples[0], soak.samples[-1]
    third = 2 * last["elapsed_s"] / 3
    lines = []
    for t in TABLES:
        dead = [int(s[f"{t}_n_dead_tup"]) for s in soak.samples if s["elapsed_s"] >= third]
        live = [int(s[f"{t}_n_live_tup"]) for s in soak.samples if s["elapsed_s"] >= third]
        runs = {
            kind: int(last[f"{t}_{kind}"]) - int(first[f"{t}_{kind}"])
            for kind in (
                *(f"{k}_count" for k in ("vacuum", "autovacuum", "analyze", "autoanalyze")),
                "n_tup_upd",
                "n_tup_hot_upd",
            )
        }
        hot = (
            f" ({100 * runs['n_tup_hot_upd'] / runs['n_tup_upd']:.0f} % HOT)"
            if runs["n_tup_upd"]
            else ""
        )
        lines.append(
            f"{t}: last third: live tuples {min(live)}-{max(live)}, dead {min(dead)}-{max(dead)};"
            f" over the run: {runs['n_tup_upd']} updates{hot}, {runs['autovacuum_count']} "
            f"autovacuums, {runs['vacuum_count']} vacuums, {runs['autoanalyze_count']} "
            f"autoanalyzes, {runs['analyze_count']} analyzes; last vacuum "
            f"{last[f'{t}_last_autovacuum'] or last[f'{t}_last_vacuum'] or 'never'}"
        )
    if soak.stand_in:
        lines.append(
            "(the server's autovacuum is off: the vacuums and analyzes are the stand-in's)"
        )
        for t in TABLES:
            took = [ran.seconds for ran in soak.vacuums if ran.work.table == t and ran.work.vacuum]
            if took:
                lines.append(
                    f"  {t}: {len(took)} vacuums, {sum(took):.1f} s in all, the longest "
                    f"{max(took):.2f} s"
                )
    return lines


def rate_lines(soak: Soak) -> list[str]:
    first, last = soak.samples[0], soak.samples[-1]
    seconds = last["elapsed_s"] - first["elapsed_s"] or 1.0

    depths = [s["queue_depth"] for s in soak.samples if s["queue_depth"] != ""]

    def per_second(*names: str) -> float:
        return float(sum(last[n] - first[n] for n in names)) / seconds

    lines = [
        f"rates over {seconds:.0f} s: offered {per_second('offered'):.1f}/s (asked "
        f"{soak.options.rate:g}/s); requests handled {per_second(*RATES['handled_per_s']):.1f}/s "
        f"({per_second('requests_processed'):.1f} processed, "
        f"{per_second('requests_duplicate'):.1f} duplicates); notices processed "
        f"{per_second('notices_processed'):.1f}/s; events published "
        f"{per_second('relay_published'):.1f}/s, received downstream "
        f"{per_second('downstream'):.1f}/s; inbox keys expired {per_second('inbox_expired'):.1f}/s",
        f"at the end: {last['queue_depth'] if last['queue_depth'] != '' else '?'} requests "
        "waiting in the work queue, outbox backlog "
        f"{last['outbox_backlog']} (oldest {last['outbox_oldest_age_s']:.1f} s); largest work "
        f"queue depth {max(depths, default='-')}, largest outbox backlog "
        f"{max(s['outbox_backlog'] for s in soak.samples)}",
    ]
    shares = {
        name: [float(s[name]) for s in soak.samples if s[name] != ""]
        for name in ("worker_cpu_pct", "soak_cpu_pct", "machine_busy_pct")
    }
    if all(shares.values()):
        mean = {name: sum(values) / len(values) for name, values in shares.items()}
        lines.append(
            f"cpu, mean of the samples: the worker {mean['worker_cpu_pct']:.0f} % of a core (at "
            f"most {max(shares['worker_cpu_pct']):.0f} %), this script "
            f"{mean['soak_cpu_pct']:.0f} %, the machine busy {mean['machine_busy_pct']:.0f} % "
            f"of its {os.cpu_count()} cores (everything on it)"
        )
    if last["other_outcomes"]:
        lines.append(f"{last['other_outcomes']} deliveries ended otherwise (dead letters, retries)")
    return lines


def report(soak: Soak, elapsed: float) -> str:
    """The summary: sizes and whether each is bounded, dead tuples and vacuums, rates, notes."""
    options = soak.options
    lines = [
        f"summary: {len(soak.samples)} samples; warm-up {format_duration(options.warm_up_seconds)}"
        f", bounded: the last third's largest within {100 * options.tolerance:g} % + "
        f"{SLACK_BYTES // 1024} KiB",
        *size_lines(soak),
        "",
        *vacuum_lines(soak),
        "",
        *rate_lines(soak),
    ]
    notes = []
    if soak.stopped_early_at is not None:
        notes.append(f"stopped early after {soak.stopped_early_at:.0f} s: {soak.stopped_by}")
    if soak.counts["publish_failures"]:
        notes.append(
            f"{soak.counts['publish_failures']} requests were not confirmed by the broker and not "
            f"sent again (the first error: {soak.first_publish_error})"
        )
    if options.warm_up_seconds < (steady := steady_state(soak)):
        notes.append(
            f"the warm-up ({format_duration(options.warm_up_seconds)}) is shorter than the "
            f"retention, a janitor interval and an autovacuum naptime ({format_duration(steady)}):"
            " the inbox cannot have reached its steady state, so nothing is judged"
        )
    if soak.worker_warnings:
        notes.append(f"{len(soak.worker_warnings)} warnings in the worker's log, the first:")
        notes += [f"  {line}" for line in soak.worker_warnings[:5]]
    notes.append(f"csv: {options.csv}; total {elapsed:.0f} s")
    return "\n".join([*lines, "", *notes])


# The command line


def parse_options(argv: list[str] | None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.soak",
        description="The inbox and outbox tables under a steady load: sizes, dead tuples, rates.",
    )
    parser.add_argument("--minutes", type=positive_float, default=30.0, help="duration (30)")
    parser.add_argument("--rate", type=positive_float, default=300.0, help="requests/s (300)")
    parser.add_argument("--sample", type=duration, default=30.0, help="sample interval (30s)")
    parser.add_argument(
        "--csv", type=Path, help="the samples' file (default: soak-<time>.csv in the temp dir)"
    )
    parser.add_argument(
        "--duplicates", type=fraction, default=0.1, help="share of repeated requests (0.1)"
    )
    parser.add_argument("--accounts", type=positive_int, default=1000, help="accounts (1000)")
    parser.add_argument(
        "--retention", type=duration, default=300.0, help="the worker's inbox_retention (5m)"
    )
    parser.add_argument(
        "--janitor-interval", type=duration, help="the worker's janitor_interval (its default)"
    )
    parser.add_argument(
        "--janitor-batch-size",
        type=positive_int,
        help="the worker's janitor_batch_size (its default)",
    )
    parser.add_argument(
        "--warm-up", type=duration, help="time before the comparison (the first third)"
    )
    parser.add_argument(
        "--tolerance", type=fraction, default=0.1, help="growth still counted as flat (0.1)"
    )
    parser.add_argument(
        "--autovacuum",
        choices=("auto", "stand-in", "none"),
        default="auto",
        help="auto: the server's daemon, or the stand-in where it is off; stand-in: always; "
        "none: no vacuum where the server's is off",
    )
    args = parser.parse_args(argv)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Options(
        minutes=args.minutes,
        rate=args.rate,
        sample=args.sample,
        csv=args.csv or Path(tempfile.gettempdir()) / f"soak-{stamp}.csv",
        duplicates=args.duplicates,
        accounts=args.accounts,
        retention=args.retention,
        janitor_interval=args.janitor_interval,
        janitor_batch_size=args.janitor_batch_size,
        warm_up=args.warm_up,
        tolerance=args.tolerance,
        autovacuum=args.autovacuum,
    )


def soak_settings(options: Options) -> Settings:
    """The worker's settings for the soak: broker names of its own, the soak's retention and
    janitor (the others from the environment, as the worker would read them)."""
    run_id = uuid.uuid4().hex[:10]
    return Settings.load(
        exchange=f"soak-{run_id}-events",
        queue=f"soak-{run_id}",
        inbox_retention=options.retention,
        janitor_interval=options.janitor_interval,
        janitor_batch_size=options.janitor_batch_size,
    )


def main(argv: list[str] | None = None) -> None:
    options = parse_options(argv)
    started = time.perf_counter()
    base = soak_settings(options)
    try:
        with scratch_database(base, payments_router, prefix="worker_soak") as settings:
            soak = asyncio.run(run_soak(settings, options))
    finally:
        asyncio.run(delete_broker_objects(base))
    print(report(soak, time.perf_counter() - started))
    if soak.failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
