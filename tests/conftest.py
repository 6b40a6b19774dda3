"""Fixtures that give each test session its own database and each test its own broker names.

URLs come from WORKER_DATABASE_URL and WORKER_AMQP_URL (localhost defaults). The session creates
a fresh database next to the one named there, migrates it, and drops it at the end; each test
gets a unique exchange and queue, deleted afterwards, so tests run in any order.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass

import aio_pika
import asyncpg
import pytest
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.orders import router as orders_router
from examples.orders.tables import metadata as orders_metadata
from examples.payments import router as payments_router
from examples.payments.tables import metadata as payments_metadata
from worker.core.router import Router
from worker.database import create_engine
from worker.ops import runner
from worker.settings import Settings, redact
from worker.sql import tables
from worker.testing import scratch_database
from worker.transport.topology import delete_topology

BASE = Settings.load()
TEST_RETRY_DELAYS = (0.1, 0.2)
"""Tests that set other ``retry_delays`` delete their retry queues themselves."""
TABLES = (*tables.metadata.tables, *payments_metadata.tables, *orders_metadata.tables)

EXAMPLES = Router()
"""Both example handler modules, whose tables every test database has."""
EXAMPLES.include(payments_router)
EXAMPLES.include(orders_router)


def _require_services() -> None:
    async def check() -> None:
        try:
            conn = await asyncpg.connect(BASE.database_url, timeout=5)
            await conn.close()
        except Exception as exc:
            pytest.exit(
                "PostgreSQL is not reachable at "
                f"WORKER_DATABASE_URL={redact(BASE.database_url)!r}: {exc!r}",
                returncode=3,
            )
        try:
            connection = await aio_pika.connect(BASE.amqp_url, timeout=5)
            await connection.close()
        except Exception as exc:
            pytest.exit(
                f"RabbitMQ is not reachable at WORKER_AMQP_URL={redact(BASE.amqp_url)!r}: {exc!r}",
                returncode=3,
            )

    asyncio.run(check())


@pytest.fixture(scope="session")
def database_url() -> Iterator[str]:
    """A fresh database with the worker's and both examples' tables."""
    _require_services()
    with scratch_database(BASE, EXAMPLES, prefix="worker_test") as scratch:
        yield scratch.database_url


@pytest.fixture
async def settings(database_url: str, engine: AsyncEngine) -> AsyncIterator[Settings]:
    """Settings for one test: the session's database, and an exchange and queues of its own
    (deleted afterwards), with delayed retries of a tenth and a fifth of a second.

    (It takes ``engine`` so that the session engine exists before ``clean_tables`` runs:
    pytest sets up session fixtures first, and ``clean_tables`` cannot start one from inside
    the running event loop.)"""
    suffix = uuid.uuid4().hex[:10]
    settings = BASE.replace(
        database_url=database_url,
        exchange=f"test-{suffix}-events",
        queue=f"test-{suffix}",
        prefetch=16,
        concurrency=4,
        retry_delays=TEST_RETRY_DELAYS,
        http_port=0,
    )
    yield settings
    connection = await aio_pika.connect(BASE.amqp_url)
    async with connection:
        await delete_topology(await connection.channel(), settings)


@pytest.fixture(scope="session")
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(
        BASE.replace(database_url=database_url, concurrency=6), application_name="worker-tests"
    )
    yield engine
    await engine.dispose()


@pytest.fixture(autouse=True)
async def clean_tables(request: pytest.FixtureRequest) -> None:
    """Empty every table before a test that uses the database."""
    if "database_url" not in request.fixturenames:
        return
    engine: AsyncEngine = request.getfixturevalue("engine")
    async with engine.begin() as conn:
        await conn.execute(text(f"TRUNCATE {', '.join(TABLES)}"))


@pytest.fixture
async def amqp() -> AsyncIterator[AbstractRobustConnection]:
    connection = await aio_pika.connect_robust(BASE.amqp_url)
    yield connection
    await connection.close()


@dataclass
class RunningWorker:
    task: asyncio.Future[Counter[str]]
    stop: asyncio.Event
    stats: Counter[str]

    async def shutdown(self) -> Counter[str]:
        self.stop.set()
        return await asyncio.wait_for(self.task, 30)


@contextlib.asynccontextmanager
async def running_worker(settings: Settings, router: Router) -> AsyncIterator[RunningWorker]:
    """The worker's real runner, in-process, stopped (drained) on exit."""
    async with _running(
        lambda stop, started, stats: runner.run(settings, router, stop, started, stats)
    ) as worker:
        yield worker


@contextlib.asynccontextmanager
async def running_relay(settings: Settings) -> AsyncIterator[RunningWorker]:
    """A relay on its own (``worker relay``), in-process, stopped on exit."""
    async with _running(
        lambda stop, started, stats: runner.run_relay(settings, stop, started, stats)
    ) as relay:
        yield relay


@contextlib.asynccontextmanager
async def _running(
    serve: Callable[[asyncio.Event, asyncio.Event, Counter[str]], Awaitable[Counter[str]]],
) -> AsyncIterator[RunningWorker]:
    stop, started, stats = asyncio.Event(), asyncio.Event(), Counter[str]()
    task = asyncio.ensure_future(serve(stop, started, stats))
    waiter = asyncio.create_task(started.wait())
    done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if task in done:
        task.result()  # raises what stopped it
    worker = RunningWorker(task, stop, stats)
    try:
        yield worker
    finally:
        if not task.done():
            await worker.shutdown()
