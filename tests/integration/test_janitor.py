"""The inbox janitor against the real PostgreSQL: it deletes only completed and failed keys past
their retention, in batches, one instance at a time, without waiting on rows a consumer holds,
and always releases its lock."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import asyncpg
import pytest
import sqlalchemy.exc
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.helpers import WORKER_SCRIPT, rows, run, scalar, wait_until
from worker.database import create_engine
from worker.ops.janitor import Janitor, Sweep, sweep
from worker.ops.metrics import Metrics
from worker.settings import Settings
from worker.sql import maintenance
from worker.telemetry import Count

EXPIRED = 8  # days; the default retention is 7
HANG_GUARD = 10.0


async def insert_keys(
    engine: AsyncEngine, prefix: str, count: int, *, status: str, age_days: float
) -> None:
    """``count`` inbox keys ``<prefix>-0`` .. of handler ``h``, last touched ``age_days`` ago."""
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "INSERT INTO inbox (handler, key, fingerprint, status, routing_key, updated_at) "
                "VALUES ('h', :key, :fingerprint, :status, 'test.key', "
                "now() - make_interval(days => :days))"
            ),
            [
                {"key": f"{prefix}-{i}", "fingerprint": b"\x00", "status": status, "days": age_days}
                for i in range(count)
            ],
        )


async def keys(engine: AsyncEngine) -> list[str]:
    return [key for (key,) in await rows(engine, "SELECT key FROM inbox ORDER BY key")]


LOCK_HOLDERS = (
    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
    f"AND classid = {maintenance.JANITOR_LOCK_CLASS} AND objid = 0 AND objsubid = 2"
)
"""Sessions holding the janitor lock (a two-key advisory lock has ``objsubid`` 2)."""


@pytest.fixture
async def other_session(settings: Settings) -> AsyncIterator[asyncpg.Connection]:
    """A database session of its own, outside the engine's pool."""
    conn = await asyncpg.connect(settings.database_url)
    yield conn
    await conn.close()


async def test_deletes_only_expired_finished_keys_in_batches(
    engine: AsyncEngine, settings: Settings
) -> None:
    await insert_keys(engine, "old-completed", 3, status="completed", age_days=EXPIRED)
    await insert_keys(engine, "old-failed", 2, status="failed", age_days=EXPIRED)
    await insert_keys(engine, "old-in-progress", 2, status="in_progress", age_days=EXPIRED)
    await insert_keys(engine, "fresh-completed", 2, status="completed", age_days=6)
    await insert_keys(engine, "fresh-failed", 1, status="failed", age_days=0)

    # 5 expired keys in batches of 2: transactions delete 2, 2 and 1; the last one is short.
    assert await sweep(engine, settings.replace(janitor_batch_size=2)) == Sweep(5, 3)

    assert await keys(engine) == [
        "fresh-completed-0",
        "fresh-completed-1",
        "fresh-failed-0",
        "old-in-progress-0",
        "old-in-progress-1",
    ]
    assert await sweep(engine, settings) == Sweep(0, 0)


async def test_a_full_last_batch_takes_one_more_empty_transaction(
    engine: AsyncEngine, settings: Settings
) -> None:
    await insert_keys(engine, "old", 4, status="completed", age_days=EXPIRED)

    # transactions delete 2, 2 and 0: only two of them deleted anything
    assert await sweep(engine, settings.replace(janitor_batch_size=2)) == Sweep(4, 2)
    assert await keys(engine) == []


async def test_skips_a_sweep_while_another_instance_holds_the_lock(
    engine: AsyncEngine, settings: Settings, other_session: asyncpg.Connection
) -> None:
    await insert_keys(engine, "old", 3, status="completed", age_days=EXPIRED)
    assert await other_session.fetchval(
        "SELECT pg_try_advisory_lock($1, 0)", maintenance.JANITOR_LOCK_CLASS
    )

    assert await sweep(engine, settings) is None
    assert len(await keys(engine)) == 3

    assert await other_session.fetchval(
        "SELECT pg_advisory_unlock($1, 0)", maintenance.JANITOR_LOCK_CLASS
    )
    assert await sweep(engine, settings) == Sweep(3, 1)
    assert await keys(engine) == []


async def test_releases_the_lock_after_a_sweep(
    engine: AsyncEngine, settings: Settings, other_session: asyncpg.Connection
) -> None:
    await insert_keys(engine, "old", 3, status="failed", age_days=EXPIRED)

    assert await sweep(engine, settings.replace(janitor_batch_size=2)) == Sweep(3, 2)
    assert await sweep(engine, settings) == Sweep(0, 0)

    assert await scalar(engine, LOCK_HOLDERS) == 0
    assert await other_session.fetchval(
        "SELECT pg_try_advisory_lock($1, 0)", maintenance.JANITOR_LOCK_CLASS
    )
    assert await other_session.fetchval(
        "SELECT pg_advisory_unlock($1, 0)", maintenance.JANITOR_LOCK_CLASS
    )


async def test_skips_rows_a_consumer_holds_instead_of_waiting(
    engine: AsyncEngine, settings: Settings, other_session: asyncpg.Connection
) -> None:
    await insert_keys(engine, "old", 3, status="completed", age_days=EXPIRED)
    consumer = other_session.transaction()
    await consumer.start()
    try:
        await other_session.execute("SELECT 1 FROM inbox WHERE key = 'old-1' FOR UPDATE")

        result = await asyncio.wait_for(sweep(engine, settings), HANG_GUARD)

        assert result == Sweep(2, 1)
        assert await keys(engine) == ["old-1"]
    finally:
        await consumer.rollback()
    assert await sweep(engine, settings) == Sweep(1, 1)


async def test_janitor_sweeps_every_interval_until_stopped(
    engine: AsyncEngine, settings: Settings
) -> None:
    await insert_keys(engine, "first", 3, status="completed", age_days=EXPIRED)
    metrics = Metrics()
    stats = metrics.stats
    stop = asyncio.Event()
    task = asyncio.create_task(
        Janitor(settings.replace(janitor_interval=0.05), engine, metrics).run(stop)
    )
    try:
        await wait_until(lambda: _at_least(stats[Count.INBOX_EXPIRED], 3))
        await insert_keys(engine, "second", 2, status="failed", age_days=EXPIRED)
        await wait_until(lambda: _at_least(stats[Count.INBOX_EXPIRED], 5))
        assert await keys(engine) == []
    finally:
        stop.set()
        await asyncio.wait_for(task, HANG_GUARD)


async def test_janitor_survives_a_transient_failure(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    # nothing listens on port 1: connecting is refused, which is transient
    unreachable = create_engine(settings.replace(database_url="postgresql://nobody@127.0.0.1:1/x"))
    stop = asyncio.Event()
    janitor = Janitor(settings.replace(janitor_interval=0.05), unreachable)
    with caplog.at_level(logging.WARNING, logger="worker.ops.janitor"):
        task = asyncio.create_task(janitor.run(stop))
        try:
            await wait_until(lambda: _at_least(_failures(caplog), 2))
            assert not task.done()
        finally:
            stop.set()
            await asyncio.wait_for(task, HANG_GUARD)
            await unreachable.dispose()
    assert janitor.metrics.stats[Count.INBOX_EXPIRED] == 0


async def test_janitor_raises_a_permanent_error(settings: Settings, engine: AsyncEngine) -> None:
    # a retention no timestamp can be that old: PostgreSQL raises a data exception (22008)
    # when it compares a key's age with it
    await insert_keys(engine, "old", 1, status="completed", age_days=1)
    settings = settings.replace(inbox_retention=1e16)
    with pytest.raises(sqlalchemy.exc.DBAPIError, match="out of range"):
        await asyncio.wait_for(Janitor(settings, engine).run(asyncio.Event()), HANG_GUARD)


def _failures(caplog: pytest.LogCaptureFixture) -> int:
    return sum("inbox sweep failed" in r.getMessage() for r in caplog.records)


async def _at_least(actual: int, expected: int) -> bool:
    return actual >= expected


async def test_worker_gc_sweeps_once_from_the_command_line(
    settings: Settings, engine: AsyncEngine
) -> None:
    await insert_keys(engine, "old", 3, status="completed", age_days=EXPIRED)
    await insert_keys(engine, "new", 1, status="completed", age_days=1)

    result = await asyncio.to_thread(
        run, WORKER_SCRIPT, "gc", WORKER_DATABASE_URL=settings.database_url
    )

    assert result.returncode == 0, result.stderr
    assert "deleted 3 inbox keys and 0 ingress requests older than 7d in 1 batches" in (
        result.stdout
    )
    assert await keys(engine) == ["new-0"]
