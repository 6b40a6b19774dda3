"""What keeping the inbox to its retention costs: the janitor's deletes against dropping a
partition, and what a time-partitioned inbox would do to the uniqueness the claim relies on.

1. ``--rows`` completed keys (``benchmarks.throughput.fill_inbox``) all past their retention;
   the janitor's own sweep (``worker.ops.janitor.sweep``, ``janitor_batch_size`` keys per
   transaction) deletes them: its time, then the time of the VACUUM the deletes leave for
   autovacuum to do, each with the WAL the cluster wrote meanwhile.
2. The same keys in one partition of ``inbox_by_time``, a copy of the inbox partitioned by range of
   ``created_at`` (its primary key must then be ``(handler, key, created_at)``); dropping that
   partition: its time and WAL, and the lock it takes.
3. On ``inbox_by_time``, what becomes of the claim's uniqueness: whether PostgreSQL accepts a
   unique index on ``(handler, key)`` alone and ``ON CONFLICT (handler, key)``, and whether a key
   claimed in the previous partition can be claimed again in the current one.

The per-key costs are then scaled to ``--rate`` keys per second (default 540: the soak's 300
requests per second, 10 % of them duplicates, make 270 payments and their 270 settlement notices,
two inbox keys each). WAL is the cluster's: on a server that others use too, it includes theirs.

A fresh database ``worker_bench_<hex>`` is created next to the one in ``WORKER_DATABASE_URL``,
migrated and dropped at the end; no broker is needed. From the repository root::

    .venv/bin/python -m benchmarks.retention [--rows 1000000] [--rate 540]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import sqlalchemy.exc
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from benchmarks.common import count_rows
from benchmarks.relay_latency import progress
from benchmarks.throughput import fill_inbox
from worker.database import create_engine
from worker.ops.janitor import sweep
from worker.settings import Settings, positive_float, positive_int
from worker.testing import scratch_database

PARTITIONED = """
CREATE TABLE inbox_by_time (LIKE inbox INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
PARTITION BY RANGE (created_at);
CREATE INDEX ON inbox_by_time (updated_at);
CREATE TABLE inbox_by_time_old PARTITION OF inbox_by_time
    FOR VALUES FROM (MINVALUE) TO (now() + interval '1 hour');
CREATE TABLE inbox_by_time_new PARTITION OF inbox_by_time
    FOR VALUES FROM (now() + interval '1 hour') TO (MAXVALUE);
CREATE UNIQUE INDEX ON inbox_by_time_old (handler, key);
CREATE UNIQUE INDEX ON inbox_by_time_new (handler, key);
INSERT INTO inbox_by_time SELECT * FROM inbox;
"""
"""A copy of the inbox partitioned by ``created_at``, its keys in the partition of the hour to
come. The best such a table can do for the claim's uniqueness is a unique index on ``(handler,
key)`` in each partition: PostgreSQL refuses one on the partitioned table, whose unique indexes
must include ``created_at``. Run one statement at a time."""


@dataclass(frozen=True)
class Cost:
    """How long a step took and the WAL the cluster wrote meanwhile."""

    seconds: float
    wal_bytes: int


@dataclass(frozen=True)
class Findings:
    """The three parts' results."""

    rows: int
    batch_size: int
    delete: Cost
    vacuum: Cost
    drop: Cost
    uniqueness: list[tuple[str, str]]


async def wal_position(conn: AsyncConnection) -> int:
    """The cluster's current WAL position, in bytes."""
    position = text("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint")
    return int((await conn.execute(position)).scalar_one())


async def measured(engine: AsyncEngine, step: Callable[[], Awaitable[object]]) -> Cost:
    """Run ``step``; its wall time and the WAL written meanwhile (the whole cluster's)."""
    async with engine.connect() as conn:
        await conn.execution_options(isolation_level="AUTOCOMMIT")
        before = await wal_position(conn)
        started = time.perf_counter()
        await step()
        seconds = time.perf_counter() - started
        return Cost(seconds, await wal_position(conn) - before)


async def autocommit(engine: AsyncEngine, *statements: str) -> None:
    """Run ``statements`` one by one outside a transaction block (as VACUUM must)."""
    async with engine.connect() as conn:
        await conn.execution_options(isolation_level="AUTOCOMMIT")
        for statement in statements:
            await conn.exec_driver_sql(statement)


async def in_transaction(engine: AsyncEngine, statement: str) -> str:
    """Run ``statement`` in a transaction of its own: "accepted" and the rows it wrote, or
    PostgreSQL's refusal."""
    try:
        async with engine.begin() as conn:
            written = (await conn.exec_driver_sql(statement)).rowcount
            return "accepted" if written < 0 else f"accepted, {written} row(s) written"
    except sqlalchemy.exc.DBAPIError as exc:
        return f"refused: {str(exc.orig).splitlines()[-1]}"


async def uniqueness(engine: AsyncEngine) -> list[tuple[str, str]]:
    """What PostgreSQL makes of the claim's uniqueness on ``inbox_by_time``."""
    claim = (
        "INSERT INTO inbox_by_time (handler, key, fingerprint, status, routing_key, created_at) "
        "VALUES ('h', 'k', '\\x00', 'completed', 'r', {at}) ON CONFLICT {target} DO NOTHING"
    )
    outcomes = [
        (
            "a unique index on (handler, key)",
            await in_transaction(engine, "CREATE UNIQUE INDEX ON inbox_by_time (handler, key)"),
        ),
        (
            "the claim's ON CONFLICT (handler, key)",
            await in_transaction(engine, claim.format(at="now()", target="(handler, key)")),
        ),
    ]
    for label, at in (
        ("a key claimed in the current partition", "now() + interval '2 hours'"),
        ("claimed again in the current partition", "now() + interval '3 hours'"),
        ("claimed again in the previous partition", "now()"),
    ):
        outcome = await in_transaction(engine, claim.format(at=at, target=""))
        async with engine.connect() as conn:
            count = await conn.scalar(text("SELECT count(*) FROM inbox_by_time WHERE key = 'k'"))
        outcomes.append(
            (f"{label} (ON CONFLICT DO NOTHING)", f"{outcome}; rows of the key: {count}")
        )
    return outcomes


async def measure(settings: Settings, rows: int) -> Findings:
    engine = create_engine(settings, application_name="bench-retention", pool_size=2)
    try:
        await fill_inbox(engine, rows)
        progress("  copying the keys into a time-partitioned inbox ...")
        await autocommit(engine, *(s for s in PARTITIONED.split(";\n") if s.strip()))
        found = await uniqueness(engine)
        await autocommit(engine, "VACUUM ANALYZE inbox_by_time", "CHECKPOINT")
        await asyncio.sleep(settings.inbox_retention)  # every key is past its retention now
        progress("  the janitor's sweep ...")
        delete = await measured(engine, lambda: sweep(engine, settings))
        if left := await count_rows(engine, "inbox"):
            raise RuntimeError(f"the sweep left {left} keys in the inbox")
        progress("  VACUUM after it ...")
        vacuum = await measured(engine, lambda: autocommit(engine, "VACUUM inbox"))
        progress("  dropping the partition ...")
        drop = await measured(engine, lambda: autocommit(engine, "DROP TABLE inbox_by_time_old"))
        return Findings(rows, settings.janitor_batch_size, delete, vacuum, drop, found)
    finally:
        await engine.dispose()


def report(findings: Findings, rate: float, server: str) -> str:
    rows = findings.rows

    def line(label: str, cost: Cost, per_key: bool = True) -> str:
        micros = f"{1e6 * cost.seconds / rows:8.1f} us/key" if per_key else " " * 15
        wal = f"WAL {cost.wal_bytes / 2**20:8.1f} MiB ({cost.wal_bytes / rows:5.0f} B/key)"
        return f"{label:<36}{cost.seconds:8.2f} s {micros}   {wal}"

    def share(cost: Cost) -> float:
        return 100 * cost.seconds / rows * rate

    return "\n".join(
        [
            f"retention of {rows:,} expired inbox keys, janitor_batch_size "
            f"{findings.batch_size}; {server}",
            line("janitor sweep (batched DELETE)", findings.delete),
            line("  VACUUM inbox after it", findings.vacuum),
            line("DROP TABLE of a partition", findings.drop, per_key=False),
            f"at {rate:g} keys/s the deletes take {share(findings.delete):.1f} % of a core and "
            f"their vacuum {share(findings.vacuum):.1f} % (PostgreSQL's time, wall clock); the "
            f"drop takes {findings.drop.seconds * 1000:.0f} ms per partition, and an ACCESS "
            "EXCLUSIVE lock on the partitioned table (every claim waits for it)",
            "",
            "uniqueness on an inbox partitioned by created_at:",
            *(f"  {what}: {outcome}" for what, outcome in findings.uniqueness),
            "(WAL is the cluster's: it includes what other sessions wrote meanwhile)",
        ]
    )


async def server_line(settings: Settings) -> str:
    engine = create_engine(settings, application_name="bench-retention", pool_size=1)
    try:
        async with engine.connect() as conn:
            version = await conn.scalar(text("SHOW server_version"))
            buffers = await conn.scalar(text("SHOW shared_buffers"))
            return f"PostgreSQL {version}, shared_buffers {buffers}"
    finally:
        await engine.dispose()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.retention",
        description="The janitor's deletes against dropping a partition; the inbox's uniqueness.",
    )
    parser.add_argument("--rows", type=positive_int, default=1_000_000, help="keys (1000000)")
    parser.add_argument(
        "--rate", type=positive_float, default=540.0, help="inbox keys per second to scale to (540)"
    )
    args = parser.parse_args(argv)
    # keys expire a second after they were written; no delayed retries to outlast
    base = Settings.load(retry_delays=(), inbox_retention=1.0)
    with scratch_database(base, prefix="worker_bench") as settings:
        findings = asyncio.run(measure(settings, args.rows))
        server = asyncio.run(server_line(settings))
    print(report(findings, args.rate, server))


if __name__ == "__main__":
    main()
