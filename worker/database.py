"""The SQLAlchemy engine the worker runs on (asyncpg driver), sized to its concurrency."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from worker import queries
from worker.errors import ConfigurationError
from worker.settings import Settings

PROBE_TIMEOUT = 5.0
"""Seconds PostgreSQL has to answer a probe before it counts as unreachable."""


def create_engine(
    settings: Settings, *, application_name: str = "worker", pool_size: int | None = None
) -> AsyncEngine:
    """An engine whose pool holds one connection per concurrent unit of work (or ``pool_size``)."""
    return create_async_engine(
        settings.sqlalchemy_url,
        pool_size=settings.concurrency if pool_size is None else pool_size,
        max_overflow=2,
        pool_timeout=60,
        connect_args={"server_settings": {"application_name": application_name}},
    )


@contextlib.asynccontextmanager
async def one_connection(settings: Settings, application_name: str) -> AsyncIterator[AsyncEngine]:
    """A one-connection engine for a command or a check, disposed of on exit."""
    engine = create_engine(settings, application_name=application_name, pool_size=1)
    try:
        yield engine
    finally:
        await engine.dispose()


async def check_durable_commits(engine: AsyncEngine) -> None:
    """Refuse to run with ``synchronous_commit=off``: an ack could then outlive a lost commit."""
    async with engine.connect() as conn:
        if await queries.synchronous_commit(conn) == "off":
            raise ConfigurationError(
                "synchronous_commit is off for the worker's database role: a crash could lose "
                "a commit whose message was already acked. Set it to 'on' (or stronger)."
            )


async def probe(engine: AsyncEngine, *, within: float = PROBE_TIMEOUT) -> None:
    """``SELECT 1`` on a pooled connection within ``within`` seconds; raises when PostgreSQL does
    not answer (the one check behind the consumer's pause, ``/healthz`` and ``worker verify``)."""
    async with asyncio.timeout(within), engine.connect() as conn:
        await queries.ping(conn)
