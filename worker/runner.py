"""Running the worker: connect, declare, consume until told to stop, then drain and close.

Shutdown order keeps the promise: stop consuming, let in-flight units of work commit and ack,
close the channel (unstarted prefetched deliveries return to the queue), let the relay finish its
batch, then close the connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine
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
from worker.relay import Relay
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
    connection: AbstractRobustConnection = await while_starting()(
        aio_pika.connect_robust, settings.amqp_url, client_properties={"connection_name": name}
    )
    return connection


async def report_stats(stats: Counter[str], interval: float = STATS_INTERVAL) -> None:
    """Log the outcome counts every ``interval`` seconds while they change."""
    last: Counter[str] = Counter()
    while True:
        await asyncio.sleep(interval)
        if stats != last:
            last = stats.copy()
            log.info("stats %s", " ".join(f"{k}={v}" for k, v in sorted(stats.items())))


@contextlib.asynccontextmanager
async def _reporting(settings: Settings, stats: Counter[str]) -> AsyncIterator[None]:
    """Log where the process connects, its counts while it runs, and its totals at a clean stop."""
    log.info("database %s, broker %s", redact(settings.database_url), redact(settings.amqp_url))
    reporter = asyncio.create_task(report_stats(stats), name="stats")
    try:
        yield
    finally:
        reporter.cancel()
    log.info("stopped; %s", dict(stats))


async def _open_engine(
    stack: contextlib.AsyncExitStack, settings: Settings, **kwargs: Any
) -> AsyncEngine:
    engine = create_engine(settings, **kwargs)
    stack.push_async_callback(engine.dispose)
    await while_starting()(check_durable_commits, engine)
    return engine


async def _open_relay(
    stack: contextlib.AsyncExitStack, settings: Settings, stats: Counter[str]
) -> Relay:
    """A relay on a database pool and a broker connection of its own.

    Its own connection keeps publisher flow control from ever holding up the consumer's acks.
    """
    engine = await _open_engine(stack, settings, application_name="worker-relay", pool_size=2)
    connection = await connect_broker(settings, name="worker-relay")
    stack.push_async_callback(connection.close)
    relay = Relay(settings, engine, connection, stats)
    await relay.start()
    return relay


async def run(
    settings: Settings,
    router: Router,
    stop: asyncio.Event,
    started: asyncio.Event | None = None,
    stats: Counter[str] | None = None,
) -> Counter[str]:
    """Consume until ``stop`` is set; count outcomes in ``stats`` (a new one by default).

    Unless ``settings.relay`` is off, an outbox relay runs alongside, woken by every commit that
    added events. If the relay dies, the consumer is drained and the error is raised: the process
    never runs half-alive.
    """
    stats = Counter() if stats is None else stats
    async with _reporting(settings, stats), contextlib.AsyncExitStack() as stack:
        engine = await _open_engine(stack, settings)
        relay = await _open_relay(stack, settings, stats) if settings.relay else None
        connection = await connect_broker(settings)
        stack.push_async_callback(connection.close)
        consumer = Consumer(
            settings, router, engine, connection, stats, on_events=relay.wake if relay else None
        )
        await consumer.start()
        relay_stop = asyncio.Event()
        relay_task = asyncio.create_task(relay.run(relay_stop), name="relay") if relay else None
        if started is not None:
            started.set()
        try:
            await _until_stopped(stop, relay_task)
        finally:
            log.info("stopping: draining in-flight messages")
            await consumer.stop()
            relay_stop.set()
            if relay_task is not None:
                await asyncio.gather(relay_task, return_exceptions=True)
    return stats


async def run_relay(
    settings: Settings,
    stop: asyncio.Event,
    started: asyncio.Event | None = None,
    stats: Counter[str] | None = None,
) -> Counter[str]:
    """Relay the outbox until ``stop`` is set (the ``worker relay`` command)."""
    stats = Counter() if stats is None else stats
    async with _reporting(settings, stats), contextlib.AsyncExitStack() as stack:
        relay = await _open_relay(stack, settings, stats)
        if started is not None:
            started.set()
        await relay.run(stop)
    return stats


async def _until_stopped(stop: asyncio.Event, task: asyncio.Task[None] | None) -> None:
    """Return when ``stop`` is set; raise if ``task`` ends first, whatever the reason."""
    waiter = asyncio.create_task(stop.wait())
    watched = {waiter} if task is None else {waiter, task}
    try:
        await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if task is not None and task.done() and not stop.is_set():
        raise RuntimeError(f"the {task.get_name()} task stopped unexpectedly") from (
            task.exception() if not task.cancelled() else None
        )
