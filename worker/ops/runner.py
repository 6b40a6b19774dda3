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
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

from aio_pika.abc import AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from worker import logs, schema
from worker.backoff import while_starting
from worker.core.handler import HandlerKind
from worker.core.router import Router
from worker.database import check_durable_commits, create_engine
from worker.liveness import Liveness
from worker.ops.health import Monitor
from worker.ops.janitor import Janitor
from worker.ops.metrics import Metrics
from worker.ops.samples import Role, Sampler
from worker.settings import Settings, format_duration, redact
from worker.transport.connection import Observing, connect
from worker.transport.consumer import Consumer
from worker.transport.relay import Relay

log = logging.getLogger(__name__)

STATS_INTERVAL = 5.0


class Component(Protocol):
    """A supervised part of the process: runs until ``stop`` is set, raises if it fails."""

    async def run(self, stop: asyncio.Event) -> None: ...


async def connect_broker(settings: Settings, *, name: str = "worker") -> AbstractRobustConnection:
    """A robust broker connection, retried with backoff while the broker starts."""
    connection: AbstractRobustConnection = await while_starting(log, settings.startup_timeout)(
        connect, settings.amqp_url, name=name, liveness=Liveness.of(settings)
    )
    return connection


async def report_stats(stats: Counter[str], interval: float = STATS_INTERVAL) -> None:
    """Log the outcome counts every ``interval`` seconds while they change."""
    last: Counter[str] = Counter()
    while True:
        await asyncio.sleep(interval)
        if stats != last:
            last = stats.copy()
            counts = dict(sorted(stats.items()))
            log.info(
                "stats %s",
                " ".join(f"{k}={v}" for k, v in counts.items()),
                extra={logs.FIELDS: {"stats": counts}},
            )


@contextlib.asynccontextmanager
async def _reporting(settings: Settings, stats: Counter[str]) -> AsyncIterator[None]:
    """Log where the process connects, its counts while it runs, and its totals at a clean stop."""
    log.info("database %s, broker %s", redact(settings.database_url), redact(settings.amqp_url))
    reporter = asyncio.create_task(report_stats(stats), name="stats")
    try:
        yield
    finally:
        reporter.cancel()
    log.info(
        "stopped; %s", dict(stats), extra={logs.FIELDS: {"stats": dict(sorted(stats.items()))}}
    )


async def _open_engine(
    stack: contextlib.AsyncExitStack, settings: Settings, router: Router | None, **kwargs: Any
) -> AsyncEngine:
    """An engine on a database that commits durably and whose schema is at the code's head
    (the worker's, and ``router``'s handler modules'); raises ``ConfigurationError`` if not."""
    engine = create_engine(settings, **kwargs)
    stack.push_async_callback(engine.dispose)
    await while_starting(log, settings.startup_timeout)(check_durable_commits, engine)
    await schema.require_current(engine, settings, router)
    return engine


async def _open_relay(
    stack: contextlib.AsyncExitStack, settings: Settings, metrics: Metrics
) -> Relay:
    """A relay on a database pool and a broker connection of its own.

    Its own connection keeps publisher flow control from ever holding up the consumer's acks.
    """
    engine = await _open_engine(stack, settings, None, application_name="worker-relay", pool_size=2)
    connection = await connect_broker(settings, name="worker-relay")
    stack.push_async_callback(connection.close)
    relay = Relay(settings, engine, connection, metrics)
    await relay.start()
    return relay


async def _open_monitor(
    stack: contextlib.AsyncExitStack,
    settings: Settings,
    connection: AbstractRobustConnection,
    metrics: Metrics,
    consumer: Consumer | None = None,
) -> Monitor:
    """``/healthz`` and ``/metrics``, listening before the process reports it started, on a
    one-connection pool of their own so that a busy consumer never looks like a dead database."""
    engine = create_engine(settings, application_name="worker-metrics", pool_size=1)
    stack.push_async_callback(engine.dispose)
    monitor = Monitor(
        settings,
        engine,
        connection,
        metrics,
        consuming=None if consumer is None else (lambda: consumer.consuming),
        condition=None if consumer is None else consumer.condition,
        database_unreachable=None if consumer is None else consumer.database_unreachable,
    )
    stack.push_async_callback(monitor.close)
    await monitor.start()  # (it logs where it listens)
    return monitor


async def _open_sampler(
    stack: contextlib.AsyncExitStack,
    settings: Settings,
    monitor: Monitor,
    role: Role,
    consumer: Consumer | None = None,
) -> Sampler | None:
    """The process's sampler (None when ``sample_interval`` is 0), on the monitor's engine and
    with its reads of the outbox, once it wrote its first sample (``starting``; a failed write
    is logged, never raised). It counts the queues on a broker connection of its own, made at
    its first count and closed with the process: never on one that carries work."""
    if not settings.sample_interval:
        return None
    broker = Observing(settings.amqp_url, f"{role.value}-observer", Liveness.of(settings))
    stack.push_async_callback(broker.close)
    sampler = Sampler(
        settings,
        monitor.engine,
        broker,
        monitor.metrics.stats,
        role=role,
        outbox=lambda: monitor.outbox,
        consumer=consumer,
    )
    await sampler.sample()
    return sampler


async def _supervise(
    settings: Settings,
    stop: asyncio.Event,
    components: dict[str, Component],
    started: asyncio.Event | None,
    before_stopping: Callable[[], Awaitable[None]] | None = None,
    sampler: Sampler | None = None,
) -> None:
    """Run ``components`` (and ``sampler``) until ``stop`` is set or one of them fails, then
    stop them all.

    ``before_stopping`` (the consumer's drain) runs first, once the sampler was told the process
    drains; each component then has the grace period to finish before it is cancelled. The
    sampler writes its last sample (``stopped``) once they all have. A failed component's error
    is raised.
    """
    if sampler is None:
        await _run_components(settings, stop, components, started, before_stopping)
        return

    async def drain() -> None:
        sampler.drain()
        if before_stopping is not None:
            await before_stopping()

    try:
        await _run_components(settings, stop, {**components, "sampler": sampler}, started, drain)
    except Exception:
        await sampler.stop(failed=True)
        raise
    await sampler.stop()


async def _run_components(
    settings: Settings,
    stop: asyncio.Event,
    components: dict[str, Component],
    started: asyncio.Event | None,
    before_stopping: Callable[[], Awaitable[None]] | None,
) -> None:
    """``_supervise``'s work without a sampler: ``before_stopping`` first, then each component
    has the grace period to finish; a failed component's error is raised."""
    background_stop = asyncio.Event()
    background = [
        asyncio.create_task(component.run(background_stop), name=name)
        for name, component in components.items()
    ]
    if started is not None:
        started.set()
    try:
        await _until_stopped(stop, background)
    finally:
        if before_stopping is not None:
            await before_stopping()
        background_stop.set()
        _, late = await asyncio.wait(background, timeout=settings.shutdown_grace)
        for task in late:
            log.warning("the %s did not stop within the grace period", task.get_name())
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)


async def run(
    settings: Settings,
    router: Router,
    stop: asyncio.Event,
    started: asyncio.Event | None = None,
    stats: Counter[str] | None = None,
) -> Counter[str]:
    """Consume until ``stop`` is set; count outcomes in ``stats`` (a new one by default).

    Unless ``settings.relay`` is off, an outbox relay runs alongside, woken by every commit that
    added events; unless ``settings.janitor`` is off, so does the inbox janitor; and the
    ``/healthz`` and ``/metrics`` endpoint. If any of them dies, the consumer is drained and the
    error is raised: the process never runs half-alive.
    """
    stats = Counter() if stats is None else stats
    async with _reporting(settings, stats), contextlib.AsyncExitStack() as stack:
        engine = await _open_engine(stack, settings, router)
        metrics = Metrics(stats)
        relay = await _open_relay(stack, settings, metrics) if settings.relay else None
        connection = await connect_broker(settings)
        stack.push_async_callback(connection.close)
        consumer = Consumer(
            settings,
            router,
            engine,
            connection,
            metrics,
            on_events=relay.wake if relay else None,
        )
        # (the health endpoint listens first: a port another process holds stops the worker
        # before it takes a delivery)
        monitor = await _open_monitor(stack, settings, connection, metrics, consumer)
        sampler = await _open_sampler(stack, settings, monitor, Role.WORKER, consumer)
        await consumer.start()
        if any(h.kind is HandlerKind.WORKFLOW for h in router.handlers()) and (
            settings.workflow_lease >= settings.retry_chain
        ):
            log.warning(
                "workflow_lease (%s) is not shorter than the delayed-retry chain (%s): a "
                "duplicate of a crashed workflow may be parked before the lease runs out",
                format_duration(settings.workflow_lease),
                format_duration(settings.retry_chain),
            )
        components: dict[str, Component] = {"consumer": consumer}
        if relay is not None:
            components["relay"] = relay
        if settings.janitor:
            components["janitor"] = Janitor(settings, engine, metrics)
        components["monitor"] = monitor

        async def drain() -> None:
            log.info(
                "stopping: draining in-flight messages (at most %s)",
                format_duration(settings.shutdown_grace),
            )
            await consumer.stop(settings.shutdown_grace)

        await _supervise(settings, stop, components, started, drain, sampler)
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
        metrics = Metrics(stats)
        relay = await _open_relay(stack, settings, metrics)
        monitor = await _open_monitor(stack, settings, relay.connection, metrics)
        sampler = await _open_sampler(stack, settings, monitor, Role.RELAY)
        components: dict[str, Component] = {"relay": relay, "monitor": monitor}
        await _supervise(settings, stop, components, started, sampler=sampler)
    return stats


async def _until_stopped(stop: asyncio.Event, tasks: Sequence[asyncio.Task[None]]) -> None:
    """Return when ``stop`` is set; raise if one of ``tasks`` ends first, whatever the reason."""
    waiter = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({waiter, *tasks}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    for task in tasks:
        if task.done() and not stop.is_set():
            raise RuntimeError(f"the {task.get_name()} task stopped unexpectedly") from (
                task.exception() if not task.cancelled() else None
            )
