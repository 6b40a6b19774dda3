"""Fixtures that give each test session its own database and each test its own broker names.

URLs come from WORKER_DATABASE_URL and WORKER_AMQP_URL (localhost defaults). The session creates
a fresh database next to the one named there, migrates it, and drops it at the end; each test
gets a unique exchange and queue, deleted afterwards, so tests run in any order.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import aio_pika
import pytest
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.integration.support import BASE, EXAMPLES, TABLES, TEST_RETRY_DELAYS, require_services
from worker.database import create_engine
from worker.settings import Settings
from worker.testing import scratch_database
from worker.transport.topology import delete_topology


@pytest.fixture(scope="session")
def database_url() -> Iterator[str]:
    """A fresh database with the worker's and both examples' tables."""
    require_services()
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
