"""Running the worker: connect, declare, consume until told to stop, then drain and close.

Shutdown order keeps the promise: stop consuming, let in-flight units of work commit and ack,
close the channel (unstarted prefetched deliveries return to the queue), then the connections.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

import aio_pika
from aio_pika.abc import AbstractRobustConnection
from tenacity import (
    AsyncRetrying,
    before_sleep_log,
    retry_if_exception,
    stop_after_delay,
    wait_exponential,
)

from worker.consumer import Consumer
from worker.database import check_durable_commits, create_engine
from worker.errors import is_transient
from worker.router import Router
from worker.settings import Settings, redact

log = logging.getLogger(__name__)

STARTUP_TIMEOUT = 60.0
STATS_INTERVAL = 5.0


def while_starting() -> AsyncRetrying:
    """Retries for connecting at start, while PostgreSQL or RabbitMQ may still be coming up."""
    return AsyncRetrying(
        stop=stop_after_delay(STARTUP_TIMEOUT),
        wait=wait_exponential(multiplier=0.2, max=5),
        retry=retry_if_exception(is_transient),
        before_sleep=before_sleep_log(log, logging.WARNING),
        reraise=True,
    )


async def connect_broker(settings: Settings, *, name: str = "worker") -> AbstractRobustConnection:
    """A robust broker connection, retried with backoff while the broker starts."""
    async for attempt in while_starting():
        with attempt:
            return await aio_pika.connect_robust(
                settings.amqp_url, client_properties={"connection_name": name}
            )
    raise AssertionError("unreachable")  # pragma: no cover


async def report_stats(stats: Counter[str], interval: float = STATS_INTERVAL) -> None:
    """Log the outcome counts every ``interval`` seconds while they change."""
    last: Counter[str] = Counter()
    while True:
        await asyncio.sleep(interval)
        if stats != last:
            last = stats.copy()
            log.info("stats %s", " ".join(f"{k}={v}" for k, v in sorted(stats.items())))


async def run(
    settings: Settings,
    router: Router,
    stop: asyncio.Event,
    started: asyncio.Event | None = None,
    stats: Counter[str] | None = None,
) -> Counter[str]:
    """Consume until ``stop`` is set; count outcomes in ``stats`` (a new one by default)."""
    log.info("database %s, broker %s", redact(settings.database_url), redact(settings.amqp_url))
    engine = create_engine(settings)
    try:
        async for attempt in while_starting():
            with attempt:
                await check_durable_commits(engine)
        connection = await connect_broker(settings)
        try:
            consumer = Consumer(settings, router, engine, connection, stats)
            await consumer.start()
            reporter = asyncio.create_task(report_stats(consumer.stats), name="stats")
            if started is not None:
                started.set()
            try:
                await stop.wait()
            finally:
                log.info("stopping: draining in-flight messages")
                await consumer.stop()
                reporter.cancel()
            log.info("stopped; %s", dict(consumer.stats))
            return consumer.stats
        finally:
            await connection.close()
    finally:
        await engine.dispose()
