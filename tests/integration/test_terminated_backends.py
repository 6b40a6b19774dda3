"""Backends terminated under a running relay and the health check, through a path that delivers a
server's farewell (its FATAL error) well before its close: the pool never hands out a connection
its server has ended, so neither logs asyncpg's "cannot switch to state 15; another operation
(2) is in progress", and both go on working."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import asyncpg
import pytest
from aio_pika import ExchangeType
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.helpers import scalar, wait_until
from tests.integration.support import running_relay
from tests.integration.tcp_proxy import TcpProxy, tcp_proxy
from tests.integration.test_relay import commit, event
from worker.database import create_engine
from worker.errors import causes
from worker.ops.health import Health
from worker.settings import Settings

ROUNDS = 8
CLOSE_DELAY = 0.5
"""Seconds between a server's end of a connection and the client seeing it closed: long enough
for the relay and the health check to check out every connection it ended."""

WATCHED = ("worker-relay", "worker-metrics")
"""The application names of the relay's pool and the health check's."""


async def terminate_idle_backends(engine: AsyncEngine) -> int:
    """Terminate the backends of ``WATCHED`` that run no statement and hold no transaction: those
    of connections in their pool, or held with nothing running (the relay's LISTEN)."""
    async with engine.connect() as conn:
        ended = await conn.execute(
            text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND application_name = ANY(:names) "
                "AND state = 'idle'"
            ),
            {"names": list(WATCHED)},
        )
        return int(ended.scalar_one())


@contextlib.asynccontextmanager
async def delayed_closes(settings: Settings) -> AsyncIterator[tuple[TcpProxy, Settings]]:
    """``settings`` on a path to PostgreSQL that closes a connection ``CLOSE_DELAY`` late."""
    url = urlsplit(settings.database_url)
    async with tcp_proxy(url.hostname or "127.0.0.1", url.port or 5432) as proxy:
        proxy.close_delay = CLOSE_DELAY
        through = url._replace(netloc=f"{url.username}@127.0.0.1:{proxy.port}").geturl()
        yield proxy, settings.replace(database_url=through, relay_poll_interval=0.05)


def internal_client_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    found = []
    for record in caplog.records:
        words = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            words += " ".join(repr(c) for c in causes(record.exc_info[1]))
        if "InternalClientError" in words or "cannot switch to state" in words:
            found.append(f"{record.name}: {words}")
    return found


async def test_terminated_backends_are_never_handed_out_to_the_relay_or_the_health_check(
    settings: Settings,
    engine: AsyncEngine,
    amqp: AbstractRobustConnection,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    channel = await amqp.channel()
    exchange = await channel.declare_exchange(settings.exchange, ExchangeType.TOPIC, durable=True)
    queue = await channel.declare_queue(f"{settings.queue}.capture", durable=True)
    await queue.bind(exchange, "event.#")
    failures: list[Exception] = []
    stopping = asyncio.Event()

    async def health_checks(health_engine: AsyncEngine) -> None:
        health = Health()
        while not stopping.is_set():
            await health.probe(health_engine, amqp)
            if health.database_failure is not None:
                failures.append(health.database_failure)
            await asyncio.sleep(0.02)

    async def healthy(health_engine: AsyncEngine) -> bool:
        health = Health()
        await health.probe(health_engine, amqp)
        return health.database

    async def published() -> bool:
        return int(await scalar(engine, "SELECT count(*) FROM outbox")) == 0

    async with delayed_closes(settings) as (_proxy, proxied), running_relay(proxied):
        # (the health check's pool, as the relay's monitor opens it, probed 50 times a second)
        health_engine = create_engine(proxied, application_name="worker-metrics", pool_size=1)
        checks = asyncio.create_task(health_checks(health_engine))
        try:
            for n in range(ROUNDS):
                # Given the relay polling and the health check probing, each through its pool,
                await commit(engine, [event(settings, n)], each=True)
                await wait_until(published)
                await wait_until(lambda: healthy(health_engine))

                # When their idle backends are terminated (their closes arriving late)
                assert await terminate_idle_backends(engine) >= 1
                await asyncio.sleep(CLOSE_DELAY + 0.2)

            # Then each went on: the relay publishes what is committed, the health check is ok
            await commit(engine, [event(settings, ROUNDS)], each=True)
            await wait_until(published)
            await wait_until(lambda: healthy(health_engine))
        finally:
            stopping.set()
            await checks
            await health_engine.dispose()
            await channel.queue_delete(queue.name)
            await channel.close()

    # and neither was ever handed a connection its server had ended
    assert internal_client_errors(caplog) == []
    assert [
        f
        for f in failures
        if any(isinstance(c, asyncpg.exceptions.InternalClientError) for c in causes(f))
    ] == []
